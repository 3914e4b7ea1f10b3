"""The ``workbench`` command line.

Each subpackage that owns a command exposes ``register(subparsers)`` in its own
``cli`` module (``workbench/<pkg>/cli.py``); kernel tools register under ``workbench kernels
<name>`` through ``register_kernels(kernels_subparsers)``, and the benchmarks, all in
:mod:`workbench.bench`, under ``workbench bench <name>`` through
``register_bench(bench_subparsers)``. A registered parser sets ``func`` (called with the parsed
namespace, returns an exit code or None). Building the parser imports these modules only, and
they import no torch: ``workbench pack`` and every ``--help`` start without it.

Errors follow one convention: a user error prints ``workbench: error: <where>: <why>; <what to
do>`` and exits 2; a preempted training run exits 75 (``EX_TEMPFAIL``: try again) after its
checkpoint; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from workbench.train.preempt import PREEMPTED_EXIT

#: Errors that are the user's to fix: one line, no traceback (``--debug`` shows it). A bug, any
#: other exception, keeps its traceback.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
USER_ERROR_EXIT = 2

# The modules that add commands (``register``) and kernel tools (``register_kernels``).
_COMMAND_MODULES = (
    "workbench.data.cli",
    "workbench.packing.cli",
    "workbench.bench.cli",
    "workbench.kernels.tools.cli",
    "workbench.train.cli",
    "workbench.train.md",
    "workbench.launch.cli",
    "workbench.viz.cli",
    "workbench.demo",
)
# The one module that adds benchmarks (``register_bench``).
_BENCH_MODULE = "workbench.bench.cli"


def _group(sub, name: str, help_: str, dest: str, metavar: str):
    """A command whose subcommands other modules add; alone, it prints its help."""
    p = sub.add_parser(name, help=help_)
    group = p.add_subparsers(dest=dest, metavar=metavar)
    p.set_defaults(func=lambda args: (p.print_help(), USER_ERROR_EXIT)[1])
    return group


def build_parser() -> argparse.ArgumentParser:
    """The ``workbench`` parser with every command (imports no torch)."""
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="cfm-workbench: data, packing, kernels, training and launch for MACE.",
        epilog=f"Exit codes: 0 done; {USER_ERROR_EXIT} a usage or input error (one line on stderr; --debug for the "
        f"traceback); {PREEMPTED_EXIT} stopped by a scheduler signal after a checkpoint (relaunch to resume); "
        "anything else is a bug and prints its traceback.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_sub = _group(sub, "bench", "benchmarks that print a table and write JSON", "bench", "BENCH")
    kernels_sub = _group(
        sub,
        "kernels",
        "kernel tools: static resource report (PTX + ptxas, no GPU needed), "
        "compile a configuration's kernels into the cache",
        "kernels_cmd",
        "CMD",
    )
    importlib.import_module(_BENCH_MODULE).register_bench(bench_sub)
    for name in _COMMAND_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "register"):
            mod.register(sub)
        if hasattr(mod, "register_kernels"):
            mod.register_kernels(kernels_sub)
    return parser


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])  # str(KeyError) would quote it
    return str(exc) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); returns its exit code."""
    from workbench.train.preempt import Preempted

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return USER_ERROR_EXIT
    try:
        code = args.func(args)
    except Preempted as exc:
        print(f"workbench: preempted: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"workbench: error: {_message(exc)}", file=sys.stderr)
        return USER_ERROR_EXIT
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
