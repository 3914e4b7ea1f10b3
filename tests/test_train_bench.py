"""``workbench bench train`` on CPU: every variant trains the same graphs once; the table and JSON agree."""

import json
import math

from workbench.bench.train import bench_structures, bench_train, format_table
from workbench.train import TrainConfig
from workbench.train.presets import tiny_config


def test_bench_structures_tiles_with_rattled_copies():
    import numpy as np

    more = bench_structures(400, seed=1, config=TrainConfig(families=["water_clusters"]))
    assert len(more) == 400 and all(a.info["config_type"] == "water_clusters" for a in more)
    originals = {(a.info["family_index"], a.info["seed"]): a for a in more if not a.info.get("bench_copy")}
    copies = [a for a in more if a.info.get("bench_copy")]
    assert copies and all("REF_energy" in a.info and "REF_forces" in a.arrays for a in copies)
    for c in copies[:20]:
        o = originals[(c.info["family_index"], c.info["seed"])]
        shift = np.abs(c.positions - o.positions)
        assert 0 < shift.max() < 0.15 and c.info["REF_energy"] == o.info["REF_energy"]


def _counting(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so each call is recorded, then delegate to the real function."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_bench_train_smoke(tmp_path, monkeypatch):
    import workbench.train.data
    import workbench.train.stats

    prepared = _counting(monkeypatch, workbench.train.data, "prepare_data")
    stats = _counting(monkeypatch, workbench.train.stats, "compute_stats")
    cfg = tiny_config(tmp_path, capacity=300, families=["water_clusters", "mptrj"])
    out = tmp_path / "train.json"
    res = bench_train(
        cfg, structures=40, batch_size=4, variants=("baseline", "packer-numba", "packer-cueq"), warmup_steps=1, out=out
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    # Four runs (warm-up and timed, two variants) share one data preparation and one set of statistics.
    assert len(prepared) == 1 and len(stats) == 1
    v = res["variants"]
    assert set(v) == {"baseline", "packer-numba"} and "packer-cueq" in res["skipped"]
    # One epoch each over the same 36 training graphs: same atoms, different batching.
    assert v["baseline"]["atoms"] == v["packer-numba"]["atoms"] > 0
    assert v["baseline"]["steps"] == math.ceil(36 / 4)
    assert v["packer-numba"]["steps"] < v["baseline"]["steps"]
    assert v["packer-numba"]["atoms_per_step_mean"] <= cfg.capacity
    assert math.isclose(res["ratios"]["baseline/packer-numba"], v["baseline"]["epoch_s"] / v["packer-numba"]["epoch_s"])
    table = format_table(res)
    assert "packer-cueq    skipped" in table and "baseline" in table
