r"""Fixed batch shapes: bounds that every bin of a capacity-``C`` packing respects, and what
padding every batch up to them costs.

A CUDA graph replays one set of tensor shapes, so a fixed-shape batch holds exactly
``atoms`` atoms, ``edges`` edges and ``graphs`` graphs, the rest being a ghost graph
(:mod:`workbench.train.padding`). The bounds hold for *any* bin of at most ``C`` atoms, not
only the bins of one epoch, so one shape serves every epoch and every algorithm that
respects the capacity:

* atoms: :math:`C + 1`; the one atom above ``C`` is the ghost graph's, so that there is
  always an atom to hang the ghost edges on;
* graphs: :math:`k + 1`, where :math:`k` is the largest number of graphs whose sizes fit in
  ``C`` (the :math:`k` smallest, summed); the one above is the ghost graph;
* edges: the fractional-knapsack bound :math:`\max \sum_i e_i x_i` subject to
  :math:`\sum_i a_i x_i \le C`, :math:`0 \le x_i \le 1`: graphs taken in order of edges per
  atom, densest first, the last one in part. It is an upper bound on the edges of any bin
  (the linear relaxation of the integer problem) and at most :math:`C \max_i e_i / a_i`.

On a mixture the edge bound is far above a typical bin (the Table-3 mixture at ``C`` = 3072:
bound 182,467, bins 98,525 on average), so padding every batch to it would nearly double the
edge work. A :class:`ShapeLadder` gives a few edge counts instead, each ``1 + step`` times the
next smaller, from the bound down; a batch takes the smallest that holds it. Padding then adds
at most ``step`` of a batch's edges, for one captured CUDA graph per rung in use.

Nothing here imports torch.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["DEFAULT_EDGE_STEP", "FixedShape", "ShapeLadder", "fixed_shape", "padding_cost", "shape_ladder"]


#: the ladder's default step (``TrainConfig.edge_bucket_step``): at most 5% more edges per batch
DEFAULT_EDGE_STEP = 0.05


@dataclass(frozen=True)
class FixedShape:
    """The shape every padded batch has: ``atoms``, ``edges`` (directed) and ``graphs``, each
    counting the ghost graph's share."""

    atoms: int
    edges: int
    graphs: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ShapeLadder:
    """Fixed shapes of equal ``atoms`` and ``graphs`` and ascending edge counts ``edges``
    (the last is the bound): :meth:`shape_for` picks a batch's."""

    atoms: int
    graphs: int
    edges: tuple[int, ...]

    def shape_for(self, edges: int) -> FixedShape:
        """The smallest shape with room for ``edges`` real edges (``ValueError`` above the top)."""
        rung = bisect.bisect_left(self.edges, edges)
        if rung == len(self.edges):
            raise ValueError(f"{edges} edges: above the top fixed shape's {self.edges[-1]}")
        return FixedShape(self.atoms, self.edges[rung], self.graphs)

    @property
    def top(self) -> FixedShape:
        return FixedShape(self.atoms, self.edges[-1], self.graphs)


def shape_ladder(top: FixedShape, step: float) -> ShapeLadder:
    """Edge counts from ``top.edges`` down, each ``1 + step`` times the next (``step`` 0: one shape)."""
    if not 0 <= step < 1:
        raise ValueError(f"shape_ladder: step must be in [0, 1), got {step}")
    rungs = [top.edges]
    while step > 0 and (nxt := int(np.floor(rungs[-1] / (1.0 + step)))) >= 1 and nxt < rungs[-1]:
        rungs.append(nxt)
    return ShapeLadder(top.atoms, top.graphs, tuple(reversed(rungs)))


def _max_graphs(atoms: np.ndarray, capacity: int) -> int:
    return int(np.searchsorted(np.cumsum(np.sort(atoms)), capacity, side="right"))


