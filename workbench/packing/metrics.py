"""Packing quality metrics.

With ``K`` batches of loads ``L_k`` (sum of graph costs), capacity ``C`` and
``R`` replicas (step ``s`` = batches ``sR .. sR+R-1``):

* ``lower_bound_bins`` = ``ceil(ceil(sum_i s_i / C) / R) * R`` (L1 bound, rounded up
  to a multiple of ``R``); ``bins_over_lb`` = ``K / lower_bound_bins``.
* ``padding_fraction`` = ``1 - sum_k L_k / (K * C')`` with ``C' = max(C, max_k L_k)``:
  the zero-filled share of the memory reserved for ``K`` batches (``C'`` covers
  count-based batchers that overflow ``C``).
* step imbalance ``I_s = max_r L_{s,r} / mean_r L_{s,r}``;
  ``step_imbalance_max = max_s I_s`` and ``step_imbalance_mean = mean_s I_s``.
* ``straggler_share`` = ``mean_s (1 - 1/I_s)``: the share of rank time spent waiting for the
  slowest rank of each step, if a batch's time is proportional to its load.
* ``est_epoch_seconds`` = ``sum_s max_r t(batch_{s,r})`` under the
  :class:`~workbench.packing.cost.CostModel` (straggler model).
* ``pair_repeat_fraction``: of the graph pairs sharing a batch in epoch ``e``,
  the fraction sharing a batch again in epoch ``e+1`` (1.0 = same batches every
  epoch). Computed in O(N log N) by counting graphs per (batch_e, batch_e+1) cell.
"""

from __future__ import annotations

import numpy as np

from workbench.packing.core import PackingData, batch_sums
from workbench.packing.cost import CostModel


def lower_bound_bins(costs: np.ndarray, capacity: float, num_replicas: int = 1) -> int:
    """L1 lower bound ``ceil(sum/C)``, rounded up to a multiple of ``num_replicas``."""
    lb = max(1, int(np.ceil(float(np.sum(costs, dtype=np.float64)) / capacity - 1e-12)))
    return -(-lb // num_replicas) * num_replicas


def step_imbalance(loads: np.ndarray, num_replicas: int) -> np.ndarray:
    """``max/mean`` of the loads of each step (steps with zero load count as 1)."""
    per = loads.reshape(-1, num_replicas)
    mean = per.mean(axis=1)
    out = np.ones(per.shape[0])
    ok = mean > 0
    out[ok] = per[ok].max(axis=1) / mean[ok]
    return out


def batch_ids(p: PackingData) -> np.ndarray:
    """Batch index of every graph."""
    ids = np.empty(p.flat.shape[0], dtype=np.int64)
    ids[p.flat] = np.repeat(np.arange(p.n_bins, dtype=np.int64), p.batch_sizes())
    return ids


def pair_repeat_fraction(a: PackingData, b: PackingData) -> float:
    """Fraction of pairs co-batched in ``a`` that are co-batched again in ``b``."""
    ia, ib = batch_ids(a), batch_ids(b)
    sizes = a.batch_sizes().astype(np.float64)
    total = float((sizes * (sizes - 1) / 2).sum())
    if total == 0:
        return 0.0
    cell = ia * np.int64(b.n_bins) + ib
    _, counts = np.unique(cell, return_counts=True)
    counts = counts.astype(np.float64)
    return float((counts * (counts - 1) / 2).sum() / total)


def packing_metrics(p: PackingData, *, next_packing: PackingData | None = None) -> dict:
    """All metrics of a packing as a flat dict (see the module docstring).

    ``pair_repeat_fraction`` is included when ``next_packing`` (the next epoch's) is given;
    :meth:`workbench.packing.api.Packing.metrics` computes it.
    """
    r = p.num_replicas
    loads = p.loads()
    lb = lower_bound_bins(p.costs, p.capacity, r)
    cap_eff = max(float(p.capacity), float(loads.max()) if loads.size else 0.0)
    imb = step_imbalance(loads, r)
    model = p.cost_model or CostModel()
    atoms = p.atoms if p.atoms is not None else p.costs
    batch_atoms = batch_sums(atoms, p.flat, p.offsets)
    batch_edges = batch_sums(p.edges, p.flat, p.offsets) if p.edges is not None else None
    shape = (-1, r)
    est = model.epoch_seconds(batch_atoms.reshape(shape), None if batch_edges is None else batch_edges.reshape(shape))
    sizes = p.batch_sizes()
    out = {
        "algorithm": p.algorithm,
        "n_graphs": int(p.costs.shape[0]),
        "capacity": float(p.capacity),
        "num_replicas": r,
        "n_bins": p.n_bins,
        "n_steps": p.n_steps,
        "lower_bound_bins": lb,
        "bins_over_lb": p.n_bins / lb,
        "padding_fraction": 1.0 - float(loads.sum()) / (p.n_bins * cap_eff) if p.n_bins else 0.0,
        "max_load": float(loads.max()) if loads.size else 0.0,
        "over_capacity_batches": int((loads > p.capacity).sum()),
        "step_imbalance_max": float(imb.max()) if imb.size else 1.0,
        "step_imbalance_mean": float(imb.mean()) if imb.size else 1.0,
        "straggler_share": float(np.mean(1.0 - 1.0 / imb)) if imb.size else 0.0,
        "graphs_per_batch_mean": float(sizes.mean()) if sizes.size else 0.0,
        "empty_batches": int((sizes == 0).sum()),
        "est_epoch_seconds": est,
        "pack_seconds": float(p.pack_seconds),
    }
    if next_packing is not None:
        out["pair_repeat_fraction"] = pair_repeat_fraction(p, next_packing)
    return out
