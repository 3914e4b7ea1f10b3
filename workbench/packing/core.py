"""Packings as data: the batch layout convention, validation and the shared fix-ups.

Layout convention
-----------------
A packing is an ordered list of batches ``batches[0..K-1]`` with ``K % R == 0``
(``R`` = ``num_replicas``). Batch ``k`` runs on rank ``k % R`` at step ``k // R``:
the consecutive groups ``batches[s*R:(s+1)*R]`` run at the same time, and the
slowest of them sets the step time. Internally a packing is stored in CSR form,
``flat`` (graph indices, batch after batch) and ``offsets`` (``K + 1`` entries),
so 2.65M graphs in 100k batches cost two arrays, not 100k small ones.

No algorithm produces empty batches: with fewer graphs than replicas it is an
error, and when a packing's count is not a multiple of ``R`` the heaviest
batches are split in two (:func:`round_to_replicas`) instead of padding with
empty batches, which a DDP rank would still have to run.

Graphs of cost 0 (an isolated atom has no edges under ``cost_field="edges"``) are valid and
packed at their cost: they never fill a batch, so a packer bound by the capacity may gather many
of them in one batch, and a split gives each half at least one graph, so every rank still gets a
non-empty batch at every step. If such graphs do cost time, say so in their cost (atoms, or the
cost model's ``a + b*atoms + c*edges``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from workbench.packing._kernels import csr_from_assign
from workbench.packing.checks import EXACT_LIMIT, check_capacity, check_int
from workbench.packing.cost import CostModel

P = TypeVar("P", bound="PackingData")

#: the fields :meth:`PackingData.save` writes and :meth:`~PackingData.load` reads back (as this
#: type; None: the array itself); ``atoms`` and ``edges`` are stored only when present
_SAVED = {
    "flat": None,
    "offsets": None,
    "costs": None,
    "capacity": float,
    "num_replicas": int,
    "algorithm": str,
    "seed": int,
    "epoch": int,
}


@dataclass
class PackingData:
    """A packing as data: the batches in CSR form and the settings that made them.

    ``flat``/``offsets`` hold the batches in CSR form; ``batches`` gives them as a
    list of int64 index arrays. ``costs`` is the packing cost per graph;
    ``atoms``/``edges`` (optional) feed the straggler cost model of the metrics.
    :class:`workbench.packing.api.Packing`, what :func:`~workbench.packing.api.pack`
    returns, adds what needs the packers (the next epoch's packing, the metrics).
    """

    flat: np.ndarray
    offsets: np.ndarray
    costs: np.ndarray
    capacity: float
    num_replicas: int
    algorithm: str
    seed: int = 0
    epoch: int = 0
    atoms: np.ndarray | None = None
    edges: np.ndarray | None = None
    cost_model: CostModel | None = None
    pack_seconds: float = 0.0
    options: dict = field(default_factory=dict)
    _batches: list | None = field(default=None, repr=False)

    @property
    def n_bins(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def n_steps(self) -> int:
        return self.n_bins // self.num_replicas

    @property
    def batches(self) -> list[np.ndarray]:
        """Batches as a list of int64 index arrays (batch ``k`` -> rank ``k % R``, step ``k // R``)."""
        if self._batches is None:
            self._batches = np.split(self.flat, self.offsets[1:-1])
        return self._batches

    def batch_sizes(self) -> np.ndarray:
        """Number of graphs in every batch."""
        return np.diff(self.offsets)

    def loads(self, values: np.ndarray | None = None) -> np.ndarray:
        """Per-batch sum of ``values`` (default: the packing costs)."""
        v = self.costs if values is None else np.asarray(values)
        return batch_sums(v, self.flat, self.offsets)

    def rank_batches(self, rank: int) -> list[np.ndarray]:
        """The batches rank ``rank`` runs, in step order."""
        return self.batches[rank :: self.num_replicas]

    def save(self, path, **arrays) -> None:
        """Write the packing to ``.npz`` (``flat``, ``offsets``, ``costs`` and the settings), with
        ``arrays`` stored beside them (:meth:`load` ignores them)."""
        extra = dict(arrays)
        if self.atoms is not None:
            extra["atoms"] = self.atoms
        if self.edges is not None:
            extra["edges"] = self.edges
        np.savez_compressed(path, **{name: getattr(self, name) for name in _SAVED}, **extra)

    @classmethod
    def load(cls: type[P], path) -> P:
        """Read a packing written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as z:
            fields = {name: z[name] if kind is None else kind(z[name]) for name, kind in _SAVED.items()}
            return cls(**fields, atoms=z.get("atoms", None), edges=z.get("edges", None))


def batch_sums(values: np.ndarray, flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``out[k] = sum(values[flat[offsets[k]:offsets[k+1]]])`` (0 for empty batches)."""
    csum = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64)[flat])))
    return csum[offsets[1:]] - csum[offsets[:-1]]


def assign_to_csr(assign: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin id per graph -> CSR (graphs keep index order inside a bin)."""
    return csr_from_assign(np.ascontiguousarray(assign, dtype=np.int64), int(n_bins))


def _split_two(members: np.ndarray, costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split one bin of two or more graphs into two non-empty halves of near-equal load (greedy,
    largest first). Equal loads go to the half with fewer graphs: graphs of cost 0 (isolated atoms
    under ``cost_field="edges"``) would otherwise all land in the first half, leaving the second
    empty."""
    members = members[np.argsort(-costs[members], kind="stable")]
    a, b, la, lb = [], [], 0.0, 0.0
    for i in members:
        if (la, len(a)) <= (lb, len(b)):
            a.append(i)
            la += costs[i]
        else:
            b.append(i)
            lb += costs[i]
    return np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)


