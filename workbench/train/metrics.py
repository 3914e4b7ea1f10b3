"""Fitting the packer's cost model from a run's measured step times (the logs: :mod:`workbench.train.rundir`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from workbench.train.rundir import read_epochs, read_steps

__all__ = ["fit_cost_model", "read_epochs", "read_steps"]


def fit_cost_model(
    run_dir: str | os.PathLike, skip_first: int = 2, nonnegative: bool = True, with_description: bool = False
):
    """Fit ``t = a + b*atoms + c*edges`` to the measured compute times of every rank's steps.

    The first ``skip_first`` steps of each rank are dropped: they include one-off costs
    (allocator warm-up, lazy initialisation, kernel compilation). The fit is
    :meth:`workbench.packing.CostModel.fit` (non-negative by default). Returns the
    ``CostModel``, or ``(CostModel, one-line description)`` with ``with_description``.
    """
    from workbench.packing import CostModel

    recs = [r for r in read_steps(run_dir) if r["global_step"] > skip_first]
    if len(recs) < 3:
        raise ValueError(
            f"{run_dir}: need at least 3 logged steps after warm-up to fit a cost model, found {len(recs)}"
        )
    atoms = np.array([r["atoms"] for r in recs], dtype=float)
    edges = np.array([r["edges"] for r in recs], dtype=float)
    seconds = np.array([r["compute_s"] for r in recs], dtype=float)
    model = CostModel.fit(atoms, edges, seconds, nonnegative=nonnegative)
    if not with_description:
        return model
    rms = float(np.sqrt(np.mean((seconds - model.batch_seconds(atoms, edges)) ** 2)))
    kind = "NNLS" if nonnegative else "least-squares"
    desc = (
        f"cost model: {kind} fit to {len(recs)} measured step compute times of run '{Path(run_dir).name}' "
        f"(batches of {atoms.min():.0f}–{atoms.max():.0f} atoms): {model.describe()}, rms residual {rms * 1e3:.3g} ms"
    )
    return model, desc
