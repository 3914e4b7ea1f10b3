"""``workbench bench cpu``: MACE on a CPU, mace-torch's e3nn modules against the workbench kernels.

Parts (``--parts``):

* ``steps`` - an MD step (energy and forces, parameters frozen as mace's ``MACECalculator``
  freezes them) and a training step (energy + force loss, gradients to every parameter), e3nn
  and numba timed interleaved in one process (e3nn, numba, e3nn, numba, ... so that machine
  noise hits both), median of ``repeats`` after a warm-up step each. Models: the paper
  configuration (128x0e+128x1o, max_ell 3, correlation 3) and a small one (32x0e+32x1o,
  max_ell 2, correlation 2); systems: periodic liquid water of 96, 384 and 768 atoms and a
  mixed batch of the embedded data (random graphs of every family, packed to 768 atoms);
  float32 and float64.
* ``ops`` - per hot op (symmetric contraction, channelwise TP), in one numba MD and train step:
  seconds in the op over all its passes, the descriptor's floating-point work (multiplies and
  adds of the term-by-term form) and what the vector programs execute, as GFLOP/s against the
  machine's measured matrix-multiply peak (``torch.mm``, same dtype and threads).
* ``profile`` - where a step's time goes (torch profiler, self CPU time by category) for both
  backends.
* ``trajectory`` - the paper's Figure 9 check on a CPU: ``steps`` training steps of the same
  run with ``backend="e3nn"`` and ``"numba"`` (same seed, data and batches), compared step by
  step: float64 must agree to :data:`FLOAT64_RTOL` relative, float32 to :data:`FLOAT32_RTOL`
  (float32 noise: the two backends sum in different orders, and training amplifies a rounding
  difference step by step; for scale, e3nn's own float32 run drifts from its float64 run by tens
  of percent within 100 steps, which the JSON records). ``--out`` gets a ``.html`` twin with
  both curves.

The table and JSON go to stdout and ``--out``; the JSON is rewritten after every case.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MODELS",
    "PARTS",
    "PRESETS",
    "bench_cpu",
    "format_table",
    "hot_op_timer",
    "mace_batch",
    "peak_gflops",
    "system_batch",
    "water_box",
]

#: name -> (hidden irreps, max_ell, correlation)
MODELS: dict[str, tuple[str, int, int]] = {"paper": ("128x0e+128x1o", 3, 3), "small": ("32x0e+32x1o", 2, 2)}
PARTS = ("steps", "ops", "profile", "trajectory")
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(
        models=("paper", "small"),
        systems=("water-96", "water-384", "water-768", "mixed"),
        dtypes=("float32", "float64"),
        repeats=3,
        trajectory_steps=100,
    ),
    "smoke": dict(
        models=("small",), systems=("water-24",), dtypes=("float32", "float64"), repeats=1, trajectory_steps=6
    ),
}
#: float32 trajectories: relative loss difference allowed per step (about 800 float32 ulps; measured
#: over 100 steps of the small model: 2.4e-7)
FLOAT32_RTOL = 1e-4
#: float64 trajectories: relative loss difference allowed per step
FLOAT64_RTOL = 1e-8
CUTOFF = 4.5
#: atoms of the ``mixed`` batch
MIXED_CAPACITY = 768
#: targets of the issue (paper config, float32 and float64): speed-up of numba over e3nn
TARGETS = {("md", "float32"): 4.0, ("train", "float32"): 3.0, ("md", "float64"): 3.0, ("train", "float64"): 3.0}


def mace_batch(structures: Sequence, dtype: str, cutoff: float = CUTOFF, z_table=None) -> tuple[dict, list[int]]:
    """One mace batch dict of ``structures`` (tensors in ``dtype``, mace's own ``AtomicData`` and
    collation) and the atomic numbers of its ``z_table`` (default: the elements present)."""
    import torch
    from mace.tools import torch_geometric

    from workbench.data.atomic_data import to_atomic_data, z_table_for

    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        z_table = z_table_for(structures) if z_table is None else z_table
        data = to_atomic_data(structures, cutoff=cutoff, z_table=z_table)
        batch = torch_geometric.batch.Batch.from_data_list(data).to_dict()
    finally:
        torch.set_default_dtype(old)
    return batch, [int(z) for z in z_table.zs]


#: atoms of the largest liquid-water box :func:`~workbench.data.generators.build_liquid_water`
#: fills (343 grid sites); larger boxes repeat a :data:`WATER_TILE`-atom box periodically
WATER_MAX_ATOMS = 1029
WATER_TILE = 768


def water_box(n: int, rng: np.random.Generator):
    """A periodic liquid-water box of ``n`` atoms: generated directly up to
    :data:`WATER_MAX_ATOMS`, else a :data:`WATER_TILE`-atom box repeated (``n / WATER_TILE`` a
    product of the three repeat counts, as cubic as possible)."""
    from workbench.data.generators import build_liquid_water

    if n % 3 or n < 3:
        raise ValueError(f"system water-{n}: a water box needs a multiple of 3 atoms")
    if n <= WATER_MAX_ATOMS:
        return build_liquid_water(n, rng)
    if n % WATER_TILE:
        raise ValueError(
            f"system water-{n}: boxes above {WATER_MAX_ATOMS} atoms repeat a {WATER_TILE}-atom box; "
            f"use a multiple of {WATER_TILE}"
        )
    k, reps, f = n // WATER_TILE, [1, 1, 1], 2
    while k > 1:  # prime factors, smallest first, each onto the shortest side
        while k % f == 0:
            k //= f
            reps[reps.index(min(reps))] *= f
        f += 1
    return build_liquid_water(WATER_TILE, rng).repeat(tuple(reps))


def system_batch(name: str, dtype: str, cutoff: float = CUTOFF, seed: int = 0) -> tuple[dict, list[int], dict]:
    """A mace batch for ``name`` (``water-<atoms>``: a periodic liquid-water box, see
    :func:`water_box`; ``mixed``: a batch of the embedded data as a packer fills it, random graphs
    while they fit in :data:`MIXED_CAPACITY` atoms), its atomic numbers and ``{atoms, edges,
    graphs, families}``."""
    rng = np.random.default_rng(seed)
    if name.startswith("water-"):
        structures = [water_box(int(name.split("-", 1)[1]), rng)]
    elif name == "mixed":
        from workbench.data.embedded import load_embedded

        frames = load_embedded(validate=False)
        structures, room = [], MIXED_CAPACITY
        for k in rng.permutation(len(frames)):  # a packed batch: random graphs while they fit
            if len(frames[k]) <= room:
                structures.append(frames[k])
                room -= len(frames[k])
    else:
        raise ValueError(f"unknown system {name!r}: use water-<atoms> (a multiple of 3) or mixed")
    batch, zs = mace_batch(structures, dtype, cutoff)
    info = {
        "atoms": int(batch["positions"].shape[0]),
        "edges": int(batch["edge_index"].shape[1]),
        "graphs": len(structures),
        "families": sorted({a.info.get("config_type", "?") for a in structures}),
    }
    return batch, zs, info


def _models(model: str, zs: list[int], info: dict, dtype: str) -> dict[str, Any]:
    """``{(backend, kind): model}``: e3nn and numba, an MD copy (frozen) and a training copy."""
    import torch

    from workbench.kernels.tools.bench import random_scaleshift_mace, with_backend

    hidden, ell, corr = MODELS[model]
    base = random_scaleshift_mace(
        hidden, ell, corr, zs, info["edges"] / max(info["atoms"], 1), getattr(torch, dtype), "cpu"
    )
    out = {}
    for backend in ("e3nn", "numba"):
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


STEPS = {"md": md_step, "train": train_step}


def set_threads(threads: int) -> None:
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


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

    stats: dict[str, dict[str, float]] = {}
    original = kops.PolyOp.evaluate_rows

    def timed(self, tensors, index):
        t = time.perf_counter()
        out = original(self, tensors, index)
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
                rows * channels * sum(rp.program.flops_per_channel() for _, rp in self.cpu_plan(channels).passes)
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
        for backend in ("e3nn", "numba"):
            STEPS[step](models[(backend, step)], batch)  # warm-up: numba compiles, caches fill
    for _ in range(repeats):
        for step in STEPS:
            for backend in ("e3nn", "numba"):
                t = time.perf_counter()
                STEPS[step](models[(backend, step)], batch)
                times.setdefault(f"{backend}_{step}", []).append(time.perf_counter() - t)
    res = {k: {"median_ms": 1e3 * statistics.median(v), "runs_ms": [1e3 * x for x in v]} for k, v in times.items()}
    for step in STEPS:
        res[f"speedup_{step}"] = res[f"e3nn_{step}"]["median_ms"] / res[f"numba_{step}"]["median_ms"]
    return res


def _ops_case(models: dict, batch: dict, peak: float) -> dict:
    out = {}
    for step in STEPS:
        STEPS[step](models[("numba", step)], batch)
        t = time.perf_counter()
        with hot_op_timer() as stats:
            STEPS[step](models[("numba", step)], batch)
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


def trajectory(steps: int, dtypes: Sequence[str], workdir: str | os.PathLike) -> dict:
    """The Figure 9 check: the same short training run with e3nn and numba, losses per step."""
    from workbench.train import TrainConfig, train
    from workbench.train.metrics import read_steps

    losses: dict[str, list[float]] = {}
    hidden, ell, corr = MODELS["small"]
    wanted = list(dtypes) + (["float64"] if "float32" in dtypes and "float64" not in dtypes else [])
    for dtype in wanted:
        for backend in ("e3nn", "numba"):
            if dtype not in dtypes and backend == "numba":
                continue
            cfg = TrainConfig(
                name=f"trajectory-{dtype}-{backend}",
                output_dir=str(workdir),
                hidden_irreps=hidden,
                max_ell=ell,
                correlation=corr,
                dtype=dtype,
                backend=backend,
                sampler="fixed-count",
                batch_size=8,
                max_structures=max(64, 8 * steps),
                epochs=100,
                max_steps=steps,
                checkpoint_every=0,
                progress=False,
                export=False,
                seed=0,
            )
            train(cfg, resume=False)
            losses[f"{backend}-{dtype}"] = [s["loss"] for s in read_steps(cfg.run_dir)]
    res: dict[str, Any] = {"steps": steps, "losses": losses}

    def rel(a: str, b: str) -> float:
        x, y = np.asarray(losses[a]), np.asarray(losses[b])
        return float(np.max(np.abs(x - y) / np.abs(y)))

    if "float64" in dtypes:
        d = rel("numba-float64", "e3nn-float64")
        res["float64"] = {"max_rel_diff": d, "bound": FLOAT64_RTOL, "ok": d <= FLOAT64_RTOL}
    if "float32" in dtypes:
        d = rel("numba-float32", "e3nn-float32")
        noise = rel("e3nn-float32", "e3nn-float64")
        res["float32"] = {
            "max_rel_diff": d,
            "e3nn_float32_vs_float64": noise,
            "bound": FLOAT32_RTOL,
            "ok": d <= FLOAT32_RTOL,
        }
    return res


def trajectory_figure(res: dict, path: str | os.PathLike) -> None:
    """Both loss curves per dtype, and their relative difference, as a self-contained HTML file."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    losses = res["losses"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training loss per step", "|numba - e3nn| / e3nn"))
    for name, ys in losses.items():
        fig.add_trace(
            go.Scatter(y=ys, name=name, mode="lines", line={"dash": "dot" if name.startswith("numba") else "solid"}),
            1,
            1,
        )
    for dtype in ("float32", "float64"):
        if f"numba-{dtype}" in losses and f"e3nn-{dtype}" in losses:
            x, y = np.asarray(losses[f"numba-{dtype}"]), np.asarray(losses[f"e3nn-{dtype}"])
            fig.add_trace(
                go.Scatter(y=(np.abs(x - y) / np.abs(y)).tolist(), name=f"{dtype} difference", mode="lines"), 1, 2
            )
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(
        title="Figure 9 check on a CPU: the numba kernels follow e3nn's training run", width=1300, height=480
    )
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)


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
) -> dict:
    """Run the parts of the benchmark (see the module docstring) and write ``out`` after each case."""
    from workbench.progress import bar

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}")
    p = PRESETS[preset]
    models = tuple(models or p["models"])
    systems = tuple(systems or p["systems"])
    dtypes = tuple(dtypes or p["dtypes"])
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    repeats = repeats or p["repeats"]
    set_threads(threads)
    res: dict[str, Any] = {
        "preset": preset,
        "threads": threads,
        "machine": _machine(),
        "cases": [],
        "targets": {f"{k[0]}_{k[1]}": v for k, v in TARGETS.items()},
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, out)

    if "ops" in parts:
        res["peak_gflops"] = {d: peak_gflops(d) for d in dtypes}
    cases = [(m, s, d) for m in models for s in systems for d in dtypes] if {"steps", "ops"} & set(parts) else []
    progress = bar(total=len(cases), desc="bench cpu", unit="case")
    for model, system, dtype in cases:
        batch, zs, info = system_batch(system, dtype)
        ms = _models(model, zs, info, dtype)
        case = {"model": model, "system": system, "dtype": dtype, **info}
        if "steps" in parts:
            case.update(_time_case(ms, batch, repeats))
        if "ops" in parts:
            case["ops"] = _ops_case(ms, batch, res["peak_gflops"][dtype])
        res["cases"].append(case)
        save()
        progress.update(1)
        del ms
    progress.close()
    if "profile" in parts:
        model, system, dtype = models[0], systems[0], dtypes[0]
        batch, zs, info = system_batch(system, dtype)
        ms = _models(model, zs, info, dtype)
        res["profile"] = {
            "model": model,
            "system": system,
            "dtype": dtype,
            **{f"{b}_{s}": step_profile(ms[(b, s)], batch, s) for b in ("e3nn", "numba") for s in STEPS},
        }
        save()
    if "trajectory" in parts:
        res["trajectory"] = trajectory(trajectory_steps or p["trajectory_steps"], dtypes, workdir)
        html = out.with_suffix(".html")
        trajectory_figure(res["trajectory"], html)
        res["trajectory"]["figure"] = str(html)
        save()
    return res


