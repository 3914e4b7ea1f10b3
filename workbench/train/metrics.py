"""Reading a run's JSONL logs, and fitting the packer's cost model from real step times."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def read_steps(run_dir: str | os.PathLike, rank: int | None = None) -> list[dict]:
    """Step records of one rank (or all ranks), as the run finally saw them.

    A step redone after a restart from a checkpoint replaces the record of the
    attempt that was lost, so each ``(rank, global_step)`` appears once.
    """
    files = sorted(Path(run_dir, "metrics").glob("rank*.jsonl"))
    if rank is not None:
        files = [f for f in files if f.stem == f"rank{rank}"]
    last: dict[tuple[int, int], dict] = {}
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                last[(rec["rank"], rec["global_step"])] = rec
    return [last[k] for k in sorted(last, key=lambda k: (k[1], k[0]))]


def read_epochs(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir, "metrics.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def fit_cost_model(run_dir: str | os.PathLike, skip_first: int = 2):
    """Fit ``t = a + b*atoms + c*edges`` to measured compute times of every rank's steps.

    The first ``skip_first`` steps of each rank are dropped: they include
    one-off costs (allocator warm-up, lazy initialisation, kernel compilation).
    """
    from workbench.packing import CostModel

    recs = [r for r in read_steps(run_dir) if r["global_step"] > skip_first]
    if len(recs) < 3:
        raise ValueError(f"{run_dir}: need at least 3 logged steps after warm-up to fit a cost model, found {len(recs)}")
    atoms = np.array([r["atoms"] for r in recs], dtype=float)
    edges = np.array([r["edges"] for r in recs], dtype=float)
    seconds = np.array([r["compute_s"] for r in recs], dtype=float)
    return CostModel.fit(atoms, edges, seconds)
