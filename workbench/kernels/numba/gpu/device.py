"""The CUDA target: is there one, is the simulator on, how large may a block be.

``numba.cuda`` is imported lazily everywhere so that ``NUMBA_ENABLE_CUDASIM=1`` can be set
first. Under the simulator the CUDA kernels run on numpy arrays (``WORKBENCH_KERNELS_CUDASIM``).
"""

from __future__ import annotations

from functools import lru_cache

from workbench.kernels.options import kernel_options, numba_simulator

__all__ = ["cuda_available", "cuda_status", "cudasim_enabled", "numba_unavailable", "threads_per_block"]

_SHARED_BYTES = 48 * 1024


def cudasim_enabled() -> bool:
    """True when numba's CUDA simulator is on and the workbench is asked to route CPU
    tensors through the CUDA kernels (``WORKBENCH_KERNELS_CUDASIM=1``), for CI."""
    return numba_simulator() and kernel_options().cudasim


@lru_cache(maxsize=1)
def cuda_status() -> tuple[bool, str]:
    """``(available, why not)``: can numba launch CUDA kernels here (a GPU with a driver, or the
    simulator)? The reason names what failed, for the error a CUDA tensor then gets."""
    try:
        from numba import cuda
    except Exception as exc:
        return False, f"numba's CUDA target does not import ({type(exc).__name__}: {exc})"
    try:
        ok = bool(cuda.is_available())
    except Exception as exc:
        return False, f"numba.cuda.is_available() failed ({type(exc).__name__}: {exc})"
    return ok, "" if ok else "numba sees no CUDA driver or GPU (numba.cuda.is_available() is False)"


def cuda_available() -> bool:
    """numba can launch CUDA kernels here (:func:`cuda_status`)."""
    return cuda_status()[0]


def threads_per_block(buffer_len: int, itemsize: int) -> int:
    """Largest power of two <= 128 whose shared buffer ``[tpb, buffer_len]`` fits in 48 KiB."""
    forced = kernel_options().threads_per_block
    if forced:
        return forced
    fit = max(1, _SHARED_BYTES // (buffer_len * itemsize))
    tpb = 1
    while tpb * 2 <= min(fit, 128):
        tpb *= 2
    return tpb


def numba_unavailable() -> str | None:
    """Why numba's kernels cannot run here (its CPU target is always there when numba imports)."""
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        return f"numba does not import ({exc})"
    return None
