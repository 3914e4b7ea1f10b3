"""Where the workbench keeps what it can rebuild (parsed structures, generated kernels):
``$WORKBENCH_CACHE_DIR``, default ``~/.cache/cfm-workbench``, one folder per kind."""

from __future__ import annotations

from pathlib import Path

from workbench.switches import switch

__all__ = ["CACHE_DIR_ENV", "cache_dir"]

CACHE_DIR_ENV = "WORKBENCH_CACHE_DIR"


def cache_dir(kind: str) -> Path:
    """The folder for ``kind`` (``"structures"``, ``"kernels"``); not created here."""
    return Path(switch(CACHE_DIR_ENV) or Path.home() / ".cache" / "cfm-workbench") / kind
