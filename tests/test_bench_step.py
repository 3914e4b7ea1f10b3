"""``workbench bench step``: the smoke preset on a CPU (both dtypes in one run), the time budget
through the CLI, a failing row, and the GPU profile's classification on a synthetic trace."""

import json
from pathlib import Path

import pytest
from cli_fixtures import run_workbench

import workbench  # noqa: F401
from workbench.bench import step as bs
from workbench.bench.step_profile import GAPS, OPTIMIZER, WORKBENCH, category, gpu_breakdown, union_length

#: loss_first agreement of numba and e3nn (same weights and batch)
RTOL = {"float64": 1e-10, "float32": 1e-4}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "step.json"
    res = bs.bench_step(preset="smoke", dtypes=["float64", "float32"], device="cpu", out=out, command="test")
    return res, out


def test_smoke_layout_agreement_and_timings(smoke):
    res, out = smoke
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))  # the file holds the final result
    meta = res["meta"]
    assert {"device", "device_name", "timestamp", "versions", "model", "repeats", "warmup", "command"} <= set(meta)
    assert (meta["device"], meta["model"], meta["repeats"], meta["warmup"]) == ("cpu", "small", 2, 1)
    assert list(res["steps"]) == ["float64", "float32"]
    for dtype, wls in res["steps"].items():
        assert list(wls) == ["water-24", "water-48", "mixture-96"]
        for name, rec in wls.items():
            assert {"atoms", "edges", "graphs", "edges_per_atom", "backends", "ratios"} <= set(rec)
            assert rec["edges_per_atom"] == pytest.approx(rec["edges"] / rec["atoms"])
            assert list(rec["backends"]) == list(bs.PRESETS["smoke"]["backends"])
            assert set(bs.default_backends()) == {"numba", "e3nn", "cueq", "oeq"} <= set(rec["backends"])
            numba, e3nn = rec["backends"]["numba"], rec["backends"]["e3nn"]
            graph, fixed = rec["backends"]["numba+graph"], rec["backends"]["numba+fixed"]
            for row in (numba, e3nn, graph, fixed):
                assert (
                    row["step_ms_median"] > 0
                    and len(row["step_ms"]) == 2
                    and row["step_ms_min"] <= row["step_ms_median"]
                )
                assert row["peak_mem_gb"] is None and row["loss_first"] > 0
            rel = abs(numba["loss_first"] - e3nn["loss_first"]) / e3nn["loss_first"]
            assert rel <= RTOL[dtype], (dtype, name, rel)
            assert numba["loss_rel_diff_vs_e3nn"] == pytest.approx(rel, abs=1e-15)
            assert "loss_rel_diff_vs_e3nn" not in e3nn
            assert rec["ratios"]["numba/e3nn"] == pytest.approx(numba["step_ms_median"] / e3nn["step_ms_median"])
            assert "numba/cueq" not in rec["ratios"]
            # padded batches, masked loss: the first loss is the unpadded batch's; a CPU graph runs eagerly
            for row in (graph, fixed):
                assert row["loss_first"] == pytest.approx(numba["loss_first"], rel=RTOL[dtype]), (dtype, name)
            assert graph["captures"] == 0 and "captures" not in fixed
            assert rec["ratios"]["numba+graph/numba"] == pytest.approx(
                graph["step_ms_median"] / numba["step_ms_median"]
            )
            assert "numba+graph/e3nn" in rec["ratios"] and "numba/numba+graph" not in rec["ratios"]
    water = res["steps"]["float32"]["water-48"]
    assert (water["atoms"], water["graphs"]) == (48, 1) and 30 < water["edges_per_atom"] < 45


