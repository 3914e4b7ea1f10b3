r"""The training split's statistics that mace bakes into a model, from data or from an index.

mace-torch's ``run_train`` computes, on the training split:

* **E0s** — per-element reference energies, the least-squares solution of
  :math:`\min_x \lVert A x - E \rVert` with :math:`A_{gz}` the count of element z in graph g
  (``compute_average_E0s``, ``numpy.linalg.lstsq`` with ``rcond=None``);
* **avg_num_neighbors** — the mean, over atoms with at least one neighbour, of their
  neighbour count (``compute_avg_num_neighbors``: ``torch.unique`` over receivers), i.e.
  :math:`\sum_g \text{edges}_g / \sum_g \text{connected}_g`;
* **shift** — the mean over graphs of the per-atom interaction energy
  :math:`(E_g - \sum_z A_{gz} E0_z) / N_g`;
* **scale** — the RMS force component :math:`\sqrt{\sum_g \sum_i |F_i|^2 / (3 \sum_g N_g)}`
  (mace's default ``rms_forces_scaling``).

:func:`compute_stats` runs mace's own functions on in-memory data. :func:`stats_from_index`
gets the same numbers from a prepared dataset's index (:mod:`workbench.data.store`) without
touching a structure, in bounded memory: E0s by a streamed QR of ``[A | E]`` (the same
minimiser and, with the same ``rcond``, the same minimum-norm solution as ``lstsq`` on ``A``),
the rest from per-graph sums. All four are exact up to float64 rounding: against mace's
functions in float64 they agree to 1e-9 relative (``tests/test_prepare.py``). Two caveats:
edges were counted at prepare time (:mod:`workbench.data.neighbours`, equal to vesin's full
list), where mace builds its graphs with matscipy (the same pairs, barring a distance within
rounding of the cutoff); and in a float32 run mace's own functions average in float32, so they
differ from these by float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ModelStats:
    """Data-derived constants baked into the model (saved in checkpoints for exact rebuilds)."""

    zs: list[int]
    e0s: list[float]
    avg_num_neighbors: float
    shift: float
    scale: float
    pt_e0s: list[float] | None = None  # multihead fine-tuning: the E0s of head pt_head (e0s: Default's)
    head_e0s: dict[str, list[float]] | None = None  # with TrainConfig.heads: each new head's (e0s: the last's)

    def to_dict(self) -> dict:
        out = {
            "zs": self.zs,
            "e0s": self.e0s,
            "avg_num_neighbors": self.avg_num_neighbors,
            "shift": self.shift,
            "scale": self.scale,
        }
        if self.pt_e0s is not None:  # absent otherwise: a one-head checkpoint reads as before
            out["pt_e0s"] = self.pt_e0s
        if self.head_e0s is not None:
            out["head_e0s"] = self.head_e0s
        return out

    def describe(self) -> str:
        """A few lines for a console or notebook."""
        from ase.data import chemical_symbols

        e0 = ", ".join(f"{chemical_symbols[z]} {e:.4f}" for z, e in zip(self.zs, self.e0s))
        return (
            f"E0s (eV): {e0}\n"
            f"average neighbours {self.avg_num_neighbors:.3f}; shift {self.shift:.5f} eV/atom; "
            f"scale (RMS force) {self.scale:.5f} eV/Å"
        )


def compute_stats(
    configs: list,
    train_data: list,
    z_table,
    neighbour_rows: np.ndarray | None = None,
    energy_rows: np.ndarray | None = None,
) -> ModelStats:
    """mace's own functions. ``configs``: mace ``Configuration`` list of the training split;
    ``train_data``: its ``AtomicData``. E0s come from every graph; ``avg_num_neighbors`` from
    ``neighbour_rows`` and shift and scale from ``energy_rows`` of ``train_data`` when given
    (the graphs mace's shuffled loader saw:
    :meth:`workbench.train.mace_order.MaceOrderSampler.statistics_rows`), else from every graph."""
    from mace.data.utils import compute_average_E0s
    from mace.modules.utils import compute_avg_num_neighbors, compute_mean_rms_energy_forces
    from mace.tools.torch_geometric import DataLoader

    def loader(rows):
        graphs = train_data if rows is None else [train_data[int(i)] for i in rows]
        return DataLoader(graphs, batch_size=32, shuffle=False)

    e0 = compute_average_E0s(configs, z_table)
    e0s = [float(e0[z]) for z in z_table.zs]
    avg = float(compute_avg_num_neighbors(loader(neighbour_rows)))
    mean, rms = compute_mean_rms_energy_forces(loader(energy_rows), np.array(e0s))
    return ModelStats(
        zs=[int(z) for z in z_table.zs],
        e0s=e0s,
        avg_num_neighbors=avg,
        shift=float(np.ravel(mean)[0]),
        scale=float(np.ravel(rms)[0]),
    )


def _columns(store, zs: list[int]) -> np.ndarray:
    where = {int(z): k for k, z in enumerate(store.elements)}
    missing = [z for z in zs if z not in where]
    if missing:
        raise ValueError(f"{store.path}: elements {missing} do not occur in the prepared dataset")
    return np.array([where[int(z)] for z in zs], dtype=np.int64)


def average_e0s(store, rows: np.ndarray, zs: list[int]) -> np.ndarray:
    """E0s of ``rows`` (mace's ``compute_average_E0s``) by a streamed QR of ``[A | E]``."""
    cols = _columns(store, zs)
    n_el = len(zs)
    r = np.zeros((0, n_el + 1))
    energy = store.column("energy")
    for block, counts in store.element_counts(np.sort(rows)):
        m = np.empty((block.size, n_el + 1))
        m[:, :n_el] = counts[:, cols]
        m[:, n_el] = energy[block]
        r = np.linalg.qr(np.vstack([r, m]), mode="r")
    r = np.vstack([r, np.zeros((max(n_el + 1 - r.shape[0], 0), n_el + 1))])[: n_el + 1]
    # numpy's rcond=None is eps * max(M, N) of the matrix it is given: use A's shape, not R's.
    rcond = np.finfo(np.float64).eps * max(int(np.asarray(rows).size), n_el)
    return np.linalg.lstsq(r[:n_el, :n_el], r[:n_el, n_el], rcond=rcond)[0]


def stats_from_index(store, rows: np.ndarray, zs: list[int]) -> ModelStats:
    """:class:`ModelStats` of the training ``rows`` of a :class:`~workbench.data.store.GraphStore`,
    for a model over elements ``zs`` (sorted), from the index and element counts alone."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        raise ValueError(f"{store.path}: no training graphs to compute statistics from")
    if not store.column("labelled", rows).all():
        raise ValueError(f"{store.path}: statistics need labelled graphs only")
    e0s = average_e0s(store, rows, zs)
    cols = _columns(store, zs)
    atoms = store.column("atoms", rows).astype(np.int64)
    edges = store.column("edges", rows).astype(np.int64)
    connected = store.column("connected", rows).astype(np.int64)
    energy, block_atoms = store.column("energy"), store.column("atoms")
    per_atom = np.empty(rows.size)  # (E - sum_z n_z E0_z) / N per graph; the order does not matter
    at = 0
    for block, counts in store.element_counts(np.sort(rows)):
        per_atom[at : at + block.size] = (energy[block] - counts[:, cols] @ e0s) / block_atoms[block]
        at += block.size
    fsq = float(np.sum(store.column("fsq", rows)))
    return ModelStats(
        zs=[int(z) for z in zs],
        e0s=[float(e) for e in e0s],
        avg_num_neighbors=float(edges.sum() / max(int(connected.sum()), 1)),
        shift=float(per_atom.mean()),
        scale=float(np.sqrt(fsq / (3.0 * atoms.sum()))) or 1.0,
    )


def dataset_statistics(store) -> ModelStats:
    """:func:`stats_from_index` over every labelled graph of a prepared dataset."""
    rows = store.select()
    return stats_from_index(store, rows, store.present_elements(rows))
