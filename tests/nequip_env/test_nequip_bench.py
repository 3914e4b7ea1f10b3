"""``workbench bench nequip``: the bound's model, and the CLI end to end through ``bench cpu``'s families part."""

from __future__ import annotations

import json
import sys

import pytest


def test_free_ops_zero_only_the_replaced_ops():
    """The bound's model: each TensorProductScatter / Contracter returns zeros of its own shape,
    the rest of the model still runs forward and backward, and the original is untouched."""
    import copy

    import torch

    from workbench.bench.nequip import build, cu_cell, free_ops, train_step
    from workbench.kernels.nequip.graphs import atomic_data

    data = atomic_data([cu_cell(1)], ["Cu"], 5.0)
    for family, cls in (("nequip", "TensorProductScatter"), ("allegro", "Contracter")):
        native = build(family, "tutorial", "float64")
        free = free_ops(copy.deepcopy(native), family)
        outputs: list = []
        record = outputs.append
        for m in free.modules():
            if type(m).__name__ == cls:
                m.register_forward_hook(lambda mod, args, out, record=record: record(out))
        assert any(type(m).__name__ == "WorkbenchSiLU" for m in free.modules())  # the companions stay
        loss = train_step(free.train(), data)
        assert outputs and all(torch.count_nonzero(o) == 0 for o in outputs)
        assert torch.isfinite(loss)
        grads = [p.grad for p in free.parameters() if p.grad is not None]
        assert grads, "the rest of the model still backpropagates"
        e_native = native.eval()({k: v.clone() for k, v in data.items()})["total_energy"]
        e_free = free.eval()({k: v.clone() for k, v in data.items()})["total_energy"]
        assert not torch.allclose(e_native, e_free)


def test_bench_cpu_families_part_runs_the_nequip_environment(tmp_path):
    """``bench cpu --parts families`` with the NequIP environment's interpreter named: the rows come
    from a subprocess of that interpreter, and the table shows them."""
    from workbench.bench.cpu import bench_cpu, format_table

    res = bench_cpu(preset="smoke", parts=["families"], nequip_python=sys.executable, out=tmp_path / "cpu.json")
    fam = res["families"]
    assert fam["python"] == sys.executable and fam["command"][1:5] == ["-m", "workbench.cli", "bench", "nequip"]
    assert [(c["family"], c["config"], c["dtype"]) for c in fam["cases"]] == [
        ("nequip", "tutorial", "float64"),
        ("allegro", "tutorial", "float64"),
    ]
    assert all(c["numba_md"] > 0 and c["bound_md"] > 0 for c in fam["cases"])
    assert json.loads((tmp_path / "cpu.json").read_text())["families"]["cases"] == fam["cases"]
    table = format_table(res)
    assert "NequIP / Allegro on" in table and "MD bound x" in table and "allegro tutorial float64" in table


def test_gpu_backends_are_skipped_with_their_reason_where_they_cannot_run(tmp_path):
    """On a CPU the families' GPU modifiers are recorded as skipped for both steps, each with its
    own reason (theirs would fall back to their own path off a GPU, which is no row), and the
    required rows still run; an unknown backend or device is refused with the choices."""
    import pytest

    from workbench.bench.nequip import backends, bench_nequip, format_table

    res = bench_nequip(
        configs=["tutorial"], dtypes=["float64"], repeat=1, repeats=1, backends=["cueq", "oeq"], out=tmp_path / "n.json"
    )
    assert res["backends"] == [b for b in backends() if b not in ("hot", "aoti")] and res["machine"]["device"] == "cpu"
    nequip, allegro = res["cases"]
    assert nequip["skipped"] == {
        "cueq_md": "LookupError: enable_CuEquivariance needs a CUDA device",
        "cueq_train": "LookupError: enable_CuEquivariance needs a CUDA device",
        "oeq_md": "LookupError: enable_OpenEquivariance needs a CUDA device",
        "oeq_train": "LookupError: enable_OpenEquivariance needs a CUDA device",
    }
    assert allegro["skipped"]["oeq_train"] == "LookupError: allegro has no oeq modifier"
    assert allegro["skipped"]["cueq_md"] == "LookupError: enable_CuEquivarianceContracter needs a CUDA device"
    assert all(c["numba_train"] > 0 and c["free_md"] > 0 and "cueq_md" not in c for c in res["cases"])
    table = format_table(res)
    assert "MD cueq/numba" in table and "train oeq/numba" in table and "skipped" in table.splitlines()[3]
    assert "allegro tutorial float64: oeq train skipped (LookupError: allegro has no oeq modifier)" in table
    with pytest.raises(ValueError, match="unknown cuda; choose from native, numba, free, hot, aoti, cueq, oeq"):
        bench_nequip(backends=["cuda"], out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="--device: 'gpu' is not cpu, cuda or cuda:N"):
        bench_nequip(device="gpu", out=tmp_path / "x.json")


