"""Where notebooks write and read runs, independent of the notebook's working directory."""

from __future__ import annotations

from pathlib import Path

from workbench.switches import switch

REPO_ROOT = Path(__file__).resolve().parents[2]


def runs_dir() -> Path:
    """``$WORKBENCH_RUNS`` if set, else ``<repo>/runs`` (``make lab`` starts in ``notebooks/``)."""
    env = switch("WORKBENCH_RUNS")
    return Path(env).resolve() if env else REPO_ROOT / "runs"
