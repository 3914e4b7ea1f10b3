"""Small runs shared by the tests' fixtures, the launcher's self-test and the benches.

:func:`tiny_config` is a real MACE (8x0e+8x1o, max_ell 1, correlation 2) that trains on a CPU
in a fraction of a second per step: small enough for CI, large enough that every code path of
a production model (equivariant features, products, radial MLP) runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.train.config import TrainConfig

#: the model of :func:`tiny_config`, as ``TrainConfig`` fields
TINY_MODEL: dict[str, Any] = {
    "hidden_irreps": "8x0e+8x1o",
    "max_ell": 1,
    "correlation": 2,
    "num_bessel": 4,
    "radial_mlp": (16, 16),
}
#: the run settings of :func:`tiny_config`: short, quiet, checkpointing often
QUICK_RUN: dict[str, Any] = {
    "valid_fraction": 0.1,
    "capacity": 200,
    "epochs": 100,
    "max_steps": 12,
    "checkpoint_every": 4,
    "lr": 0.01,
    "progress": False,
    "seed": 3,
    "dist_timeout_s": 120,
}


def tiny_config(output_dir: str | os.PathLike, name: str = "tiny", **overrides: Any) -> TrainConfig:
    """A ``TrainConfig`` of :data:`TINY_MODEL` and :data:`QUICK_RUN`, with ``overrides`` applied."""
    fields = {"name": name, "output_dir": str(output_dir), **TINY_MODEL, **QUICK_RUN, **overrides}
    fields["radial_mlp"] = list(fields["radial_mlp"])
    return TrainConfig(**fields)


def small_dataset(
    path: str | os.PathLike, n: int = 48, families: tuple[str, ...] = ("water_clusters", "hea"), scan: int = 400
) -> Path:
    """Write ``n`` small labelled structures of ``families`` from the embedded mixture to ``path``.

    Reading the whole embedded dataset takes tens of seconds on a small CI machine, and every
    rank of every launched run would pay it; this file takes well under a second to read.
    """
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.data.io import read_structures, write_structures

    path = Path(path)
    if path.exists():
        return path
    frames = read_structures(EMBEDDED_PATH, index=f":{scan}")
    chosen = [a for a in frames if a.info.get("config_type") in families and a.info.get("labelled", True)][:n]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} structures of {families} in the first {scan} frames; raise scan")
    tmp = path.with_suffix(path.suffix + ".tmp")
    write_structures(tmp, chosen)
    os.replace(tmp, path)
    return path