def test_smoke_mixture_batches_hold_at_most_capacity(smoke):
    mix = smoke[0]["steps"]["float64"]["mixture-96"]
    assert mix["capacity"] == 96 and mix["batches"] == 3 == len(mix["atoms_per_batch"])  # 1 warm-up + 2 timed
    assert max(mix["atoms_per_batch"]) <= 96 and mix["atoms_max"] <= 96
    assert mix["atoms"] == pytest.approx(sum(mix["atoms_per_batch"]) / 3) and mix["graphs"] > 1
    assert (
        len(set(zip(mix["atoms_per_batch"], mix["edges_per_batch"], strict=True))) > 1
    )  # the steps walk distinct batches
    assert len(mix["families"]) >= 2


def test_gpu_only_rows_are_skipped_with_the_reason(smoke):
    for wls in smoke[0]["steps"].values():
        for rec in wls.values():
            for name in ("cueq", "oeq"):  # the registry's CUDA-only converters
                assert rec["backends"][name] == {"skipped": f"{name} runs on cuda only, not cpu"}
                assert f"numba/{name}" not in rec["ratios"]


def test_smoke_profile_shares(smoke):
    pr = smoke[0]["profile"]
    assert (pr["workload"], pr["backend"], pr["dtype"], pr["profiled_steps"]) == ("water-48", "numba", "float64", 3)
    assert pr["step_ms"] > 0
    shares = [c["share"] for c in pr["categories"].values()]
    assert all(0 <= s <= 1 for s in shares) and sum(shares) <= 1 + 1e-9
    assert pr["categories"][WORKBENCH]["ms"] > 0 and pr["categories"][OPTIMIZER]["ms"] > 0
    assert pr["categories"]["matmul (linears, radial MLP)"]["ms"] > 0
    assert [s for _, s in pr["top5"]] == sorted(shares, reverse=True)[:5]
    assert 0 < len(pr["top_kernels"]) <= 15 and any(k[0] == "_SparsePolyFunction" for k in pr["top_kernels"])
    assert all(pr["ranges"][r]["cpu_ms"] > 0 for r in ("forward", "backward", "optimizer"))
    table = bs.format_table(smoke[0])
    assert "mixture-96" in table and "workbench kernels" in table and "float64" in table
    pg = smoke[0]["profile_graph"]
    assert (pg["backend"], pg["profiled_steps"]) == ("numba+graph", 3) and pg["step_ms"] > 0
    assert pg["categories"][WORKBENCH]["ms"] > 0 and "numba+graph" in table


