"""``pack``: one entry point for every packing algorithm, the registry of those algorithms
(:data:`ALGORITHMS`) and the :class:`Packing` it returns.

Every list of algorithms elsewhere (command-line choices, the capacity grid, the benchmarks,
the demo, the figures' order and colours, the trainer's samplers) is derived from
:data:`ALGORITHMS`: adding an algorithm is a function returning ``(assign, n_bins)`` plus one
entry here.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from workbench.packing import baselines
from workbench.packing._kernels import level_steps as level_step_kernel
from workbench.packing.checks import check_int, check_options
from workbench.packing.core import (
    PackingData,
    assign_to_csr,
    check_inputs,
    check_oversize,
    oversize_mask,
    round_to_replicas,
)
from workbench.packing.cost import CostModel
from workbench.packing.metrics import packing_metrics
from workbench.packing.paper import paper_bins
from workbench.packing.shuffled import shuffled_paper_bins

#: ``run(costs, capacity, num_replicas, rng, **options) -> (assign, n_bins)``: ``assign[i]`` is the
#: bin of graph ``i``, bins numbered ``0..n_bins-1`` in the algorithm's natural order.
Runner = Callable[..., tuple[np.ndarray, int]]


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """A packing algorithm and the properties it guarantees.

    ``run``: see :data:`Runner`. ``respects_capacity``: no batch exceeds the capacity (count-based
    batchers cannot promise it), and graphs above it are refused or set apart (``oversize``).
    ``count_bound``: batches are cut by graph count, set by the ``graphs_per_batch`` option (the
    trainer passes ``TrainConfig.batch_size``), and it bounds every ``"batch"``, or every
    ``"step"`` (its ``R`` batches together hold at most ``R * graphs_per_batch`` graphs, their
    split balanced by load, not count); None: no such option. ``randomized``: batches change
    with ``(seed, epoch)``. ``order_steps_by_load``: bins are ordered by load before being cut
    into steps. ``options``: the options it takes (``pack(..., **options)``), name -> default.
    """

    name: str
    run: Runner
    respects_capacity: bool
    count_bound: Literal["batch", "step"] | None = None
    randomized: bool
    order_steps_by_load: bool = False
    description: str
    options: dict[str, Any]

    @property
    def takes_graphs_per_batch(self) -> bool:
        """Whether the algorithm batches by count (``graphs_per_batch``)."""
        return self.count_bound is not None


def _defaults(function: Callable, *internal: str) -> dict[str, Any]:
    """The options of ``function``: its parameters with a default, but for those ``internal`` to
    the package (read from the signature, so each default is written once, there)."""
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.default is not p.empty and p.name not in internal}


# The two kinds of algorithm: what a kind implies is said once, here.
def _to_capacity(
    name: str, run: Runner, description: str, takes: Callable | None = None, **properties: Any
) -> Algorithm:
    """An algorithm that fills batches up to the capacity, never past it; options those of ``takes``
    (default: of ``run``); not randomized unless ``properties`` say so."""
    options = _defaults(takes or run, "graph_order")
    properties.setdefault("randomized", False)
    return Algorithm(name=name, run=run, description=description, respects_capacity=True, options=options, **properties)


def _by_count(name: str, run: Runner, description: str, bound: Literal["batch", "step"], takes: Callable) -> Algorithm:
    """A batcher that cuts shuffled graphs by count (per batch or per ``bound="step"``), blind to the capacity."""
    properties = dict(respects_capacity=False, count_bound=bound, randomized=True, options=_defaults(takes))
    return Algorithm(name=name, run=run, description=description, **properties)


#: The packing algorithms, in the order tables and figures show them: the packers, then the baselines.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        _to_capacity(
            "paper",
            lambda c, cap, r, rng, **o: paper_bins(c, cap, r, **o),
            "Algorithm 1 of the paper (cyclic dealing of size-sorted graphs, adaptive reopening)",
            paper_bins,
            randomized=False,
            order_steps_by_load=True,
        ),
        _to_capacity(
            "shuffled-paper",
            shuffled_paper_bins,
            "Algorithm 1 on a per-epoch window-shuffled size order (ours)",
            randomized=True,
            order_steps_by_load=True,
        ),
        _to_capacity(
            "ffd", lambda c, cap, r, rng, **o: baselines.ffd(c, cap, **o), "first-fit decreasing", baselines.ffd
        ),
        _to_capacity(
            "dynamic",
            lambda c, cap, r, rng, **o: baselines.dynamic(c, cap, rng, **o),
            "PyG DynamicBatchSampler: greedy next-fit up to max_num on shuffled graphs",
            takes=baselines.dynamic,
            randomized=True,
        ),
        _by_count(
            "lpt",
            lambda c, cap, r, rng, **o: baselines.lpt(c, r, rng, **o),
            "fairchem-style: shuffled global batch per step, LPT-balanced across ranks",
            "step",
            baselines.lpt,
        ),
        _by_count(
            "fixed-count",
            lambda c, cap, r, rng, **o: baselines.fixed_count(c, r, rng, **o),
            "PyG default: fixed graphs per batch, shuffled, split like DistributedSampler",
            "batch",
            baselines.fixed_count,
        ),
    )
}


def algorithm_named(name: str) -> Algorithm:
    """The registered algorithm ``name``; a ``KeyError`` lists the choices."""
    if name not in ALGORITHMS:
        raise KeyError(f"unknown packing algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


class Packing(PackingData):
    """What :func:`pack` returns: :class:`~workbench.packing.core.PackingData` plus the next
    epoch's packing and the quality metrics."""

    def next_epoch(self) -> Packing:
        """The packing the same call gives at ``epoch + 1`` (for the randomness metric)."""
        return pack(
            self.costs,
            self.capacity,
            self.num_replicas,
            algorithm=self.algorithm,
            seed=self.seed,
            epoch=self.epoch + 1,
            atoms=self.atoms,
            edges=self.edges,
            cost_model=self.cost_model,
            **self.options,
        )

    def metrics(self, *, randomness: bool = True, next_packing: PackingData | None = None) -> dict:
        """Quality metrics (:func:`workbench.packing.metrics.packing_metrics`); ``randomness`` adds
        ``pair_repeat_fraction`` against ``next_packing`` (default: :meth:`next_epoch`)."""
        if randomness and next_packing is None:
            next_packing = self.next_epoch()
        return packing_metrics(self, next_packing=next_packing if randomness else None)


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


