"""Per-family validation errors: computed by hand on a small set, and ``workbench eval``."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.data import read_structures, write_structures
from workbench.data.embedded import EMBEDDED_PATH
from workbench.train import TrainConfig

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def small():
    """A tiny float64 model and 9 labelled structures of three families."""
    from workbench.data.atomic_data import to_atomic_data, z_table_for
    from workbench.train.model import build_model
    from workbench.train.stats import ModelStats

    frames = read_structures(EMBEDDED_PATH)
    chosen = []
    for fam in ("water_clusters", "hea", "mptrj"):
        chosen += [a for a in frames if a.info["config_type"] == fam][:3]
    z = z_table_for(chosen)
    cfg = TrainConfig(
        hidden_irreps="8x0e+8x1o", max_ell=1, correlation=2, num_bessel=4, radial_mlp=[16], dtype="float64"
    )
    stats = ModelStats(
        zs=list(z.zs), e0s=[-0.1 * k for k in range(len(z.zs))], avg_num_neighbors=10.0, shift=0.0, scale=1.0
    )
    torch.manual_seed(4)
    model = build_model(cfg, stats)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        data = to_atomic_data(chosen, cutoff=cfg.cutoff, z_table=z)
    finally:
        torch.set_default_dtype(previous)
    return model, chosen, data


def test_per_family_errors_by_hand(small):
    from workbench.train.evaluation import evaluate

    model, chosen, data = small
    families = [a.info["config_type"] for a in chosen]
    got = evaluate(model, data, batch_size=4, families=families)
    by: dict = {}
    from mace.tools.torch_geometric import Batch

    for a, d in zip(chosen, data):  # one graph at a time, errors in plain numpy
        out = model(Batch.from_data_list([d]).to_dict(), training=False, compute_force=True)
        e = (float(out["energy"][0]) - a.info["REF_energy"]) / len(a)
        df = out["forces"].detach().numpy() - a.arrays["REF_forces"]
        for key in (a.info["config_type"], "all"):
            r = by.setdefault(key, {"e": [], "fa": [], "fs": [], "n": 0})
            r["e"].append(e)
            r["fa"].append(np.abs(df).mean(axis=1).sum())
            r["fs"].append((df**2).sum())
            r["n"] += len(a)
    for key, r in by.items():
        m = got if key == "all" else got["families"][key]
        assert m["graphs"] == len(r["e"])
        np.testing.assert_allclose(m["e_mae_mev_atom"], 1000 * np.mean(np.abs(r["e"])), rtol=1e-10)
        np.testing.assert_allclose(m["e_rmse_mev_atom"], 1000 * np.sqrt(np.mean(np.square(r["e"]))), rtol=1e-10)
        np.testing.assert_allclose(m["f_mae_mev_a"], 1000 * np.sum(r["fa"]) / r["n"], rtol=1e-10)
        np.testing.assert_allclose(m["f_rmse_mev_a"], 1000 * np.sqrt(np.sum(r["fs"]) / (3 * r["n"])), rtol=1e-10)
    assert sorted(got["families"]) == ["hea", "mptrj", "water_clusters"]
    assert all(v["e_mae_mev_atom"] > 0 and v["f_rmse_mev_a"] >= v["f_mae_mev_a"] for v in got["families"].values())


def test_workbench_eval_prints_the_table(small, tmp_path):
    from workbench.train.evaluation import evaluate_file

    model, chosen, _ = small
    torch.save(model, tmp_path / "m.model")
    path = write_structures(tmp_path / "set.extxyz", chosen)
    want = evaluate_file(tmp_path / "m.model", path)
    res = subprocess.run(
        [str(BIN / "workbench"), "eval", str(tmp_path / "m.model"), str(path), "--json", str(tmp_path / "e.json")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {
        line.split()[0]: line.split()
        for line in res.stdout.splitlines()
        if line and line.split()[0] in ("hea", "mptrj", "water_clusters", "all")
    }
    assert set(rows) == {"hea", "mptrj", "water_clusters", "all"}
    assert float(rows["hea"][2]) == pytest.approx(want["families"]["hea"]["e_mae_mev_atom"], abs=0.051)
    assert json.loads((tmp_path / "e.json").read_text())["graphs"] == 9
    bad = subprocess.run([str(BIN / "workbench"), "eval", str(path), str(path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "set.extxyz: not a loadable model" in bad.stderr


def test_package_evaluate_is_the_function_once_the_trainer_is_imported():
    # a submodule named like the function used to replace it on the package after `import loop`
    import workbench.train.loop  # noqa: F401
    from workbench.train import evaluate

    assert callable(evaluate) and evaluate.__module__ == "workbench.train.evaluation"
