"""Tools layer: the static resource report (PTX + ptxas), the ``workbench kernels`` / ``workbench
bench`` commands and the benchmark fixtures (:mod:`.bench`)."""
