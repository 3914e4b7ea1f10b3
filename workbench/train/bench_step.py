"""``workbench bench step``: the whole MACE train step on one device, numba vs cuEquivariance vs e3nn.

One process, one device, the same model weights (a random-weight ``ScaleShiftMACE``, deep-copied
per backend) and the same batches for every backend. A train step is ``zero_grad``, forward with
forces (``training=True``), loss = mean(((E - E_ref) / atoms)^2) + mean((F - F_ref)^2) against the
batch's reference labels (zeros where a structure has none), ``backward`` and an Adam step
(``foreach=True``). Each backend runs ``warmup`` steps (numba compiles its CUDA kernels there),
then ``repeats`` timed steps (``torch.cuda.synchronize`` around each on CUDA), and records the
median, the minimum, every step, the peak memory of the timed steps and the loss of its first
step (identical weights and batch: it must agree across backends).

Parts (``--parts``): ``steps`` (the table above for every dtype and workload) and ``profile``
(where the numba step's time goes, :mod:`workbench.train.bench_step_profile`). Every row runs in
``try``/``except``: an error, an unavailable backend (``skipped``) or a spent ``--budget-s``
(``skipped: time budget``) is recorded and the run goes on; the JSON is rewritten after every row.

Workloads: ``water-<atoms>`` (one periodic liquid-water box, :func:`~workbench.train.bench_cpu.water_box`;
the same batch every step) and ``mixture-<capacity>`` (the embedded mixture packed by the paper's
algorithm at ``capacity`` atoms; every step its own batch, warm-up on the first ones).
"""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from workbench.train.bench_cpu import CUTOFF, MODELS, mace_batch, system_batch

__all__ = [
    "BACKENDS",
    "PARTS",
    "PRESETS",
    "bench_step",
    "default_out",
    "format_table",
    "make_optimizer",
    "mixture_batches",
    "step_loss",
    "time_steps",
    "to_device",
    "train_step",
    "workload_batches",
]

BACKENDS = ("numba", "cueq", "e3nn")
PARTS = ("steps", "profile")
PRESETS: dict[str, dict[str, Any]] = {
    # most wanted first: a spent budget drops the tail
    # 5 warm-up steps: TorchScript optimises mace's graphs at their 3rd and 4th call (H100: ~1 s steps)
    "gpu": {
        "model": "paper",
        "workloads": ("water-3072", "mixture-3072", "water-768", "water-1536", "water-6144"),
        "dtypes": ("float32",),
        "warmup": 5,
        "repeats": 10,
        "profile_workload": "water-3072",
    },
    "smoke": {
        "model": "small",
        "workloads": ("water-24", "water-48", "mixture-96"),
        "dtypes": ("float32",),
        "warmup": 1,
        "repeats": 2,
        "profile_workload": "water-48",
    },
}
#: torch.optim.Adam's learning rate
LR = 1e-3
WORKLOAD = re.compile(r"(water|mixture)-[0-9]+")
BUDGET = "time budget"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _log(msg: str) -> None:
    print(f"[bench step] {msg}", flush=True)


# --- batches --------------------------------------------------------------------------------------


