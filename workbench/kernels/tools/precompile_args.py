"""``workbench kernels precompile``'s options checked before anything is built or compiled: a
value out of range is one line naming the option and what it accepts (exit 2), not a traceback
or an hour of compiling for nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from workbench.limits import MAX_ELL_RANGE, MAX_Z

__all__ = ["check_precompile_args", "parse_cc"]


def _in_range(flag: str, value: int, lo: int, hi: int, why: str = "") -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{flag} {value}: give an integer from {lo} to {hi}{why}")


def _check_hidden(hidden: str) -> None:
    from e3nn import o3

    try:
        irreps = o3.Irreps(hidden)
    except (ValueError, AssertionError, TypeError) as exc:
        raise ValueError(f"--hidden {hidden!r}: not an irreps string like 128x0e+128x1o ({exc})") from None
    mults = {mul for mul, _ in irreps}
    if not any(mul > 0 and ir.l == 0 and ir.p == 1 for mul, ir in irreps):
        raise ValueError(f"--hidden {hidden!r}: MACE needs scalar channels (0e), like 128x0e+128x1o")
    if len(mults) != 1 or 0 in mults:
        raise ValueError(
            f"--hidden {hidden!r}: every irrep needs the same number of channels, like 128x0e+128x1o "
            "(the kernels run channelwise)"
        )


def parse_cc(text: str) -> tuple[int, int]:
    """``--cc``: a compute capability ``MAJOR.MINOR`` this CUDA toolkit compiles for."""
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"--cc {text!r}: give a compute capability MAJOR.MINOR, like 9.0")
    cc = (int(major), int(minor))
    supported = _supported_ccs()
    if supported and cc not in supported:
        names = ", ".join(f"{a}.{b}" for a, b in supported)
        raise ValueError(f"--cc {text}: this CUDA toolkit compiles for {names}")
    return cc


def _supported_ccs() -> list[tuple[int, int]]:
    """What NVRTC of this environment compiles for (empty where it cannot say: no check then)."""
    try:
        from numba.cuda.cudadrv import nvrtc

        return sorted(nvrtc.get_supported_ccs())
    except Exception:  # no CUDA toolkit libraries here: ptxas says so at its first kernel
        return []


def _check_output(json_path: str | None) -> None:
    if json_path is None:
        return
    path = Path(json_path)
    if path.is_dir():
        raise ValueError(f"--json {json_path}: a folder; give a file name")
    if not path.absolute().parent.is_dir():
        raise ValueError(f"--json {json_path}: folder {path.absolute().parent} does not exist")


def check_precompile_args(args: argparse.Namespace) -> None:
    """Every option of ``workbench kernels precompile``, before the model is built (the cache
    folder is checked by the command, once it knows it)."""
    from workbench.kernels.mace.symmetric_contraction import PROVEN_CORRELATIONS

    _in_range("--max-ell", args.max_ell, *MAX_ELL_RANGE, " (mace builds no model at 0)")
    _in_range(
        "--correlation",
        args.correlation,
        PROVEN_CORRELATIONS[0],
        PROVEN_CORRELATIONS[-1],
        " (the correlations the kernels are checked for)",
    )
    _in_range("--elements", args.elements, 1, MAX_Z)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: give a number of processes >= 1")
    _check_hidden(args.hidden)
    if args.modules is not None and not [m for m in args.modules.split(",") if m.strip()]:
        raise ValueError(f"--modules {args.modules!r}: give module name prefixes, like products.0.,interactions.1.")
    parse_cc(args.cc)
    _check_output(args.json)
