"""The ``profile`` part of ``workbench bench step``: where the numba train step's time goes.

A few train steps of the numba model run under ``torch.profiler`` after the warm-up. On CUDA every
GPU kernel, memcpy and memset of the trace is put in a category (:func:`category`) by its name and
by where it was launched from: a kernel launched inside the ``optimizer`` range is the optimizer's,
a driver-API launch inside ``_SparsePolyFunction`` is a workbench kernel (numba launches through
the driver API, torch through the runtime). ``launch gaps (GPU idle)`` is the step's wall time
minus the union of the GPU intervals. On a CPU the categories share the ops' self CPU time, and
``untraced (Python, gaps)`` is the wall time no op accounts for. Shares are of the wall time (of
the categories' sum where concurrent kernels make that larger), so they add up to at most 1;
milliseconds and calls (``top_kernels``: ``[name, ms, calls]``) are per step.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["CATEGORIES", "category", "cpu_breakdown", "format_profile", "gpu_breakdown", "profile_part", "union_length"]

#: profiled steps after the warm-up
PROFILED_STEPS = 3
OPTIMIZER = "optimizer (Adam)"
WORKBENCH = "workbench kernels"
GAPS = "launch gaps (GPU idle)"
UNTRACED = "untraced (Python, gaps)"
#: (category, substrings of a lower-cased kernel name, exact lower-cased CPU op names); first match wins
CATEGORIES: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    (WORKBENCH, ("_sparsepolyfunction", "cudapy", "workbench", "sparse_poly", "edge_poly", "segment_sum"), frozenset()),
    (OPTIMIZER, ("multi_tensor_apply", "_foreach_", "adam"), frozenset()),
    (
        "matmul (linears, radial MLP)",
        ("gemm", "gemv", "cutlass", "xmma", "cublas", "nvjet", "splitkreduce", "dot_kernel"),
        frozenset(
            f"aten::{n}" for n in ("mm", "addmm", "bmm", "matmul", "baddbmm", "linear", "mv", "addmv", "dot", "einsum")
        ),
    ),
    (
        "copies/fills",
        ("memcpy", "memset", "fill", "copy", "catarray"),
        frozenset(
            f"aten::{n}"
            for n in (
                "cat",
                "stack",
                "clone",
                "to",
                "_to_copy",
                "contiguous",
                "zeros",
                "zeros_like",
                "ones",
                "ones_like",
                "full",
                "zero_",
            )
        ),
    ),
    ("scatter/index/gather", ("scatter", "index", "gather", "sort", "radix", "embedding"), frozenset()),
    (
        "reductions",
        ("reduce", "cub::", "softmax"),
        frozenset(
            f"aten::{n}"
            for n in ("sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "max", "min", "prod", "cumsum")
        ),
    ),
    (
        "elementwise",
        ("elementwise", "vectorized", "pointwise", "functor"),
        frozenset(
            f"aten::{n}"
            for n in (
                "mul",
                "mul_",
                "add",
                "add_",
                "sub",
                "sub_",
                "div",
                "div_",
                "silu",
                "silu_backward",
                "sigmoid",
                "sigmoid_backward",
                "pow",
                "neg",
                "sqrt",
                "rsqrt",
                "sin",
                "cos",
                "exp",
                "log",
                "where",
                "clamp",
                "clamp_min",
                "abs",
                "reciprocal",
                "tanh",
                "lerp_",
                "addcmul_",
                "addcdiv_",
                "square",
                "sign",
                "relu",
                "threshold_backward",
                "maximum",
                "minimum",
                "eq",
                "ne",
                "gt",
                "lt",
                "ge",
                "le",
                "floor",
                "remainder",
                "masked_fill",
                "sinc",
                "rsub",
                "mul_out",
                "add_out",
            )
        ),
    ),
)
OTHER = "other"


def category(name: str, in_optimizer: bool = False, in_workbench_op: bool = False) -> str:
    """The category of a GPU kernel or CPU op ``name`` (:data:`CATEGORIES`); ``in_optimizer``:
    launched inside the ``optimizer`` range; ``in_workbench_op``: launched through the driver
    API inside a workbench op (a numba kernel whatever its name)."""
    low = name.lower()
    if in_optimizer:
        return OPTIMIZER
    if in_workbench_op:
        return WORKBENCH
    return next((cat for cat, subs, exact in CATEGORIES if low in exact or any(s in low for s in subs)), OTHER)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _inside(t: float, ranges: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in ranges)


def _summary(times: dict[str, float], calls: dict[str, tuple[float, int]], wall_ms: float, steps: int) -> dict:
    """Per-step ms and shares (of ``max(wall, sum)``), the five largest, the 15 heaviest kernels."""
    scale = max(wall_ms, sum(times.values())) or 1.0
    cats = {k: {"ms": v / steps, "share": v / scale} for k, v in sorted(times.items(), key=lambda kv: -kv[1])}
    top = sorted(calls.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "step_ms": wall_ms / steps,
        "categories": cats,
        "top5": [[k, v["share"]] for k, v in list(cats.items())[:5]],
        "top_kernels": [[name[:200], ms / steps, n / steps] for name, (ms, n) in top],
    }


def _ranges(events: list[dict], steps: int) -> dict:
    """ms per step of the ``forward``/``backward``/``optimizer`` ranges: CPU side, and the GPU
    span kineto projects them onto (``gpu_user_annotation``) where present."""
    out: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("name") in ("forward", "backward", "optimizer") and e.get("cat") in (
            "user_annotation",
            "gpu_user_annotation",
        ):
            key = "cpu_ms" if e["cat"] == "user_annotation" else "gpu_ms"
            rec = out.setdefault(e["name"], {})
            rec[key] = rec.get(key, 0.0) + e.get("dur", 0.0) / 1e3 / steps
    return out


def gpu_breakdown(events: list[dict], wall_ms: float, steps: int) -> dict:
    """Categories of a CUDA chrome trace's ``events`` (kernels, memcpys, memsets) over ``steps``
    steps that took ``wall_ms`` in all, plus :data:`GAPS`."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    spans = {
        name: [
            (e["ts"], e["ts"] + e.get("dur", 0.0))
            for e in events
            if e.get("cat") in ("user_annotation", "cpu_op") and name in e.get("name", "")
        ]
        for name in ("optimizer", "_SparsePolyFunction")
    }
    times: dict[str, float] = {}
    calls: dict[str, tuple[float, int]] = {}
    busy = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        t = launch["ts"] if launch else None
        driver = launch is not None and launch.get("cat") == "cuda_driver"
        cat = category(
            e["name"] if e["cat"] == "kernel" else f"{e['cat']} {e['name']}",
            in_optimizer=t is not None and _inside(t, spans["optimizer"]),
            in_workbench_op=driver and _inside(t, spans["_SparsePolyFunction"]),
        )
        ms = e.get("dur", 0.0) / 1e3
        times[cat] = times.get(cat, 0.0) + ms
        prev = calls.get(e["name"], (0.0, 0))
        calls[e["name"]] = (prev[0] + ms, prev[1] + 1)
        busy.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    times[GAPS] = max(0.0, wall_ms - union_length(busy) / 1e3)
    return {
        **_summary(times, calls, wall_ms, steps),
        "ranges": _ranges(events, steps),
        "gpu_busy_ms": union_length(busy) / 1e3 / steps,
    }


