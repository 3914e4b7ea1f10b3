"""Multihead models: ``workbench eval --head``, ``md --head`` and ``TrainConfig.foundation_head``
pick one head (mace's ``remove_pt_head``), and an open or wrong choice lists the heads."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from finetune_fixtures import residual_mace

from workbench.train.heads import HeadError, heads_of, select_head


def _multihead(heads: list[str], seed: int = 0) -> torch.nn.Module:
    """A small ScaleShiftMACE over H and O with several heads, in float64."""
    from e3nn import o3

    torch.manual_seed(seed)
    n = len(heads)
    with torch.random.fork_rng():
        return residual_mace(
            r_max=4.0,
            num_bessel=4,
            num_elements=2,
            hidden_irreps=o3.Irreps("4x0e+4x1o"),
            MLP_irreps=o3.Irreps("4x0e"),
            atomic_energies=np.array([[-1.0 - k, -2.0 - k] for k in range(n)]),
            avg_num_neighbors=3.0,
            atomic_numbers=[1, 8],
            radial_MLP=[8, 8],
            heads=heads,
            atomic_inter_scale=[1.0 + 0.5 * k for k in range(n)],
            atomic_inter_shift=[0.1 * k for k in range(n)],
        )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from workbench.data.embedded import load_embedded
    from workbench.data.io import write_structures

    where = tmp_path_factory.mktemp("heads")
    water = [a for a in load_embedded() if a.info.get("config_type") == "water_clusters" and len(a) <= 30][:6]
    write_structures(where / "water.extxyz", water)
    torch.save(_multihead(["pt_head", "Default"]), where / "two.model")
    torch.save(_multihead(["omat", "mp", "pt_head"], seed=1), where / "three.model")
    for name in ("pt_head", "Default"):
        torch.save(
            select_head(torch.load(where / "two.model", weights_only=False), name, "two")[1], where / f"{name}.model"
        )
    return where


def _main(argv: list[str], tmp_path: Path) -> tuple[int, str]:
    from workbench.cli import main

    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh, pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", fh)
        code = main(argv)
    return code, err.read_text()


def test_select_head_reduces_to_the_named_head_and_lists_the_heads_otherwise(files):
    two = torch.load(files / "two.model", weights_only=False)
    assert heads_of(two) == ("pt_head", "Default")
    assert select_head(two, None, "two")[0] == "Default"  # the only head that is not pt_head
    name, one = select_head(two, "pt_head", "two")
    assert name == "pt_head" and heads_of(one) == ("pt_head",)
    assert (
        float(one.scale_shift.scale.reshape(-1)[0]) == 1.0
        and float(one.atomic_energies_fn.atomic_energies[0, 1]) == -2.0
    )
    for dtype in (torch.float64, torch.float32):  # mace rebuilds in the default dtype: ours is the model's
        assert next(select_head(two.to(dtype), "Default", "two")[1].parameters()).dtype == dtype
    with pytest.raises(HeadError, match=r"--head: 'omat' is not a head of two; its heads: pt_head, Default"):
        select_head(two, "omat", "two")
    with pytest.raises(HeadError, match=r"three has heads omat, mp, pt_head; name the one to use"):
        select_head(torch.load(files / "three.model", weights_only=False), None, "three")


def test_eval_head_equals_the_single_head_model(files, tmp_path):
    from workbench.train.evaluation import evaluate_file

    water = files / "water.extxyz"
    by_head = {h: evaluate_file(files / "two.model", water, head=h) for h in ("pt_head", "Default")}
    for head, result in by_head.items():
        alone = evaluate_file(files / f"{head}.model", water)
        assert result["e_mae_mev_atom"] == pytest.approx(alone["e_mae_mev_atom"], rel=1e-12)
        assert result["f_mae_mev_a"] == pytest.approx(alone["f_mae_mev_a"], rel=1e-12)
    assert by_head["pt_head"]["e_mae_mev_atom"] != pytest.approx(by_head["Default"]["e_mae_mev_atom"], rel=1e-3)
    assert evaluate_file(files / "two.model", water)["e_mae_mev_atom"] == by_head["Default"]["e_mae_mev_atom"]
    for argv, message in (
        (["--head", "omat"], r"'omat' is not a head of .*two\.model; its heads: pt_head, Default"),
        ([], None),
    ):
        code, err = _main(["eval", str(files / "two.model"), str(water), *argv], tmp_path)
        if message is None:
            assert code == 0, err
        else:
            lines = [line for line in err.splitlines() if line.startswith("workbench: error:")]
            assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), err
    code, err = _main(["eval", str(files / "three.model"), str(water)], tmp_path)
    assert code == 2 and "has heads omat, mp, pt_head; name the one to use" in err


def test_md_head_runs_the_named_head(files):
    from workbench.train.md import run_md

    kw = dict(structure=str(files / "water.extxyz"), steps=3, backend="e3nn", progress=False, seed=2)
    for head in ("pt_head", "Default"):
        picked = run_md(files / "two.model", head=head, **kw)
        alone = run_md(files / f"{head}.model", **kw)
        np.testing.assert_allclose(picked.potential_energy, alone.potential_energy, rtol=1e-12)


def test_finetuning_starts_from_the_foundation_head(files, tmp_path):
    from ase.io import read

    from workbench.train.build import _model
    from workbench.train.config import TrainConfig
    from workbench.train.data import prepare_data
    from workbench.train.foundation import finetune_stats, load_foundation, resolve

    cfg = TrainConfig(
        dataset=str(files / "water.extxyz"),
        foundation_model=str(files / "two.model"),
        foundation_head="pt_head",
        dtype="float64",
        output_dir=str(tmp_path),
        progress=False,
    )
    found = load_foundation(cfg.foundation_model, head="pt_head")
    assert found.heads == ("pt_head", "Default") and found.head == "pt_head"
    cfg = resolve(cfg)
    data = prepare_data(cfg)
    model = _model(cfg, finetune_stats(cfg, list(data.z_table.zs), {}))
    single = torch.load(files / "pt_head.model", weights_only=False)
    from mace.calculators import MACECalculator

    for atoms in read(files / "water.extxyz", ":2"):
        energies = []
        for m in (model, single):
            a = atoms.copy()
            a.calc = MACECalculator(models=[m], device="cpu", default_dtype="float64")
            energies.append(a.get_potential_energy())
        assert energies[0] == pytest.approx(energies[1], rel=1e-10)
