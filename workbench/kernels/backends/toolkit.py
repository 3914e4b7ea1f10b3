"""Where the CUDA toolkit's command-line tools are: ``ptxas`` (PTX to machine code) and
``nvdisasm`` (machine code to SASS text), for the static resource report and for compiling
kernels ahead of time on a machine without a GPU."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["find_nvdisasm", "find_ptxas"]


def _find_cuda_tool(tool: str, env: str, wheel_dir: str) -> str | None:
    """``$env``, then the wheel's copy (``nvidia/cu*/bin`` or ``nvidia/<wheel_dir>/bin``), then
    PATH, then /usr/local/cuda*."""
    if os.environ.get(env):
        return os.environ[env]
    candidates = []
    for base in map(Path, sys.path):
        candidates += sorted(base.glob(f"nvidia/cu*/bin/{tool}")) + sorted(base.glob(f"nvidia/{wheel_dir}/bin/{tool}"))
    if shutil.which(tool):
        candidates.append(Path(shutil.which(tool)))
    candidates += sorted(Path("/usr/local").glob(f"cuda*/bin/{tool}"), reverse=True)
    return str(candidates[0]) if candidates else None


def find_ptxas() -> str | None:
    """``ptxas``: ``$PTXAS``, then the ``nvidia-cuda-nvcc`` wheel (same release as the NVVM that
    writes the PTX), then PATH, then /usr/local/cuda*."""
    return _find_cuda_tool("ptxas", "PTXAS", "cuda_nvcc")


def find_nvdisasm() -> str | None:
    """``nvdisasm``: ``$NVDISASM``, then the ``nvidia-cuda-nvdisasm`` wheel, then PATH, then /usr/local/cuda*."""
    return _find_cuda_tool("nvdisasm", "NVDISASM", "cuda_nvdisasm")
