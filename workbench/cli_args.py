"""What the command modules share about parsed options (argparse only: every floor may import it)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["option_values"]


def option_values(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``{name: args.name}``: parsed options passed on as the keywords of the same names."""
    return {name: getattr(args, name) for name in names}
