"""The ``workbench`` command line.

Each subpackage that owns a command exposes ``register(subparsers)`` in its own
``cli`` module (``workbench/<pkg>/cli.py``); benchmarks register under
``workbench bench <name>`` through ``register_bench(bench_subparsers)``. A
registered parser sets ``func`` (called with the parsed namespace, returns an
exit code or None).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The modules that add commands.
_COMMAND_MODULES = (
    "workbench.data.cli",
    "workbench.packing.cli",
    "workbench.kernels.tools.cli",
    "workbench.train.cli",
    "workbench.launch.cli",
    "workbench.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="cfm-workbench: data, packing, kernels, training and launch for MACE.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    for name in _COMMAND_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "register"):
            mod.register(sub)
        if hasattr(mod, "register_bench"):
            mod.register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        # User errors: one clear line, no traceback.
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
