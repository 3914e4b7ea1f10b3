"""Training with stress: a mace-order run with ``loss=stress`` pairs with ``mace_run_train --loss
stress`` step for step; a prepared store trains as the file does; an E+F run computes no stress;
validation stress errors per family reach metrics.jsonl, ``workbench eval`` and the report."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from train_fixtures import pair_with_mace_run_train, step_losses, tiny

from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.values import ConfigError

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")
BIN = Path(sys.executable).parent
#: periodic families with stress (EMT) and clusters without: the masking is exercised too
FAMILIES = ["hea", "water_clusters", "mptrj"]


def test_a_stress_run_pairs_with_mace_run_train_step_for_step(tmp_path):
    from workbench.bench.quality import PRESETS, base_config
    from workbench.train.evaluation import evaluate_file

    cfg = base_config(PRESETS["small"], tmp_path, seed=4, loss="stress", stress_weight=10.0)
    cfg = replace(cfg, max_structures=60, valid_fraction=0.2, families=FAMILIES)
    epochs = 2
    split, mace_model, our_model, theirs, mine = pair_with_mace_run_train(cfg, tmp_path, epochs)
    assert len(mine) == len(theirs) == epochs * (split["n_train"] // cfg.batch_size)
    np.testing.assert_allclose(mine, theirs, rtol=1e-9)
    a, b = evaluate_file(mace_model, split["valid"]), evaluate_file(our_model, split["valid"])
    assert 0 < a["stress_graphs"] == b["stress_graphs"] < b["graphs"]  # clusters carry no stress
    for key in ("e_mae_mev_atom", "f_mae_mev_a", "s_mae_mev_a3", "s_rmse_mev_a3"):
        assert b[key] == pytest.approx(a[key], rel=1e-9), key


def test_store_and_file_train_alike_and_report_stress_per_family(tmp_path):
    from workbench.data.io import read_structures, write_structures
    from workbench.data.prepare import prepare
    from workbench.train.loop import train
    from workbench.train.rundir import read_epochs

    chosen = [a for a in read_structures(EMBEDDED_PATH, index=":400") if a.info["config_type"] in FAMILIES]
    src = write_structures(tmp_path / "mix.extxyz", chosen[:60])
    store = prepare([src], tmp_path / "store", workers=2, progress=False)
    run = dict(dtype="float64", loss="stress", stress_weight=10.0, capacity=600, max_steps=3, families=None)
    run["max_structures"] = None  # every element of the file in the model: eval reads the whole file
    runs = [
        train(tiny(tmp_path, name, dataset=str(d), **run), resume=False) for name, d in (("f", src), ("s", store.path))
    ]
    assert step_losses(runs[0].run_dir) == pytest.approx(step_losses(runs[1].run_dir), rel=1e-12)
    epoch = read_epochs(runs[1].run_dir)[-1]
    assert epoch["train_s_mae_mev_a3"] > 0 and epoch["valid_s_mae_mev_a3"] > 0
    fams = epoch["valid_families"]
    assert all("s_mae_mev_a3" not in m for f, m in fams.items() if f == "water_clusters")
    assert any(m.get("s_mae_mev_a3", 0) > 0 for f, m in fams.items() if f != "water_clusters")
    out = subprocess.run(
        [str(BIN / "workbench"), "eval", str(runs[1].model_path), str(src)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    head, units = out.stdout.splitlines()[:2]
    assert "S MAE" in head and "meV/Å³" in units
    water = next(line for line in out.stdout.splitlines() if line.startswith("water_clusters"))
    assert water.split()[-2:] == ["-", "-"]  # no stress label, no stress error
    report = subprocess.run([str(BIN / "workbench"), "report", str(runs[1].run_dir)], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-2000:]
    html = (runs[1].run_dir / "report.html").read_text()
    assert "validation stress MAE" in html and "S MAE<br>meV/Å³" in html


def test_an_energy_forces_run_computes_no_stress(tmp_path, monkeypatch):
    from mace.modules.models import ScaleShiftMACE

    from workbench.train.loop import train

    seen = []
    forward = ScaleShiftMACE.forward

    def spy(self, data, *args, **kwargs):
        seen.append(bool(kwargs.get("compute_stress")))
        return forward(self, data, *args, **kwargs)

    monkeypatch.setattr(ScaleShiftMACE, "forward", spy)
    train(tiny(tmp_path, "ef", max_steps=2, families=FAMILIES, capacity=600), resume=False)
    assert seen and not any(seen)
    seen.clear()
    train(tiny(tmp_path, "efs", max_steps=2, families=FAMILIES, capacity=600, loss="stress", stress_weight=1.0))
    assert seen and all(seen)  # training steps and validation


def test_a_stress_weight_without_stress_labels_is_refused(tmp_path):
    from workbench.train.loop import train

    with pytest.raises(ConfigError, match="stress_weight: 1, but no training graph has a stress label"):
        train(tiny(tmp_path, "nolabel", loss="stress", stress_weight=1.0, families=["water_clusters"]))


def test_a_non_finite_stress_error_names_its_graph():
    """The graphs a non-finite step names include one whose only bad number is its stress (or virials)."""
    from types import SimpleNamespace

    import torch

    from workbench.train.step import _culprits

    g = torch.Generator().manual_seed(7)
    sizes = [3, 2, 4]
    batch = SimpleNamespace(
        ptr=torch.tensor([0, 3, 5, 9]),
        batch=torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)),
        energy=torch.randn(3, generator=g, dtype=torch.float64),
        forces=torch.randn(9, 3, generator=g, dtype=torch.float64),
        stress=torch.randn(3, 3, 3, generator=g, dtype=torch.float64),
        virials=torch.randn(3, 3, 3, generator=g, dtype=torch.float64),
    )
    out = {k: getattr(batch, k) + 0.1 for k in ("energy", "forces", "stress", "virials")}
    assert _culprits(out, batch, [10, 11, 12]) == ([10, 11, 12], False)  # nothing stands out
    out["stress"][1, 2, 0] = float("nan")
    assert _culprits(out, batch, [10, 11, 12]) == ([11], True)
    out["virials"][2, 0, 0] = float("inf")
    assert _culprits(out, batch, [10, 11, 12]) == ([11, 12], True)
    del out["stress"], out["virials"]  # an E+F run computes neither
    assert _culprits(out, batch, [10, 11, 12]) == ([10, 11, 12], False)