def test_hot_backend_is_the_hot_op_without_its_companions(tmp_path):
    """``--backends hot``: ours with the hot op swapped and every companion left as the family's,
    timed beside ours, its time over ours in the table."""
    from workbench.bench.nequip import bench_nequip, build, format_table, hot_op_only
    from workbench.kernels.e3nn import gate as e3nn_gate
    from workbench.kernels.e3nn import linear as e3nn_linear
    from workbench.kernels.e3nn import scalar_tp as e3nn_scalar_tp
    from workbench.kernels.e3nn import silu
    from workbench.kernels.nequip import radial, tp_scatter

    model = hot_op_only(build("nequip", "tutorial", "float64"), "nequip")
    assert sum(tp_scatter.is_workbench(m) for m in model.modules()) == 3
    companions = (radial.SWAP, silu.SWAP, e3nn_linear.SWAP, e3nn_gate.SWAP, e3nn_scalar_tp.SWAP)
    assert not any(c.is_ours(m) for c in companions for m in model.modules())
    assert all(any(c.is_native(m) for m in model.modules()) for c in companions)
    res = bench_nequip(
        families=["nequip"],
        configs=["tutorial"],
        dtypes=["float32"],
        repeat=1,
        repeats=1,
        backends=["hot"],
        out=tmp_path / "n.json",
    )
    (case,) = res["cases"]
    assert case["hot_over_numba_md"] == case["hot_md"] / case["numba_md"] > 0
    assert "MD hot/numba" in format_table(res)


def test_aoti_row_is_nequips_compiled_model_for_md(tmp_path, monkeypatch):
    """``--backends aoti``: the family's model compiled as ``nequip-compile --mode aotinductor
    --target ase`` compiles it (minutes of C++ on 2 cores), timed for MD beside ours, its time
    over ours in the table; its train step is skipped with the reason; the file NequIP's loader
    reads back gives the eager model's energy and forces."""
    import torch
    from nequip.integrations.ase import NequIPCalculator
    from nequip.model.inference_models import load_compiled_model
    from nequip.nn import graph_model

    from workbench.bench.nequip import R_MAX, bench_nequip, build, cu_cell, format_table
    from workbench.bench.nequip_compiled import aoti_model
    from workbench.kernels.nequip.graphs import atomic_data

    monkeypatch.chdir(tmp_path)  # the compiled model goes under runs/bench/nequip-aoti
    res = bench_nequip(
        families=["nequip"], configs=["tutorial"], dtypes=["float32"], repeat=1, repeats=1, backends=["aoti"]
    )
    (case,) = res["cases"]
    assert case["aoti_md"] > 0 and case["aoti_over_numba_md"] == case["aoti_md"] / case["numba_md"]
    assert case["skipped"] == {"aoti_train": "inference only: a compiled model has no parameters to train"}
    assert "MD aoti/numba" in format_table(res)
    path = tmp_path / "runs/bench/nequip-aoti/nequip-tutorial-float32.nequip.pt2"
    target = NequIPCalculator._get_aoti_compile_target()
    compiled, meta = load_compiled_model(str(path), "cpu", list(target["input"]), list(target["output"]))
    data = atomic_data([cu_cell(2, seed=3)], ["Cu"], R_MAX)  # another size than the one compiled from
    native = build("nequip", "tutorial", "float32").eval()
    ref = native({k: v.clone() for k, v in data.items()})
    got = compiled({k: v.clone() for k, v in data.items()})
    scale = float(ref["forces"].abs().max())
    assert scale > 0 and float((got["forces"] - ref["forces"]).abs().max()) <= 1e-5 * scale
    torch.testing.assert_close(got["total_energy"], ref["total_energy"], rtol=1e-5, atol=0)
    assert float(meta[graph_model.R_MAX_KEY]) == R_MAX
    with pytest.raises(ValueError, match="must end in .nequip.pt2"):
        aoti_model(native, data, tmp_path / "model.pt2")
    with pytest.raises(LookupError, match="on the CPU here, not on cuda"):
        aoti_model(native, data, path, device="cuda")


def test_each_timed_step_comes_after_settle_steps_of_the_same_model(tmp_path, monkeypatch):
    """``settle`` untimed steps of one model run right before each of its timed steps (a step right
    after another model's pays for that model's caches); a negative count is refused."""
    import pytest

    from workbench.bench import nequip as bench

    order = []
    for name, fn in list(bench.STEPS.items()):
        monkeypatch.setitem(bench.STEPS, name, lambda m, d, fn=fn, name=name: order.append((id(m), name)) or fn(m, d))
    res = bench.bench_nequip(
        families=["nequip"],
        configs=["tutorial"],
        dtypes=["float32"],
        repeat=1,
        repeats=2,
        settle=2,
        out=tmp_path / "s.json",
    )
    assert res["settle"] == 2 and "2 settle step(s) before each" in bench.format_table(res)
    timed = order[6:]  # after the first step of each of the six (backend, step) models
    assert len(timed) == 6 * 3 * 3  # three rounds (one warms up) of one timed and two settle steps each
    assert all(len(set(timed[i : i + 3])) == 1 for i in range(0, len(timed), 3))  # same model, back to back
    with pytest.raises(ValueError, match="--settle: -1 is negative"):
        bench.bench_nequip(settle=-1, out=tmp_path / "x.json")
