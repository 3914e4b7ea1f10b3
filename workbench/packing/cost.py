"""Straggler cost model for a DDP step: ``t(batch) = a + b * atoms + c * edges``.

A data-parallel step ends when its slowest rank ends, so an epoch takes

    T = sum over steps s of  max over ranks r of  t(batch[s, r]).

Default coefficients are placeholders anchored on one measurement (DESIGN.md):
an H100 train step of the paper's MACE model (e3nn) at 3072 atoms / 143k edges
takes ~286 ms. We split it as a 10 ms constant (launch, optimizer, all-reduce
latency), 16 ms atom-proportional (linear layers, product block) and 260 ms
edge-proportional (channelwise tensor product and scatter), so

    a = 0.010 s,  b = 0.016 / 3072 s/atom,  c = 0.260 / 143_000 s/edge.

Replace them by :meth:`CostModel.fit` on measured step times from trainer logs.
When only one cost array is known, edges are estimated as
``edges_per_atom * atoms`` with the same anchor's 46.5 edges per atom.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Per-batch time ``a + b*atoms + c*edges`` in seconds."""

    a: float = 0.010
    b: float = 0.016 / 3072
    c: float = 0.260 / 143_000
    edges_per_atom: float = 143_000 / 3072

    def batch_seconds(self, atoms: np.ndarray, edges: np.ndarray | None = None) -> np.ndarray:
        """Time of batches with the given atom (and edge) totals; empty batches cost nothing."""
        atoms = np.asarray(atoms, dtype=np.float64)
        edges = atoms * self.edges_per_atom if edges is None else np.asarray(edges, dtype=np.float64)
        t = self.a + self.b * atoms + self.c * edges
        return np.where((atoms > 0) | (edges > 0), t, 0.0)

    def graph_costs(self, atoms: np.ndarray, edges: np.ndarray | None = None) -> np.ndarray:
        """Marginal per-graph cost ``b*atoms + c*edges``: a packing cost array (no constant)."""
        atoms = np.asarray(atoms, dtype=np.float64)
        edges = atoms * self.edges_per_atom if edges is None else np.asarray(edges, dtype=np.float64)
        return self.b * atoms + self.c * edges

    @classmethod
    def fit(cls, atoms: np.ndarray, edges: np.ndarray, seconds: np.ndarray) -> "CostModel":
        """Least-squares fit of ``seconds ~ a + b*atoms + c*edges`` over measured batches.

        Needs at least three batches with independent atom and edge totals;
        otherwise ``numpy.linalg.lstsq`` returns the minimum-norm solution.
        """
        atoms = np.asarray(atoms, dtype=np.float64)
        edges = np.asarray(edges, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if not (atoms.shape == edges.shape == seconds.shape) or atoms.ndim != 1 or atoms.size == 0:
            raise ValueError("atoms, edges and seconds must be 1-D arrays of the same non-zero length")
        # Scale columns so the solve is well conditioned (atoms ~1e3, edges ~1e5).
        sa, se = max(atoms.max(), 1.0), max(edges.max(), 1.0)
        x = np.column_stack([np.ones_like(atoms), atoms / sa, edges / se])
        coef, *_ = np.linalg.lstsq(x, seconds, rcond=None)
        epa = float(edges.sum() / atoms.sum()) if atoms.sum() > 0 else cls.edges_per_atom
        return cls(a=float(coef[0]), b=float(coef[1] / sa), c=float(coef[2] / se), edges_per_atom=epa)

    def epoch_seconds(self, step_batch_atoms: np.ndarray, step_batch_edges: np.ndarray | None = None) -> float:
        """Epoch time for per-batch totals shaped ``(steps, ranks)``: sum of per-step maxima."""
        t = self.batch_seconds(step_batch_atoms, step_batch_edges)
        return float(t.max(axis=1).sum()) if t.size else 0.0
