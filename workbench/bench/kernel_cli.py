"""The options of the kernel benchmarks (``workbench bench symmetric-contraction``,
``workbench bench channelwise-tp``) and of ``workbench kernels resources``.

Kept apart from the benchmarks themselves, which import torch: building the command line's
parser imports this module only, and a command imports its benchmark when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from workbench.bench.table import RESULTS_DIR
from workbench.kernels.registry import DEFAULT_BACKEND, contenders, labels

__all__ = ["PASSES", "add_common_arguments", "register_bench", "register_kernels"]

PASSES = ("forward", "forward_backward", "double_backward")


def add_common_arguments(ap: argparse.ArgumentParser, passes: Sequence[str] = PASSES) -> None:
    """Options every kernel benchmark takes: the device, the model (paper config by default),
    dtypes, backends, passes and the repeat counts."""
    ap.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when available)")
    ap.add_argument("--hidden", default="128x0e+128x1o")
    ap.add_argument("--max-ell", type=int, default=3)
    ap.add_argument("--correlation", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument(
        "--backends",
        nargs="+",
        default=list(contenders("mace")),
        choices=labels(family="mace"),
        metavar="BACKEND",
        help=f"any of {' '.join(labels(family='mace'))} (the registry's backends and their variants: "
        f"{DEFAULT_BACKEND}-table / -unrolled force one CUDA kernel kind, -unfused launches an edge op's outputs "
        "one kernel each; default: %(default)s)",
    )
    ap.add_argument("--passes", nargs="+", default=list(passes), choices=list(passes))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=25)


def _symmetric_contraction(args: argparse.Namespace) -> int:
    from workbench.bench.symmetric_contraction import main

    return main(args)


def _channelwise_tp(args: argparse.Namespace) -> int:
    from workbench.bench.channelwise_tp import main

    return main(args)


def register_bench(bench_sub) -> None:
    """``workbench bench symmetric-contraction`` and ``workbench bench channelwise-tp``."""
    p = bench_sub.add_parser(
        "symmetric-contraction",
        help="time MACE's symmetric contraction and products[0] (numba / e3nn / cueq), JSON to benchmarks/results/",
        description="Time MACE's symmetric contraction alone and the whole products[0] block, forward, "
        "backward and double backward, on every backend; parity against e3nn in the same run.",
    )
    p.add_argument("--atoms", type=int, default=3072)
    add_common_arguments(p)
    p.add_argument("--elements", type=int, default=10)
    p.add_argument("--targets", nargs="+", default=["contraction", "products0"], choices=["contraction", "products0"])
    p.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/symmetric_contraction_<device>_<time>.json)"
    )
    p.set_defaults(func=_symmetric_contraction)

    p = bench_sub.add_parser(
        "channelwise-tp",
        help="time MACE's interactions[1] message op: fused channelwise TP + scatter (numba / e3nn / cueq), "
        "JSON to benchmarks/results/",
        description="Time MACE's interactions[1] (channelwise tensor product + scatter) on periodic water "
        "boxes, forward, backward and double backward, on every backend; parity against e3nn in the same run.",
    )
    p.add_argument("--boxes", type=int, default=4)
    p.add_argument("--atoms-per-box", type=int, default=768)
    p.add_argument("--cutoff", type=float, default=4.5)
    add_common_arguments(p)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run (1 box of 24 atoms, 4x0e+4x1o, 2 repeats) to check the benchmark end to end",
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/channelwise_tp_<device>_<time>.json)"
    )
    p.set_defaults(func=_channelwise_tp)


def _resources(args: argparse.Namespace) -> int:
    from workbench.bench.resources import main

    return main(args)


def register_kernels(ks) -> None:
    """``workbench kernels resources`` (``ks``: the ``kernels`` command's subparsers)."""
    r = ks.add_parser("resources", help="compile the paper config's kernels to PTX; registers, spills, occupancy")
    r.add_argument("--cc", default="9.0", help="compute capability (default 9.0, H100)")
    r.add_argument(
        "--variant",
        choices=("auto", "unrolled", "table", "both"),
        default="both",
        help="auto: the kernels the dispatcher launches; both: auto and table (default)",
    )
    r.add_argument("--dtype", choices=("float32", "float64", "both"), default="both")
    r.add_argument("--ops", default="symmetric_contraction,channelwise_tp")
    r.add_argument(
        "--hidden",
        default="128x0e+128x1o",
        help="hidden irreps (the channel count is their multiplicity; default: the paper's %(default)s)",
    )
    r.add_argument("--max-ell", type=int, default=3, help="spherical harmonics degree (default %(default)s)")
    r.add_argument("--correlation", type=int, default=3, help="body order of the contraction (default %(default)s)")
    r.add_argument(
        "--json", default=str(RESULTS_DIR / "kernel_resources_sm{cc}.json"), help="output JSON ('' for none)"
    )
    r.set_defaults(func=_resources)
