"""Every list of kernel backends in the benchmarks, the figures and the trainer is read from the
registry: a toy backend registered at run time shows up in each, runs a benchmark row, and gets
its own colour; the numba variants and the converters are registry entries too."""

import argparse

import pytest
import torch
from kernel_fixtures import build_model

from workbench.bench import nequip as nequip_bench
from workbench.bench import step as step_bench
from workbench.bench.harness import backend_kernels, kernel_variant, use_backend_kernels
from workbench.bench.kernel_cli import add_common_arguments
from workbench.kernels import accelerate, reference, registry
from workbench.kernels.options import kernel_options
from workbench.kernels.registry import DEFAULT_BACKEND, Backend
from workbench.train.config import TrainConfig
from workbench.viz import gpu_results
from workbench.viz.style import BACKEND_COLORS, backend_color

TOY = "toy"


@pytest.fixture
def toy(monkeypatch):
    """A descriptor backend that is the plain-torch reference under another name."""
    monkeypatch.setitem(
        registry.BACKENDS, TOY, Backend(TOY, "descriptor", "a toy: the reference", evaluate=reference.evaluate)
    )
    return TOY


def _kernel_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_common_arguments(ap)
    return ap


def test_a_toy_backend_is_in_every_list(toy):
    assert toy in registry.labels() and toy in registry.contenders("mace", "cuda")
    assert toy in step_bench.backend_choices() and toy in step_bench.default_backends()
    assert step_bench.default_backends()[0] == DEFAULT_BACKEND
    ap = _kernel_parser()
    assert toy in ap.parse_args([]).backends and ap.parse_args(["--backends", toy]).backends == [toy]
    assert toy in nequip_bench.backends() and toy in nequip_bench.over_ours()
    assert nequip_bench.check_backends([toy]) == ("native", "numba", toy, "free")
    assert toy in gpu_results.gpu_backends()
    row = gpu_results._table_row("x", "float32", "forward", {DEFAULT_BACKEND: 1.0, toy: 4.0}, "")
    assert row[f"{toy} ms"] == 4.0 and row[f"{DEFAULT_BACKEND}/{toy}"] == pytest.approx(0.25)
    assert TrainConfig(backend=toy).backend == toy
    colours = {backend_color(b) for b in registry.labels()}
    assert len(colours) == len(registry.labels()) and backend_color(toy) != "#777"  # one each, none grey
    assert backend_color(DEFAULT_BACKEND) == BACKEND_COLORS[DEFAULT_BACKEND] and backend_color("nope") == "#777"


def test_unknown_labels_are_refused_with_the_choices(toy):
    with pytest.raises(SystemExit):
        _kernel_parser().parse_args(["--backends", "triton"])
    with pytest.raises(ValueError, match=r"unknown backend\(s\) triton; choose from numba, numba-table, .*toy"):
        step_bench.bench_step(preset="smoke", backends=["triton"], device="cpu")
    with pytest.raises(ValueError, match="--backends: unknown triton; choose from native, numba, toy, free, hot"):
        nequip_bench.check_backends(["triton"])
    with pytest.raises(ValueError, match="unknown backend 'numba-fast'; choose one of numba, numba-table"):
        registry.resolve("numba-fast")
    with pytest.raises(ValueError, match="TrainConfig.backend: 'triton' is not one of numba, torch, e3nn"):
        TrainConfig(backend="triton")


def test_the_toy_runs_a_step_benchmark_row_that_agrees_with_e3nn(toy, tmp_path):
    res = step_bench.bench_step(
        preset="smoke",
        parts=["steps"],
        workloads=["water-24"],
        dtypes=["float64"],
        backends=[toy, "e3nn"],
        device="cpu",
        out=tmp_path / "s.json",
        command="test",
    )
    rec = res["steps"]["float64"]["water-24"]
    assert list(rec["backends"]) == [toy, "e3nn"]
    row = rec["backends"][toy]
    assert row["step_ms_median"] > 0 and row["loss_rel_diff_vs_e3nn"] <= 1e-10
    assert toy in step_bench.format_table(res)


def test_variants_are_kernel_options_of_their_backend():
    backend, options = registry.resolve("numba-unfused")
    assert backend.name == DEFAULT_BACKEND and options == {"fuse_passes": False}
    assert registry.resolve("e3nn") == (registry.get_backend("e3nn"), {})
    assert [kernel_variant(x) for x in ("numba", "numba-table", "numba-unrolled", "cueq")] == [
        "auto",
        "table",
        "unrolled",
        "auto",
    ]
    try:
        use_backend_kernels("numba-table")
        assert (kernel_options().cuda_kernels, kernel_options().fuse_passes) == ("table", True)
        use_backend_kernels("numba-unfused")  # the table kind another label set is gone
        assert (kernel_options().cuda_kernels, kernel_options().fuse_passes) == ("auto", False)
    finally:
        use_backend_kernels(DEFAULT_BACKEND)
    assert (kernel_options().cuda_kernels, kernel_options().fuse_passes) == ("auto", True)
    with backend_kernels("numba-unrolled"):  # a benchmark row's options end with the row
        assert kernel_options().cuda_kernels == "unrolled"
    assert kernel_options().cuda_kernels == "auto"
    assert registry.labels(family="mace", device="cpu") == (
        "numba",
        "numba-table",
        "numba-unrolled",
        "numba-unfused",
        "torch",
        "e3nn",
    )
    assert "torch" not in registry.contenders()  # the exact reference is not a speed contender


@pytest.mark.parametrize("name", ["cueq", "oeq"])
def test_converters_are_registry_entries_that_say_why_they_cannot_run(name):
    b = registry.get_backend(name)
    assert b.kind == "convert" and b.devices == ("cuda",) and name in registry.MODELS["mace"].converts
    assert name not in registry.MODELS["nequip"].converts
    if b.available:
        pytest.skip(f"{name} runs here")
    why = b.unavailable()
    assert "do not import" in why or "no CUDA GPU" in why, why
    model = build_model("MACE", "4x0e+4x1o", 2, 2, 3, dtype=torch.float64)
    if "do not import" in why:
        with pytest.raises(ImportError, match=f"backend='{name}': .*do not import"):
            accelerate(model, backend=name)
