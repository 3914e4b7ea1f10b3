"""Bounds and shared defaults of settings that preparing data, packing, training and the kernel tools
enforce (one place, so they agree)."""

#: atoms per batch: the paper's bin capacity (3072 atoms on one H100, §3), the default of ``pack``'s
#: callers, ``TrainConfig.capacity``, the CLIs and the notebooks' widgets
DEFAULT_CAPACITY = 3072

#: Å: MACE models use 4-6 Å; far beyond, neighbour lists of condensed phases explode
#: (a 1000 Å cutoff was OOM-killed at 22 GB in prepare before it was bounded).
MAX_CUTOFF = 15.0

#: the heaviest element a structure may hold (ASE's table ends at oganesson)
MAX_Z = 118

#: the max_ell (largest l of the edge spherical harmonics) training and precompile accept: mace
#: builds no model at 0 (an IndexError in its interaction block); above 4 nothing is measured
MAX_ELL_RANGE = (1, 4)
