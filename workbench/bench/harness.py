"""What the kernel and step benchmarks share: a model on a backend, timing, peak memory, and the
parity check of every backend against e3nn in the same run.

A backend label is a registered backend or one of its variants
(:func:`workbench.kernels.registry.labels`): ``e3nn`` (mace-torch's own modules), ``numba`` (the
workbench kernels, the CUDA kernel kind the dispatcher picks), ``numba-table`` /
``numba-unrolled`` (one CUDA kernel kind forced), ``numba-unfused`` (an edge op's outputs one
kernel each), ``cueq`` (cuEquivariance through mace-torch's converter), ``oeq``
(OpenEquivariance's fused message op), and any backend registered since.
"""

from __future__ import annotations

import copy
import datetime as _dt
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from workbench.kernels.registry import BACKENDS, resolve

__all__ = [
    "backend_kernels",
    "backend_model",
    "compare_with_e3nn",
    "kernel_run_header",
    "kernel_variant",
    "measure_pass",
    "measured_bandwidth",
    "parity",
    "pass_line",
    "peak_memory",
    "precompile_for_bench",
    "record_outputs",
    "set_threads",
    "snapshot",
    "timer",
    "use_backend_kernels",
    "with_backend",
]


def kernel_variant(backend: str) -> str:
    """The CUDA kernel kind a backend label asks for (``"numba-table"``: ``"table"``); ``"auto"``,
    the dispatcher's choice, for every label whose variant does not force one."""
    return resolve(backend)[1].get("cuda_kernels", "auto")


def _label_options(backend: str) -> dict:
    """The kernel options of a backend label, with every field another label's variant sets unset."""
    variant_fields = {k for b in BACKENDS.values() for v in b.variants.values() for k in v}
    return {**dict.fromkeys(variant_fields), **resolve(backend)[1]}


def use_backend_kernels(backend: str) -> None:
    """Set, for the rest of the process, the kernel options a backend label asks for
    (:func:`~workbench.kernels.registry.resolve`: ``"numba-unfused"`` launches an edge op's outputs
    one kernel each); the options another label set are unset first. The compile workers get
    them through :func:`~workbench.kernels.options.child_environment`."""
    from workbench.kernels.options import configure

    configure(**_label_options(backend))


@contextmanager
def backend_kernels(backend: str) -> Iterator[None]:
    """:func:`use_backend_kernels` for a block only: the options in effect before come back."""
    from workbench.kernels.options import overridden

    with overridden(**_label_options(backend)):
        yield


