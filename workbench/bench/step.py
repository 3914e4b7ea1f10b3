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
(where the numba step's time goes, eager and as a CUDA graph, :mod:`workbench.bench.step_profile`).
A row ``<backend>+fixed`` or ``<backend>+graph`` runs that backend on fixed-shape batches, the
latter as one CUDA graph per shape (:mod:`workbench.bench.step_modes`). Every row runs in
``try``/``except``: an error, an unavailable backend (``skipped``) or a spent ``--budget-s``
(``skipped: time budget``) is recorded and the run goes on; the JSON is rewritten after every row.

Workloads (:mod:`workbench.bench.workloads`): ``water-<atoms>`` (one periodic liquid-water box; the
same batch every step) and ``mixture-<capacity>`` (the embedded mixture packed by the paper's
algorithm at ``capacity`` atoms; every step its own batch, warm-up on the first ones).
"""

from __future__ import annotations

import os
import re
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workbench.bench.step_model import base_model, free_memory, sync
from workbench.bench.step_modes import mode_labels, ready_for_mode, split_label, stepper
from workbench.bench.table import RESULTS_DIR, Column, cpu_name, render, run_versions, write_json
from workbench.bench.workloads import MODELS, to_device, workload_batches
from workbench.kernels.registry import DEFAULT_BACKEND, contenders, labels, resolve

__all__ = [
    "PARTS",
    "PRESETS",
    "backend_choices",
    "bench_step",
    "default_backends",
    "default_out",
    "format_table",
    "time_steps",
]

PARTS = ("steps", "profile")
#: the ratios are ours over every other backend of the row
OURS = DEFAULT_BACKEND
#: the rows whose ratios over every other row are reported: ours, eager and as a graph
OURS_ROWS = (OURS, f"{OURS}+graph")


def backend_choices() -> tuple[str, ...]:
    """Every row label a MACE step can run: the registry's backends with their variants, and
    those with a step mode (:mod:`workbench.bench.step_modes`: ``numba+graph``, ``cueq+fixed``)."""
    return labels(family="mace") + mode_labels(labels(family="mace"))


def default_backends() -> tuple[str, ...]:
    """The registry's contenders for MACE, ours first."""
    return contenders("mace")


PRESETS: dict[str, dict[str, Any]] = {
    # most wanted first: a spent budget drops the tail
    # 5 warm-up steps: TorchScript optimises mace's graphs at their 3rd and 4th call (H100: ~1 s steps)
    "gpu": {
        "model": "paper",
        "workloads": ("water-3072", "mixture-3072", "water-768", "water-1536", "water-6144"),
        "dtypes": ("float32",),
        "backends": ("numba", "numba+graph", "cueq", "cueq+fixed", "e3nn"),
        "warmup": 5,
        "repeats": 10,
        "profile_workload": "water-3072",
    },
    "smoke": {
        "model": "small",
        "workloads": ("water-24", "water-48", "mixture-96"),
        "dtypes": ("float32",),
        "backends": ("numba", "numba+graph", "numba+fixed", "e3nn", "cueq", "oeq"),
        "warmup": 1,
        "repeats": 2,
        "profile_workload": "water-48",
    },
}
WORKLOAD = re.compile(r"(water|mixture)-[0-9]+")
BUDGET = "time budget"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _log(msg: str) -> None:
    print(f"[bench step] {msg}", flush=True)


# --- one train step -------------------------------------------------------------------------------


def time_steps(model, batches: Sequence[dict], warmup: int, repeats: int, device: str, mode: str | None = None) -> dict:
    """Warm-up steps on ``batches[:warmup]``, then ``repeats`` timed steps on the next batches,
    in step ``mode`` (:mod:`~workbench.bench.step_modes`; a graph's shapes captured in between)."""
    import torch

    cuda = device.startswith("cuda")
    step, prime = stepper(model, mode, device)
    loss_first = None
    for i in range(warmup):
        loss = step(batches[i])
        if loss_first is None:
            loss_first = float(loss.detach())
    prime(batches[warmup : warmup + repeats])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup, warmup + repeats):
        sync(device)
        t = time.perf_counter()
        loss = step(batches[i])
        sync(device)
        times.append(1e3 * (time.perf_counter() - t))
        if loss_first is None:
            loss_first = float(loss.detach())
    row = {
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms": times,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "loss_first": loss_first,
    }
    if mode == "graph":
        row["captures"] = step.runner.captures
    return row


