"""``workbench bench symmetric-contraction`` and ``workbench bench channelwise-tp``: run the
kernel lab's benchmark scripts (``kernels/bench_*.py``); ``workbench kernels resources`` and
``workbench kernels precompile``.

The benchmark scripts live in the repository's kernel lab (``kernels/``), not in the installed
package, so these commands work from a source checkout; each takes its script's options.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: command name -> (script file, help)
BENCHES = {
    "symmetric-contraction": (
        "bench_symmetric_contraction.py",
        "time MACE's symmetric contraction and products[0] (numba / e3nn / cueq), JSON to kernels/results/",
    ),
    "channelwise-tp": (
        "bench_channelwise_tp.py",
        "time MACE's interactions[1] message op: fused channelwise TP + scatter (numba / e3nn / cueq), JSON to kernels/results/",
    ),
}


def _script(name: str = "bench_symmetric_contraction.py") -> Path:
    return Path(__file__).resolve().parents[3] / "kernels" / name


def _load(name: str = "bench_symmetric_contraction.py"):
    path = _script(name)
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _register_one(bench_subparsers, command: str, script: str, help_: str) -> None:
    mod = _load(script)
    if mod is None:  # installed without the source tree: explain instead of failing
        p = bench_subparsers.add_parser(command, help=help_)

        def _missing(args, script=script):
            raise FileNotFoundError(f"{_script(script)} not found: run from a source checkout of cfm-workbench")

        p.set_defaults(func=_missing)
        return
    p = bench_subparsers.add_parser(command, help=help_, parents=[mod.build_parser(add_help=False)])
    p.set_defaults(func=lambda args, mod=mod: int(mod.main(args=args) or 0))


def register_bench(bench_subparsers) -> None:
    for command, (script, help_) in BENCHES.items():
        _register_one(bench_subparsers, command, script, help_)


def register(subparsers) -> None:
    from workbench.kernels.tools.precompile_cli import register as register_precompile
    from workbench.kernels.tools.resources import register as register_resources

    p = subparsers.add_parser(
        "kernels",
        help="kernel tools: static resource report (PTX + ptxas, no GPU needed), "
        "compile a configuration's kernels into the cache",
    )
    ks = p.add_subparsers(dest="kernels_cmd", metavar="CMD")
    register_resources(ks)
    register_precompile(ks)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
