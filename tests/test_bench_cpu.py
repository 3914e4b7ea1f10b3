"""``workbench bench cpu``: the smoke preset end to end (table, JSON, the trajectory figure)."""

import json
from pathlib import Path

import pytest
from cli_fixtures import run_workbench

import workbench  # noqa: F401
from workbench.bench.cpu import bench_cpu, format_table, hot_op_timer
from workbench.bench.workloads import system_batch


def test_smoke_preset_writes_table_json_and_trajectory_figure(tmp_path):
    out = tmp_path / "cpu.json"
    res = run_workbench(
        "bench", "cpu", "--preset", "smoke", "--trajectory-steps", 4, "--out", out, "--workdir", tmp_path / "runs"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(c["model"], c["system"], c["dtype"]) for c in data["cases"]] == [
        ("small", "water-24", "float32"),
        ("small", "water-24", "float64"),
        ("small", "crystal-32", "float32"),
        ("small", "crystal-32", "float64"),
    ]
    (compiled,) = data["compiled"]  # torch.compile against eager: one graph, the same numbers
    assert (compiled["compiler"], compiled["dtype"], list(compiled["rows"])) == (
        "aot_eager",
        "float64",
        ["md", "train"],
    )
    for row in compiled["rows"].values():
        assert row["graph_breaks"] == 0 and row["rel_diff"] <= 1e-10 and row["cold_s"] > 0
        assert row["compiled_over_eager"] == pytest.approx(row["compiled_ms"] / row["eager_ms"])
    for case in data["cases"]:
        assert case["atoms"] == int(case["system"].split("-")[1]) and case["edges"] > 0
        for key in ("e3nn_md", "numba_md", "e3nn_train", "numba_train", "e3nn_stress", "numba_stress"):
            assert case[key]["median_ms"] > 0 and len(case[key]["runs_ms"]) == 1
        assert case["speedup_md"] == pytest.approx(case["e3nn_md"]["median_ms"] / case["numba_md"]["median_ms"])
        assert case["speedup_stress"] == pytest.approx(
            case["e3nn_stress"]["median_ms"] / case["numba_stress"]["median_ms"]
        )
        for step in ("md", "train", "stress"):
            ops = case["ops"][step]
            assert set(ops) == {"step_ms", "symmetric_contraction", "channelwise_tp"}
            assert all(
                0 < ops[k]["share"] < 1 and ops[k]["gflops"] > 0 for k in ("symmetric_contraction", "channelwise_tp")
            )
    assert data["peak_gflops"]["float32"] > 0
    prof = data["profile"]
    assert abs(sum(v for k, v in prof["numba_train"].items() if k != "total_ms") - 1) < 1e-9
    assert prof["numba_train"]["workbench ops"] > 0 and "workbench ops" not in prof["e3nn_train"]
    traj = data["trajectory"]
    assert len(traj["losses"]["numba-float64"]) == 4 and traj["float64"]["ok"] and traj["float32"]["ok"]
    assert traj["families"] == ["water_clusters", "hea"]
    html = Path(traj["figure"]).read_text()
    assert "numba-float32" in html and "e3nn-float64" in html
    assert (
        "speed-up" not in res.stdout and "small  water-24" in res.stdout and "trajectory 4 steps, float64" in res.stdout
    )
    assert "+stress e3nn" in res.stdout and "small  crystal-32" in res.stdout
    # this environment has no nequip: the families part says so and how to get its rows
    assert "--nequip-python" in data["families"]["skipped"]
    assert "NequIP / Allegro: skipped" in res.stdout


def test_mixed_batch_is_packed_from_several_families():
    batch, zs, info = system_batch("mixed", "float32")
    assert 700 <= info["atoms"] <= 768 and len(info["families"]) >= 3 and info["graphs"] >= 5
    assert batch["positions"].shape[0] == info["atoms"] and len(zs) >= 5


def test_hot_op_timer_counts_every_pass():
    import torch

    from workbench.bench.cpu import _models, train_step

    batch, zs, info = system_batch("water-24", "float64")
    models = _models("small", zs, info, "float64")
    train_step(models[("numba", "train")], batch)
    with hot_op_timer() as stats:
        train_step(models[("numba", "train")], batch)
    # per layer: forward, the forces' backward, then in loss.backward the double backward and the
    # energy term's own first derivative: 4 evaluations of each op, 2 layers
    assert stats["symmetric_contraction"]["calls"] == 8 and stats["channelwise_tp"]["calls"] == 8
    with hot_op_timer() as stats:
        train_step(models[("e3nn", "train")], batch)
    assert stats == {}
    assert torch.get_default_dtype() == torch.float32


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="--nequip-python: .*nope.* is not an executable file"):
        bench_cpu(parts=["families"], nequip_python=tmp_path / "nope", out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="--nequip-python: empty; name the NequIP environment's python"):
        bench_cpu(parts=["families"], nequip_python="", out=tmp_path / "x.json")
    quiet = bench_cpu(preset="smoke", parts=["families"], nequip_python="/bin/true", out=tmp_path / "x.json")
    assert quiet["families"]["error"] == (
        "/bin/true: bench nequip exited 0 without writing nequip.json: "
        "no output (is it a python with the workbench installed?)"
    )
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of full, smoke"):
        bench_cpu(preset="huge", out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown part"):
        bench_cpu(parts=["speed"], out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="a water box needs a multiple of 3 atoms"):
        system_batch("water-25", "float32")
    assert format_table({"cases": []}) == ""


def test_families_part_names_an_interpreter_without_nequip(tmp_path, monkeypatch):
    """Pointed at a python that lacks nequip (this environment's), the part records the failure
    and the table says so; a bad $WORKBENCH_NEQUIP_PYTHON is named as such."""
    import sys

    res = bench_cpu(preset="smoke", parts=["families"], nequip_python=sys.executable, out=tmp_path / "x.json")
    err = res["families"]["error"]
    assert err.startswith(f"{sys.executable}: bench nequip exited 2: workbench: error: nequip and nequip-allegro are ")
    assert json.loads((tmp_path / "x.json").read_text())["families"]["error"] == err
    assert "NequIP / Allegro: failed" in format_table(res)
    from workbench.viz.nequip_views import nequip_python

    monkeypatch.setenv("WORKBENCH_NEQUIP_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"\$WORKBENCH_NEQUIP_PYTHON: .*missing.* is not an executable file"):
        nequip_python()