# --- rows -----------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def backend_row(base, backend: str, batches: Sequence[dict], warmup: int, repeats: int, device: str) -> dict:
    """One backend's timings on its own copy of ``base``; an unavailable backend is ``skipped``
    (its probe says why, or another library's converter failed), any other failure an ``error``."""
    from workbench.bench.harness import backend_kernels

    backend, mode = split_label(backend)
    b = resolve(backend)[0]
    why = (
        b.unavailable()
        if device.split(":")[0] in b.devices
        else f"{b.name} runs on {', '.join(b.devices)} only, not {device}"
    )
    if why:
        return {"skipped": why}
    with backend_kernels(backend):  # a variant's options hold for its row only
        return _timed_row(base, b, (backend, mode), batches, warmup, repeats, device)


def _timed_row(base, b, row: tuple, batches: Sequence[dict], warmup: int, repeats: int, device: str) -> dict:
    from workbench.bench.harness import precompile_for_bench, with_backend

    backend, mode = row
    try:
        model = with_backend(base, backend)
        batches = ready_for_mode(model, b.name, mode, batches, float(base.r_max))
    except Exception as exc:
        if b.kind == "convert":
            return {"skipped": f"{type(exc).__name__}: {exc}"}
        return _error(exc)
    try:
        pre = precompile_for_bench(model, backend)  # parallel, before the warm-up; instant from a warm cache
        row = time_steps(model, batches, warmup, repeats, device, mode)
        if pre:
            row["precompile"] = {k: pre[k] for k in ("jobs", "compiled", "cached", "seconds")}
        return row
    except Exception as exc:
        return _error(exc)
    finally:
        del model
        free_memory(device)


def _compared(mine: str, other: str) -> bool:
    """Whether ``mine`` (one of :data:`OURS_ROWS`) gets a ratio over ``other``: not over itself,
    and eager ours not over ours as a graph."""
    return other != mine and not (mine == OURS and other in OURS_ROWS)


def _ratio(a: dict, b: dict, key: str) -> float | None:
    x, y = a.get(key), b.get(key)
    return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def compare(backends: dict) -> dict:
    """Sets ``loss_rel_diff_vs_e3nn`` on each timed non-e3nn row; returns the ratios (times and
    peak memory, ours over each other backend: below 1 ours is faster / smaller)."""
    ref = backends.get("e3nn", {}).get("loss_first")
    for name, row in backends.items():
        if name != "e3nn" and row.get("loss_first") is not None and ref is not None:
            row["loss_rel_diff_vs_e3nn"] = abs(row["loss_first"] - ref) / max(abs(ref), 1e-300)
    ratios = {}
    for mine in (r for r in OURS_ROWS if r in backends):
        for other in backends:
            if not _compared(mine, other):
                continue
            r = _ratio(backends[mine], backends[other], "step_ms_median")
            if r is not None:
                ratios[f"{mine}/{other}"] = r
            peak = _ratio(backends[mine], backends[other], "peak_mem_gb")
            if peak is not None:
                ratios[f"peak {mine}/{other}"] = peak
    return ratios


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
        write_json(self.out, self.res)


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
    free_memory(device)


def _row_text(row: dict) -> str:
    if "step_ms_median" in row:
        peak = f", peak {row['peak_mem_gb']:.2f} GB" if row.get("peak_mem_gb") is not None else ""
        return f"{row['step_ms_median']:.1f} ms{peak}, loss {row['loss_first']:.6g}"
    return f"skipped: {row['skipped']}" if "skipped" in row else f"ERROR {row.get('error', '?')}"


# --- the run --------------------------------------------------------------------------------------


def default_out(device: str) -> Path:
    """``benchmarks/results/train_step_gpu_<gpu>.json`` on CUDA, ``runs/bench/train_step_cpu.json`` else."""
    if device.startswith("cuda"):
        import torch

        slug = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(torch.device(device)).lower()).strip("_")
        return RESULTS_DIR / f"train_step_gpu_{slug.removeprefix('nvidia_')}.json"
    return Path("runs/bench/train_step_cpu.json")


