"""``BinPackingBatchSampler``: equal length per rank, no communication, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from workbench.packing import ALGORITHMS, BinPackingBatchSampler

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sizes(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(np.exp(rng.normal(3.5, 1.0, n))), 1, 768).astype(np.int64)


@st.composite
def setups(draw):
    replicas = draw(st.integers(1, 6))
    n = draw(st.integers(replicas, 300))
    return (
        sizes(n, draw(st.integers(0, 9999))),
        replicas,
        draw(st.integers(0, 99)),
        draw(st.sampled_from(sorted(ALGORITHMS))),
    )


def ranks(costs, replicas, seed, algorithm, **kw):
    return [
        BinPackingBatchSampler(
            costs, capacity=1024, num_replicas=replicas, rank=r, seed=seed, algorithm=algorithm, **kw
        )
        for r in range(replicas)
    ]


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 5))
def test_ranks_equal_length_disjoint_and_complete(setup, epoch):
    costs, replicas, seed, algorithm = setup
    samplers = ranks(costs, replicas, seed, algorithm)
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(s) for s in samplers}) == 1, "len(sampler) equal on every rank"
    assert all(len(b) == len(samplers[0]) for b in per_rank), "every rank yields len(sampler) batches"
    flat = sorted(i for batches in per_rank for b in batches for i in b)
    assert flat == list(range(len(costs))), "ranks together cover every graph exactly once"
    assert all(len(b) > 0 for batches in per_rank for b in batches)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 5))
def test_deterministic_across_processes(setup, epoch):
    costs, replicas, seed, algorithm = setup
    a, b = ranks(costs, replicas, seed, algorithm), ranks(costs, replicas, seed, algorithm)
    for x, y in zip(a, b):
        x.set_epoch(epoch)
        y.set_epoch(epoch)
        assert list(x) == list(y)


@SETTINGS
@given(setup=setups(), epoch=st.integers(0, 3), data=st.data())
def test_resume_reproduces_rest_of_epoch(setup, epoch, data):
    costs, replicas, seed, algorithm = setup
    rank = data.draw(st.integers(0, replicas - 1))
    full = BinPackingBatchSampler(costs, 1024, num_replicas=replicas, rank=rank, seed=seed, algorithm=algorithm)
    full.set_epoch(epoch)
    expected = list(full)
    k = data.draw(st.integers(0, len(expected)))
    live = BinPackingBatchSampler(costs, 1024, num_replicas=replicas, rank=rank, seed=seed, algorithm=algorithm)
    live.set_epoch(epoch)
    it = iter(live)
    head = [next(it) for _ in range(k)]
    state = live.state_dict()
    fresh = BinPackingBatchSampler(costs, 1024, num_replicas=replicas, rank=rank, seed=seed, algorithm=algorithm)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert head + rest == expected, "no graph lost or repeated on resume"
    assert list(fresh) == expected, "the following pass is a whole epoch again"


def test_set_epoch_reshuffles_and_paper_keeps_step_balance():
    costs = sizes(3000, 0)
    s = BinPackingBatchSampler(costs, 3072, num_replicas=4, rank=0, seed=1, algorithm="paper")
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1 and sorted(map(tuple, e0)) == sorted(map(tuple, e1)), "paper: same batches, new step order"
    r = BinPackingBatchSampler(costs, 3072, num_replicas=4, rank=0, seed=1, algorithm="shuffled-paper")
    a = list(r)
    r.set_epoch(1)
    assert sorted(map(tuple, a)) != sorted(map(tuple, list(r))), "shuffled-paper: new batches"
    n = BinPackingBatchSampler(costs, 3072, num_replicas=4, rank=0, seed=1, shuffle=False)
    assert list(n) == list(n)


def test_reads_world_from_torch_distributed(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    s = BinPackingBatchSampler(sizes(100, 1), 1024)
    assert (s.num_replicas, s.rank) == (3, 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    s = BinPackingBatchSampler(sizes(100, 1), 1024)
    assert (s.num_replicas, s.rank) == (1, 0)


def test_load_state_checks_settings():
    s = BinPackingBatchSampler(sizes(50, 1), 1024, num_replicas=2, rank=0, seed=1)
    t = BinPackingBatchSampler(sizes(50, 1), 1024, num_replicas=2, rank=0, seed=2)
    with pytest.raises(ValueError, match="seed"):
        t.load_state_dict(s.state_dict())


def test_consumed_override():
    s = BinPackingBatchSampler(sizes(500, 1), 1024, num_replicas=2, rank=1, seed=1)
    expected = list(s)
    it = iter(s)
    for _ in range(3):
        next(it)  # e.g. a prefetching loader ran ahead
    state = s.state_dict(consumed=1)
    t = BinPackingBatchSampler(sizes(500, 1), 1024, num_replicas=2, rank=1, seed=1)
    t.load_state_dict(state)
    assert list(t) == expected[1:]


class _Graphs(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def test_works_as_dataloader_batch_sampler():
    costs = sizes(200, 3)
    s = BinPackingBatchSampler(costs, 1024, num_replicas=2, rank=0, seed=0)
    loader = DataLoader(_Graphs(200), batch_sampler=s, collate_fn=torch.cat)
    got = [b.tolist() for b in loader]
    assert got == list(s) and len(loader) == len(s)
