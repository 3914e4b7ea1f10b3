"""``workbench bench cpu``: MACE on a CPU, mace-torch's e3nn modules against the workbench kernels.

Parts (``--parts``):

* ``steps`` - an MD step (energy and forces, parameters frozen as mace's ``MACECalculator``
  freezes them), a training step (energy + force loss, gradients to every parameter) and a
  training step with stress (energy + force + stress loss: the stress differentiates through
  mace's displacement, its loss once more to the weights), e3nn and numba timed interleaved in one process (e3nn, numba, e3nn, numba, ... so that machine
  noise hits both), median of ``repeats`` after a warm-up step each. Models: the paper
  configuration (128x0e+128x1o, max_ell 3, correlation 3) and a small one (32x0e+32x1o,
  max_ell 2, correlation 2); systems: periodic liquid water of 96, 384 and 768 atoms, a
  strained CuNi crystal of 256 atoms and a mixed batch of the embedded data (random graphs of
  every family, packed to 768 atoms); float32 and float64.
* ``ops`` - per hot op (symmetric contraction, channelwise TP), in one numba MD and train step:
  seconds in the op over all its passes, the descriptor's floating-point work (multiplies and
  adds of the term-by-term form) and what the vector programs execute, as GFLOP/s against the
  machine's measured matrix-multiply peak (``torch.mm``, same dtype and threads).
* ``profile`` - where a step's time goes (torch profiler, self CPU time by category) for both
  backends.
* ``trajectory`` - the paper's Figure 9 check on a CPU: ``steps`` training steps of the same
  run with ``backend="e3nn"`` and ours (``numba``) (same seed, data and batches), compared step by
  step: float64 must agree to :data:`FLOAT64_RTOL` relative, float32 to :data:`FLOAT32_RTOL`
  (float32 noise: the two backends sum in different orders, and training amplifies a rounding
  difference step by step; for scale, e3nn's own float32 run drifts from its float64 run by tens
  of percent within 100 steps, which the JSON records). ``--out`` gets a ``.html`` twin with
  both curves. The full preset trains on the whole embedded mixture, the smoke preset on its
  small-structure families (water clusters, HEA).
* ``md`` - an MD step through ASE calculators: mace-torch's on e3nn, ours, and the peers a user
  would install instead (Symmetrix-XL), each with its agreement with e3nn
  (:mod:`workbench.bench.cpu_md`).
* ``compiled`` - ``torch.compile`` of the accelerated model against eager, MD and train steps
  (:mod:`workbench.bench.cpu_compiled`; ``compiler``: ``inductor``, ``aot_eager``).
* ``families`` - NequIP and Allegro MD and train steps against their own path
  (:mod:`workbench.bench.nequip_env`: run in the NequIP environment's interpreter,
  ``nequip_python``, since the two families cannot share one environment).

The table and JSON go to stdout and ``--out``; the JSON is rewritten after every case.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workbench.bench.cpu_tables import format_table
from workbench.bench.table import cpu_name, run_versions, write_json
from workbench.bench.workloads import MODELS, model_cutoff, system_batch
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["PARTS", "PRESETS", "bench_cpu", "format_table", "hot_op_timer", "peak_gflops", "step_profile"]

PARTS = ("steps", "ops", "profile", "trajectory", "families", "md", "compiled")
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        models=("paper", "small"),
        systems=("water-96", "water-384", "water-768", "crystal-256", "mixed"),
        dtypes=("float32", "float64"),
        repeats=3,
        trajectory_steps=100,
        trajectory_families=None,  # the whole embedded mixture
        families={"configs": ("tutorial", "large"), "dtypes": ("float32", "float64"), "repeats": 5, "repeat": 4},
        md={"models": ("paper",), "systems": ("water-96", "water-384", "water-1536"), "repeats": 5},
        compiled={
            "models": ("paper",),
            "systems": ("water-96", "water-384"),
            "dtypes": ("float32",),
            "repeats": 5,
            "compiler": "inductor",
        },
    ),
    "smoke": dict(
        models=("small",),
        systems=("water-24", "crystal-32"),
        dtypes=("float32", "float64"),
        repeats=1,
        trajectory_steps=6,
        # small structures only: the whole mixture's 768-atom water boxes made a smoke step ~25 s
        trajectory_families=("water_clusters", "hea"),
        families={"configs": ("tutorial",), "dtypes": ("float64",), "repeat": 1, "repeats": 1},
        md={"models": ("small",), "systems": ("water-24",), "repeats": 1},
        # aot_eager: the plumbing and the agreement, without inductor's minutes of C++ compiling
        compiled={
            "models": ("small",),
            "systems": ("water-24",),
            "dtypes": ("float64",),
            "repeats": 1,
            "compiler": "aot_eager",
        },
    ),
}
#: targets (paper config, float32 and float64): speed-up of numba over e3nn
TARGETS = {
    ("md", "float32"): 4.0,
    ("train", "float32"): 3.0,
    ("md", "float64"): 3.0,
    ("train", "float64"): 3.0,
    ("stress", "float32"): 3.0,
}


def _models(model: str, zs: list[int], info: dict, dtype: str) -> dict[str, Any]:
    """``{(backend, kind): model}``: e3nn and numba, an MD copy (frozen) and a training copy."""
    import torch

    from workbench.bench.harness import with_backend
    from workbench.kernels.tools.models import random_scaleshift_mace

    hidden, ell, corr = MODELS[model]
    neighbours = info["edges"] / max(info["atoms"], 1)
    base = random_scaleshift_mace(
        hidden, ell, corr, zs, neighbours, getattr(torch, dtype), "cpu", r_max=model_cutoff(model)
    )
    out = {}
    for backend in ("e3nn", DEFAULT_BACKEND):
        m = with_backend(base, backend)
        frozen = copy.deepcopy(m)
        for p in frozen.parameters():
            p.requires_grad_(False)
        out[(backend, "md")] = frozen
        out[(backend, "train")] = m
    return out


def md_step(model, batch: dict):
    """Energy and forces, as an MD code asks for them."""
    out = model({k: v.clone() for k, v in batch.items()}, training=False, compute_force=True)
    return out["forces"]


def train_step(model, batch: dict):
    """Energy + force loss and its gradient to every parameter (forces differentiate twice)."""
    model.zero_grad(set_to_none=True)
    out = model({k: v.clone() for k, v in batch.items()}, training=True, compute_force=True)
    loss = out["energy"].pow(2).mean() + out["forces"].pow(2).mean()
    loss.backward()
    return loss


def stress_step(model, batch: dict):
    """Energy + force + stress loss and its gradient to every parameter (a foundation model's step)."""
    model.zero_grad(set_to_none=True)
    out = model({k: v.clone() for k, v in batch.items()}, training=True, compute_force=True, compute_stress=True)
    loss = out["energy"].pow(2).mean() + out["forces"].pow(2).mean() + out["stress"].pow(2).mean()
    loss.backward()
    return loss


STEPS = {"md": md_step, "train": train_step, "stress": stress_step}
#: which copy of the model each step runs: MD on the frozen one, the training steps on the other
STEP_MODEL = {"md": "md", "train": "train", "stress": "train"}


def peak_gflops(dtype: str, n: int = 1536, repeats: int = 5) -> float:
    """The machine's measured dense peak: ``torch.mm`` of two ``n x n`` matrices, GFLOP/s."""
    import torch

    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


@contextmanager
def hot_op_timer() -> Iterator[dict]:
    """Time every evaluation of the workbench ops while active: ``{op: {"s", "flops",
    "program_flops", "calls"}}`` with op ``"symmetric_contraction"`` or ``"channelwise_tp"``;
    flops count every pass (forward, backward, double backward) on its rows."""
    from workbench.kernels import ops as kops
    from workbench.kernels.numba.dispatch import cpu_plan

    stats: dict[str, dict[str, float]] = {}
    original = kops.PolyOp.evaluate_rows

    def timed(self, tensors, index, *args, **kwargs):
        t = time.perf_counter()
        out = original(self, tensors, index, *args, **kwargs)
        dt = time.perf_counter() - t
        name = "channelwise_tp" if self.edge else "symmetric_contraction"
        rows = index.num_edges if self.edge else int(index.species.shape[0])
        channels = self.channels if self.edge else tensors[0].shape[1] // self.operands[0].size
        rec = stats.setdefault(name, {"s": 0.0, "flops": 0.0, "program_flops": 0.0, "calls": 0})
        rec["s"] += dt
        rec["calls"] += 1
        rec["flops"] += rows * channels * sum(c.poly.flops_per_channel() for c in self.compiled)
        if tensors[0].device.type == "cpu":
            rec["program_flops"] += (
                rows * channels * sum(rp.program.flops_per_channel() for _, rp in cpu_plan(self, channels).passes)
            )
        return out

    kops.PolyOp.evaluate_rows = timed
    try:
        yield stats
    finally:
        kops.PolyOp.evaluate_rows = original


_CATEGORIES = (
    ("workbench ops", ("_SparsePolyFunction",)),
    (
        "matrix products (radial MLP, linears, e3nn TP)",
        ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::baddbmm"),
    ),
    (
        "elementwise",
        (
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::div",
            "aten::silu",
            "aten::sigmoid",
            "aten::pow",
            "aten::neg",
            "aten::sqrt",
            "aten::sin",
            "aten::cos",
            "aten::exp",
            "aten::where",
            "aten::clamp",
        ),
    ),
    (
        "copies and gathers",
        (
            "aten::copy_",
            "aten::cat",
            "aten::index",
            "aten::gather",
            "aten::scatter_add_",
            "aten::index_select",
            "aten::_index_put_impl_",
            "aten::index_add_",
            "aten::stack",
        ),
    ),
    ("fills", ("aten::fill_", "aten::zero_", "aten::zeros", "aten::ones")),
    ("reductions", ("aten::sum", "aten::mean", "aten::norm")),
)


def step_profile(model, batch: dict, step: str) -> dict[str, float]:
    """Share of one step's self CPU time by category (:data:`_CATEGORIES`, the rest is
    ``"other (autograd engine, views, Python)"``), and the step's profiled total in ms."""
    from torch.profiler import ProfilerActivity, profile

    STEPS[step](model, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        STEPS[step](model, batch)
    totals: dict[str, float] = {}
    total = 0.0
    for ev in prof.key_averages():
        t = ev.self_cpu_time_total
        total += t
        cat = next(
            (c for c, names in _CATEGORIES if any(ev.key.startswith(n) for n in names)),
            "other (autograd engine, views, Python)",
        )
        totals[cat] = totals.get(cat, 0.0) + t
    shares = {k: v / total for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    shares["total_ms"] = total / 1e3
    return shares


def _time_case(models: dict, batch: dict, repeats: int) -> dict:
    times: dict[str, list[float]] = {}
    for step in STEPS:
        for backend in ("e3nn", DEFAULT_BACKEND):
            STEPS[step](models[(backend, STEP_MODEL[step])], batch)  # warm-up: numba compiles, caches fill
    for _ in range(repeats):
        for step in STEPS:
            for backend in ("e3nn", DEFAULT_BACKEND):
                t = time.perf_counter()
                STEPS[step](models[(backend, STEP_MODEL[step])], batch)
                times.setdefault(f"{backend}_{step}", []).append(time.perf_counter() - t)
    res = {k: {"median_ms": 1e3 * statistics.median(v), "runs_ms": [1e3 * x for x in v]} for k, v in times.items()}
    for step in STEPS:
        res[f"speedup_{step}"] = res[f"e3nn_{step}"]["median_ms"] / res[f"{DEFAULT_BACKEND}_{step}"]["median_ms"]
    return res


def _ops_case(models: dict, batch: dict, peak: float) -> dict:
    out = {}
    for step in STEPS:
        STEPS[step](models[(DEFAULT_BACKEND, STEP_MODEL[step])], batch)
        t = time.perf_counter()
        with hot_op_timer() as stats:
            STEPS[step](models[(DEFAULT_BACKEND, STEP_MODEL[step])], batch)
        total = time.perf_counter() - t
        out[step] = {"step_ms": 1e3 * total}
        for name, rec in stats.items():
            out[step][name] = {
                "ms": 1e3 * rec["s"],
                "share": rec["s"] / total,
                "calls": rec["calls"],
                "gflops": rec["flops"] / rec["s"] / 1e9,
                "program_gflops": rec["program_flops"] / rec["s"] / 1e9,
                "of_peak": rec["flops"] / rec["s"] / 1e9 / peak,
            }
    return out


def _resolve(preset: str, parts: Sequence[str], models, systems, dtypes, repeats) -> dict[str, Any]:
    """The preset's settings with what was given instead; unknown names are an error."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}")
    p = PRESETS[preset]
    s = {
        "models": tuple(models or p["models"]),
        "systems": tuple(systems or p["systems"]),
        "dtypes": tuple(dtypes or p["dtypes"]),
        "repeats": repeats or p["repeats"],
    }
    for m in s["models"]:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    return s


def _cases(res: dict, s: dict, parts: Sequence[str], out: Path) -> None:
    """The ``steps`` and ``ops`` parts: one case per (model, system, dtype), saved after each."""
    from workbench.progress import bar

    cases = [(m, y, d) for m in s["models"] for y in s["systems"] for d in s["dtypes"]]
    progress = bar(total=len(cases), desc="bench cpu", unit="case")
    for model, system, dtype in cases:
        batch, zs, info = system_batch(system, dtype, model=model)
        ms = _models(model, zs, info, dtype)
        case = {"model": model, "system": system, "dtype": dtype, **info}
        if "steps" in parts:
            case.update(_time_case(ms, batch, s["repeats"]))
        if "ops" in parts:
            case["ops"] = _ops_case(ms, batch, res["peak_gflops"][dtype])
        res["cases"].append(case)
        write_json(out, res)
        progress.update(1)
        del ms
    progress.close()


def _profile(s: dict) -> dict:
    """The ``profile`` part on the first model, system and dtype."""
    model, system, dtype = s["models"][0], s["systems"][0], s["dtypes"][0]
    batch, zs, info = system_batch(system, dtype, model=model)
    ms = _models(model, zs, info, dtype)
    return {
        "model": model,
        "system": system,
        "dtype": dtype,
        **{f"{b}_{k}": step_profile(ms[(b, k)], batch, k) for b in ("e3nn", DEFAULT_BACKEND) for k in ("md", "train")},
    }


def bench_cpu(
    preset: str = "full",
    parts: Sequence[str] = PARTS,
    models: Sequence[str] | None = None,
    systems: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    repeats: int | None = None,
    trajectory_steps: int | None = None,
    threads: int = 2,
    out: str | os.PathLike = "runs/bench/cpu.json",
    workdir: str | os.PathLike = "runs/bench/cpu",
    nequip_python: str | os.PathLike | None = None,
    keep_memory: bool = False,
    md_calculators: Sequence[str] | None = None,
    compiler: str | None = None,
) -> dict:
    """Run the parts of the benchmark (see the module docstring) and write ``out`` after each case.
    ``md_calculators``: the md part's rows (:data:`~workbench.bench.cpu_md.CALCULATORS`, all by default);
    ``compiler``: the compiled part's ``torch.compile`` backend (default: the preset's)."""
    from workbench.bench.harness import set_threads
    from workbench.bench.nequip_env import check_python, run_families

    md_rows = _md_rows(md_calculators)  # refused before hours of other parts
    s = _resolve(preset, parts, models, systems, dtypes, repeats)
    if nequip_python is not None and "families" in parts:
        check_python(nequip_python)  # before hours of other parts
    set_threads(threads)
    res: dict[str, Any] = {
        "preset": preset,
        "threads": threads,
        "machine": _machine(),
        "cases": [],
        "targets": {f"{k[0]}_{k[1]}": v for k, v in TARGETS.items()},
    }
    out = Path(out)
    if "ops" in parts:
        res["peak_gflops"] = {d: peak_gflops(d) for d in s["dtypes"]}
    if {"steps", "ops"} & set(parts):
        _cases(res, s, parts, out)
    if "profile" in parts:
        res["profile"] = _profile(s)
        write_json(out, res)
    if "trajectory" in parts:
        _trajectory(res, PRESETS[preset], trajectory_steps, s["dtypes"], workdir, out)
    if "md" in parts:
        md = dict(PRESETS[preset]["md"], **({"repeats": repeats} if repeats else {}))
        res["keep_memory"] = keep_memory
        res["md_calculators"] = md_rows
        _md(res, md, models, systems, s["dtypes"], Path(workdir), out)
    if "compiled" in parts:
        p = dict(PRESETS[preset]["compiled"], **({"compiler": compiler} if compiler else {}))
        _compiled(res, p, models, systems, repeats, out)
    if "families" in parts:  # last: nequip sets global torch state in this process
        res["families"] = run_families(PRESETS[preset]["families"], threads, nequip_python)
        write_json(out, res)
    return res


def _trajectory(res: dict, p: dict, steps: int | None, dtypes, workdir, out: Path) -> None:
    """The ``trajectory`` part, and its figure beside ``out`` as .html."""
    from workbench.bench.cpu_trajectory import trajectory, trajectory_figure

    res["trajectory"] = trajectory(steps or p["trajectory_steps"], dtypes, workdir, p["trajectory_families"])
    html = out.with_suffix(".html")
    trajectory_figure(res["trajectory"], html)
    res["trajectory"]["figure"] = str(html)
    write_json(out, res)


def _md_rows(names: Sequence[str] | None) -> list[str]:
    """The md part's rows: ``names``, checked, or every calculator."""
    from workbench.bench.cpu_md import CALCULATORS

    unknown = sorted(set(names or ()) - set(CALCULATORS))
    if unknown:
        raise ValueError(f"md calculators {', '.join(unknown)}: the choices are {', '.join(CALCULATORS)}")
    return list(names or CALCULATORS)


def _md(res: dict, p: dict, models, systems, dtypes, workdir: Path, out: Path) -> None:
    """The ``md`` part: the preset's models and systems unless given, saved after each case."""
    from workbench.bench.cpu_md import md_case

    # the peers run OpenMP runtimes of their own, which read this when they load: --threads for all
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(res["threads"])
    try:
        res["md"] = []
        for model, system, dtype in [
            (m, y, d) for m in models or p["models"] for y in systems or p["systems"] for d in dtypes
        ]:
            keep, rows = res["keep_memory"], res["md_calculators"]
            res["md"].append(md_case(model, system, dtype, p["repeats"], workdir / "md", rows, keep_memory=keep))
            write_json(out, res)
    finally:  # the setting stays with this part
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _compiled(res: dict, p: dict, models, systems, repeats: int | None, out: Path) -> None:
    """The ``compiled`` part: the preset's models, systems and dtypes unless given, saved after each case."""
    from workbench.bench.cpu_compiled import compiled_case

    res["compiled"] = []
    for model in models or p["models"]:
        for system in systems or p["systems"]:
            for dtype in p["dtypes"]:
                res["compiled"].append(compiled_case(model, system, dtype, repeats or p["repeats"], p["compiler"]))
                write_json(out, res)


def _machine() -> dict:
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": run_versions(),
    }
