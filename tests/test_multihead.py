"""Multihead fine-tuning with replay (workbench.train.replay): heads pt_head and Default, the
replayed pre-training structures selected, weighted and packed with the new ones, against
mace_run_train --multiheads_finetuning True step for step."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from finetune_fixtures import ARCH, foundation, hea, pt_file, train_cli, write_family  # noqa: F401 (fixtures)
from train_fixtures import pair_with_mace_run_train, step_losses

from workbench.train.config import TrainConfig
from workbench.train.values import ConfigError


def _cfg(tmp_path: Path, foundation: Path, data: Path, pt: Path, **kw) -> TrainConfig:  # noqa: F811
    base = dict(name="mh", output_dir=str(tmp_path), dataset=str(data), foundation_model=str(foundation))
    base.update(dtype="float64", sampler="fixed-count", batch_size=4, epochs=1, progress=False, checkpoint_every=0)
    base.update(multihead_finetuning=True, pt_dataset=str(pt), num_samples_pt=16)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("e0s", ["foundation", "estimated"])
def test_a_multihead_run_pairs_with_mace_run_train_step_for_step(tmp_path, foundation, hea, pt_file, e0s):  # noqa: F811
    """mace_run_train --multiheads_finetuning True given the structures our run replays, and a
    mace-order run: float64 e3nn, every step's loss equal, and the final models' errors per head,
    with the foundation's E0s or mace's estimated ones; the numba kernels take the same steps."""
    from workbench.bench.quality import PRESETS, base_config
    from workbench.train import train
    from workbench.train.evaluation import evaluate_file

    cfg = base_config(PRESETS["small"], tmp_path, seed=3, loss="universal", stress_weight=10.0)
    cfg = replace(cfg, dataset=str(hea), max_structures=None, batch_size=4, **ARCH, clip_grad=0.05)
    cfg = replace(cfg, foundation_model=str(foundation), multihead_finetuning=True, pt_dataset=str(pt_file))
    cfg = replace(cfg, num_samples_pt=16, weight_pt_head=2.0, e0s=e0s)
    split, mace_model, our_model, theirs, mine = pair_with_mace_run_train(cfg, tmp_path, 2)
    n_train = split["n_train"] + split["n_pt_train"]
    assert len(mine) == len(theirs) == 2 * (n_train // cfg.batch_size)
    np.testing.assert_allclose(mine, theirs, rtol=1e-9)
    for head, valid in (("pt_head", split["pt_valid"]), ("Default", split["valid"])):
        a, b = evaluate_file(mace_model, valid, head=head), evaluate_file(our_model, valid, head=head)
        for key in ("e_mae_mev_atom", "f_mae_mev_a", "s_mae_mev_a3"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), (head, key)
    epoch = [json.loads(x) for x in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()][-1]
    assert set(epoch["valid_heads"]) == {"pt_head", "Default"}
    assert set(epoch["valid_heads"]["pt_head"]["families"]) == {"mptrj"}
    assert set(epoch["valid_heads"]["Default"]["families"]) == {"hea"}
    assert epoch["valid_loss"] == epoch["valid_heads"]["Default"]["loss"]  # mace's last head drives the scheduler
    if e0s == "foundation":
        numba = replace(cfg, name="numba", backend="numba", sampler="mace-order", dataset=split["train"], max_steps=4)
        numba = replace(numba, valid_dataset=split["valid"], output_dir=str(tmp_path / "numba"), export=False)
        train(numba)
        np.testing.assert_allclose(step_losses(numba.run_dir), mine[:4], rtol=1e-10)


def test_the_replay_is_selected_weighted_and_split(tmp_path, foundation, pt_file):  # noqa: F811
    """random: num_samples_pt distinct structures, fixed by the seed; fps: the foundation's
    descriptors' farthest points; each replayed structure weighted weight_pt_head, in head
    pt_head, split by valid_fraction; a prepared dataset replays the same structures."""
    from ase.io import read

    from workbench.cli import main
    from workbench.train.replay import load_replay

    source = read(pt_file, index=":")
    cfg = _cfg(tmp_path, foundation, pt_file, pt_file, num_samples_pt=10, weight_pt_head=3.0, valid_fraction=0.2)
    a, b = load_replay(cfg), load_replay(cfg)
    other = load_replay(cfg.replace(seed=1))
    assert np.array_equal(a.picked, b.picked) and not np.array_equal(a.picked, other.picked)
    assert len(set(a.picked.tolist())) == 10 and (len(a.train), len(a.valid)) == (8, 2)
    assert all(x.info["config_weight"] == 3.0 and x.info["head"] == "pt_head" for x in a.train + a.valid)
    energies = sorted(x.info["REF_energy"] for x in a.train + a.valid)
    assert energies == sorted(source[i].info["REF_energy"] for i in a.picked)
    fps = load_replay(cfg.replace(subselect_pt="fps"))
    assert len(set(fps.picked.tolist())) == 10 and not np.array_equal(np.sort(fps.picked), np.sort(a.picked))
    assert main(["data", "prepare", "--out", str(tmp_path / "store"), "--cutoff", "4.0", str(pt_file)]) == 0
    stored = load_replay(cfg.replace(pt_dataset=str(tmp_path / "store")))
    assert np.array_equal(stored.picked, a.picked)
    for x, y in zip(stored.train, a.train):
        np.testing.assert_allclose(x.positions, y.positions, atol=1e-12)
        assert x.info["REF_energy"] == pytest.approx(y.info["REF_energy"], rel=1e-12)
    everything = load_replay(cfg.replace(num_samples_pt=None))
    assert len(everything.train) + len(everything.valid) == len(source)


def test_farthest_point_sampling_picks_the_farthest_points():
    from workbench.train.replay import fps_indices

    line = np.array([[0.0], [1.0], [2.0], [10.0], [4.0]])
    picked = fps_indices(line, 3, seed=0)
    assert len(set(picked.tolist())) == 3
    assert {3, 0} <= set(picked.tolist()) or {3, 1} <= set(picked.tolist())  # the far end is always taken
    start = int(np.random.default_rng(0).integers(5))
    assert picked[0] == start and picked[1] == int(np.argmax(np.abs(line[:, 0] - line[start, 0])))
    with pytest.raises(ValueError, match="cannot pick 6 of 5"):
        fps_indices(line, 6, seed=0)


def test_few_new_structures_are_repeated_as_mace_does(tmp_path, foundation, hea, pt_file):  # noqa: F811
    """Below a tenth of the replay, the new training structures are repeated floor(0.1 / r) more
    times (mace's real_pt_data_ratio_threshold); the packer packs both heads' graphs together."""
    from workbench.train.data import prepare_data
    from workbench.train.replay import repeats

    assert repeats(5, 100) == 2 and repeats(1, 100) == 10 and repeats(10, 100) == 0 and repeats(3, 0) == 0
    small = write_family(tmp_path / "few.extxyz", ["hea"], 2, 1000)
    cfg = _cfg(tmp_path, foundation, small, pt_file, num_samples_pt=None, valid_fraction=0.0, sampler="paper")
    data = prepare_data(cfg)
    n_pt, n_new = int((data.train_heads == 0).sum()), 2
    copies = 1 + repeats(n_new, n_pt)
    assert copies > 1 and len(data.train) == n_pt + copies * n_new
    assert (data.train_heads == 1).sum() == copies * n_new and "repeated" in data.replay_note
    batch_heads = [set(data.train_heads[list(b)].tolist()) for b in _batches(cfg, data)]
    assert any(h == {0, 1} for h in batch_heads)  # graphs of both heads share bins


def _batches(cfg, data) -> list:
    from workbench.train.samplers import make_sampler

    sampler = make_sampler(cfg.replace(capacity=400), data.train_atoms, 1, 0)
    return list(sampler)


def test_a_multihead_model_exports_both_heads_for_eval_and_md(tmp_path, foundation, hea, pt_file):  # noqa: F811
    from workbench.cli import main
    from workbench.train import train
    from workbench.train.evaluation import evaluate_file
    from workbench.train.heads import heads_of
    from workbench.train.model_file import load_model

    cfg = _cfg(tmp_path, foundation, hea, pt_file, max_steps=2, sampler="paper", capacity=400)
    result = train(cfg)
    model = load_model(result.model_path)
    assert heads_of(model) == ("pt_head", "Default")
    assert model.atomic_energies_fn.atomic_energies.shape[0] == 2
    by_head = {h: evaluate_file(result.model_path, hea, head=h) for h in ("pt_head", "Default")}
    assert by_head["pt_head"]["f_mae_mev_a"] != by_head["Default"]["f_mae_mev_a"]  # the readouts diverged
    assert evaluate_file(result.model_path, hea)["f_mae_mev_a"] == by_head["Default"]["f_mae_mev_a"]
    out = tmp_path / "md.json"
    args = ["md", str(result.model_path), "--structure", str(hea), "--steps", "2", "--head", "pt_head"]
    assert main([*args, "--json", str(out)]) == 0 and out.exists()


def test_bad_replay_input_is_one_line_and_exit_2(tmp_path, foundation, hea, pt_file):  # noqa: F811
    from ase.io import read, write

    unlabelled = tmp_path / "unlabelled.extxyz"
    frames = read(pt_file, index=":")
    del frames[2].info["REF_energy"]
    write(unlabelled, frames)
    cfg = _cfg(tmp_path, foundation, hea, pt_file, max_steps=1)
    cases = [
        (["--set", f"pt_dataset={unlabelled}"], r"unlabelled\.extxyz.*frame 2.*REF_energy"),
        (["--set", f"pt_dataset={tmp_path / 'missing.extxyz'}"], r"missing\.extxyz"),
        (["--set", "e0s=average"], r"TrainConfig\.e0s: 'average' cannot be used with multihead_finetuning"),
        (["--set", "subselect_pt=kmeans"], r"TrainConfig\.subselect_pt: 'kmeans' is not one of random, fps"),
        (["--set", "loss=stress", "--set", "stress_weight=1"], r"TrainConfig\.loss: 'stress': multihead"),
        (["--set", "num_samples_pt=0"], r"TrainConfig\.num_samples_pt"),
    ]
    for extra, message in cases:
        code, err = train_cli(tmp_path, cfg, *extra)
        lines = [line for line in err.splitlines() if line.startswith("workbench: error:")]
        assert code == 2 and len(lines) == 1, err
        assert re.search(message, lines[0]), lines[0]
    with pytest.raises(ConfigError, match="needs pt_dataset"):
        cfg.replace(pt_dataset=None)
    with pytest.raises(ConfigError, match="fine-tunes foundation_model, which is not set"):
        TrainConfig(multihead_finetuning=True, pt_dataset=str(pt_file))
    with pytest.raises(ConfigError, match="multihead_finetuning: true, which is not set"):
        TrainConfig(pt_dataset=str(pt_file))
    with pytest.raises(ConfigError, match="'estimated' starts from the E0s of foundation_model, which is not set"):
        TrainConfig(e0s="estimated")


def test_mace_recipe_where_the_config_keeps_the_defaults(tmp_path, foundation, hea, pt_file):  # noqa: F811
    from workbench.train.foundation import resolve

    mine = resolve(_cfg(tmp_path, foundation, hea, pt_file))
    assert (mine.lr, mine.ema_decay, mine.loss) == (1e-4, 0.99999, "universal")
    kept = resolve(_cfg(tmp_path, foundation, hea, pt_file, lr=0.003, ema_decay=0.9, loss="universal"))
    assert (kept.lr, kept.ema_decay) == (0.003, 0.9)
