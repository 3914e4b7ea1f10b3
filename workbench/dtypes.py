"""torch's default dtype, set for a block and restored after it.

mace and e3nn build their buffers (CG coefficients, radial bases, scale/shift) in
``torch.get_default_dtype()``; to build a float64 model, or read float64 data, the default is
switched for the duration and restored even when the block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["default_dtype"]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | str) -> Iterator[torch.dtype]:
    """Run the block with ``torch.set_default_dtype(dtype)``; ``dtype`` may be a name (``"float64"``).

    Yields the dtype in effect. The previous default comes back on exit, also after an exception.
    """
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r}: not a torch dtype; use float32 or float64")
        dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield dtype
    finally:
        torch.set_default_dtype(previous)
