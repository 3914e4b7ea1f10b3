"""Import-time fixes for the pinned scientific stack, applied once for the whole package.

mace-torch 0.3.16 pins e3nn 0.4.4, which calls ``torch.load`` on its own constants
file without ``weights_only``; torch >= 2.6 defaults that to ``True`` and the import
fails. The documented switch ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` restores the
old behaviour; we set it before e3nn can be imported and silence the warning torch
prints for it. Users who set the variable themselves keep their value.

numba-cuda 0.30 registers a device overload for ``np.row_stack`` when its CUDA target first
loads; NumPy 2.5 removed that alias of ``np.vstack``, so every kernel launch failed with an
``AttributeError`` (seen on the H200 image: numpy 2.5.2, numba-cuda 0.30.4). We restore the alias.
"""

from __future__ import annotations

import os
import warnings

import numpy as _np

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
warnings.filterwarnings("ignore", message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected")
warnings.filterwarnings("ignore", message="cuequivariance or cuequivariance_torch is not available")
warnings.filterwarnings("ignore", message="The TorchScript type system doesn't support instance-level annotations")
warnings.filterwarnings("ignore", message=r"`torch.jit.script` is deprecated")

# mace-torch prints a cuequivariance notice on import: hidden unless WORKBENCH_SHOW_MACE_NOTICES=1.
from workbench.quiet import quiet_mace  # noqa: E402  (standard library only: no torch at import)

quiet_mace()
