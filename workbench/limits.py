"""Bounds on settings that preparing data, training and the kernel tools enforce (one place, so they agree)."""

#: Å: MACE models use 4-6 Å; far beyond, neighbour lists of condensed phases explode
#: (a 1000 Å cutoff was OOM-killed at 22 GB in prepare before it was bounded).
MAX_CUTOFF = 15.0

#: the heaviest element a structure may hold (ASE's table ends at oganesson)
MAX_Z = 118

#: the max_ell (largest l of the edge spherical harmonics) training and precompile accept: mace
#: builds no model at 0 (an IndexError in its interaction block); above 4 nothing is measured
MAX_ELL_RANGE = (1, 4)
