"""What the command modules share about options (argparse only: every floor may import it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Options", "add_command", "add_options", "option_values"]

#: ``{flag: add_argument keywords}``, in ``--help`` order; a tuple key is a flag and its aliases.
Options = Mapping[str | tuple[str, ...], Mapping[str, Any]]


def option_values(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``{name: args.name}``: parsed options passed on as the keywords of the same names."""
    return {name: getattr(args, name) for name in names}


def add_options(parser: argparse.ArgumentParser, options: Options) -> argparse.ArgumentParser:
    """Add ``options`` to ``parser`` (returned)."""
    for flag, keywords in options.items():
        parser.add_argument(*((flag,) if isinstance(flag, str) else flag), **keywords)
    return parser


def add_command(
    subparsers: Any,
    name: str,
    options: Options,
    func: Callable[[argparse.Namespace], int | None],
    help_: str | None = None,
    **parser_keywords: Any,
) -> argparse.ArgumentParser:
    """The command ``name`` declared as a table: its ``options``, and ``func`` that runs it. Its
    help line is ``help_``, by default ``func``'s docstring (as click does: one text, not a
    docstring and a help string that drift apart). Returns the parser, for what a table cannot say."""
    text = help_ if help_ is not None else " ".join((func.__doc__ or "").split())
    parser = subparsers.add_parser(name, help=text, **parser_keywords)
    parser.set_defaults(func=func)
    return add_options(parser, options)
