"""Several new datasets, one head each (TrainConfig.heads, mace's --heads), next to the replayed
pt_head: against mace_run_train step for step, per-head E0s and validation, exported heads,
and bad input."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from finetune_fixtures import ARCH, foundation, hea, pt_file, train_cli  # noqa: F401 (fixtures)
from train_fixtures import pair_with_mace_run_train

from workbench.train.config import TrainConfig
from workbench.train.values import ConfigError


@pytest.fixture(scope="module")
def bulk(tmp_path_factory, foundation) -> Path:  # noqa: F811
    """mptrj crystals the foundation did not train on (17-40 atoms, its elements only)."""
    from workbench.data.embedded import load_embedded
    from workbench.data.io import write_structures
    from workbench.train.foundation import load_foundation

    zs = set(load_foundation(foundation).zs)
    picked = [
        a
        for a in load_embedded()
        if a.info.get("config_type") == "mptrj" and 17 <= len(a) <= 40 and set(a.numbers) <= zs
    ][:14]
    path = tmp_path_factory.mktemp("bulk") / "bulk.extxyz"
    write_structures(path, picked)
    return path


def _cfg(tmp_path, foundation, pt_file, heads, **kw) -> TrainConfig:  # noqa: F811
    base = dict(name="heads", output_dir=str(tmp_path), foundation_model=str(foundation), dtype="float64")
    base.update(sampler="fixed-count", batch_size=4, epochs=1, progress=False, checkpoint_every=0)
    base.update(multihead_finetuning=True, pt_dataset=str(pt_file), num_samples_pt=16, heads=heads)
    return TrainConfig(**{**base, **kw})


def test_two_new_heads_pair_with_mace_run_train_step_for_step(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    """mace_run_train --heads {alloys, bulk} --multiheads_finetuning True and a mace-order run:
    float64 e3nn, every step's loss equal, each head's final validation errors equal; the heads
    keep their own E0s (alloys a map, bulk mace's estimated ones, pt_head the foundation's)."""
    from workbench.bench.quality import PRESETS, base_config
    from workbench.train.evaluation import evaluate_file
    from workbench.train.model_file import load_model

    given = {int(z): -1.0 - z / 64 for z in sorted({int(z) for a in hea_atoms(hea) for z in a.numbers})}
    heads = {
        "alloys": {"dataset": str(hea), "e0s": given},
        "bulk": {"dataset": str(bulk), "e0s": "estimated", "valid_fraction": 0.2},
    }
    cfg = base_config(PRESETS["small"], tmp_path, seed=2, loss="universal", stress_weight=10.0)
    cfg = replace(cfg, dataset=None, max_structures=None, batch_size=4, **ARCH, clip_grad=0.05)
    cfg = replace(cfg, foundation_model=str(foundation), multihead_finetuning=True, pt_dataset=str(pt_file))
    cfg = replace(cfg, num_samples_pt=16, weight_pt_head=2.0, e0s="foundation", heads=heads)
    split, mace_model, our_model, theirs, mine = pair_with_mace_run_train(cfg, tmp_path, 2)
    n_train = sum(x["n_train"] for x in split["heads"].values()) + split["n_pt_train"]
    assert len(mine) == len(theirs) == 2 * (n_train // cfg.batch_size)
    np.testing.assert_allclose(mine, theirs, rtol=1e-9)
    valid = {"pt_head": split["pt_valid"], **{h: x["valid"] for h, x in split["heads"].items()}}
    for head, path in valid.items():
        a, b = evaluate_file(mace_model, path, head=head), evaluate_file(our_model, path, head=head)
        for key in ("e_mae_mev_atom", "f_mae_mev_a", "s_mae_mev_a3"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), (head, key)
    e0s = load_model(our_model).atomic_energies_fn.atomic_energies
    table = [int(z) for z in load_model(our_model).atomic_numbers]
    assert e0s.shape[0] == 3 and [float(e0s[1][table.index(z)]) for z in given] == list(given.values())
    assert not torch_equal(e0s[0], e0s[2]) and not torch_equal(e0s[1], e0s[2])
    epoch = [json.loads(x) for x in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()][-1]
    assert list(epoch["valid_heads"]) == ["pt_head", "alloys", "bulk"]
    assert set(epoch["valid_heads"]["alloys"]["families"]) == {"hea"}
    assert epoch["valid_loss"] == epoch["valid_heads"]["bulk"]["loss"]  # mace's last head drives the scheduler


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_the_heads_are_joined_after_the_replay_in_order(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    """Graphs carry their head's index; every head is repeated together when all of them are
    fewer than a tenth of the replay; families and origins name each head's file."""
    from workbench.train.data import prepare_data
    from workbench.train.replay import repeats

    heads = {"alloys": {"dataset": str(hea), "valid_dataset": str(bulk)}, "bulk": {"dataset": str(bulk)}}
    data = prepare_data(_cfg(tmp_path, foundation, pt_file, heads))
    assert data.heads == ["pt_head", "alloys", "bulk"]
    n = {h: int((data.train_heads == k).sum()) for k, h in enumerate(data.heads)}
    assert (
        n["alloys"] == 19
        and n["bulk"] == len(data.new_train_configs("bulk"))
        and n["pt_head"] == len(data.train) - 19 - n["bulk"]
    )
    assert data.new_train == {"alloys": 19, "bulk": n["bulk"]}
    assert [int(g.head) for g in data.train] == data.train_heads.tolist()
    assert data.valid_heads.count("alloys") == 14 and set(data.valid_heads) == {"pt_head", "alloys", "bulk"}
    assert all(c.head == "bulk" for c in data.new_train_configs("bulk"))
    first_bulk = int(np.flatnonzero(data.train_heads == 2)[0])
    assert "bulk.extxyz, frame" in data.describe([first_bulk]) and "hea.extxyz" in data.describe(
        [len(data.train) - n["bulk"] - 1]
    )
    assert data.z_table.zs == sorted(
        {int(z) for g in [*hea_atoms(hea), *hea_atoms(bulk), *hea_atoms(pt_file)] for z in g.numbers}
    )
    few = {
        "alloys": {"dataset": str(hea), "valid_fraction": 0.95},
        "bulk": {"dataset": str(bulk), "valid_fraction": 0.95},
    }
    data = prepare_data(_cfg(tmp_path, foundation, pt_file, few, num_samples_pt=None))
    copies = 1 + repeats(sum(data.new_train.values()), int((data.train_heads == 0).sum()))
    assert copies > 1 and all(
        (data.train_heads == k).sum() == copies * data.new_train[h] for k, h in enumerate(data.heads) if k
    )


