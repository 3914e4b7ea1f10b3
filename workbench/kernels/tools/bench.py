"""Benchmark fixtures: random-weight mace-torch models (same architecture as training), backend
switching, and the version record of a benchmark run."""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

__all__ = [
    "add_common_arguments",
    "backend_model",
    "compare_with_e3nn",
    "kernel_variant",
    "measure_pass",
    "parity",
    "peak_memory",
    "precompile_for_bench",
    "random_scaleshift_mace",
    "record_outputs",
    "run_versions",
    "snapshot",
    "timer",
    "use_backend_kernels",
    "with_backend",
]

#: packages whose versions a benchmark result records (besides torch and python)
RECORDED_PACKAGES = ("mace", "e3nn", "numba", "cuequivariance_torch", "openequivariance")


def random_scaleshift_mace(
    hidden: str,
    max_ell: int,
    correlation: int,
    atomic_numbers: Sequence[int],
    avg_num_neighbors: float,
    dtype: torch.dtype,
    device: str | torch.device,
    perturb: float = 0.1,
    seed: int = 0,
) -> torch.nn.Module:
    """A 2-layer ``ScaleShiftMACE`` (residual interaction blocks, 8 Bessel functions, 4.5 Å) in ``dtype``.

    ``perturb`` adds ``perturb * N(0, 1)`` to every trainable parameter, so that no kernel is
    timed or checked on mace's structured initial values alone.
    """
    from e3nn import o3
    from mace import modules

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        model = modules.ScaleShiftMACE(
            r_max=4.5,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=max_ell,
            interaction_cls=block,
            interaction_cls_first=block,
            num_interactions=2,
            num_elements=len(atomic_numbers),
            hidden_irreps=o3.Irreps(hidden),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.zeros(len(atomic_numbers)),
            avg_num_neighbors=avg_num_neighbors,
            atomic_numbers=list(atomic_numbers),
            correlation=correlation,
            gate=torch.nn.functional.silu,
            atomic_inter_scale=1.0,
            atomic_inter_shift=0.0,
        )
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(perturb * torch.randn_like(p))
    finally:
        torch.set_default_dtype(old)
    return model.to(device)


def kernel_variant(backend: str) -> str:
    """``WORKBENCH_CUDA_KERNELS`` for a benchmark backend name: ``"numba-table"`` and
    ``"numba-unrolled"`` force one CUDA kernel kind, every other name leaves the choice to the
    dispatcher (``"auto"``)."""
    base, _, variant = backend.partition("-")
    return variant if base == "numba" and variant in ("table", "unrolled") else "auto"


def use_backend_kernels(backend: str) -> None:
    """Set the kernel switches a benchmark backend name asks for (read at every launch):
    :func:`kernel_variant`, and ``"numba-unfused"`` launches an edge op's outputs one kernel
    each (``WORKBENCH_FUSE_PASSES=0``) instead of one fused kernel per pass."""
    os.environ["WORKBENCH_CUDA_KERNELS"] = kernel_variant(backend)
    os.environ["WORKBENCH_FUSE_PASSES"] = "0" if backend == "numba-unfused" else "1"


def with_backend(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """A copy of ``model`` with ``backend`` (kernels not compiled ahead: see
    :func:`precompile_for_bench`; ``"e3nn"``: the original modules; ``"numba-table"``
    and ``"numba-unrolled"`` are ``"numba"``, see :func:`kernel_variant`; ``"oeq"``:
    OpenEquivariance's fused message op through mace-torch's converter, the contraction stays e3nn's)."""
    from workbench.kernels.mace.accelerate import accelerate

    m = copy.deepcopy(model)
    if backend.startswith("numba-"):
        backend = "numba"
    if backend == "oeq":
        try:
            import openequivariance  # noqa: F401
        except Exception as exc:  # ImportError, or its extension failing to build
            raise ImportError(f"backend 'oeq' needs openequivariance ({type(exc).__name__}: {exc})") from exc
        from mace.cli.convert_e3nn_oeq import run as run_e3nn_to_oeq

        return run_e3nn_to_oeq(m, device=next(m.parameters()).device.type, return_model=True)
    return m if backend == "e3nn" else accelerate(m, backend=backend, precompile=False)


def precompile_for_bench(model: torch.nn.Module, backend: str, modules: Sequence[str] | None = None) -> dict | None:
    """For a numba backend on a CUDA device: compile the kernels force training of ``modules``
    (name prefixes; all when None) launches, in parallel, before the benchmark's warm-up, so
    that no timed pass (nor the warm-up) compiles one after another. The report as a dict."""
    from workbench.kernels.backends.device import cuda_available
    from workbench.kernels.mace.accelerate import precompile_model

    p = next(model.parameters())
    if not backend.startswith("numba") or p.device.type != "cuda" or not cuda_available():
        return None
    return precompile_model(model, modules=modules).as_dict()


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


def run_versions() -> dict[str, str]:
    """``{package: version}`` of torch, python and :data:`RECORDED_PACKAGES` for a benchmark
    result; a package that does not import is ``"unavailable: <exception class>"``."""
    import platform

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in RECORDED_PACKAGES:
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as exc:
            versions[mod] = f"unavailable: {type(exc).__name__}"
    return versions


def add_common_arguments(ap: argparse.ArgumentParser, passes: Sequence[str]) -> None:
    """Options every kernel benchmark takes: the model (paper config by default), dtypes,
    backends, passes and the repeat counts."""
    ap.add_argument("--hidden", default="128x0e+128x1o")
    ap.add_argument("--max-ell", type=int, default=3)
    ap.add_argument("--correlation", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["numba", "numba-table", "e3nn", "cueq"],
        help="numba: the kernels the dispatcher picks (unrolled up to WORKBENCH_UNROLL_MAX_TERMS terms); "
        "numba-table / numba-unrolled: one kind forced",
    )
    ap.add_argument("--passes", nargs="+", default=list(passes))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=25)


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


def record_outputs(entry: dict, fn) -> list:
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


def timer(device: str, fn, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup``: CUDA events on a GPU,
    ``perf_counter`` on a CPU."""
    import time

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


def measure_pass(make_fn, device: str, warmup: int, repeats: int, entry: dict) -> list | None:
    """Build one pass (``make_fn()``), time it into ``entry`` (median, min, every repeat, peak
    memory, ``bitwise_repeatable``) and return its outputs (:func:`snapshot`); an exception
    becomes ``entry["error"]`` and ``None``, so the benchmark goes on with the next pass."""
    import statistics
    import traceback

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


def backend_model(
    base: torch.nn.Module, backend: str, modules: Sequence[str], results: dict, dtype: str
) -> torch.nn.Module:
    """``base`` on ``backend`` for a benchmark: the kernel switches its name asks for, a copy
    (:func:`with_backend`), and for numba on a GPU its kernels of ``modules`` compiled ahead
    (the report goes to ``results["precompile"]``)."""
    use_backend_kernels(backend)
    model = with_backend(base, backend)
    pre = precompile_for_bench(model, backend, modules)
    if pre:
        results.setdefault("precompile", {})[f"{backend} {dtype}"] = pre
    return model
