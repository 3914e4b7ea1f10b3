"""``workbench bench symmetric-contraction``: runs ``kernels/bench_symmetric_contraction.py``.

The benchmark script lives in the repository's kernel lab (``kernels/``), not in the installed
package, so this command works from a source checkout; it takes the script's options.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _script() -> Path:
    return Path(__file__).resolve().parents[2] / "kernels" / "bench_symmetric_contraction.py"


def _load():
    path = _script()
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("bench_symmetric_contraction", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def register_bench(bench_subparsers) -> None:
    mod = _load()
    help_ = "time MACE's symmetric contraction and products[0] (numba / e3nn / cueq), JSON to kernels/results/"
    if mod is None:  # installed without the source tree: explain instead of failing
        p = bench_subparsers.add_parser("symmetric-contraction", help=help_)

        def _missing(args):
            raise FileNotFoundError(f"{_script()} not found: run from a source checkout of cfm-workbench")

        p.set_defaults(func=_missing)
        return
    p = bench_subparsers.add_parser("symmetric-contraction", help=help_, parents=[mod.build_parser(add_help=False)])
    p.set_defaults(func=lambda args: int(mod.main(args=args) or 0))
