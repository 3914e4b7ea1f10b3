"""A sampler state (``state_dict``) resumes only the batch sequence it was saved from: every
setting that decides the batches is in it, a mismatch is refused by name, a malformed state is a
clear ``ValueError``, and states of the previous format (without the settings recorded since)
still resume, with a warning."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

from workbench.packing import BinPackingBatchSampler
from workbench.packing.loader import PackedDataLoader

COSTS = np.random.default_rng(0).integers(5, 100, 300)
#: what the sampler's state held before shuffle, sizes and options were recorded
OLD_FIELDS = ("epoch", "batches_done", "seed", "algorithm", "num_replicas", "n_graphs", "capacity", "rank")


def sampler(costs=COSTS, **kw) -> BinPackingBatchSampler:
    return BinPackingBatchSampler(costs, **{"capacity": 512, "num_replicas": 2, "rank": 0, **kw})


def saved(s: BinPackingBatchSampler, epoch: int = 1, k: int = 2) -> dict:
    s.set_epoch(epoch)
    it = iter(s)
    for _ in range(k):
        next(it)
    return s.state_dict()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"shuffle": False}, "shuffle"),
        (
            {"costs": COSTS[::-1].copy()},
            r"sizes='\w+' \(a fingerprint of the per-graph costs\), this sampler has '\w+'; ",
        ),
        ({"costs": np.where(np.arange(COSTS.size) == 7, COSTS + 1, COSTS)}, "sizes"),
        ({"order": "emptier-first"}, "options.order"),
        ({"level_steps": False}, "options.level_steps"),
        ({"oversize": "alone"}, "options.oversize"),
        (
            {"cost_field": "edges", "costs": np.rec.fromarrays([COSTS, COSTS], names="atoms,edges")},
            "options.cost_field",
        ),
    ],
)
def test_state_refused_by_a_sampler_of_other_batches(kw, field):
    # each of these loaded before and resumed other batches
    state = saved(sampler())
    with pytest.raises(ValueError, match=rf"sampler state was saved with {field}"):
        sampler(**kw).load_state_dict(state)


def test_state_names_every_differing_field_and_option():
    state = saved(sampler(algorithm="shuffled-paper", window=4))
    other = sampler(algorithm="shuffled-paper", window=6, seed=3, shuffle=False)
    with pytest.raises(ValueError) as err:
        other.load_state_dict(state)
    text = str(err.value)
    for said in ("seed=0, this sampler has 3", "shuffle=True, this sampler has False", "options.window=4"):
        assert said in text
    counted = saved(sampler(algorithm="fixed-count", graphs_per_batch=5))
    with pytest.raises(ValueError, match="options.graphs_per_batch=5, this sampler has 6"):
        sampler(algorithm="fixed-count", graphs_per_batch=6).load_state_dict(counted)


def test_same_batches_spelled_otherwise_still_resume():
    # explicit defaults, int and float sizes of the same values, metrics-only options: same batches
    s = sampler(algorithm="paper")
    expected = s.rank_batches(1)
    state = saved(s)
    for same in (
        sampler(algorithm="paper", order="fuller-first", level_steps=True, oversize="error", cost_field="atoms"),
        sampler(COSTS.astype(np.float64)),
        sampler(atoms=COSTS, edges=COSTS * 10),
        sampler(capacity=512.0),
    ):
        same.load_state_dict(state)
        assert list(same) == expected[2:]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda st: None, "sampler state must be a dict .*got NoneType"),
        (lambda st: [1, 2], "sampler state must be a dict .*got list"),
        (lambda st: {k: v for k, v in st.items() if k != "epoch"}, "sampler state lacks epoch;"),
        (lambda st: {k: v for k, v in st.items() if k not in ("epoch", "batches_done")}, "lacks epoch, batches_done"),
        (lambda st: {**st, "epoch": 2.7}, r"sampler state: epoch must be an integer >= 0 .*got 2.7"),
        (lambda st: {**st, "epoch": True}, "sampler state: epoch must be an integer >= 0 .*got True"),
        (lambda st: {**st, "batches_done": None}, "sampler state: batches_done must be an integer >= 0 .*got None"),
        (lambda st: {**st, "batches_done": -1}, "sampler state: batches_done must be an integer >= 0"),
        (lambda st: {**st, "batches_done": 10**6}, r"batches_done=1000000 is outside 0\.\.\d+ \(epoch 1\)"),
        (lambda st: {**st, "seed": True}, "saved with seed=True, this sampler has 0"),
        (lambda st: {**st, "rank": 1.0}, "saved with rank=1.0, this sampler has 0"),
        (lambda st: {**st, "options": None}, "saved with options=None"),
        (lambda st: {k: v for k, v in st.items() if k != "n_graphs"}, "sampler state lacks n_graphs; it cannot be"),
    ],
)
def test_hand_edited_state_is_a_clear_value_error(edit, message):
    s = sampler()
    state = edit(saved(s))
    fresh = sampler()
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict(state)
    assert fresh.epoch == 0 and list(fresh) == fresh.rank_batches(0), "a refused state changes nothing"


def test_state_of_the_previous_format_resumes_with_a_warning():
    s = sampler(algorithm="shuffled-paper")
    expected = s.rank_batches(1)
    old = {k: v for k, v in saved(s).items() if k in OLD_FIELDS}
    fresh = sampler(algorithm="shuffled-paper")
    with pytest.warns(UserWarning, match="does not record shuffle, sizes, options"):
        fresh.load_state_dict(old)
    assert list(fresh) == expected[2:]
    with pytest.raises(ValueError, match="saved with seed=0, this sampler has 1"):
        sampler(algorithm="shuffled-paper", seed=1).load_state_dict(old)  # what it records is still checked
    checked = sampler(algorithm="shuffled-paper")
    with pytest.warns(UserWarning):
        completed = checked.check_state(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked.load_state_dict(completed)  # completed: loads without warning again
    assert list(checked) == expected[2:]


def test_train_resume_names_the_checkpoint_and_completes_older_states():
    from workbench.train.checkpoint import CheckpointError
    from workbench.train.resume import _sampler_state

    s = sampler()
    session = types.SimpleNamespace(sampler=sampler(), rank=0, run=types.SimpleNamespace(checkpoint="run/ckpt.pt"))
    state = saved(s)
    assert _sampler_state(session, state) == state
    old = {k: v for k, v in state.items() if k in OLD_FIELDS}
    with pytest.warns(UserWarning, match="older version"):
        assert _sampler_state(session, old) == state
    with pytest.raises(CheckpointError, match=r"run/ckpt.pt: rank 0: sampler state lacks epoch"):
        _sampler_state(session, {k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(CheckpointError, match=r"run/ckpt.pt: rank 0: sampler state was saved with seed=5"):
        _sampler_state(session, {**state, "seed": 5})


class _Graphs(torch.utils.data.Dataset):
    """nequip-like graphs: dicts with positions, ``sizes[i]`` atoms each."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return {"pos": torch.zeros(int(self.sizes[i]), 3)}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"shuffle": False}, "shuffle"),
        ({"algorithm": "ffd"}, "algorithm"),
        ({"seed": 4}, "seed"),
        ({"sizes": COSTS[::-1].copy()}, "sizes"),
        ({"capacity": 600}, "capacity"),
    ],
)
def test_packed_loader_state_resumes_only_its_own_batches(kw, field):
    data = _Graphs(COSTS)

    def make(**k) -> PackedDataLoader:
        return PackedDataLoader(data, **{"capacity": 512, "num_replicas": 2, "rank": 0, "sizes": COSTS, **k})

    loader = make(algorithm="shuffled-paper")
    loader.set_epoch(1)
    expected = list(loader.batch_sampler)
    state = {**loader.state_dict(), "batches_done": 2}
    with pytest.raises(ValueError, match=rf"sampler state was saved with {field}"):
        make(**{"algorithm": "shuffled-paper", **kw}).load_state_dict(state)
    again = make(algorithm="shuffled-paper")
    again.load_state_dict(state)
    assert list(again.batch_sampler) == expected[2:]
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        again.set_epoch(-1)