def mixture_batches(capacity: int, n_batches: int, dtype: str, seed: int = 0) -> tuple[list[dict], list[int], dict]:
    """``n_batches`` distinct mace batches of the embedded mixture, packed by ``pack(...,
    algorithm="paper")`` at ``capacity`` atoms (the fullest bins first, as the packer orders them),
    with one z_table over all of them; ``info``: mean atoms/edges per batch and the packing."""
    from workbench.data.embedded import load_embedded
    from workbench.packing import pack
    from workbench.train.bench import bench_structures

    def eligible(frames: list) -> list:
        return [a for a in frames if a.info.get("labelled", True) and len(a) <= capacity]

    want = 1.5 * capacity * n_batches  # atoms in the pool: enough graphs to fill the first bins
    frames = eligible(load_embedded(validate=False))
    have = sum(len(a) for a in frames)
    if have < want:  # tile with rattled copies (bench train's mixture)
        frames = eligible(bench_structures(int(len(frames) * want / max(have, 1)) + 1, seed=seed))
    rng = np.random.default_rng(seed)
    pool, atoms = [], 0
    for k in rng.permutation(len(frames)):
        if atoms >= want:
            break
        pool.append(frames[k])
        atoms += len(frames[k])
    sizes = np.array([len(a) for a in pool], dtype=np.int64)
    packing = pack(sizes, capacity=capacity, num_replicas=1, algorithm="paper", seed=seed)
    chosen = [[pool[i] for i in b] for b in packing.batches[:n_batches]]
    if len(chosen) < n_batches:
        raise ValueError(f"mixture-{capacity}: {len(chosen)} batches packed, {n_batches} wanted")
    from workbench.data.atomic_data import z_table_for

    z_table = z_table_for(a for b in chosen for a in b)
    batches = [mace_batch(b, dtype, CUTOFF, z_table)[0] for b in chosen]
    atoms_per = [int(b["positions"].shape[0]) for b in batches]
    edges_per = [int(b["edge_index"].shape[1]) for b in batches]
    info = {
        "atoms": float(np.mean(atoms_per)),
        "edges": float(np.mean(edges_per)),
        "graphs": float(np.mean([len(b) for b in chosen])),
        "batches": n_batches,
        "capacity": capacity,
        "atoms_per_batch": atoms_per,
        "edges_per_batch": edges_per,
        "atoms_max": max(atoms_per),
        "families": sorted({a.info.get("config_type", "?") for b in chosen for a in b}),
    }
    return batches, [int(z) for z in z_table.zs], info


def workload_batches(name: str, dtype: str, n_batches: int, seed: int = 0) -> tuple[list[dict], list[int], dict]:
    """The batches a workload's steps walk (``n_batches`` of them; a water box repeats its one
    batch), its atomic numbers and ``{atoms, edges, graphs, edges_per_atom, ...}`` (per batch)."""
    if name.startswith("mixture-"):
        batches, zs, info = mixture_batches(int(name.split("-", 1)[1]), n_batches, dtype, seed)
    elif name.startswith("water-"):
        batch, zs, info = system_batch(name, dtype, seed=seed)
        batches = [batch] * n_batches
    else:
        raise ValueError(f"unknown workload {name!r}: use water-<atoms> or mixture-<capacity>")
    info["edges_per_atom"] = info["edges"] / max(info["atoms"], 1)
    return batches, zs, info


def to_device(batches: Sequence[dict], device: str) -> list[dict]:
    """``batches`` on ``device``, a batch repeated in the list moved once."""
    moved: dict[int, dict] = {}
    for b in batches:
        if id(b) not in moved:
            moved[id(b)] = {k: v.to(device) for k, v in b.items()}
    return [moved[id(b)] for b in batches]


# --- one train step -------------------------------------------------------------------------------


def make_optimizer(model):
    import torch

    return torch.optim.Adam(model.parameters(), lr=LR, foreach=True)


def step_loss(out: dict, batch: dict):
    """mean(((E - E_ref) / atoms)^2) + mean((F - F_ref)^2); the references are the batch's
    ``energy`` / ``forces`` (zeros where a structure has no label, or the keys are missing)."""
    import torch

    atoms = (batch["ptr"][1:] - batch["ptr"][:-1]).to(out["energy"].dtype)
    e_ref = batch.get("energy", torch.zeros_like(out["energy"]))
    f_ref = batch.get("forces", torch.zeros_like(out["forces"]))
    return ((out["energy"] - e_ref) / atoms).pow(2).mean() + (out["forces"] - f_ref).pow(2).mean()


def train_step(model, optimizer, batch: dict):
    """One full train step, its parts in profiler ranges ``forward``, ``backward``, ``optimizer``;
    returns the loss (a tensor: reading it would synchronise)."""
    from torch.profiler import record_function

    optimizer.zero_grad(set_to_none=True)
    with record_function("forward"):
        out = model({k: v.clone() for k, v in batch.items()}, training=True, compute_force=True)
        loss = step_loss(out, batch)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
    return loss


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(model, batches: Sequence[dict], warmup: int, repeats: int, device: str) -> dict:
    """Warm-up steps on ``batches[:warmup]``, then ``repeats`` timed steps on the next batches."""
    import torch

    optimizer = make_optimizer(model)
    loss_first = None
    for i in range(warmup):
        loss = train_step(model, optimizer, batches[i])
        if loss_first is None:
            loss_first = float(loss.detach())
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup, warmup + repeats):
        _sync(device)
        t = time.perf_counter()
        loss = train_step(model, optimizer, batches[i])
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t))
        if loss_first is None:
            loss_first = float(loss.detach())
    del optimizer
    return {
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms": times,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "loss_first": loss_first,
    }