def round_to_replicas(assign: np.ndarray, n_bins: int, costs: np.ndarray, num_replicas: int) -> tuple[np.ndarray, int]:
    """Make the batch count a multiple of ``num_replicas`` by splitting the heaviest batches.

    Works on bin ids (``assign[i]`` = bin of graph ``i``). Each split keeps one
    half in the old bin and moves the other, of near-equal load, to a new bin
    numbered right after it (later bins shift by one). Splitting never breaks
    the capacity bound and never creates an empty batch; if too few batches hold
    two or more graphs a ``ValueError`` says so.
    """
    need = (-n_bins) % num_replicas
    if need == 0:
        return assign, n_bins
    costs = np.asarray(costs, dtype=np.float64)
    assign = np.array(assign, dtype=np.int64, copy=True)
    key = list(np.arange(n_bins, dtype=np.float64))  # position of each bin in the final order
    while need:
        flat, offsets = assign_to_csr(assign, n_bins)
        loads = np.bincount(assign, weights=costs, minlength=n_bins)
        loads[np.diff(offsets) < 2] = -np.inf
        cand = np.argsort(-loads, kind="stable")[:need]
        cand = cand[np.isfinite(loads[cand])]
        if cand.size == 0:
            raise ValueError(
                f"cannot make {n_bins} batches a multiple of num_replicas={num_replicas} without empty "
                f"batches: every batch holds a single graph. Use fewer replicas or more graphs."
            )
        for b in cand:
            _, second = _split_two(flat[offsets[b] : offsets[b + 1]], costs)
            assign[second] = n_bins
            key.append(key[b])  # equal key, later in the list: stable sort puts it right after its parent
            n_bins += 1
        need -= cand.size
    rank = np.empty(n_bins, dtype=np.int64)
    rank[np.argsort(np.asarray(key), kind="stable")] = np.arange(n_bins, dtype=np.int64)
    return rank[assign], n_bins


def check_inputs(costs: np.ndarray, capacity: float, num_replicas: int) -> np.ndarray:
    """Validate and return costs as a 1-D float or int array (capacity and ``num_replicas`` as
    :mod:`workbench.packing.checks` says)."""
    costs = np.asarray(costs)
    if costs.ndim != 1:
        raise ValueError(f"costs must be a 1-D array of per-graph sizes, got shape {costs.shape}")
    if not (np.issubdtype(costs.dtype, np.integer) or np.issubdtype(costs.dtype, np.floating)):
        raise ValueError(f"costs must be numeric, got dtype {costs.dtype}")
    if costs.size and (not np.all(np.isfinite(costs)) or costs.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(costs) | (costs < 0))[0])
        raise ValueError(f"costs must be finite and >= 0; graph {bad} has cost {costs[bad]}")
    check_capacity(capacity)
    if costs.size and costs.max() > EXACT_LIMIT:
        bad = int(np.argmax(costs))
        raise ValueError(
            f"graph {bad} has cost {costs[bad]:g}, beyond {EXACT_LIMIT:g} (2**53), where sums of sizes are not exact"
        )
    check_int("num_replicas", num_replicas, 1)
    if costs.shape[0] < num_replicas:
        raise ValueError(
            f"{costs.shape[0]} graphs cannot give every one of num_replicas={num_replicas} ranks a non-empty "
            f"batch; use at most {costs.shape[0]} replicas"
        )
    return costs


#: what :func:`oversize_mask` does with a graph larger than the capacity
OVERSIZE_CHOICES = ("error", "alone")


def check_oversize(oversize: str) -> str:
    """``oversize`` when it is one of :data:`OVERSIZE_CHOICES`, else a ``ValueError`` listing them."""
    if oversize not in OVERSIZE_CHOICES:
        raise ValueError(f"oversize must be 'error' or 'alone', got {oversize!r}")
    return oversize


def oversize_mask(
    costs: np.ndarray,
    capacity: float,
    oversize: str,
    setting: str = "capacity",
    remedy: str = "drop them, or pass oversize='alone' to give each its own batch",
) -> np.ndarray:
    """Graphs larger than ``capacity`` (the one oversize check): an error naming them, the
    ``setting`` to raise and by how much, or (``oversize="alone"``) a warning."""
    check_oversize(oversize)
    big = costs > capacity
    if not big.any():
        return big
    idx = np.flatnonzero(big)
    shown = ", ".join(f"graph {i} (size {costs[i]:g})" for i in idx[:5])
    more = f" and {idx.size - 5} more" if idx.size > 5 else ""
    if oversize == "error":
        raise ValueError(
            f"{idx.size} graph(s) exceed {setting} {capacity:g}: {shown}{more}. "
            f"Raise {setting} to at least {costs[big].max():g}, {remedy}."
        )
    warnings.warn(
        f"{idx.size} graph(s) exceed capacity {capacity:g} and get a batch of their own: {shown}{more}", stacklevel=3
    )
    return big
