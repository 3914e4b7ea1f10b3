"""Tools layer: ``workbench kernels precompile`` (:mod:`.cli`) and the random-weight models it and
the benchmarks build (:mod:`.models`). The benchmarks and the static resource report live in
:mod:`workbench.bench`."""
