"""Where the CUDA toolkit's command-line tools are: ``ptxas`` (PTX to machine code) and
``nvdisasm`` (machine code to SASS text), for the static resource report and for compiling
kernels ahead of time on a machine without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["assembled", "find_nvdisasm", "find_ptxas"]


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


@contextmanager
def assembled(
    ptx: str, cc: tuple[int, int], ptxas: str, verbose: bool = False, timeout: float = 600
) -> Iterator[tuple[Path, str]]:
    """``ptx`` assembled by ``ptxas`` for ``sm_<cc>``: yields the cubin's path (a temporary file,
    gone after the block) and ptxas's log (its resource report with ``verbose``)."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        res = subprocess.run(
            [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", *(["-v"] if verbose else []), "-o", str(cubin), str(src)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed ({ptxas}): {res.stderr.strip()[-2000:]}")
        yield cubin, res.stdout + res.stderr