def test_budget_zero_skips_every_row_through_the_cli(tmp_path):
    out = tmp_path / "b.json"
    r = run_workbench(
        "bench", "step", "--preset", "smoke", "--budget-s", 0, "--device", "cpu", "--out", out, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["command"].startswith("workbench bench step --preset smoke --budget-s 0")
    for name in ("water-24", "water-48", "mixture-96"):
        rec = res["steps"]["float32"][name]
        assert rec["skipped"] == "time budget" and rec["backends"] == {
            b: {"skipped": "time budget"} for b in bs.PRESETS["smoke"]["backends"]
        }
    assert res["profile"] == res["profile_graph"] == {"skipped": "time budget"}
    assert "water-24" in r.stdout and f"wrote {out}" in r.stdout


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real, calls = bs.time_steps, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(bs, "time_steps", flaky)
    res = bs.bench_step(
        preset="smoke",
        parts=["steps"],
        workloads=["water-24"],
        backends=["numba", "e3nn"],
        device="cpu",
        out=tmp_path / "e.json",
    )
    rows = res["steps"]["float32"]["water-24"]["backends"]
    assert (
        rows["numba"]["error"] == "RuntimeError: CUDA out of memory (simulated)"
        and "flaky" in rows["numba"]["traceback"]
    )
    assert rows["e3nn"]["step_ms_median"] > 0 and res["steps"]["float32"]["water-24"]["ratios"] == {}
    assert "profile" not in res and json.loads((tmp_path / "e.json").read_text()) == json.loads(json.dumps(res))


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown backend"):
        bs.bench_step(backends=["triton"], out=tmp_path / "x.json")
    with pytest.raises(ValueError, match=r"unknown backend.*choose from .*numba\+graph"):
        bs.bench_step(backends=["e3nn+graph"], out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown workload"):
        bs.bench_step(preset="smoke", workloads=["argon-12"], out=tmp_path / "x.json")
    assert bs.default_out("cpu") == Path("runs/bench/train_step_cpu.json")


def _x(name, cat, ts, dur, corr=None, **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": ({"correlation": corr} if corr else {}) | args,
    }


def test_gpu_breakdown_of_a_synthetic_trace():
    events = [
        _x("optimizer", "user_annotation", 900, 100),
        _x("_SparsePolyFunction", "cpu_op", 0, 50),
        _x("cuLaunchKernel", "cuda_driver", 10, 1, corr=1),  # numba launch, mangled name
        _x("cuLaunchKernel", "cuda_driver", 20, 1, corr=2),  # numba launch, unknown name: by where it was launched
        _x("cudaLaunchKernel", "cuda_runtime", 60, 1, corr=3),
        _x("cudaLaunchKernel", "cuda_runtime", 950, 1, corr=4),
        _x("cudaMemcpyAsync", "cuda_runtime", 70, 1, corr=5),
        _x("_ZN6cudapy24workbench_unrolled_ab12cd6kernelB2v1", "kernel", 100, 200, corr=1),
        _x("weird_numba_name", "kernel", 300, 100, corr=2),
        _x("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", "kernel", 350, 150, corr=3),  # overlaps the one before
        _x("void at::native::multi_tensor_apply_kernel<...>", "kernel", 960, 40, corr=4),
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 600, 100, corr=5),
    ]
    res = gpu_breakdown(events, wall_ms=2.0, steps=2)  # 2000 us of wall time over 2 steps
    cats = {k: v["ms"] for k, v in res["categories"].items()}
    assert cats[WORKBENCH] == pytest.approx(0.15) and cats[OPTIMIZER] == pytest.approx(0.02)
    assert cats["matmul (linears, radial MLP)"] == pytest.approx(0.075) and cats["copies/fills"] == pytest.approx(0.05)
    busy = union_length([(100, 300), (300, 400), (350, 500), (960, 1000), (600, 700)])
    assert (
        busy == 540
        and res["gpu_busy_ms"] == pytest.approx(0.27)
        and cats[GAPS] == pytest.approx((2000 - 540) / 1e3 / 2)
    )
    assert sum(c["share"] for c in res["categories"].values()) <= 1 + 1e-9
    assert res["ranges"] == {"optimizer": {"cpu_ms": pytest.approx(0.05)}} and res["step_ms"] == 1.0
    assert res["top_kernels"][0][0].startswith("_ZN6cudapy") and res["top_kernels"][0][2] == 0.5


@pytest.mark.parametrize(
    "name, cat",
    [
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "copies/fills"),
        ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", "copies/fills"),
        ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", "scatter/index/gather"),
        ("void at::native::index_elementwise_kernel<128, 4>", "scatter/index/gather"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reductions"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, MulFunctor<float>>>",
            "elementwise",
        ),
        ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNN", "matmul (linears, radial MLP)"),
        ("aten::mul", "elementwise"),
        ("aten::mm", "matmul (linears, radial MLP)"),
        ("aten::index_select", "scatter/index/gather"),
        ("aten::_foreach_addcdiv_", OPTIMIZER),
        ("_SparsePolyFunctionBackward", WORKBENCH),
        ("aten::empty", "other"),
    ],
)
def test_category_names(name, cat):
    assert category(name) == cat


def test_large_water_boxes_repeat_the_768_atom_box():
    import numpy as np

    from workbench.bench.workloads import water_box

    small = water_box(768, np.random.default_rng(0))
    for n, reps in ((1536, (2, 1, 1)), (3072, (2, 2, 1)), (6144, (2, 2, 2))):
        big = water_box(n, np.random.default_rng(0))
        assert len(big) == n and np.allclose(big.cell.lengths(), small.cell.lengths() * reps) and big.pbc.all()
    with pytest.raises(ValueError, match="use a multiple of 768"):
        water_box(1200, np.random.default_rng(0))
