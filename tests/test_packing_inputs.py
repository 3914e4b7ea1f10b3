"""The packer's arguments: graphs of cost 0, and counts, seeds, epochs and capacities that are
not what they should be (bool, float, negative), refused up front with the argument named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.cli import main
from workbench.packing import ALGORITHMS, BinPackingBatchSampler, pack

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COSTS = np.arange(1, 41)


def _options(algorithm: str, graphs_per_batch: int = 4) -> dict:
    return {"graphs_per_batch": graphs_per_batch} if ALGORITHMS[algorithm].takes_graphs_per_batch else {}


# -- graphs of cost 0 (isolated atoms have no edges) ----------------------------------------------


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", [2, 8, 33])
def test_all_zero_costs_give_every_rank_a_graph(algorithm, n):
    # ffd and dynamic put every zero-cost graph in one bin; splitting it for 2 ranks left one empty
    p = pack(np.zeros(n, dtype=np.int64), 10, 2, algorithm=algorithm, **_options(algorithm))
    assert (p.batch_sizes() > 0).all() and sorted(p.flat.tolist()) == list(range(n))


@st.composite
def zero_heavy(draw):
    replicas = draw(st.integers(1, 6))
    n = draw(st.integers(replicas, 80))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    costs = rng.integers(1, 60, n) * (rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.5, 0.9])))
    return costs, replicas, draw(st.integers(0, 99))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@SETTINGS
@given(problem=zero_heavy(), gpb=st.integers(1, 9))
def test_zero_costs_never_leave_a_batch_empty(algorithm, problem, gpb):
    costs, replicas, seed = problem
    try:
        p = pack(costs, 100, replicas, algorithm=algorithm, seed=seed, **_options(algorithm, gpb))
    except ValueError as exc:  # too few graphs to fill every rank's batch: refused, by design
        assert "every batch holds a single graph" in str(exc)
        return
    assert (p.batch_sizes() > 0).all(), p.batch_sizes()
    assert sorted(p.flat.tolist()) == list(range(costs.size))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_edges_cost_with_isolated_atoms_every_rank_every_step(algorithm):
    sizes = np.zeros(12, dtype=[("atoms", np.int64), ("edges", np.int64)])
    sizes["atoms"] = 1  # isolated atoms: no edges at any cutoff
    sizes["edges"][:2] = 30
    options = {"cost_field": "edges", **_options(algorithm)}
    for rank in (0, 1):
        s = BinPackingBatchSampler(sizes, 64, num_replicas=2, rank=rank, algorithm=algorithm, **options)
        for epoch in (0, 1):
            s.set_epoch(epoch)
            assert all(len(b) > 0 for b in s), (rank, epoch)


# -- counts, seeds, epochs -------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("replicas", [2.0, True, 2.5, "2", -1, 0])
def test_num_replicas_must_be_an_integer(algorithm, replicas):
    # 2.0 was a numba TypingError (paper, shuffled-paper, lpt) or a TypeError (fixed-count)
    with pytest.raises(ValueError, match=r"num_replicas must be a positive integer .*got"):
        pack(COSTS, 100, replicas, algorithm=algorithm, **_options(algorithm))
    with pytest.raises(ValueError, match=r"num_replicas must be a positive integer"):
        BinPackingBatchSampler(COSTS, 100, num_replicas=replicas, rank=0, algorithm=algorithm)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("seed", True), ("seed", 1.0), ("seed", 1.5), ("seed", -1), ("epoch", False), ("epoch", 2.0), ("epoch", -3)],
)
def test_seed_and_epoch_must_be_integers(argument, value):
    with pytest.raises(ValueError, match=rf"{argument} must be an integer >= 0 .*got {value!r}"):
        pack(COSTS, 100, 2, algorithm="shuffled-paper", **{argument: value})


@pytest.mark.parametrize("value", [True, False, "100", None, 0, -5, float("nan")])
def test_capacity_refuses_bool_and_non_numbers(value):
    with pytest.raises(ValueError, match="capacity must be a finite number > 0"):
        pack(COSTS, value, 2)
    with pytest.raises(ValueError, match="capacity must be a finite number > 0"):
        BinPackingBatchSampler(COSTS, value, num_replicas=2, rank=0)


def test_numpy_integers_and_float_capacities_are_accepted():
    ref = pack(COSTS, 100, 2, algorithm="shuffled-paper", seed=3, epoch=1)
    same = pack(COSTS, np.int32(100), np.int64(2), algorithm="shuffled-paper", seed=np.uint8(3), epoch=np.int16(1))
    assert np.array_equal(ref.flat, same.flat) and np.array_equal(ref.offsets, same.offsets)
    floats = pack(COSTS, np.float32(100.0), 2)
    assert np.array_equal(floats.flat, pack(COSTS, 100, 2).flat)
    halves = pack(COSTS / 2.0, 50.5, 2)  # float costs, float capacity: valid
    assert halves.loads().max() <= 50.5
    s = BinPackingBatchSampler(COSTS, 100.0, num_replicas=np.int64(2), rank=np.int64(1), seed=np.int32(0))
    assert (s.num_replicas, s.rank, s.seed) == (2, 1, 0) and type(s.rank) is int


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("rank", True, "rank must be an integer >= 0"),
        ("rank", 1.0, "rank must be an integer >= 0"),
        ("rank", 2, r"rank must be in \[0, 1\]"),
        ("seed", True, "seed must be an integer >= 0"),
        ("seed", 0.5, "seed must be an integer >= 0"),
        ("shuffle", "yes", "shuffle must be True or False"),
        ("shuffle", 1, "shuffle must be True or False"),
    ],
)
def test_sampler_refuses_bad_arguments_when_made(argument, value, message):
    kw = {"num_replicas": 2, "rank": 0, argument: value}
    with pytest.raises(ValueError, match=message):
        BinPackingBatchSampler(COSTS, 100, **kw)


@pytest.mark.parametrize(
    ("algorithm", "options", "message"),
    [
        ("fixed-count", {"graphs_per_batch": 2.0}, "graphs_per_batch must be a positive integer"),
        ("lpt", {"graphs_per_batch": True}, "graphs_per_batch must be a positive integer"),
        ("lpt", {"graphs_per_batch": 0}, "graphs_per_batch must be a positive integer"),
        ("shuffled-paper", {"window": 2.5}, "window must be a positive integer"),
        ("paper", {"window": 4}, r"algorithm 'paper' takes no option window; its options: max_restarts, order"),
        ("ffd", {"graphs_per_batch": 4}, r"algorithm 'ffd' takes no option graphs_per_batch; its options: none"),
        ("paper", {"oversize": "skip"}, "oversize must be 'error' or 'alone'"),
    ],
)
def test_algorithm_options_are_checked(algorithm, options, message):
    with pytest.raises(ValueError, match=message):
        pack(COSTS, 100, 2, algorithm=algorithm, **options)
    with pytest.raises(ValueError, match=message):
        BinPackingBatchSampler(COSTS, 100, num_replicas=2, rank=0, algorithm=algorithm, **options)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epoch", [-2, True, 1.0, "1", None])
def test_set_epoch_refuses_the_same_way_with_or_without_shuffle(shuffle, epoch):
    # -2 was taken with shuffle off, and refused by numpy, without the epoch, with it on
    s = BinPackingBatchSampler(COSTS, 100, num_replicas=2, rank=0, shuffle=shuffle, algorithm="shuffled-paper")
    with pytest.raises(ValueError, match=rf"epoch must be an integer >= 0 .*got {epoch!r}"):
        s.set_epoch(epoch)
    assert s.epoch == 0
    if epoch is not None:  # None asks the packing of the current epoch
        with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
            s.rank_batches(epoch)
    s.set_epoch(np.int64(3))
    assert s.epoch == 3 and type(s.epoch) is int and len(list(s)) == len(s)


def test_cli_negative_seed_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "sizes.npy"
    np.save(path, COSTS)
    assert main(["pack", str(path), "--capacity", "100", "--seed", "-1", "-o", str(tmp_path / "p.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "seed must be an integer >= 0" in err and "-1" in err
