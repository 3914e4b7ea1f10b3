r"""``mace-order``: the batches ``mace_run_train`` draws, so that a run pairs with it step for step.

mace-torch's ``run_train`` (0.3.16, one process; ``tests/test_mace_order.py`` checks it against the real one) batches

.. code-block:: python

    DataLoader(train_set, batch_size, shuffle=True, drop_last=True,
               generator=torch.Generator().manual_seed(seed))

and iterates that loader twice before the first step: pass 0 gives ``avg_num_neighbors``,
pass 1 the shift and scale (``compute_mean_rms_energy_forces``). Epoch :math:`e` is therefore
the loader's pass :math:`2 + e`. Every pass is a fresh permutation of :math:`n` graphs cut into
:math:`\lfloor n / b \rfloor` batches of :math:`b`; the last :math:`n \bmod b` graphs it drew sit
that pass out.

The draws depend on :math:`n`, :math:`b` and the seed only, so replaying the same torch loader
over ``range(n)`` gives mace's indices without touching a graph. With the same split, seed and
initial weights (:func:`workbench.train.build.build_training`), a ``mace-order`` run sees the
same batches in the same order as ``mace_run_train``, and
:meth:`MaceOrderSampler.statistics_rows` gives the graphs mace's statistics saw.
``workbench bench quality`` uses this to compare the two trainers seed by seed instead of
through the seed-to-seed spread.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from workbench.packing.sampler import EpochBatchSampler

NAME = "mace-order"
STATISTICS_PASSES = 2  # avg_num_neighbors, then shift and scale, before the first step


def statistics_passes(config) -> int:
    """The loader passes mace_run_train makes before its first step: 2, or 1 in multihead
    fine-tuning, where the replay head's neighbour count comes from the foundation and mace
    skips the avg_num_neighbors pass (only the scaling pass is left)."""
    return 1 if getattr(config, "multihead_finetuning", False) else STATISTICS_PASSES


class _Passes:
    """The loader's passes in order, replayed from the seed (a pass is recomputed, not stored)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = int(n), int(batch_size), int(seed)
        self._restart()

    def _restart(self) -> None:
        import torch
        from torch.utils.data import DataLoader

        self._loader = DataLoader(
            range(self.n),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=list,
        )
        self._next = 0

    def get(self, k: int) -> np.ndarray:
        """Pass ``k`` as a ``(n // batch_size, batch_size)`` array of graph indices."""
        if k < self._next:
            self._restart()
        while True:
            batches = np.array(list(self._loader), dtype=np.int64).reshape(-1, self.batch_size)
            self._next += 1
            if self._next > k:
                return batches


def check_ranks(ranks: int, detail: str = "") -> None:
    """Refuse more than one rank: mace's distributed runs draw from ``DistributedSampler`` instead."""
    if ranks != 1:
        raise ValueError(
            f"sampler {NAME!r} replays mace_run_train's single-process batch order: it runs on one "
            f"rank, not {ranks}{detail}; use 'fixed-count' for several"
        )


def file_order(data) -> np.ndarray | None:
    """For each position of the training file (the order mace reads it in), the index of that
    graph in ``data`` (:class:`~workbench.train.data.TrainData`); None when the graphs are in
    file order or did not come from one file."""
    frames = getattr(data.origin, "frames", None)
    if frames is None:
        return None
    order = np.argsort(frames, kind="stable")
    return None if np.array_equal(order, np.arange(order.size)) else order


class MaceOrderSampler(EpochBatchSampler):
    """Yield the batches of ``mace_run_train``'s training loader for ``seed``, epoch by epoch.

    Parameters
    ----------
    n : number of training graphs (in the order mace reads its training file).
    batch_size : graphs per batch (mace's ``--batch_size``).
    seed : mace's ``--seed``.
    order : :func:`file_order` (mace's file positions to dataset indices); None: the same.
    atoms : atoms per graph, for :meth:`packing` (the run record's batch layout).
    statistics_passes : loader passes mace makes before its first step (:func:`statistics_passes`).

    One process only: mace's distributed runs draw from ``DistributedSampler`` instead.
    The protocol of :class:`~workbench.packing.sampler.EpochBatchSampler` (``set_epoch``,
    ``state_dict`` / ``load_state_dict`` to resume mid-epoch, ``packing`` for the run record).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int = 0,
        order: np.ndarray | None = None,
        atoms: np.ndarray | None = None,
        statistics_passes: int = STATISTICS_PASSES,
    ) -> None:
        if n < batch_size:
            raise ValueError(
                f"sampler {NAME!r}: {n} training graphs make no full batch of {batch_size} "
                "(mace_run_train drops the incomplete last batch); lower TrainConfig.batch_size"
            )
        self.n, self.batch_size, self.seed = int(n), int(batch_size), int(seed)
        if order is not None and sorted(np.asarray(order).tolist()) != list(range(self.n)):
            raise ValueError(f"order must be a permutation of the {self.n} training graphs")
        self.order = None if order is None else np.asarray(order, dtype=np.int64)
        self.atoms = np.ones(self.n, dtype=np.int64) if atoms is None else np.asarray(atoms, dtype=np.int64)
        self.statistics_passes = int(statistics_passes)
        self.set_epoch(0)
        self._passes = _Passes(n, batch_size, seed)
        self._cache: tuple[int, np.ndarray] | None = None

    def batches(self, epoch: int | None = None) -> np.ndarray:
        """The ``(steps, batch_size)`` graph indices of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._cache is None or self._cache[0] != epoch:
            b = self._passes.get(self.statistics_passes + epoch)
            self._cache = (epoch, b if self.order is None else self.order[b])
        return self._cache[1]

    def statistics_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(neighbour_rows, energy_rows)``: the training graphs mace's ``avg_num_neighbors`` and
        its shift and scale are computed over (passes 0 and 1, each in drawing order; one pass
        serves both when mace makes only one)."""
        rows = self._passes.get(0).ravel(), self._passes.get(self.statistics_passes - 1).ravel()
        return rows if self.order is None else (self.order[rows[0]], self.order[rows[1]])

    def packing(self, epoch: int | None = None):
        """The epoch's batches as a :class:`~workbench.packing.Packing` (for ``packing.npz``)."""
        from workbench.packing import Packing

        b = self.batches(epoch)
        offsets = np.arange(b.shape[0] + 1, dtype=np.int64) * self.batch_size
        return Packing(
            flat=b.ravel().copy(),
            offsets=offsets,
            costs=self.atoms.astype(np.float64),
            capacity=float(self.atoms[b].sum(axis=1).max()),
            num_replicas=1,
            algorithm=NAME,
            seed=self.seed,
            epoch=self.epoch if epoch is None else int(epoch),
            atoms=self.atoms,
        )

    def __iter__(self) -> Iterator[list[int]]:
        b = self.batches()
        return self._yield_from(b.shape[0], lambda k: b[k].tolist())

    def __len__(self) -> int:
        return self.n // self.batch_size

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "algorithm": NAME,
            "num_replicas": 1,
            "n_graphs": self.n,
            "batch_size": self.batch_size,
            "rank": 0,
        }