def cpu_breakdown(function_events, events: list[dict], wall_ms: float, steps: int) -> dict:
    """Categories of the ops' self CPU time (``function_events``: ``prof.events()``), plus
    :data:`UNTRACED`; ``events``: the chrome trace, for the ranges."""
    times: dict[str, float] = {}
    calls: dict[str, tuple[float, int]] = {}
    for fe in function_events:
        if str(fe.device_type).split(".")[-1] != "CPU":
            continue
        parent, in_opt = fe, False
        while parent is not None and not in_opt:
            in_opt = parent.name == "optimizer" or parent.name.startswith("Optimizer.")
            parent = parent.cpu_parent
        ms = fe.self_cpu_time_total / 1e3
        cat = category(fe.name, in_optimizer=in_opt)
        if fe.name in ("forward", "backward", "optimizer"):
            cat = OTHER  # our ranges' own time: Python between the ops
        times[cat] = times.get(cat, 0.0) + ms
        prev = calls.get(fe.name, (0.0, 0))
        calls[fe.name] = (prev[0] + ms, prev[1] + 1)
    times[UNTRACED] = max(0.0, wall_ms - sum(times.values()))
    return {**_summary(times, calls, wall_ms, steps), "ranges": _ranges(events, steps)}


def _trace(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def profile_part(
    model_name: str,
    workload: str,
    dtype: str,
    warmup: int,
    device: str,
    steps: int = PROFILED_STEPS,
    label: str = DEFAULT_BACKEND,
) -> dict:
    """Profile ``steps`` train steps of row ``label`` (``numba``, or ``numba+graph``: the replays
    of the captured step) on ``workload`` after ``max(warmup, 1)`` warm-up steps (a graph's
    shapes captured after them) and one more under the profiler's own warm-up (not recorded)."""
    from workbench.bench.step_model import free_memory
    from workbench.bench.workloads import to_device, workload_batches

    warmup = max(warmup, 1)
    batches, zs, info = workload_batches(workload, dtype, warmup + 1 + steps)
    step, batches = _profiled_step(model_name, label, to_device(batches, device), zs, info, dtype, device)
    for b in batches[:warmup]:
        step(b)
    step.prime(batches[warmup:])
    cuda = device.startswith("cuda")
    res = _profile(step, batches[warmup:], steps, device)
    del step
    free_memory(device)
    return {
        "workload": workload,
        "backend": label,
        "dtype": dtype,
        "device": "cuda" if cuda else "cpu",
        "atoms": info["atoms"],
        "edges": info["edges"],
        "profiled_steps": steps,
        "time_base": "GPU kernel time" if cuda else "self CPU time",
        **res,
    }


def _profiled_step(model_name: str, label: str, batches: list, zs, info: dict, dtype: str, device: str):
    """``(step, batches)``: row ``label``'s step on its own model (``step.prime`` captures a
    graph's shapes) and the batches it takes (padded in a step mode)."""
    from workbench.bench.harness import with_backend
    from workbench.bench.step_model import base_model
    from workbench.bench.step_modes import ready_for_mode, split_label, stepper

    backend, mode = split_label(label)
    model = with_backend(base_model(model_name, zs, info, dtype, device), backend)
    batches = ready_for_mode(model, backend, mode, batches, float(model.r_max))
    step, prime = stepper(model, mode, device)
    step.prime = prime
    return step, batches


def _profile(step, batches: list, steps: int, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    from workbench.bench.step_model import sync

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    wall = 0.0
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        for i, b in enumerate(batches):
            sync(device)
            t = time.perf_counter()
            step(b)
            sync(device)
            wall += (time.perf_counter() - t) if i else 0.0
            prof.step()
    events = _trace(prof)
    return gpu_breakdown(events, 1e3 * wall, steps) if cuda else cpu_breakdown(prof.events(), events, 1e3 * wall, steps)


def format_profile(pr: dict) -> str:
    """The profile as text: categories (ms per step, share), ranges and the heaviest kernels."""
    if "categories" not in pr:
        return f"profile: {pr.get('skipped') or pr.get('error')}"
    lines = [
        (
            f"profile: numba train step, {pr['workload']} {pr['dtype']} on {pr['device']}, {pr['step_ms']:.1f} ms per "
            f"step ({pr['time_base']}, {pr['profiled_steps']} steps)"
        )
    ]
    lines += [f"  {k:32} {v['ms']:9.2f} ms {100 * v['share']:6.1f}%" for k, v in pr["categories"].items()]
    lines += [
        f"  range {k:10} " + ", ".join(f"{w} {v:.1f}" for w, v in rec.items())
        for k, rec in pr.get("ranges", {}).items()
    ]
    lines += ["  heaviest (per step):"] + [
        f"    {ms:9.2f} ms x{n:<5g} {name[:100]}" for name, ms, n in pr["top_kernels"][:8]
    ]
    return "\n".join(lines)