# --- rows -----------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def backend_row(base, backend: str, batches: Sequence[dict], warmup: int, repeats: int, device: str) -> dict:
    """One backend's timings on its own copy of ``base``; an unavailable backend is ``skipped``
    (cueq: not importable or conversion failed), any other failure an ``error``."""
    from workbench.kernels.tools.bench import precompile_for_bench, with_backend

    try:
        model = with_backend(base, backend)
    except Exception as exc:
        if backend == "cueq":
            return {"skipped": f"{type(exc).__name__}: {exc}"}
        return _error(exc)
    try:
        pre = precompile_for_bench(model, backend)  # parallel, before the warm-up; instant from a warm cache
        row = time_steps(model, batches, warmup, repeats, device)
        if pre:
            row["precompile"] = {k: pre[k] for k in ("jobs", "compiled", "cached", "seconds")}
        return row
    except Exception as exc:
        return _error(exc)
    finally:
        del model
        _free(device)


def _ratio(a: dict, b: dict, key: str) -> float | None:
    x, y = a.get(key), b.get(key)
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def compare(backends: dict) -> dict:
    """Sets ``loss_rel_diff_vs_e3nn`` on each timed non-e3nn row; returns the ratios (times and
    peak memory, numba over the other: below 1 numba is faster / smaller)."""
    ref = backends.get("e3nn", {}).get("loss_first")
    for name, row in backends.items():
        if name != "e3nn" and row.get("loss_first") is not None and ref is not None:
            row["loss_rel_diff_vs_e3nn"] = abs(row["loss_first"] - ref) / max(abs(ref), 1e-300)
    numba = backends.get("numba", {})
    ratios = {}
    for other in ("cueq", "e3nn"):
        r = _ratio(numba, backends.get(other, {}), "step_ms_median")
        if r is not None:
            ratios[f"numba/{other}"] = r
    peak = _ratio(numba, backends.get("cueq", {}), "peak_mem_gb")
    if peak is not None:
        ratios["peak numba/cueq"] = peak
    return ratios


def base_model(model: str, zs: Sequence[int], info: dict, dtype: str, device: str):
    """The random-weight model every backend copies: ``MODELS[model]``, ``avg_num_neighbors`` =
    the workload's edges per atom."""
    import torch

    from workbench.kernels.tools.bench import random_scaleshift_mace

    hidden, ell, corr = MODELS[model]
    return random_scaleshift_mace(hidden, ell, corr, list(zs), info["edges_per_atom"], getattr(torch, dtype), device)


class _Run:
    """The result dict, where it is written, and the clock of the current part."""

    def __init__(self, res: dict, out: Path, budget_s: float | None):
        self.res, self.out, self.budget_s, self.t0, self.part = res, out, budget_s, time.perf_counter(), ""
        self.bases: dict[tuple, Any] = {}  # the last base model, for the next workload with the same key

    def start_part(self, name: str) -> None:
        """Start ``name``'s clock (the budget is per part); ``meta.parts_s`` records its seconds."""
        self.part, self.t0 = name, time.perf_counter()

    def end_part(self) -> None:
        self.res["meta"].setdefault("parts_s", {})[self.part] = round(time.perf_counter() - self.t0, 1)
        self.bases.clear()
        self.save()

    def over_budget(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.t0 >= self.budget_s

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.res, indent=1))
        os.replace(tmp, self.out)