def test_a_head_may_read_a_prepared_dataset(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    """A prepared dataset as a head's data builds the same graphs, in that head, as its file."""
    from workbench.cli import main
    from workbench.train.data import prepare_data

    assert main(["data", "prepare", "--out", str(tmp_path / "store"), "--cutoff", "4.0", str(bulk)]) == 0
    heads = {"alloys": {"dataset": str(hea)}, "bulk": {"dataset": str(bulk)}}
    from_file = prepare_data(_cfg(tmp_path, foundation, pt_file, heads))
    heads["bulk"]["dataset"] = str(tmp_path / "store")
    stored = prepare_data(_cfg(tmp_path, foundation, pt_file, heads))
    assert stored.heads == from_file.heads and np.array_equal(stored.train_heads, from_file.train_heads)
    assert stored.z_table.zs == from_file.z_table.zs and stored.new_train == from_file.new_train
    where = np.flatnonzero(stored.train_heads == 2)
    for i in where[:3]:
        a, b = stored.train[int(i)], from_file.train[int(i)]
        assert int(a.head) == 2 and int(b.head) == 2
        np.testing.assert_allclose(a.positions.numpy(), b.positions.numpy(), atol=1e-12)
        assert torch_equal(a.node_attrs, b.node_attrs)


def hea_atoms(path):
    from ase.io import read

    return read(path, index=":")


def test_each_head_exports_for_eval_and_md(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    from workbench.cli import main
    from workbench.train import train
    from workbench.train.evaluation import evaluate_file
    from workbench.train.heads import heads_of
    from workbench.train.model_file import load_model

    mine = {int(z): -1.0 - z / 64 for z in sorted({int(z) for a in hea_atoms(bulk) for z in a.numbers})}
    heads = {"alloys": {"dataset": str(hea)}, "bulk": {"dataset": str(bulk), "e0s": mine}}
    result = train(_cfg(tmp_path, foundation, pt_file, heads, max_steps=2, sampler="paper", capacity=400))
    model = load_model(result.model_path)
    assert heads_of(model) == ("pt_head", "alloys", "bulk")
    table = [int(z) for z in model.atomic_numbers]
    assert [float(model.atomic_energies_fn.atomic_energies[2][table.index(z)]) for z in mine] == list(mine.values())
    by_head = {h: evaluate_file(result.model_path, hea, head=h)["f_mae_mev_a"] for h in ("pt_head", "alloys", "bulk")}
    assert len(set(by_head.values())) == 3  # three readouts, trained apart
    with pytest.raises(ValueError, match="has heads pt_head, alloys, bulk; name the one to use"):
        evaluate_file(result.model_path, hea)
    out = tmp_path / "md.json"
    args = ["md", str(result.model_path), "--structure", str(hea), "--steps", "2", "--head", "bulk"]
    assert main([*args, "--json", str(out)]) == 0 and out.exists()


def test_bad_heads_are_one_line_and_exit_2(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    cfg = _cfg(tmp_path, foundation, pt_file, {"alloys": {"dataset": str(hea)}}, max_steps=1)
    cases = [
        ("heads={alloys: {dataset: " + str(tmp_path / "none.extxyz") + "}}", r"none\.extxyz"),
        ("heads={alloys: {data: x.extxyz}}", r"TrainConfig\.heads\.alloys: unknown key\(s\) data; a head sets dataset"),
        ("heads={pt_head: {dataset: x.extxyz}}", r"TrainConfig\.heads: 'pt_head': a head name"),
        ("heads={alloys: {dataset: x.extxyz, e0s: average}}", r"TrainConfig\.heads\.alloys\.e0s: 'average' cannot"),
        (
            "heads={alloys: {dataset: x.extxyz, valid_fraction: 1.5}}",
            r"heads\.alloys\.valid_fraction: must be in \[0, 1\)",
        ),
        ("heads={alloys: {dataset: x.extxyz, e0s: {Xx: 1}}}", r"heads\.alloys\.e0s: 'Xx' is not an element"),
        ("heads=[a, b]", r"TrainConfig\.heads: expected a mapping"),
        (f"dataset={hea}", r"TrainConfig\.dataset: with heads, each head names its own dataset"),
        ("heads={alloys: {dataset: x.extxyz, valid_fraction: 0}}", r"heads\.alloys\.valid_fraction: 0 leaves the head"),
        ("heads={alloys: {dataset: " + str(bulk) + ", e0s: {Cu: -3.5}}}", r"heads\.alloys\.e0s: no energy for"),
    ]
    for override, message in cases:
        code, err = train_cli(tmp_path, cfg, "--set", override)
        lines = [line for line in err.splitlines() if line.startswith("workbench: error:")]
        assert code == 2 and len(lines) == 1, (override, err)
        assert re.search(message, lines[0]), lines[0]
    with pytest.raises(
        ConfigError, match="heads: several new datasets, one head each, train with multihead_finetuning"
    ):
        TrainConfig(foundation_model=str(foundation), heads={"a": {"dataset": str(hea)}})


def test_mace_is_given_each_head_with_its_files_split_and_e0s(tmp_path, foundation, hea, bulk, pt_file):  # noqa: F811
    import ast

    from workbench.train.foundation import mace_run_train_flags

    heads = {
        "alloys": {"dataset": str(hea)},
        "bulk": {"dataset": str(bulk), "valid_dataset": str(hea), "e0s": {"Cu": 1}},
    }
    cfg = _cfg(tmp_path, foundation, pt_file, heads, valid_fraction=0.3, e0s="estimated")
    flags = mace_run_train_flags(cfg, {"pt_train": "a", "pt_valid": "b"})
    given = ast.literal_eval(flags["--heads"])
    assert list(given) == ["alloys", "bulk"]
    assert given["alloys"] == {"train_file": str(hea), "valid_file": None, "valid_fraction": 0.3, "E0s": "estimated"}
    assert given["bulk"]["valid_file"] == str(hea) and given["bulk"]["E0s"] == "{29: 1.0}"


def test_reordered_heads_change_the_run_identity():
    """The order of heads is the order of the readouts: a resume with the heads swapped is refused."""
    heads = {"a": {"dataset": "a.extxyz"}, "b": {"dataset": "b.extxyz", "e0s": {"H": -13.6}}}
    cfg = TrainConfig(foundation_model="f.model", multihead_finetuning=True, pt_dataset="pt.extxyz", heads=heads)
    saved = cfg.to_dict()
    assert cfg.identity_changes(saved) == [] and cfg.heads["b"]["e0s"] == {1: -13.6}
    swapped = cfg.replace(heads={"b": heads["b"], "a": heads["a"]})
    assert [c.split(":")[0] for c in swapped.identity_changes(saved)] == ["heads"]
    assert "valid_fraction" not in cfg.heads["a"]  # unset: follows the config's
    from workbench.train.replay_options import head_settings

    assert head_settings(cfg.replace(valid_fraction=0.3), "a")["valid_fraction"] == 0.3
