"""``mace-order``: mace_run_train's batches replayed, its statistics and its choice of final model,
so that a workbench run pairs with a mace_run_train run step for step; ``keep="best"``."""

import functools
import json
import operator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from train_fixtures import pair_with_mace_run_train, tiny

from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.mace_order import MaceOrderSampler, file_order

needs_data = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")


def _mace_loader_passes(n: int, batch_size: int, seed: int, passes: int) -> list[list[list[int]]]:
    """The passes of mace's own training loader (its vendored torch_geometric DataLoader, built as
    run_train builds it) over graphs that carry their index as energy."""
    from mace.tools.torch_geometric import DataLoader
    from mace.tools.torch_geometric.data import Data

    graphs = [Data(x=torch.zeros(1, 1), energy=torch.tensor([float(i)]), num_nodes=1) for i in range(n)]
    loader = DataLoader(
        graphs, batch_size=batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
    )
    return [[b.energy.long().tolist() for b in loader] for _ in range(passes)]


def test_batches_are_the_passes_of_maces_loader_after_its_two_statistics_passes():
    rng = np.random.default_rng()
    n, b, seed = int(rng.integers(40, 90)), int(rng.integers(3, 9)), int(rng.integers(0, 1000))
    passes = _mace_loader_passes(n, b, seed, 5)
    sampler = MaceOrderSampler(n, b, seed=seed)
    assert len(sampler) == n // b
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        assert list(sampler) == passes[2 + epoch]
    sampler.set_epoch(1)  # going back replays from the seed
    assert list(sampler) == passes[3]
    neighbours, energies = sampler.statistics_rows()
    assert neighbours.tolist() == functools.reduce(
        operator.iadd, passes[0], []
    ) and energies.tolist() == functools.reduce(operator.iadd, passes[1], [])
    assert len(set(neighbours.tolist())) == (n // b) * b  # drop_last: n mod b graphs sit each pass out

    # file positions -> dataset indices
    order = rng.permutation(n)
    mapped = MaceOrderSampler(n, b, seed=seed, order=order)
    mapped.set_epoch(0)
    assert list(mapped) == [order[batch].tolist() for batch in passes[2]]
    assert mapped.statistics_rows()[1].tolist() == order[functools.reduce(operator.iadd, passes[1], [])].tolist()


def test_resume_mid_epoch_and_refusals():
    sampler = MaceOrderSampler(50, 4, seed=7)
    sampler.set_epoch(1)
    it = iter(sampler)
    first = [next(it) for _ in range(5)]
    state = sampler.state_dict()
    assert state["batches_done"] == 5 and state["algorithm"] == "mace-order"
    again = MaceOrderSampler(50, 4, seed=7)
    again.load_state_dict(state)
    assert first + list(again) == MaceOrderSampler(50, 4, seed=7).batches(1).tolist()
    atoms = np.random.default_rng().integers(1, 50, 50)
    p = MaceOrderSampler(50, 4, seed=7, atoms=atoms).packing(1)  # the run record's layout
    assert p.flat.tolist() == MaceOrderSampler(50, 4, seed=7).batches(1).ravel().tolist() and p.n_steps == 12
    assert p.capacity == max(atoms[b].sum() for b in p.batches)
    with pytest.raises(ValueError, match=r"saved with seed=7, this sampler has 8"):
        MaceOrderSampler(50, 4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="no full batch of 8"):
        MaceOrderSampler(5, 8)
    with pytest.raises(ValueError, match="permutation"):
        MaceOrderSampler(5, 2, order=np.zeros(5, dtype=int))


def test_file_order_maps_file_positions_to_dataset_indices():
    from workbench.train.data import FileOrigin

    frames = np.array([7, 2, 9, 4])
    data = type("D", (), {"origin": FileOrigin("f.xyz", frames)})()
    order = file_order(data)
    assert frames[order].tolist() == [2, 4, 7, 9]
    data.origin = FileOrigin("f.xyz", np.arange(4))
    assert file_order(data) is None


@needs_data
def test_several_ranks_and_prepared_datasets_are_refused(tmp_path):
    from workbench.train import loop

    cfg = tiny(tmp_path, "mo", sampler="mace-order")
    with pytest.raises(ValueError, match="one rank, not 2"):
        loop.make_sampler(cfg, np.full(40, 10), num_replicas=2, rank=0)


@needs_data
def test_keep_best_exports_the_epoch_with_the_lowest_validation_loss(tmp_path):
    """Each epoch's validation loss is the mean of its batches' losses; the exported model
    (the EMA weights of the best epoch) gives back the lowest of them, also when the best epoch
    came before a resume (it is kept in the checkpoint) and later epochs were worse."""
    from mace.modules.loss import WeightedEnergyForcesLoss

    from workbench.train import TrainConfig
    from workbench.train.data import prepare_data
    from workbench.train.evaluation import evaluate
    from workbench.train.loop import train

    with pytest.raises(ValueError, match="TrainConfig.keep: 'best' picks the epoch by validation loss"):
        TrainConfig(keep="best", valid_fraction=0)
    with pytest.raises(ValueError, match="TrainConfig.keep: 'worst' is not one of last, best"):
        TrainConfig(keep="worst")
    cfg = tiny(
        tmp_path,
        "best",
        sampler="fixed-count",
        batch_size=4,
        keep="best",
        epochs=2,
        max_steps=None,
        checkpoint_every=0,
        ema_decay=None,
    )
    train(cfg, resume=False)
    res = train(replace(cfg, epochs=4, lr=0.5), resume=True)  # a learning rate that ruins the model
    epochs = [json.loads(line) for line in Path(res.run_dir, "metrics.jsonl").read_text().splitlines()]
    losses = [e["valid_loss"] for e in epochs]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert min(losses[2:]) > min(losses[:2])  # the best epoch is before the resume
    data = prepare_data(cfg)
    model = torch.load(res.model_path, weights_only=False)
    loss_fn = WeightedEnergyForcesLoss(energy_weight=cfg.energy_weight, forces_weight=cfg.forces_weight)
    got = evaluate(model, data.valid, batch_size=cfg.batch_size, loss_fn=loss_fn)
    assert got["loss"] == pytest.approx(min(losses), rel=1e-9)
    # the loss by hand: the mean over batches of 4 graphs, in order
    from mace.tools.torch_geometric import DataLoader

    by_hand = [
        float(loss_fn(pred=model(b.to_dict(), training=False, compute_force=True), ref=b).detach())
        for b in DataLoader(data.valid, batch_size=4, shuffle=False)
    ]
    assert got["loss"] == pytest.approx(np.mean(by_hand), rel=1e-12)


@needs_data
def test_a_mace_order_run_pairs_with_mace_run_train_step_for_step(tmp_path):
    """Real mace_run_train and the workbench on the same split files, seed and recipe in float64:
    every step's training loss agrees, and so do the final models' validation errors (mace
    keeps its best epoch; the workbench with keep="best" too)."""
    from workbench.bench.quality import PRESETS, base_config
    from workbench.train.evaluation import evaluate_file

    cfg = replace(
        base_config(PRESETS["small"], tmp_path, seed=5), max_structures=70, families=["water_clusters", "cuni"]
    )
    epochs = 3
    split, mace_model, our_model, theirs, mine = pair_with_mace_run_train(cfg, tmp_path, epochs)
    assert len(mine) == len(theirs) == epochs * (split["n_train"] // cfg.batch_size)
    np.testing.assert_allclose(mine, theirs, rtol=1e-9)
    a = evaluate_file(mace_model, split["valid"])
    b = evaluate_file(our_model, split["valid"])
    for key in ("e_mae_mev_atom", "f_mae_mev_a", "e_rmse_mev_atom", "f_rmse_mev_a"):
        assert b[key] == pytest.approx(a[key], rel=1e-9)
