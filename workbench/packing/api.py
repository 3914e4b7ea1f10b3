"""``pack``: one entry point for every packing algorithm."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workbench.packing import baselines
from workbench.packing._kernels import level_steps as level_step_kernel
from workbench.packing.core import Packing, assign_to_csr, check_inputs, oversize_mask, round_to_replicas
from workbench.packing.cost import CostModel
from workbench.packing.paper import paper_bins
from workbench.packing.shuffled import shuffled_paper_bins


@dataclass(frozen=True)
class Algorithm:
    """A packing algorithm and the properties it guarantees.

    ``run(costs, capacity, num_replicas, rng, **options) -> (assign, n_bins)``.
    ``respects_capacity``: no batch exceeds capacity (count-based batchers cannot
    promise it). ``randomized``: batches change with ``(seed, epoch)``.
    ``order_steps_by_load``: bins are ordered by load before being cut into steps.
    """

    name: str
    run: Callable
    respects_capacity: bool
    randomized: bool
    order_steps_by_load: bool
    description: str


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "paper",
            lambda c, cap, r, rng, **o: paper_bins(c, cap, r, **o),
            True,
            False,
            True,
            "Algorithm 1 of the paper (cyclic dealing of size-sorted graphs, adaptive reopening)",
        ),
        Algorithm(
            "shuffled-paper",
            shuffled_paper_bins,
            True,
            True,
            True,
            "Algorithm 1 on a per-epoch window-shuffled size order (ours)",
        ),
        Algorithm(
            "fixed-count",
            lambda c, cap, r, rng, **o: baselines.fixed_count(c, r, rng, **o),
            False,
            True,
            False,
            "PyG default: fixed graphs per batch, shuffled, split like DistributedSampler",
        ),
        Algorithm(
            "dynamic",
            lambda c, cap, r, rng, **o: baselines.dynamic(c, cap, rng, **o),
            True,
            True,
            False,
            "PyG DynamicBatchSampler: greedy next-fit up to max_num on shuffled graphs",
        ),
        Algorithm(
            "ffd", lambda c, cap, r, rng, **o: baselines.ffd(c, cap, **o), True, False, False, "first-fit decreasing"
        ),
        Algorithm(
            "lpt",
            lambda c, cap, r, rng, **o: baselines.lpt(c, r, rng, **o),
            False,
            True,
            False,
            "fairchem-style: shuffled global batch per step, LPT-balanced across ranks",
        ),
    )
}


def _layout(
    assign: np.ndarray, n_bins: int, costs: np.ndarray, r: int, capacity: float, by_load: bool, level: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Bin ids -> CSR batches in rank/step layout.

    Makes the count a multiple of ``r`` (splitting the heaviest bins if needed),
    optionally orders bins by load, descending (neighbouring loads share a step),
    and optionally levels steps whose max/mean load exceeds 1.001.
    """
    sizes = costs.astype(np.float64)
    assign, n_bins = round_to_replicas(assign, n_bins, costs, r)
    loads = np.bincount(assign, weights=sizes, minlength=n_bins)
    if by_load:
        bin_order = np.argsort(-loads, kind="stable")
        rank = np.empty(n_bins, dtype=np.int64)
        rank[bin_order] = np.arange(n_bins, dtype=np.int64)
        assign, loads = rank[assign], loads[bin_order]
    flat, offsets = assign_to_csr(assign, n_bins)
    if level:
        level_step_kernel(flat, offsets, sizes, loads, r, capacity, 1.001)
    return flat, offsets


def _resolve_costs(costs, cost_field: str, atoms, edges):
    """Accept a plain array or a structured sizes array (fields atoms, edges, family)."""
    arr = np.asarray(costs)
    if arr.dtype.names:
        names = arr.dtype.names
        if cost_field not in names:
            raise KeyError(f"sizes array has no field {cost_field!r}; fields are {', '.join(names)}")
        if atoms is None and "atoms" in names:
            atoms = arr["atoms"]
        if edges is None and "edges" in names:
            edges = arr["edges"]
        arr = np.ascontiguousarray(arr[cost_field])
    return arr, atoms, edges


