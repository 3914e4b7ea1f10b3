"""Ahead-of-time kernel compilation: every generated kernel of a force-training step, compiled in
worker processes, once per node under a file lock, into a cache folder that can be shared.

Without a GPU the workers compile to PTX and assemble it with the real ``ptxas`` for sm_90 (the
``ptx`` target); what a GPU run adds (machine code in numba's cache, loaded by the next process)
is measured by ``workbench bench cold-start`` on the GPU machine (benchmarks/results/cold_start.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_fixtures import run_workbench, workbench_command
from kernel_fixtures import build_model

from workbench.kernels import accelerate
from workbench.kernels.acceleration import model_ops, precompile_model
from workbench.kernels.launches import launches, training_ops
from workbench.kernels.numba import generated
from workbench.kernels.numba.gpu.toolkit import find_ptxas
from workbench.kernels.precompile import decode_types, encode_types, kernel_jobs, precompile, target_id

pytestmark = pytest.mark.skipif(find_ptxas() is None, reason="ptxas (nvidia-cuda-nvcc wheel) not installed")
#: the model that the command-line tests compile
MODEL_OPTIONS = ("--hidden", "4x0e+4x1o", "--max-ell", 2, "--correlation", 2)


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return accelerate(build_model("ScaleShiftMACE", "4x0e+4x1o", 2, 2, 3, dtype=torch.float32), precompile=False)


def test_model_ops_names_every_accelerated_module(small_model):
    sites = model_ops(small_model)
    assert [s.label for s in sites] == [
        "interactions.0.conv_tp",
        "interactions.1.conv_tp",
        "products.0.symmetric_contractions",
        "products.1.symmetric_contractions",
    ]
    assert all(s.channels == 4 for s in sites)
    # the first interaction's node features are the species embedding: forces never differentiate through them
    assert [s.position_free for s in sites] == [("x",), (), (), ()]


def test_jobs_are_the_generated_launches_of_every_training_pass(small_model):
    ops = model_ops(small_model)
    jobs, in_process = kernel_jobs(ops, "float32")
    generated_launches = set()
    for site in ops:
        for _, p in training_ops(site.op, site.position_free):
            for launch in launches(p, "float32", site.channels):
                if launch.plan is not None and launch.variant == "unrolled":
                    generated_launches.add(sys.modules[launch.plan[0].py_func.__module__].__file__)
    assert {j.path for j in jobs} == generated_launches and len(jobs) >= len(generated_launches) > 0
    assert all(Path(j.path).is_file() and Path(j.path).parent == generated.source_dir() for j in jobs)
    assert [j.terms for j in jobs] == sorted((j.terms for j in jobs), reverse=True)  # longest first
    # the per-species sums of weight gradients are numba closures kept in memory: they compile where they launch
    assert in_process and all("d(W)" in label for label, _, _ in in_process)


_TRACE = r"""
import hashlib, json, os, sys
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"; os.environ["WORKBENCH_KERNELS_CUDASIM"] = "1"
import torch
sys.path.insert(0, "tests")
from workbench.kernels.numba.gpu import unrolled
seen, digest, compile_one = [], {}, unrolled._compile.__wrapped__
def recorded(source):
    kernel = compile_one(source)
    digest[id(kernel)] = hashlib.sha1(source.encode()).hexdigest()
    seen.append(digest[id(kernel)])
    return kernel
unrolled._compile = recorded
from kernel_fixtures import build_model, random_batch
from workbench.kernels import accelerate
from workbench.kernels.launches import launches, training_ops
from workbench.kernels.acceleration import model_ops
model = accelerate(build_model("ScaleShiftMACE", "4x0e+4x1o", 2, 2, 3, dtype=torch.float32), precompile=False)
batch = random_batch(3, dtype=torch.float32)
out = model(dict(batch), training=True, compute_force=True)
(out["energy"].pow(2).mean() + out["forces"].pow(2).mean()).backward()
launched, planned = set(seen), set()
for site in model_ops(model):
    for _, op in training_ops(site.op, site.position_free):
        planned |= {digest[id(la.plan[0])] for la in launches(op, "float32", site.channels) if la.variant == "unrolled"}
