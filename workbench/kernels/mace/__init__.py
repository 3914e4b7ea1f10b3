"""The MACE model family: mace-torch's symmetric contraction and channelwise tensor product as
:class:`~workbench.kernels.ops.PolyOp` s, and the adapter :func:`~workbench.kernels.accelerate`
uses (:mod:`~workbench.kernels.mace.adapter`, registered in :mod:`workbench.kernels.registry`)."""