def run_workload(
    run: _Run, model: str, name: str, dtype: str, backends: Sequence[str], warmup: int, repeats: int, device: str
) -> None:
    """All backends of one (dtype, workload), each row saved as it finishes."""
    wls = run.res["steps"].setdefault(dtype, {})
    if run.over_budget():
        wls[name] = {"skipped": BUDGET, "backends": {b: {"skipped": BUDGET} for b in backends}, "ratios": {}}
        return run.save()
    try:
        batches, zs, info = workload_batches(name, dtype, warmup + repeats)
        batches = to_device(batches, device)
        key = (model, tuple(zs), round(info["edges_per_atom"], 9), dtype, device)
        if key not in run.bases:  # the water boxes share one model (same elements, same edges per atom)
            run.bases.clear()
            run.bases[key] = base_model(model, zs, info, dtype, device)
        base = run.bases[key]
    except Exception as exc:
        wls[name] = {
            **_error(exc),
            "backends": {b: {"skipped": f"workload failed: {type(exc).__name__}"} for b in backends},
            "ratios": {},
        }
        _log(f"{dtype} {name}: {wls[name]['error']}")
        return run.save()
    wls[name] = rec = {**info, "backends": {}, "ratios": {}}
    _log(f"{dtype} {name}: {info['atoms']:.0f} atoms, {info['edges']:.0f} edges ({info['edges_per_atom']:.1f}/atom)")
    for backend in backends:
        if run.over_budget():
            rec["backends"][backend] = {"skipped": BUDGET}
        else:
            t = time.perf_counter()
            rec["backends"][backend] = row = backend_row(base, backend, batches, warmup, repeats, device)
            rec["ratios"] = compare(rec["backends"])
            _log(f"{dtype} {name} {backend}: {_row_text(row)} ({time.perf_counter() - t:.0f} s)")
        run.save()
    del base, batches
    _free(device)


def _row_text(row: dict) -> str:
    if "step_ms_median" in row:
        peak = f", peak {row['peak_mem_gb']:.2f} GB" if row.get("peak_mem_gb") is not None else ""
        return f"{row['step_ms_median']:.1f} ms{peak}, loss {row['loss_first']:.6g}"
    return f"skipped: {row['skipped']}" if "skipped" in row else f"ERROR {row.get('error', '?')}"


# --- the run --------------------------------------------------------------------------------------


def default_out(device: str) -> Path:
    """``kernels/results/train_step_gpu_<gpu>.json`` on CUDA, ``runs/bench/train_step_cpu.json`` else."""
    if device.startswith("cuda"):
        import torch

        slug = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(torch.device(device)).lower()).strip("_")
        return Path("kernels/results") / f"train_step_gpu_{slug.removeprefix('nvidia_')}.json"
    return Path("runs/bench/train_step_cpu.json")