def _max_edges(atoms: np.ndarray, edges: np.ndarray, capacity: int) -> int:
    order = np.argsort(-(edges / atoms), kind="stable")
    a, e = atoms[order].astype(np.float64), edges[order].astype(np.float64)
    whole = int(np.searchsorted(np.cumsum(a), capacity, side="right"))  # densest graphs taken whole
    total = float(e[:whole].sum())
    if whole < len(a):
        room = capacity - float(a[:whole].sum())
        total += e[whole] * room / a[whole]
    return int(np.floor(total + 1e-9))


def fixed_shape(atoms: np.ndarray, edges: np.ndarray, capacity: int, edge_capacity: int | None = None) -> FixedShape:
    """The :class:`FixedShape` of batches of graphs of ``atoms`` atoms and ``edges`` edges packed
    at ``capacity`` atoms (the module docstring's bounds).

    ``edge_capacity``: the real edges a batch may hold, instead of the bound (smaller bounds pad
    less; a batch over it is refused when it is padded). Raises ``ValueError`` naming the
    first graph larger than ``capacity``, a graph without atoms, or arrays of different lengths.
    """
    atoms, edges = np.asarray(atoms, dtype=np.int64), np.asarray(edges, dtype=np.int64)
    if atoms.shape != edges.shape or atoms.ndim != 1 or len(atoms) == 0:
        raise ValueError(
            f"fixed_shape: atoms {atoms.shape} and edges {edges.shape} must be equal, non-empty 1-d arrays"
        )
    if capacity < 1:
        raise ValueError(f"fixed_shape: capacity must be at least 1 atom, got {capacity}")
    for name, bad in (("has no atoms", atoms < 1), ("has negative edges", edges < 0), ("exceeds", atoms > capacity)):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"fixed_shape: graph {i} ({atoms[i]} atoms) {name}"
                + (f" the capacity of {capacity} atoms" if name == "exceeds" else "")
            )
    bound = _max_edges(atoms, edges, capacity)
    if edge_capacity is not None:
        if edge_capacity < int(edges.max()):
            i = int(np.argmax(edges))
            raise ValueError(
                f"fixed_shape: edge_capacity {edge_capacity} is below graph {i}'s {edges[i]} edges; "
                f"raise it, or leave it unset for the bound of {bound}"
            )
        bound = min(bound, int(edge_capacity))
    return FixedShape(atoms=capacity + 1, edges=bound, graphs=_max_graphs(atoms, capacity) + 1)


def padding_cost(bin_atoms: np.ndarray, bin_edges: np.ndarray, shapes: FixedShape | ShapeLadder) -> dict[str, float]:
    """What padding bins of ``bin_atoms`` atoms and ``bin_edges`` edges to ``shapes`` (one shape,
    or each bin to its rung of a ladder) adds: ghost atoms and edges in total and as a share of
    the real ones, and how many shapes the bins use."""
    bin_atoms, bin_edges = np.asarray(bin_atoms, dtype=np.int64), np.asarray(bin_edges, dtype=np.int64)
    if isinstance(shapes, FixedShape):
        shapes = ShapeLadder(shapes.atoms, shapes.graphs, (shapes.edges,))
    rungs = np.asarray(shapes.edges, dtype=np.int64)
    which = np.searchsorted(rungs, bin_edges, side="left")
    if len(which) and which.max() >= len(rungs):
        raise ValueError(f"padding_cost: a bin has {bin_edges.max()} edges, above the top shape's {rungs[-1]}")
    ghost_atoms = int(len(bin_atoms) * shapes.atoms - bin_atoms.sum())
    ghost_edges = int(rungs[which].sum() - bin_edges.sum())
    return {
        "batches": len(bin_atoms),
        "shapes_used": len(np.unique(which)),
        "ghost_atoms": ghost_atoms,
        "ghost_edges": ghost_edges,
        "atoms_added": ghost_atoms / max(int(bin_atoms.sum()), 1),
        "edges_added": ghost_edges / max(int(bin_edges.sum()), 1),
    }
