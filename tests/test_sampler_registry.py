"""Every registered packing algorithm trains as ``TrainConfig.sampler`` and keeps its declared bound.

The registry (:data:`workbench.packing.api.ALGORITHMS`) says whether an algorithm respects
``capacity`` (atoms per batch) or batches by count (``batch_size`` graphs per batch, or per rank
and step: ``count_bound``). For each one the trainer runs two steps in-process; the steps it
logged and the epoch's batches it recorded (``packing.npz``) must keep that bound, hold every
training graph exactly once, and the logged steps must be batches of that epoch.
"""

from __future__ import annotations

import numpy as np
import pytest
from train_fixtures import tiny

from workbench.data.embedded import EMBEDDED_PATH
from workbench.packing.api import ALGORITHMS

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

CAPACITY = 200  # atoms per batch for the capacity-respecting algorithms
BATCH_SIZE = 3  # graphs per batch for the count-based ones (below lpt's and fixed-count's own default of 8)
# Count-based algorithms never look at the capacity: one below the smallest graph must not stop them.
UNUSED_CAPACITY = 1


def _config(tmp_path, name: str):
    spec = ALGORITHMS[name]
    return tiny(
        tmp_path,
        f"s_{name}",
        sampler=name,
        capacity=CAPACITY if spec.respects_capacity else UNUSED_CAPACITY,
        batch_size=BATCH_SIZE,
        max_steps=2,
        epochs=1,
        checkpoint_every=0,
        export=False,
        ema_decay=None,
        hidden_irreps="4x0e+4x1o",
        radial_mlp=[8],
        max_structures=40,
    )


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory):
    """The graphs, prepared once: every sampler trains on the same split."""
    from workbench.train.data import prepare_data

    return prepare_data(_config(tmp_path_factory.mktemp("data"), "paper"))


def _check_bound(name: str, packing, atoms: np.ndarray, capacity: int, graphs: int) -> None:
    """The bound the registry declares for ``name``: capacity, graphs per batch, or per rank and step."""
    spec = ALGORITHMS[name]
    if spec.respects_capacity:
        loads = packing.loads(atoms)
        assert loads.max() <= capacity, f"{name}: a batch of {loads.max():g} atoms > capacity {capacity}"
    per = {"batch": 1, "step": packing.num_replicas}.get(spec.count_bound)
    if per is not None:
        counts = packing.batch_sizes().reshape(-1, per).sum(axis=1)
        assert counts.max() <= graphs * per, f"{name}: {counts.max()} graphs per {spec.count_bound} > {graphs * per}"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_registered_algorithm_packs_within_its_declared_bound_on_several_ranks(name):
    from workbench.packing.api import pack

    atoms = np.random.default_rng(1).integers(3, 120, size=300)
    options = {"graphs_per_batch": 4} if ALGORITHMS[name].takes_graphs_per_batch else {}
    for replicas in (1, 3):
        for epoch in (0, 1):
            p = pack(atoms, 250, replicas, algorithm=name, seed=2, epoch=epoch, **options)
            assert np.array_equal(np.sort(p.flat), np.arange(atoms.size))
            _check_bound(name, p, atoms, 250, 4)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_registered_algorithm_trains_within_its_declared_bound(name, tmp_path, shared_data):
    from workbench.train import train
    from workbench.train.record import read_packing
    from workbench.train.rundir import read_steps
    from workbench.train.step import batch_hash

    spec = ALGORITHMS[name]
    cfg = _config(tmp_path, name)
    result = train(cfg, resume=False, data=shared_data)
    assert result.global_step == 2

    packing, sizes = read_packing(cfg.run_dir)
    n = len(shared_data.train_atoms)
    assert np.array_equal(np.sort(packing.flat), np.arange(n)), "every training graph once per epoch"
    _check_bound(name, packing, sizes["atoms"], CAPACITY, BATCH_SIZE)
    batches = packing.batches

    steps = read_steps(cfg.run_dir)
    assert len(steps) == 2
    for s in steps:  # one rank: a step is one batch
        assert s["atoms"] <= CAPACITY if spec.respects_capacity else s["graphs"] <= BATCH_SIZE
    epoch = {batch_hash(b) for b in batches}
    assert all(s["batch_hash"] in epoch for s in steps), "the steps ran batches of the recorded epoch"
    assert len({s["batch_hash"] for s in steps}) == 2, "no batch twice in the epoch"


def test_unknown_sampler_names_every_choice():
    from workbench.train.config import SAMPLERS, TrainConfig
    from workbench.train.mace_order import NAME

    assert set(SAMPLERS) == {*ALGORITHMS, NAME}
    with pytest.raises(ValueError, match="is not one of " + ", ".join(SAMPLERS)):
        TrainConfig(sampler="no-such-packer")


def test_every_list_of_algorithms_follows_the_registry():
    from workbench.packing import grid
    from workbench.viz import layout, style

    assert tuple(ALGORITHMS) == grid.GRID_ALGORITHMS
    assert set(style.ALGORITHM_COLORS) == set(ALGORITHMS), "every registered algorithm has a colour"
    assert len(set(style.ALGORITHM_COLORS.values())) == len(style.ALGORITHM_COLORS), "and its own"
    assert style.algorithm_order(["x", *reversed(ALGORITHMS)]) == [*ALGORITHMS, "x"]
    assert tuple(a for a in ALGORITHMS if ALGORITHMS[a].respects_capacity) == layout.LAYOUT_PACKERS
    # An algorithm bounds its batches by capacity or by count (the trainer gives it one of the two).
    assert all(a.respects_capacity or a.takes_graphs_per_batch for a in ALGORITHMS.values())