def pack_inputs(
    costs, cost_field: str, atoms: np.ndarray | None, edges: np.ndarray | None, capacity: float, num_replicas: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Validated ``(costs, atoms, edges)`` from a plain cost array or a structured sizes array
    (fields atoms, edges, family; ``cost_field`` picks the cost column)."""
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
    arr = check_inputs(arr, capacity, num_replicas)
    n = arr.shape[0]
    for name, per_graph in (("atoms", atoms), ("edges", edges)):
        if per_graph is not None and np.shape(per_graph) != (n,):
            raise ValueError(f"{name} must have one entry per graph ({n}), got shape {np.shape(per_graph)}")
    return arr, atoms, edges


def _assign(
    spec: Algorithm,
    raw: np.ndarray,
    capacity: float,
    num_replicas: int,
    rng: np.random.Generator,
    big: np.ndarray,
    options: dict,
) -> tuple[np.ndarray, int]:
    """Run ``spec``; the graphs marked ``big`` (above capacity, ``oversize="alone"``) get a bin
    each, after the others'."""
    n = raw.shape[0]
    if not big.any():
        return spec.run(raw, capacity, num_replicas, rng, **options)
    keep = np.flatnonzero(~big)
    if keep.size:
        sub_assign, sub_bins = spec.run(raw[keep], capacity, 1, rng, **options)
    else:
        sub_assign, sub_bins = np.empty(0, dtype=np.int64), 0
    assign = np.empty(n, dtype=np.int64)
    assign[keep] = sub_assign
    assign[big] = sub_bins + np.arange(int(big.sum()))
    return assign, sub_bins + int(big.sum())


def _batches(
    spec: Algorithm,
    raw: np.ndarray,
    capacity: float,
    num_replicas: int,
    rng: np.random.Generator,
    oversize: str,
    level_steps: bool | None,
    options: dict,
) -> tuple[np.ndarray, np.ndarray]:
    """The batches of ``spec`` as CSR ``(flat, offsets)`` in rank/step layout (see :func:`pack`)."""
    big = oversize_mask(raw, capacity, oversize) if spec.respects_capacity else np.zeros(raw.shape[0], dtype=bool)
    assign, n_bins = _assign(spec, raw, capacity, num_replicas, rng, big, options)
    level = spec.order_steps_by_load if level_steps is None else level_steps
    return _layout(assign, n_bins, raw, num_replicas, capacity, spec.order_steps_by_load, level)


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
    capacity : maximum total cost of a batch, a finite number > 0 (costs may be floats).
    num_replicas : number of ranks ``R``. The ``K`` batches, ``K % R == 0``, run on rank ``k % R`` at step ``k // R``.
    algorithm : a key of :data:`ALGORITHMS`.
    seed, epoch : randomised algorithms draw from ``default_rng([seed, epoch])``; integers
        >= 0 (these, ``num_replicas`` and the options: :mod:`workbench.packing.checks`).
    atoms, edges : per-graph totals for the straggler cost model in ``metrics``.
    oversize : ``"error"`` (default) rejects graphs larger than ``capacity``
        naming them; ``"alone"`` gives each its own batch with a warning.
    level_steps : after ordering bins by load, re-deal (LPT) the graphs of any
        step whose max/mean load exceeds 1.001, if that keeps capacity. Default:
        on for the algorithms that order steps by load (paper, shuffled-paper).
    options : algorithm options (:attr:`Algorithm.options`), e.g. ``graphs_per_batch`` (the
        algorithms that ``takes_graphs_per_batch``), ``order`` (paper), ``window``
        (shuffled-paper); another name is refused, listing the algorithm's own.
    """
    spec = algorithm_named(algorithm)
    seed, epoch = check_int("seed", seed), check_int("epoch", epoch)
    options = check_options(algorithm, options, spec.options)
    raw, atoms, edges = pack_inputs(costs, cost_field, atoms, edges, capacity, num_replicas)
    num_replicas = int(num_replicas)  # an int or a numpy integer (checked); the kernels get an int
    t0, rng = time.perf_counter(), np.random.default_rng([seed, epoch])
    flat, offsets = _batches(spec, raw, float(capacity), num_replicas, rng, oversize, level_steps, options)
    return Packing(
        flat=flat,
        offsets=offsets,
        costs=raw,
        capacity=float(capacity),
        num_replicas=num_replicas,
        algorithm=algorithm,
        seed=seed,
        epoch=epoch,
        atoms=None if atoms is None else np.asarray(atoms),
        edges=None if edges is None else np.asarray(edges),
        cost_model=cost_model,
        pack_seconds=time.perf_counter() - t0,
        options=dict(options, oversize=oversize, level_steps=level_steps),
    )


#: pack's keywords that feed the metrics only, not the batches
_METRICS_ONLY = ("atoms", "edges", "cost_model")
#: pack's keywords that decide the batches, with pack's defaults (``level_steps`` is resolved)
_BATCH_KEYWORDS = {"cost_field": "atoms", "oversize": "error", "level_steps": None}


def batch_settings(algorithm: str, pack_options: dict) -> dict:
    """Everything in ``pack_options`` (:func:`pack`'s keywords) that decides the batches, checked
    and with every default filled in, so that settings giving the same batches compare equal;
    the keywords that feed only the metrics (``atoms``, ``edges``, ``cost_model``) are left out."""
    spec = algorithm_named(algorithm)
    given = {k: v for k, v in pack_options.items() if k not in _METRICS_ONLY}
    own = {k: v for k, v in given.items() if k not in _BATCH_KEYWORDS}
    settings = {**_BATCH_KEYWORDS, **{k: v for k, v in given.items() if k in _BATCH_KEYWORDS}}
    check_oversize(settings["oversize"])
    if settings["level_steps"] is None:
        settings["level_steps"] = spec.order_steps_by_load
    return {**settings, **spec.options, **check_options(algorithm, own, spec.options)}