def _meta(device: str, model: str, warmup: int, repeats: int, budget_s: float | None, command: str) -> dict:
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else cpu_name()
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
    backends: Sequence[str] | None = None,
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

    from workbench.dtypes import default_dtype

    backends = tuple(backends or PRESETS.get(preset, {}).get("backends") or default_backends())
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
    if "steps" in parts:
        run.start_part("steps")
        for dtype in dtypes:
            with default_dtype(dtype):
                for name in workloads:
                    run_workload(run, model, name, dtype, backends, warmup, repeats, device)
        run.end_part()
    if "profile" in parts:
        _profiles(run, model, profile_workload, dtypes[0], warmup, device)
    return res


def _profiles(run: _Run, model: str, workload: str, dtype: str, warmup: int, device: str) -> None:
    """The profile part: ours eager (``profile``) and as a CUDA graph (``profile_graph``)."""
    from workbench.bench.step_profile import profile_part
    from workbench.dtypes import default_dtype

    run.start_part("profile")
    for key, label in (("profile", OURS), ("profile_graph", f"{OURS}+graph")):
        with default_dtype(dtype):
            run.res[key] = (
                {"skipped": BUDGET}
                if run.over_budget()
                else _guard(lambda label=label: profile_part(model, workload, dtype, warmup, device, label=label))
            )
        run.save()
    run.end_part()


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
        ("backend", backends, backend_choices()),
    ):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"unknown {what}(s) {', '.join(map(str, bad))}; choose from {', '.join(known)}")


def _cell(row: dict) -> str:
    """One backend's cell: median step ms (peak GB), or why there is none."""
    if "step_ms_median" in row:
        mem = f" ({row['peak_mem_gb']:.1f}G)" if row.get("peak_mem_gb") is not None else ""
        return f"{row['step_ms_median']:>9.1f} ms{mem}"
    return "skipped" if "skipped" in row else ("error" if "error" in row else "-")


def _max_diff(rec: dict) -> str:
    diffs = [r["loss_rel_diff_vs_e3nn"] for r in rec["backends"].values() if "loss_rel_diff_vs_e3nn" in r]
    return f"{max(diffs):.1e}" if diffs else ""


def format_table(res: dict) -> str:
    """Median step ms (peak GB) per backend, the ratios, loss agreement, and the profile."""
    from workbench.bench.step_profile import format_profile

    bar = Column("|", lambda r: "|")
    ran = list(
        dict.fromkeys(b for wls in res.get("steps", {}).values() for rec in wls.values() for b in rec["backends"])
    )
    columns = [
        Column("dtype", "dtype", width=8, align="<"),
        Column("workload", "name", width=13, align="<"),
        Column("atoms", lambda r: r.get("atoms", 0), ".0f", 6),
        Column("e/atom", lambda r: r.get("edges_per_atom", 0), ".1f", 6),
        *(c for b in ran for c in (bar, Column(b, lambda r, b=b: _cell(r["backends"].get(b, {})), width=18))),
        bar,
        *(
            Column(k, lambda r, k=k: r.get("ratios", {}).get(k), ".2f", 10)
            for k in (f"{mine}/{b}" for mine in OURS_ROWS if mine in ran for b in ran if _compared(mine, b))
        ),
        Column("max loss diff", _max_diff, width=13),
    ]
    rows, notes = [], {}
    for dtype, wls in res.get("steps", {}).items():
        for name, rec in wls.items():
            rows.append({**rec, "dtype": dtype, "name": name})
            notes[len(rows) - 1] = [
                f"    {b}: {row.get('skipped') or row.get('error')}"
                for b, row in rec["backends"].items()
                if "step_ms_median" not in row and (row.get("skipped") or row.get("error"))
            ]
    meta = res["meta"]
    lines = [f"{meta['device_name']}, model {meta['model']}, {meta['repeats']} timed steps"]
    if rows:
        table = render(rows, columns).splitlines()
        lines += table[:2]
        for i, line in enumerate(table[2:]):
            lines += [line, *notes[i]]
    for key in ("profile", "profile_graph"):
        if key in res:
            lines += ["", format_profile(res[key])]
    return "\n".join(lines)
