"""The small dataset shipped in git: ``data/mixture.extxyz.gz``.

It is ``make_mixture(n=EMBEDDED_N, seed=EMBEDDED_SEED)`` written by
:func:`workbench.data.write_structures`; ``workbench data make`` regenerates it
bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_N = 2000
EMBEDDED_SEED = 0
EMBEDDED_NAME = "mixture.extxyz.gz"


def _default_path() -> Path:
    env = os.environ.get("WORKBENCH_DATA")
    if env:
        return Path(env)
    # Editable installs and checkouts: <repo>/data next to the package.
    return Path(__file__).resolve().parents[2] / "data" / EMBEDDED_NAME


EMBEDDED_PATH: Path = _default_path()


def load_embedded(path: str | os.PathLike | None = None, validate: bool = True) -> list:
    """Read the embedded mixture (list of ``ase.Atoms``), with a hint when it is missing."""
    from workbench.data.io import read_structures

    path = Path(path) if path is not None else EMBEDDED_PATH
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: embedded dataset not found; create it with `workbench data make --out {path}` "
            "or point WORKBENCH_DATA at a copy"
        )
    return read_structures(path, validate=validate)