def _machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from workbench.kernels.tools.bench import run_versions

    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "versions": run_versions()}


def format_table(res: dict) -> str:
    """The steps table (ms, e3nn / numba, speed-up), the hot ops' GFLOP/s, the profile and the
    trajectory verdict, as text."""
    lines = []
    cases = [c for c in res["cases"] if "e3nn_md" in c]
    if cases:
        lines.append(
            f"{'model':6} {'system':10} {'dtype':8} {'atoms':>5} {'edges':>6} | {'MD e3nn':>8} {'numba':>7} {'x':>5} | "
            f"{'train e3nn':>10} {'numba':>7} {'x':>5}"
        )
        for c in cases:
            lines.append(
                f"{c['model']:6} {c['system']:10} {c['dtype']:8} {c['atoms']:5d} {c['edges']:6d} | "
                f"{c['e3nn_md']['median_ms']:8.1f} {c['numba_md']['median_ms']:7.1f} {c['speedup_md']:5.2f} | "
                f"{c['e3nn_train']['median_ms']:10.1f} {c['numba_train']['median_ms']:7.1f} {c['speedup_train']:5.2f}"
            )
    ops = [c for c in res["cases"] if "ops" in c]
    if ops:
        peak = res.get("peak_gflops", {})
        lines.append("")
        lines.append(
            "hot ops in one numba step: ms (share of the step), GFLOP/s of the term-by-term work (program's executed) "
            f"and % of the torch.mm peak ({', '.join(f'{d} {v:.0f}' for d, v in peak.items())} GFLOP/s)"
        )
        for c in ops:
            for step, rec in c["ops"].items():
                cells = [
                    f"{name.split('_')[0]}: {r['ms']:.1f} ms ({100 * r['share']:.0f}%) {r['gflops']:.1f} ({r['program_gflops']:.1f}) "
                    f"{100 * r['of_peak']:.1f}%"
                    for name, r in rec.items()
                    if isinstance(r, dict)
                ]
                lines.append(f"  {c['model']:6} {c['system']:10} {c['dtype']:8} {step:5}  " + "; ".join(cells))
    if "profile" in res:
        pr = res["profile"]
        lines.append("")
        lines.append(f"profile ({pr['model']}, {pr['system']}, {pr['dtype']}): share of self CPU time")
        keys = [k for k in pr if k.endswith(("_md", "_train"))]
        cats = sorted({c for k in keys for c in pr[k] if c != "total_ms"})
        lines.append(f"  {'':48} " + " ".join(f"{k:>12}" for k in keys))
        lines.append(f"  {'total (profiled) ms':48} " + " ".join(f"{pr[k]['total_ms']:12.1f}" for k in keys))
        for cat in cats:
            lines.append(f"  {cat:48} " + " ".join(f"{100 * pr[k].get(cat, 0.0):11.1f}%" for k in keys))
    if "trajectory" in res:
        tr = res["trajectory"]
        lines.append("")
        for dtype in ("float64", "float32"):
            if dtype in tr:
                r = tr[dtype]
                extra = f" (e3nn float32 vs float64: {r['e3nn_float32_vs_float64']:.2e})" if dtype == "float32" else ""
                lines.append(
                    f"trajectory {tr['steps']} steps, {dtype}: max |numba - e3nn| / e3nn = {r['max_rel_diff']:.2e}, "
                    f"bound {r['bound']:.2e}{extra}: {'ok' if r['ok'] else 'FAILED'}"
                )
    return "\n".join(lines)
