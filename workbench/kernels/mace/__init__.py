"""MACE layer: mace-torch's symmetric contraction and channelwise tensor product as
:class:`~workbench.kernels.ops.PolyOp` s, and :func:`~workbench.kernels.mace.accelerate.accelerate`."""
