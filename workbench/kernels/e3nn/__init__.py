"""e3nn's modules on the kernels, for the model families built from them (NequIP, Allegro, and
MACE's message op): :mod:`~workbench.kernels.e3nn.tp` (the channelwise ``"uvu"`` tensor product
and scatter as one edge polynomial), :mod:`~workbench.kernels.e3nn.linear`,
:mod:`~workbench.kernels.e3nn.gate`, :mod:`~workbench.kernels.e3nn.scalar_tp` (with
:mod:`~workbench.kernels.e3nn.scalar_tp_groups`) and :mod:`~workbench.kernels.e3nn.silu`. Each
swaps in by ``__class__`` assignment and keeps e3nn's state-dict keys."""