def with_backend(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """A copy of ``model`` on the backend of the label ``backend`` (kernels not compiled ahead:
    see :func:`precompile_for_bench`; the label's options: :func:`use_backend_kernels`)."""
    from workbench.kernels.acceleration import accelerate

    return accelerate(copy.deepcopy(model), backend=resolve(backend)[0].name, precompile=False)


def precompile_for_bench(model: torch.nn.Module, backend: str, modules: Sequence[str] | None = None) -> dict | None:
    """For a compiled backend on a CUDA device: compile the kernels force training of ``modules``
    (name prefixes; all when None) launches, in parallel, before the benchmark's warm-up, so
    that no timed pass (nor the warm-up) compiles one after another. The report as a dict."""
    from workbench.kernels.acceleration import precompile_model
    from workbench.kernels.numba.gpu.device import cuda_available

    p = next(model.parameters())
    if not resolve(backend)[0].compiled or p.device.type != "cuda" or not cuda_available():
        return None
    return precompile_model(model, modules=modules).as_dict()


def backend_model(
    base: torch.nn.Module, backend: str, modules: Sequence[str], results: dict, dtype: str
) -> torch.nn.Module:
    """``base`` on ``backend`` for a benchmark: the kernel options its name asks for, a copy
    (:func:`with_backend`), and for numba on a GPU its kernels of ``modules`` compiled ahead
    (the report goes to ``results["precompile"]``)."""
    use_backend_kernels(backend)
    model = with_backend(base, backend)
    pre = precompile_for_bench(model, backend, modules)
    if pre:
        results.setdefault("precompile", {})[f"{backend} {dtype}"] = pre
    return model


@contextmanager
def peak_memory(device: str) -> Iterator[dict]:
    """On a CUDA ``device``, ``rec["peak_mem_MB"]``: the most memory allocated above what was
    allocated on entry, while the block ran (nothing on a CPU)."""
    rec: dict = {}
    on_gpu = str(device).startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    yield rec
    if on_gpu:
        torch.cuda.synchronize()
        rec["peak_mem_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20


def timer(device: str, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup``: CUDA events on a GPU,
    ``perf_counter`` on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return times
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def measured_bandwidth(device: str) -> float | None:
    """Device-to-device copy bandwidth in GB/s (read + write bytes), median of 20; None on a CPU."""
    if not device.startswith("cuda"):
        return None
    n = 256 * 1024 * 1024 // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ts = timer(device, lambda: b.copy_(a), 5, 20)
    return 2 * a.numel() * 4 / (statistics.median(ts) * 1e-3) / 1e9


def snapshot(result) -> list[torch.Tensor | None]:
    """The tensors a benchmark pass returned (a tensor, or a tuple with tensors and None), as
    float64 host copies, for :func:`parity`."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t.detach().to("cpu", torch.float64).clone() if torch.is_tensor(t) else None for t in items]


def parity(result: list, reference: list) -> dict:
    """How far ``result`` is from ``reference`` (two :func:`snapshot` lists, e.g. numba against
    e3nn): the largest ``max|a - b| / max|b|`` over the tensors present in both with equal
    shapes, and how many were compared (an accelerated module may lay out a parameter
    differently, which is then skipped and counted)."""
    worst, compared, skipped = 0.0, 0, 0
    for a, b in zip(result, reference):
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            skipped += 1
            continue
        scale = float(b.abs().max()) or 1.0
        worst = max(worst, float((a - b).abs().max()) / scale)
        compared += 1
    return {"max_rel_err": worst, "compared": compared, "skipped_shape": skipped}


def record_outputs(entry: dict, fn: Callable[[], object]) -> list:
    """Run a timed pass ``fn`` twice more: ``entry["bitwise_repeatable"]`` says whether both runs
    gave the same bits; returns the first run's :func:`snapshot` (for :func:`compare_with_e3nn`)."""
    first, second = snapshot(fn()), snapshot(fn())
    entry["bitwise_repeatable"] = all(a is None or torch.equal(a, b) for a, b in zip(first, second))
    return first


def compare_with_e3nn(snaps: dict) -> list[tuple[tuple, dict]]:
    """``snaps``: ``(backend, *case) -> (entry, outputs)``. Sets ``entry["parity_vs_e3nn"]``
    (:func:`parity` against ``("e3nn", *case)``) for every other backend that has an e3nn
    reference; returns the ``(key, entry)`` pairs compared."""
    done = []
    for (backend, *case), (entry, out) in snaps.items():
        ref = snaps.get(("e3nn", *case))
        if backend != "e3nn" and ref is not None:
            entry["parity_vs_e3nn"] = parity(out, ref[1])
            done.append(((backend, *case), entry))
    return done


def measure_pass(make_fn: Callable[[], Callable], device: str, warmup: int, repeats: int, entry: dict) -> list | None:
    """Build one pass (``make_fn()``), time it into ``entry`` (median, min, every repeat, peak
    memory, ``bitwise_repeatable``) and return its outputs (:func:`snapshot`); an exception
    becomes ``entry["error"]`` and ``None``, so the benchmark goes on with the next pass."""
    try:
        fn = make_fn()
        with peak_memory(device) as mem:
            ts = timer(device, fn, warmup, repeats)
        entry.update(median_ms=statistics.median(ts), min_ms=min(ts), times_ms=ts, **mem)
        return record_outputs(entry, fn)
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc()[-2000:]
        return None


def pass_line(prefix: str, entry: dict, width: int = 9) -> str:
    """One printed line per timed pass: median and peak memory, or the error."""
    if "median_ms" not in entry:
        return f"{prefix} {entry.get('error', '')}"
    peak = f"  peak {entry['peak_mem_MB']:.0f} MB" if "peak_mem_MB" in entry else ""
    return f"{prefix} {entry['median_ms']:{width}.3f} ms{peak}"


def kernel_run_header(device: str, config: dict, smoke: bool = False) -> dict:
    """The record a kernel benchmark's JSON opens with: what ran where (``label``, ``device``,
    ``device_name``, ``timestamp``), ``config``, ``versions`` and the copy bandwidth; ``runs``
    gets a row per timed pass."""
    from workbench.bench.table import run_versions

    on_gpu = device.startswith("cuda")
    label = "GPU" if on_gpu else "CPU (not the GPU benchmark; correctness/smoke timing only)"
    return {
        "label": label + (" SMOKE" if smoke else ""),
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or platform.machine(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ"),
        "config": config,
        "versions": run_versions(),
        "measured_bandwidth_GBps": measured_bandwidth(device),
        "runs": [],
    }


def pass_costs(ops: Sequence, flops: Sequence[float], min_bytes: Sequence[float]) -> dict:
    """Terms, flops and minimum bytes of the forward, backward and double backward descriptors
    ``ops`` (each with ``compiled`` parts), keyed as the kernel benchmarks' JSON has them."""
    names = ("forward", "backward", "double_backward")
    passes = ("forward", "forward_backward", "double_backward")
    return {
        "terms": {n: [c.num_terms for c in op.compiled] for n, op in zip(names, ops, strict=True)},
        "flops": dict(zip(passes, flops, strict=True)),
        "min_bytes": dict(zip(passes, min_bytes, strict=True)),
    }


def set_threads(threads: int) -> None:
    """torch's and numba's CPU threads (numba's at most what its pool was started with)."""
    import numba

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