def pack(
    costs,
    capacity: float,
    num_replicas: int = 1,
    algorithm: str = "paper",
    seed: int = 0,
    *,
    epoch: int = 0,
    atoms: np.ndarray | None = None,
    edges: np.ndarray | None = None,
    cost_model: CostModel | None = None,
    oversize: str = "error",
    cost_field: str = "atoms",
    level_steps: bool | None = None,
    **options,
) -> Packing:
    """Pack graphs into batches for ``num_replicas`` data-parallel ranks.

    Parameters
    ----------
    costs : per-graph size (atoms, edges, or any cost such as
        :meth:`CostModel.graph_costs`), or a structured sizes array with fields
        ``atoms``/``edges``/``family`` (``cost_field`` picks the cost column).
    capacity : maximum total cost of a batch.
    num_replicas : number of ranks ``R``. The result has ``K`` batches with
        ``K % R == 0``; batch ``k`` runs on rank ``k % R`` at step ``k // R``.
    algorithm : a key of :data:`ALGORITHMS`.
    seed, epoch : randomised algorithms draw from ``default_rng([seed, epoch])``.
    atoms, edges : per-graph totals for the straggler cost model in ``metrics``.
    oversize : ``"error"`` (default) rejects graphs larger than ``capacity``
        naming them; ``"alone"`` gives each its own batch with a warning.
    level_steps : after ordering bins by load, re-deal (LPT) the graphs of any
        step whose max/mean load exceeds 1.001, if that keeps capacity. Default:
        on for the algorithms that order steps by load (paper, shuffled-paper).
    options : algorithm options, e.g. ``graphs_per_batch`` (fixed-count, lpt),
        ``order`` (paper), ``window`` (shuffled-paper).
    """
    if algorithm not in ALGORITHMS:
        raise KeyError(f"unknown packing algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    spec = ALGORITHMS[algorithm]
    raw, atoms, edges = _resolve_costs(costs, cost_field, atoms, edges)
    raw = check_inputs(raw, capacity, num_replicas)
    n = raw.shape[0]
    for name, arr in (("atoms", atoms), ("edges", edges)):
        if arr is not None and np.shape(arr) != (n,):
            raise ValueError(f"{name} must have one entry per graph ({n}), got shape {np.shape(arr)}")
    t0 = time.perf_counter()
    big = oversize_mask(raw, capacity, oversize) if spec.respects_capacity else np.zeros(n, dtype=bool)
    rng = np.random.default_rng([int(seed), int(epoch)])
    if big.any():
        keep = np.flatnonzero(~big)
        if keep.size:
            sub_assign, sub_bins = spec.run(raw[keep], capacity, 1, rng, **options)
        else:
            sub_assign, sub_bins = np.empty(0, dtype=np.int64), 0
        assign = np.empty(n, dtype=np.int64)
        assign[keep] = sub_assign
        assign[big] = sub_bins + np.arange(int(big.sum()))
        n_bins = sub_bins + int(big.sum())
    else:
        assign, n_bins = spec.run(raw, capacity, num_replicas, rng, **options)
    flat, offsets = _layout(
        assign,
        n_bins,
        raw,
        int(num_replicas),
        float(capacity),
        spec.order_steps_by_load,
        spec.order_steps_by_load if level_steps is None else level_steps,
    )
    seconds = time.perf_counter() - t0
    return Packing(
        flat=flat,
        offsets=offsets,
        costs=raw,
        capacity=float(capacity),
        num_replicas=int(num_replicas),
        algorithm=algorithm,
        seed=int(seed),
        epoch=int(epoch),
        atoms=None if atoms is None else np.asarray(atoms),
        edges=None if edges is None else np.asarray(edges),
        cost_model=cost_model,
        pack_seconds=seconds,
        options=dict(options, oversize=oversize, level_steps=level_steps),
    )