print(json.dumps({"launched": sorted(launched), "planned": sorted(planned)}))
"""


def test_precompile_plans_exactly_the_kernels_a_training_step_launches():
    """A real force-training step (the CUDA kernels in numba's simulator) asks for the same generated
    kernels as precompile plans: none compiles at the first step, none is compiled for nothing."""
    res = subprocess.run(
        [sys.executable, "-c", _TRACE],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # four ops: forward, the forces' backward (no per-species weights, no position-free operand),
    # the loss's full backward where the forces skipped operands, the double backward
    assert len(got["launched"]) == 16
    assert got["launched"] == got["planned"]


def test_argument_types_survive_the_trip_to_a_worker(small_model):
    import numba

    jobs, _ = kernel_jobs(model_ops(small_model), "float32")
    for job in jobs:
        types = decode_types(job.signature)
        assert encode_types(types) == job.signature
        assert all(isinstance(t, (numba.types.Array, numba.types.Integer)) for t in types)
    with pytest.raises(TypeError, match="cannot name kernel argument type"):
        encode_types([numba.types.float32[:, :].dtype, numba.typeof((1, 2))])


def test_kernel_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(tmp_path / "shared"))
    assert generated.source_dir() == tmp_path / "shared"
    monkeypatch.delenv("WORKBENCH_KERNEL_CACHE")
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "c"))
    assert generated.source_dir() == tmp_path / "c" / "kernels"


def test_markers_name_the_target_and_the_compiler():
    assert target_id("ptx", (9, 0)).startswith("ptxas-sm90-numba-cuda-")
    assert target_id("device", (8, 0)).startswith("sm80-numba-cuda-")
    with pytest.raises(ValueError, match="choose 'device' or 'ptx'"):
        precompile([], "float32", target="cubin")


def _precompile_cli(cache: Path, out: Path) -> subprocess.Popen:
    options = ("--elements", 3, "--target", "ptx", "--modules", "products.0.", "--workers", 2)
    cmd = workbench_command("kernels", "precompile", *MODEL_OPTIONS, *options, "--cache", cache, "--json", out)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def test_processes_of_a_node_compile_each_kernel_once(tmp_path):
    """Two ranks start together on one cache: one compiles every kernel, the other waits on the
    lock and finds them all done; a third process later compiles nothing."""
    cache = tmp_path / "kernels"
    procs = [_precompile_cli(cache, tmp_path / f"rank{k}.json") for k in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    reports = [json.loads((tmp_path / f"rank{k}.json").read_text())["reports"]["float32"] for k in range(2)]
    jobs = reports[0]["jobs"]
    # products.0: forward, backward, double backward and the forces' backward (d(x) alone), one kernel each
    assert jobs == reports[1]["jobs"] == 4
    assert sorted(r["compiled"] for r in reports) == [0, jobs]
    assert sorted(r["cached"] for r in reports) == [0, jobs]
    assert all(not r["errors"] for r in reports)
    assert len(list((cache / "ready").glob("ptxas-sm90-*/*"))) == jobs
    later = _precompile_cli(cache, tmp_path / "later.json")
    later.communicate(timeout=600)
    again = json.loads((tmp_path / "later.json").read_text())["reports"]["float32"]
    assert (again["compiled"], again["cached"], again["workers"]) == (0, jobs, 0)


def test_a_kernel_that_fails_to_compile_is_reported_not_raised(small_model, tmp_path, monkeypatch):
    from workbench.kernels import precompile as pc

    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(tmp_path / "k"))
    jobs, in_process = kernel_jobs(model_ops(small_model)[3:], "float32")  # products.1
    bad_source = tmp_path / "workbench_unrolled_broken.py"
    bad_source.write_text(Path(jobs[-1].path).read_text().replace("def kernel(", "def kernel(one_too_many, ", 1))
    bad = pc.KernelJob(str(bad_source), jobs[-1].signature, "a broken kernel", 1)
    monkeypatch.setattr(pc, "kernel_jobs", lambda *a, **k: (jobs + [bad], in_process))
    report = precompile_model(small_model, target="ptx", modules=("products.1.",), workers=2, progress=False)
    assert report.jobs == len(jobs) + 1
    assert report.compiled == len(jobs)
    assert [label for label, _ in report.errors] == ["a broken kernel"]
    assert "TypingError" in report.errors[0][1] or "arguments" in report.errors[0][1]
    ready = list((tmp_path / "k" / "ready").glob("*/*"))
    assert len(ready) == len(jobs)  # no marker for the kernel that failed: it compiles again at its launch


def test_precompile_model_refuses_a_cpu_model_for_the_device_target(small_model):
    with pytest.raises(ValueError, match="not on a CUDA device"):
        precompile_model(small_model)


def test_train_config_kernel_cache_is_one_line():
    from workbench.train.config import TrainConfig
    from workbench.train.values import ConfigError

    assert TrainConfig(kernel_cache="/shared/kernels").kernel_cache == "/shared/kernels"
    with pytest.raises(ConfigError, match="TrainConfig.kernel_cache"):
        TrainConfig(kernel_cache="/a\nrm -rf /")


def test_cold_start_bench_times_the_compile_from_an_empty_cache(tmp_path):
    """``workbench bench cold-start`` without a GPU: PTX + ptxas of every kernel from an empty cache,
    then the same cache again (nothing left to compile), each in a fresh process; JSON per machine."""
    out = tmp_path / "cold_start.json"
    options = ("--atoms", 48, "--target", "ptx", "--workers", 2, "--name", "ci", "--out", out)
    res = run_workbench("bench", "cold-start", *MODEL_OPTIONS, *options)
    assert res.returncode == 0, res.stderr[-3000:]
    entry = json.loads(out.read_text())["machines"]["ci"]
    cold, warm = entry["runs"]["cold"], entry["runs"]["warm"]
    assert entry["seconds"] == cold["seconds"] > 0 and entry["target_s"] == 60.0
    assert (cold["precompile"]["jobs"], cold["precompile"]["compiled"], cold["precompile"]["workers"]) == (16, 16, 2)
    assert (warm["precompile"]["compiled"], warm["precompile"]["cached"]) == (0, 16)
    assert warm["seconds"] < cold["seconds"]
    assert "target <= 60 s" in res.stdout


def test_workers_of_a_rank_compile_on_its_own_gpu(monkeypatch):
    from workbench.kernels.precompile import _visible_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _visible_device(3) == "3" and _visible_device(None) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert _visible_device(1) == "5"
    assert _visible_device(6) is None  # an index the mask does not hold: leave the environment alone
