"""The NequIP model family (nequip 0.19) for :func:`~workbench.kernels.accelerate`.

NequIP's interaction block sends messages with ``TensorProductScatter``: an e3nn
``TensorProduct`` of weighted ``"uvu"`` instructions over edges (node features of the sender,
spherical harmonics of the edge, weights from the radial MLP) and a scatter-sum to the
receiver. That is the channelwise edge polynomial MACE's message runs
(:mod:`workbench.kernels.e3nn.tp`), so :mod:`.tp_scatter` swaps it onto the workbench
kernels in place, and with it (as companions, :class:`~workbench.kernels.class_swap.ClassSwap`,
listed in :mod:`.companions`) the Bessel edge encoding, the radial MLPs' SiLU, e3nn's linears,
gates and self-connection products, which compute nequip's values in fewer calls;
:mod:`.adapter` is the family's entry in the registry, and
:mod:`.extension` makes ``enable_WorkbenchKernels`` a nequip model modifier.

Importing this package needs nequip (and e3nn >= 0.6), not mace-torch.
"""
