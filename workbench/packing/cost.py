"""Straggler cost model for a DDP step: ``t(batch) = a + b * atoms + c * edges``.

A data-parallel step ends when its slowest rank ends, so an epoch takes

    T = sum over steps s of  max over ranks r of  t(batch[s, r]).

Default coefficients are placeholders anchored on one measurement:
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

#: Trainable parameters of the paper's MACE (TrainConfig() defaults, 17 elements of the embedded mixture),
#: counted with workbench.train.model.build_model.
PAPER_MODEL_PARAMS = 1_269_264


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
    def fit(cls, atoms: np.ndarray, edges: np.ndarray, seconds: np.ndarray, nonnegative: bool = True) -> CostModel:
        """Least-squares fit of ``seconds ~ a + b*atoms + c*edges`` over measured batches.

        ``nonnegative`` (default) constrains ``a, b, c >= 0`` (NNLS): a short run covers a
        narrow range of batch sizes, and an unconstrained fit there can return negative
        terms that make extrapolated batches take negative time. Needs at least three
        batches with independent atom and edge totals; otherwise the unconstrained solve
        returns the minimum-norm solution.
        """
        atoms = np.asarray(atoms, dtype=np.float64)
        edges = np.asarray(edges, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if not (atoms.shape == edges.shape == seconds.shape) or atoms.ndim != 1 or atoms.size == 0:
            raise ValueError("atoms, edges and seconds must be 1-D arrays of the same non-zero length")
        # Scale columns so the solve is well conditioned (atoms ~1e3, edges ~1e5).
        sa, se = max(atoms.max(), 1.0), max(edges.max(), 1.0)
        x = np.column_stack([np.ones_like(atoms), atoms / sa, edges / se])
        if nonnegative:
            from scipy.optimize import nnls

            coef, _ = nnls(x, seconds)
        else:
            coef, *_ = np.linalg.lstsq(x, seconds, rcond=None)
        epa = float(edges.sum() / atoms.sum()) if atoms.sum() > 0 else cls.edges_per_atom
        return cls(a=float(coef[0]), b=float(coef[1] / sa), c=float(coef[2] / se), edges_per_atom=epa)

    def describe(self) -> str:
        return f"t = {self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} µs/atom + {self.c * 1e6:.3g} µs/edge"

    def epoch_seconds(self, step_batch_atoms: np.ndarray, step_batch_edges: np.ndarray | None = None) -> float:
        """Epoch time for per-batch totals shaped ``(steps, ranks)``: sum of per-step maxima."""
        t = self.batch_seconds(step_batch_atoms, step_batch_edges)
        return float(t.max(axis=1).sum()) if t.size else 0.0


@dataclass(frozen=True)
class AllReduceModel:
    """Gradient all-reduce per step: ``2 (R-1)/R * bytes / bandwidth + 2 ceil(log2 R) * latency``.

    Bandwidth is NVLink-class inside a node (``R <= gpus_per_node``) and the
    NIC's inside the dragonfly otherwise (4 A100 per node and 25 GB/s per GPU,
    as on the paper's system). One all-reduce per step, not overlapped with
    the backward pass (pessimistic). ``grad_bytes``: fp32 gradients of the paper's
    MACE (:data:`PAPER_MODEL_PARAMS` parameters).
    """

    grad_bytes: float = PAPER_MODEL_PARAMS * 4.0
    inter_node_bandwidth: float = 25e9
    intra_node_bandwidth: float = 200e9
    gpus_per_node: int = 4
    latency: float = 10e-6

    def seconds(self, num_gpus: int) -> float:
        r = int(num_gpus)
        if r <= 1:
            return 0.0
        bw = self.intra_node_bandwidth if r <= self.gpus_per_node else self.inter_node_bandwidth
        return 2.0 * (r - 1) / r * self.grad_bytes / bw + 2.0 * np.ceil(np.log2(r)) * self.latency

    def describe(self) -> str:
        return (
            f"all-reduce: {self.grad_bytes / 1e6:.1f} MB fp32 gradients per step, ring at "
            f"{self.inter_node_bandwidth / 1e9:.0f} GB/s/GPU between nodes ({self.intra_node_bandwidth / 1e9:.0f} "
            f"inside a {self.gpus_per_node}-GPU node) + {self.latency * 1e6:.0f} µs × 2⌈log2 R⌉, not overlapped"
        )


class _Batches(Protocol):
    """What :func:`simulate_epoch` reads of a packing (:class:`workbench.packing.core.PackingData`)."""

    num_replicas: int

    def loads(self, values: np.ndarray | None = None) -> np.ndarray: ...


def simulate_epoch(
    packing: _Batches, sizes: np.ndarray, cost_model: CostModel, allreduce: AllReduceModel | None = None
) -> dict:
    """Epoch time of a packing: every step lasts as long as its slowest rank, plus one all-reduce.

    ``sizes``: structured array with ``atoms`` and ``edges`` per graph. Returns ``compute_s``
    (sum of per-step maxima, :meth:`CostModel.epoch_seconds`), ``balanced_s`` (sum of per-step
    means: the same work with perfect balance), ``allreduce_s``, ``epoch_s`` and ``steps``.
    """
    r = packing.num_replicas
    atoms = packing.loads(sizes["atoms"]).reshape(-1, r)
    edges = packing.loads(sizes["edges"]).reshape(-1, r)
    steps = atoms.shape[0]
    ar = (allreduce or AllReduceModel()).seconds(r) * steps
    compute = cost_model.epoch_seconds(atoms, edges)
    balanced = float(cost_model.batch_seconds(atoms, edges).mean(axis=1).sum()) if steps else 0.0
    return {"steps": steps, "compute_s": compute, "balanced_s": balanced, "allreduce_s": ar, "epoch_s": compute + ar}


def fit_step_times(
    steps: Sequence[Mapping], skip_first: int = 2, nonnegative: bool = True, source: str = "the step log"
) -> tuple[CostModel, str]:
    """:meth:`CostModel.fit` on a training run's measured steps, and one line that says what was fitted.

    ``steps``: one record per rank and step with ``global_step``, ``atoms``, ``edges`` and
    ``compute_s`` (the trainer's step log, :func:`workbench.train.rundir.read_steps`). The first
    ``skip_first`` steps of each rank are dropped: they carry one-off costs (allocator warm-up,
    lazy initialisation, kernel compilation). ``nonnegative``: NNLS, else least squares.
    """
    recs = [r for r in steps if r["global_step"] > skip_first]
    if len(recs) < 3:
        raise ValueError(f"{source}: need at least 3 logged steps after warm-up to fit a cost model, found {len(recs)}")
    atoms = np.array([r["atoms"] for r in recs], dtype=float)
    edges = np.array([r["edges"] for r in recs], dtype=float)
    seconds = np.array([r["compute_s"] for r in recs], dtype=float)
    model = CostModel.fit(atoms, edges, seconds, nonnegative=nonnegative)
    rms = float(np.sqrt(np.mean((seconds - model.batch_seconds(atoms, edges)) ** 2)))
    kind = "NNLS" if nonnegative else "least-squares"
    desc = (
        f"cost model: {kind} fit to {len(recs)} measured step compute times of {source} "
        f"(batches of {atoms.min():.0f}–{atoms.max():.0f} atoms): {model.describe()}, rms residual {rms * 1e3:.3g} ms"
    )
    return model, desc
