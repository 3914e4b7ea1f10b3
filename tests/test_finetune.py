"""Fine-tuning from a foundation model file (workbench.train.foundation): a small foundation
trained by real mace_run_train on the mixture's mptrj structures (with stress), fine-tuned on its
hea alloys, against mace_run_train's own fine-tuning and the foundation's predictions."""

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from finetune_fixtures import ARCH, foundation, hea, train_cli, write_family  # noqa: F401 (fixtures)
from train_fixtures import pair_with_mace_run_train, step_losses

from workbench.train.config import TrainConfig
from workbench.train.values import ConfigError


def _cfg(tmp_path: Path, foundation: Path, data: Path, **kw) -> TrainConfig:  # noqa: F811
    base = dict(name="ft", output_dir=str(tmp_path), dataset=str(data), foundation_model=str(foundation))
    base.update(dtype="float64", sampler="fixed-count", batch_size=4, epochs=1, progress=False, checkpoint_every=0)
    return TrainConfig(**{**base, **kw})


def test_a_finetuning_run_pairs_with_mace_run_train_step_for_step(tmp_path, foundation, hea):  # noqa: F811
    """mace_run_train --foundation_model and a mace-order run, float64 e3nn, stress loss: every
    step's loss and the final models' validation errors agree, for the data's elements (mace's
    default) and E0s refitted (average), for all the file's elements with its own E0s, and with
    mace's estimated E0s (the foundation's, corrected on the training split)."""
    from workbench.bench.quality import PRESETS, base_config
    from workbench.train.evaluation import evaluate_file

    for k, (e0s, elements) in enumerate((("average", "data"), ("foundation", "all"), ("estimated", "data"))):
        where = tmp_path / f"{e0s}-{elements}"
        cfg = base_config(PRESETS["small"], where, seed=3 + k, loss="stress", stress_weight=10.0)
        cfg = replace(cfg, dataset=str(hea), max_structures=None, batch_size=4, **ARCH)
        # a small clip_grad clips every step: mace's norm counts the Bessel weights it never steps
        cfg = replace(cfg, foundation_model=str(foundation), e0s=e0s, foundation_elements=elements, clip_grad=0.05)
        split, mace_model, our_model, theirs, mine = pair_with_mace_run_train(cfg, where, 2)
        assert len(mine) == len(theirs) == 2 * (split["n_train"] // cfg.batch_size)
        np.testing.assert_allclose(mine, theirs, rtol=1e-9)
        a, b = evaluate_file(mace_model, split["valid"]), evaluate_file(our_model, split["valid"])
        for key in ("e_mae_mev_atom", "f_mae_mev_a", "s_mae_mev_a3"):
            assert b[key] == pytest.approx(a[key], rel=1e-9)


def test_the_architecture_comes_from_the_file_and_a_contradiction_names_both(tmp_path, foundation, hea):  # noqa: F811
    from workbench.train.foundation import FoundationError, load_foundation, resolve

    found = load_foundation(foundation)
    assert found.heads == ("Default",) and len(found.sha256) == 64
    resolved = resolve(_cfg(tmp_path, foundation, hea))
    for name, value in {**ARCH, "mlp_irreps": "8x0e"}.items():
        assert getattr(resolved, name) == value, name
    assert resolve(resolved) is resolved  # idempotent: the data and the trainer both resolve
    assert resolve(_cfg(tmp_path, foundation, hea, cutoff=4.0)).cutoff == 4.0  # agreeing is fine
    with pytest.raises(FoundationError, match=r"TrainConfig.cutoff: 5.0, but the foundation model .* has cutoff 4.0"):
        resolve(_cfg(tmp_path, foundation, hea, cutoff=5.0))
    with pytest.raises(FoundationError, match=r"hidden_irreps: '16x0e', .* has hidden_irreps '8x0e\+8x1o'"):
        resolve(_cfg(tmp_path, foundation, hea, hidden_irreps="16x0e"))


def _predict(model, atoms) -> tuple[float, np.ndarray]:
    from mace.calculators import MACECalculator

    calc = MACECalculator(models=[model], device="cpu", default_dtype="float64")
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


@pytest.mark.parametrize("elements", ["data", "all"])
def test_before_any_step_the_model_predicts_what_the_foundation_does(tmp_path, foundation, hea, elements):  # noqa: F811
    """The rebuilt model with the foundation's E0s equals the foundation on new structures, to
    1e-10, whether it keeps the data's elements (mace rescales the embedding) or all of them."""
    from ase.io import read

    from workbench.train.build import _model
    from workbench.train.data import prepare_data
    from workbench.train.foundation import finetune_stats, load_foundation, resolve

    cfg = resolve(_cfg(tmp_path, foundation, hea, e0s="foundation", foundation_elements=elements))
    data = prepare_data(cfg)
    zs = list(data.z_table.zs)
    found = load_foundation(foundation)
    assert zs == (found.zs if elements == "all" else [13, 28, 29, 46, 47, 78, 79])
    model = _model(cfg, finetune_stats(cfg, zs, {}))
    for atoms in read(hea, ":3"):
        e0, f0 = _predict(found.model, atoms)
        e1, f1 = _predict(model, atoms)
        assert e1 == pytest.approx(e0, rel=1e-10)
        np.testing.assert_allclose(f1, f0, rtol=1e-10, atol=1e-12)


def test_e0s_foundation_average_and_an_explicit_map(tmp_path, foundation, hea):  # noqa: F811
    from mace.data.utils import compute_average_E0s

    from workbench.train.data import prepare_data
    from workbench.train.foundation import finetune_stats, load_foundation, resolve
    from workbench.train.stats import compute_stats

    found = load_foundation(foundation)
    cfg = resolve(_cfg(tmp_path, foundation, hea, foundation_elements="all"))
    data = prepare_data(cfg)
    zs = list(data.z_table.zs)
    lsq = compute_average_E0s(data.train_configs, data.z_table)
    fitted = {z: lsq[z] for z in data.train_elements}
    assert set(fitted) == {13, 28, 29, 46, 47, 78, 79} and set(zs) - set(fitted) == {6, 8}
    assert finetune_stats(cfg, zs, fitted).e0s == [found.e0s[z] for z in zs]  # the default: the file's
    stats = finetune_stats(replace(cfg, e0s="average"), zs, fitted)
    assert stats.e0s == [fitted.get(z, found.e0s[z]) for z in zs]  # C and O: not in the data, the file's
    assert stats.avg_num_neighbors == found.mace_config["avg_num_neighbors"]
    assert stats.scale == pytest.approx(float(found.model.scale_shift.scale[0]), rel=1e-15)
    assert compute_stats(data.train_configs, data.train, data.z_table).scale != stats.scale
    explicit = {z: -1.0 - z for z in fitted}
    assert finetune_stats(replace(cfg, e0s=explicit), zs, fitted).e0s == [explicit.get(z, found.e0s[z]) for z in zs]
    with pytest.raises(ConfigError, match=r"no energy for Al \(Z=13\)"):
        finetune_stats(replace(cfg, e0s={28: -1.0}), zs, fitted)
    assert _cfg(tmp_path, foundation, hea, e0s={"Al": -3, "28": -2.5}).e0s == {13: -3.0, 28: -2.5}
    for bad, why in (
        ({"Xx": 1.0}, "not an element"),
        ({13: float("nan")}, "not a finite energy"),
        ("best", "not one of"),
    ):
        with pytest.raises(ConfigError, match=why):
            _cfg(tmp_path, foundation, hea, e0s=bad)
    with pytest.raises(ConfigError, match="applies to fine-tuning"):
        TrainConfig(e0s={1: -13.6})


def test_finetuning_trains_resumes_and_refuses_another_foundation_file(tmp_path, foundation, hea):  # noqa: F811
    import shutil

    from workbench.train import train

    mine = tmp_path / "found.model"
    shutil.copy(foundation, mine)
    cfg = _cfg(tmp_path, mine, hea, e0s="average", loss="stress", stress_weight=10.0, max_steps=2, epochs=3)
    first = train(cfg)
    assert first.global_step == 2 and first.model_path.exists()
    more = train(replace(cfg, max_steps=4))
    assert more.global_step == 4 and more.steps_run == 2
    shutil.copy(first.model_path, mine)  # another model at the same path
    with pytest.raises(ValueError, match=r"foundation model .* changed since this checkpoint \(sha256"):
        train(replace(cfg, max_steps=6))
    losses = step_losses(cfg.run_dir)
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_the_numba_kernels_finetune_as_e3nn_does(tmp_path, foundation, hea):  # noqa: F811
    """float64: the same losses on both backends, on the foundation's rebuilt architecture."""
    from workbench.train import train

    runs = {}
    for backend in ("e3nn", "numba"):
        cfg = _cfg(tmp_path, foundation, hea, name=backend, backend=backend, max_steps=2, export=False)
        train(cfg)
        runs[backend] = step_losses(cfg.run_dir)
    np.testing.assert_allclose(runs["numba"], runs["e3nn"], rtol=1e-10)


def _cli(tmp_path: Path, foundation_value: str, hea: Path, *extra: str) -> tuple[int, str]:  # noqa: F811
    return train_cli(tmp_path, _cfg(tmp_path, Path(foundation_value), hea), *extra)


def test_bad_foundation_input_is_one_line_and_exit_2(tmp_path, foundation, hea):  # noqa: F811
    other = tmp_path / "not-a-model.pt"
    torch.save({"weights": torch.ones(3)}, other)
    truncated = tmp_path / "truncated.model"
    truncated.write_bytes(foundation.read_bytes()[:5000])
    water = write_family(tmp_path / "water.extxyz", ["water_clusters"], 8, 30)
    cases = [
        (str(other), [], r"a dict, not a mace-torch model"),
        (str(truncated), [], r"truncated\.model: not a loadable model file"),
        (str(tmp_path / "missing.model"), [], "no such model file"),
        (str(foundation), ["--set", f"dataset={water}"], r"element\(s\) H \(Z=1\) occur in the data but not in"),
        (str(foundation), ["--set", "foundation_head=omat"], r"'omat' is not a head of .*; its heads: Default"),
    ]
    for value, extra, message in cases:
        code, err = _cli(tmp_path, value, hea, *extra)
        lines = [line for line in err.splitlines() if line.startswith("workbench: error:")]
        assert code == 2 and len(lines) == 1, err
        assert re.search(message, lines[0]), lines[0]


def test_a_prepared_dataset_finetunes_as_the_file_does(tmp_path, foundation, hea):  # noqa: F811
    """The store keeps its own element table; fine-tuning with all the file's elements and E0s
    refitted gives the in-memory run's losses."""
    from workbench.cli import main
    from workbench.train import train

    assert main(["data", "prepare", "--out", str(tmp_path / "store"), "--cutoff", "4.0", str(hea)]) == 0
    losses = []
    for name, data in (("file", hea), ("store", tmp_path / "store")):
        cfg = _cfg(tmp_path, foundation, data, name=name, foundation_elements="all", e0s="average", max_steps=3)
        train(cfg)
        losses.append(step_losses(cfg.run_dir))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-9)