def _meta(device: str, model: str, warmup: int, repeats: int, budget_s: float | None, command: str) -> dict:
    import torch

    from workbench.kernels.tools.bench import run_versions
    from workbench.train.bench_cpu import _machine

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else _machine()["cpu"]
    return {
        "device": "cuda" if device.startswith("cuda") else "cpu",
        "device_name": name,
        "timestamp": _now(),
        "versions": run_versions(),
        "model": model,
        "repeats": repeats,
        "warmup": warmup,
        "command": command,
        "budget_s": budget_s,
        "torch_threads": torch.get_num_threads(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "peak_mem_note": "torch.cuda.max_memory_allocated over the timed steps (torch's allocator)",
    }


def bench_step(
    preset: str = "gpu",
    parts: Sequence[str] = PARTS,
    model: str | None = None,
    dtypes: Sequence[str] | None = None,
    workloads: Sequence[str] | None = None,
    backends: Sequence[str] = BACKENDS,
    warmup: int | None = None,
    repeats: int | None = None,
    device: str | None = None,
    out: str | os.PathLike | None = None,
    budget_s: float | None = None,
    profile_workload: str | None = None,
    command: str = "workbench bench step",
) -> dict:
    """Run the parts (module docstring); write ``out`` after every row; return the result."""
    import torch

    from workbench.train.bench_step_profile import profile_part

    _check(preset, parts, model, dtypes, backends)
    p = PRESETS[preset]
    model, dtypes = model or p["model"], tuple(dtypes or p["dtypes"])
    workloads, profile_workload = tuple(workloads or p["workloads"]), profile_workload or p["profile_workload"]
    bad = [w for w in (*workloads, profile_workload) if not WORKLOAD.fullmatch(w)]
    if bad:
        raise ValueError(f"unknown workload(s) {', '.join(bad)}: use water-<atoms> or mixture-<capacity>")
    warmup, repeats = p["warmup"] if warmup is None else warmup, p["repeats"] if repeats is None else repeats
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = {"meta": _meta(device, model, warmup, repeats, budget_s, command), "steps": {}}
    run = _Run(res, Path(out) if out else default_out(device), budget_s)
    res["meta"]["out"] = str(run.out)
    _log(f"{res['meta']['device_name']}: model {model}, dtypes {', '.join(dtypes)}, out {run.out}")
    run.save()
    old = torch.get_default_dtype()
    try:
        if "steps" in parts:
            run.start_part("steps")
            for dtype in dtypes:
                torch.set_default_dtype(getattr(torch, dtype))
                for name in workloads:
                    run_workload(run, model, name, dtype, backends, warmup, repeats, device)
            run.end_part()
        if "profile" in parts:
            run.start_part("profile")
            torch.set_default_dtype(getattr(torch, dtypes[0]))
            res["profile"] = (
                {"skipped": BUDGET}
                if run.over_budget()
                else _guard(lambda: profile_part(model, profile_workload, dtypes[0], warmup, device))
            )
            run.end_part()
    finally:
        torch.set_default_dtype(old)
    return res


def _guard(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:
        _log(f"profile: {type(exc).__name__}: {exc}")
        return _error(exc)


def _check(preset, parts, model, dtypes, backends) -> None:
    for what, given, known in (
        ("preset", [preset], PRESETS),
        ("part", parts, PARTS),
        ("model", [model] if model else [], MODELS),
        ("dtype", dtypes or [], ("float32", "float64")),
        ("backend", backends, BACKENDS),
    ):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"unknown {what}(s) {', '.join(map(str, bad))}; choose from {', '.join(known)}")


def format_table(res: dict) -> str:
    """Median step ms (peak GB) per backend, the ratios, loss agreement, and the profile."""
    from workbench.train.bench_step_profile import format_profile

    lines = [f"{res['meta']['device_name']}, model {res['meta']['model']}, {res['meta']['repeats']} timed steps"]
    head = f"{'dtype':8} {'workload':13} {'atoms':>6} {'e/atom':>6} | " + " | ".join(f"{b:>18}" for b in BACKENDS)
    if res.get("steps"):
        lines += [head + " | numba/cueq numba/e3nn  max loss diff", "-" * (len(head) + 34)]
    for dtype, wls in res.get("steps", {}).items():
        for name, rec in wls.items():
            cells = []
            for b in BACKENDS:
                row = rec["backends"].get(b, {})
                if "step_ms_median" in row:
                    mem = f" ({row['peak_mem_gb']:.1f}G)" if row.get("peak_mem_gb") is not None else ""
                    cells.append(f"{row['step_ms_median']:>9.1f} ms{mem}")
                else:
                    cells.append("skipped" if "skipped" in row else ("error" if "error" in row else "-"))
            diffs = [r["loss_rel_diff_vs_e3nn"] for r in rec["backends"].values() if "loss_rel_diff_vs_e3nn" in r]
            ratio = [
                f"{rec['ratios'][k]:10.2f}" if k in rec.get("ratios", {}) else f"{'-':>10}"
                for k in ("numba/cueq", "numba/e3nn")
            ]
            lines.append(
                f"{dtype:8} {name:13} {rec.get('atoms', 0):6.0f} {rec.get('edges_per_atom', 0):6.1f} | "
                + " | ".join(f"{c:>18}" for c in cells)
                + " | "
                + " ".join(ratio)
                + (f"  {max(diffs):.1e}" if diffs else "")
            )
            lines += [
                f"    {b}: {row.get('skipped') or row.get('error')}"
                for b, row in rec["backends"].items()
                if "step_ms_median" not in row and (row.get("skipped") or row.get("error"))
            ]
    if "profile" in res:
        lines += ["", format_profile(res["profile"])]
    return "\n".join(lines)
