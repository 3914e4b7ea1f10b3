"""The code path of a MACE-MP-0 file: 89 elements (H to Ac) and r_max 6.0 Å, as MACE-MP-0's
foundation files carry them (the channels are kept small here so that CPU tests stay fast). The
cutoff and the element table come from the file; before any step the fine-tuned model, naive or
multihead (each head), predicts what the foundation does on a crystal of three of its elements."""

from pathlib import Path

import numpy as np
import pytest
import torch
from finetune_fixtures import residual_mace, write_family

from workbench.train.config import TrainConfig

MP0_ELEMENTS = list(range(1, 90))


@pytest.fixture(scope="module")
def mp0_like(tmp_path_factory) -> Path:
    from e3nn import o3

    torch.manual_seed(5)
    model = residual_mace(
        r_max=6.0,
        num_bessel=10,
        num_elements=len(MP0_ELEMENTS),
        hidden_irreps=o3.Irreps("8x0e+8x1o"),
        MLP_irreps=o3.Irreps("16x0e"),
        atomic_energies=np.random.default_rng(5).uniform(-9.0, -0.5, len(MP0_ELEMENTS)),
        avg_num_neighbors=61.96,
        atomic_numbers=MP0_ELEMENTS,
        atomic_inter_scale=0.8,
        atomic_inter_shift=0.1,
        radial_MLP=[64, 64, 64],
    )
    path = tmp_path_factory.mktemp("mp0") / "mp0-like.model"
    torch.save(model, path)
    return path


@pytest.fixture(scope="module")
def crystals(tmp_path_factory) -> tuple[Path, Path]:
    """Small mptrj crystals of three elements to fine-tune on, and others to replay."""
    from workbench.data.embedded import load_embedded
    from workbench.data.io import write_structures

    where = tmp_path_factory.mktemp("crystals")
    mptrj = [a for a in load_embedded() if a.info.get("config_type") == "mptrj" and len(a) <= 16]
    three = [a for a in mptrj if len(set(a.numbers)) == 3][:6]
    assert len(three) >= 4, "the embedded mixture should hold small three-element crystals"
    write_structures(where / "three.extxyz", three)
    return where / "three.extxyz", write_family(where / "replay.extxyz", ["mptrj"], 24, 16)


def _predict(model, atoms, head=None) -> tuple[float, np.ndarray]:
    from mace.calculators import MACECalculator

    from workbench.train.heads import select_head

    calc = MACECalculator(models=[select_head(model, head, "model")[1]], device="cpu", default_dtype="float64")
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


@pytest.mark.parametrize("mode", ["data", "all", "multihead"])
def test_an_mp0_like_file_sets_cutoff_and_elements_and_starts_where_the_foundation_is(
    tmp_path, mp0_like, crystals, mode
):
    from ase.io import read

    from workbench.train.build import _model
    from workbench.train.data import prepare_data
    from workbench.train.foundation import finetune_stats, load_foundation, resolve

    three, replay = crystals
    extra = {"foundation_elements": "all"} if mode == "all" else {}
    if mode == "multihead":
        extra = {"multihead_finetuning": True, "pt_dataset": str(replay), "num_samples_pt": 12}
    cfg = TrainConfig(
        name=mode, output_dir=str(tmp_path), dataset=str(three), foundation_model=str(mp0_like), dtype="float64",
        progress=False, **extra,
    )  # fmt: skip
    cfg = resolve(cfg)
    assert cfg.cutoff == 6.0 and cfg.hidden_irreps == "8x0e+8x1o" and cfg.num_bessel == 10
    data = prepare_data(cfg)
    data_zs = sorted({int(z) for a in read(three, ":") for z in a.numbers})
    zs = list(data.z_table.zs)
    assert zs == MP0_ELEMENTS if mode == "all" else set(data_zs) <= set(zs)
    if mode == "data":
        assert zs == data_zs
    found = load_foundation(mp0_like)
    model = _model(cfg, finetune_stats(cfg, zs, {}))
    heads = ["Default", "pt_head"] if mode == "multihead" else [None]
    for atoms in read(three, ":2"):
        e0, f0 = _predict(found.model, atoms)
        for head in heads:
            e1, f1 = _predict(model, atoms, head)
            assert e1 == pytest.approx(e0, rel=1e-10), head
            np.testing.assert_allclose(f1, f0, rtol=1e-9, atol=1e-11)


def test_an_mp0_like_file_finetunes_multihead(tmp_path, mp0_like, crystals):
    from workbench.train import train
    from workbench.train.heads import heads_of
    from workbench.train.model_file import load_model

    three, replay = crystals
    cfg = TrainConfig(
        name="mh", output_dir=str(tmp_path), dataset=str(three), foundation_model=str(mp0_like),
        multihead_finetuning=True, pt_dataset=str(replay), num_samples_pt=12, max_steps=2, sampler="paper",
        capacity=64, progress=False, checkpoint_every=0,
    )  # fmt: skip
    result = train(cfg)
    model = load_model(result.model_path)
    assert heads_of(model) == ("pt_head", "Default") and float(model.r_max) == 6.0
    assert result.global_step == 2 and np.isfinite(result.final_loss)
