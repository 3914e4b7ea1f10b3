r"""Compile the CUDA kernels of a training step before the step: in parallel processes, once per node.

A fresh node would compile every generated kernel at its first launch, one after another
(numba's typing and lowering, NVVM, then ptxas: up to ~25 s each at the paper configuration).
Instead, the launches of each op's forward and training derivatives are planned up front
(:mod:`~workbench.kernels.launches`) and every generated kernel is compiled by its own worker
process into numba's on-disk cache, so the step that follows loads machine code.

* **One compiler per node.** The processes of a node take a file lock in the cache folder
  (``fcntl.lockf``, which NFS and Lustre honour when mounted with locking): the first compiles,
  the others wait, then find every kernel done.
* **A shared cache.** The folder is ``$WORKBENCH_KERNEL_CACHE`` (default
  ``~/.cache/cfm-workbench/kernels``); put it on a shared filesystem and a kernel one job
  compiled is loaded by the next. A marker per kernel, target and numba-cuda version records
  what is in the cache.
* **Workers** are plain ``python -m workbench.kernels.precompile --worker`` processes (no
  ``multiprocessing``: nothing of the caller's ``__main__`` is re-imported), as many as
  ``$WORKBENCH_PRECOMPILE_WORKERS`` or the usable cores, longest kernel first.

``target="device"`` compiles for the GPU of this process into the cache; ``target="ptx"``
(no GPU needed) compiles each kernel to PTX and assembles it with ``ptxas`` for ``cc``, which
costs what a GPU node pays and caches nothing numba can load: it measures a cold start here.

    >>> report = precompile(model_ops(model), "float32")
    >>> report.compiled, report.seconds
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.kernels.launches import OpSite
from workbench.kernels.numba.gpu.unrolled import GENERATED_PREFIX
from workbench.kernels.options import child_environment, kernel_options

__all__ = ["KernelJob", "PrecompileReport", "kernel_jobs", "node_lock", "precompile", "target_id", "usable_cores"]


@dataclass(frozen=True)
class KernelJob:
    """One generated kernel and the argument types it is launched with."""

    path: str  # the generated module's source file
    signature: tuple  # encoded argument types (:func:`encode_types`)
    label: str  # where it is launched, e.g. "products.0 backward atom pass"
    terms: int

    @property
    def key(self) -> str:
        return hashlib.sha1(f"{Path(self.path).name}|{json.dumps(self.signature)}".encode()).hexdigest()[:24]


@dataclass
class PrecompileReport:
    """What :func:`precompile` did: kernels planned, compiled now, found done, in what wall time."""

    target: str
    jobs: int = 0
    compiled: int = 0
    cached: int = 0
    workers: int = 0
    seconds: float = 0.0  # wall time, lock wait included
    waited_s: float = 0.0  # blocked on another process's lock
    slowest: list = field(default_factory=list)  # [(label, seconds)] of the five slowest kernels
    errors: list = field(default_factory=list)  # [(label, message)]

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- argument types
def encode_types(types: Sequence[Any]) -> tuple:
    """numba argument types as JSON-safe tuples: ``("array", dtype, ndim, layout, readonly)`` or
    ``("scalar", name)``; the kernels take nothing else."""
    from numba.core import types as nt

    out = []
    for t in types:
        if isinstance(t, nt.Array):
            out.append(("array", str(t.dtype), t.ndim, t.layout, not t.mutable))
        elif isinstance(t, (nt.Integer, nt.Float, nt.Boolean)):
            out.append(("scalar", str(t)))
        else:
            raise TypeError(f"precompile: cannot name kernel argument type {t!r} for a worker process")
    return tuple(out)


def decode_types(encoded: Sequence[Sequence]) -> tuple:
    """The numba types :func:`encode_types` named."""
    from numba.core import types as nt

    out = []
    for item in encoded:
        if item[0] == "array":
            _, dtype, ndim, layout, readonly = item
            out.append(nt.Array(getattr(nt, dtype), int(ndim), layout, readonly=bool(readonly)))
        elif item[0] == "scalar":
            out.append(getattr(nt, item[1]))
        else:
            raise ValueError(f"precompile: unknown encoded argument type {item!r}")
    return tuple(out)


# ----------------------------------------------------------------------------- planning
def _device_alloc(device: Any):
    from numba import cuda

    def alloc(shape: tuple, dtype: str):
        with cuda.gpus[device.index or 0]:
            return cuda.device_array(shape, dtype=dtype)

    return alloc


def kernel_jobs(ops: Sequence[OpSite], dtype: str, device: Any = None) -> tuple[list[KernelJob], list]:
    """``(jobs, in_process)`` for ``ops``: one :class:`KernelJob` per
    distinct generated kernel of each op's forward and training derivatives, longest first, and
    ``(label, kernel, argument types)`` of the small kernels numba keeps in memory only (table
    and per-species sums), which compile in the process that launches them.

    ``device``: a CUDA ``torch.device`` plans on device arrays, exactly as the launch types them;
    ``None`` plans on host arrays (the same types, for PTX)."""
    import numba

    from workbench.kernels.launches import launches, training_ops

    alloc = None if device is None else _device_alloc(device)
    jobs: dict[tuple, KernelJob] = {}
    in_process = []
    for site in ops:
        for pass_label, pass_op in training_ops(site.op, site.position_free):
            for launch in launches(pass_op, dtype, site.channels, alloc):
                if launch.plan is None:
                    continue
                kernel, _, _, args = launch.plan
                types = tuple(numba.typeof(a) for a in args)
                where = f"{site.label} {pass_label} {launch.output}"
                module = sys.modules.get(getattr(kernel.py_func, "__module__", ""), None)
                path = getattr(module, "__file__", None)
                if path is None or not module.__name__.startswith(GENERATED_PREFIX):
                    in_process.append((where, kernel, types))
                    continue
                job = KernelJob(str(path), encode_types(types), where, launch.terms)
                jobs.setdefault((job.path, job.signature), job)
    return sorted(jobs.values(), key=lambda j: -j.terms), in_process


def target_id(target: str, cc: tuple[int, int] | None = None) -> str:
    """Names what a marker vouches for: the compute capability (this GPU's for ``"device"``) and
    the numba-cuda version, since either changes the machine code."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        nbc = version("numba-cuda")
    except PackageNotFoundError:
        nbc = "unknown"
    if cc is None:
        from numba import cuda

        cc = cuda.get_current_device().compute_capability
    kind = "sm" if target == "device" else "ptxas-sm"
    return f"{kind}{cc[0]}{cc[1]}-numba-cuda-{nbc}"


# ----------------------------------------------------------------------------- the node lock
@contextmanager
def node_lock(folder: Path) -> Iterator[float]:
    """Hold ``folder/precompile.lock`` (blocking); yields the seconds spent waiting for it."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(folder / "precompile.lock", "a+") as fh:
        fcntl.lockf(fh, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - t0
        finally:
            fcntl.lockf(fh, fcntl.LOCK_UN)


def _marker(folder: Path, target: str, job: KernelJob) -> Path:
    return folder / "ready" / target / job.key


def _write_marker(marker: Path, content: dict) -> None:
    """A marker is a shortcut only: where it cannot be written (full disk) the next run checks
    numba's cache instead."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(content))
    except OSError:
        with suppress(OSError):  # a half-written marker would vouch for nothing
            marker.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- workers
def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _visible_device(index: int | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a worker compiling for this process's device ``index``, so
    that the workers of rank 3 make their contexts on GPU 3, not all on GPU 0."""
    if index is None:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else (None if visible else str(index))


def _start_worker(target: str, cc: tuple[int, int] | None, device_index: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workbench.kernels.precompile", "--worker", "--target", target]
    if cc is not None:
        cmd += ["--cc", f"{cc[0]}.{cc[1]}"]
    # the options set in code here (a cache folder, a kernel kind) hold in the worker too
    env = {**child_environment(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    visible = _visible_device(device_index) if target == "device" else None
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env
    )


def _serve(proc: subprocess.Popen, todo: queue.Queue[KernelJob], done: queue.Queue[tuple]) -> None:
    """Feed one worker jobs until the queue is empty; every reply goes to ``done``."""
    try:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                break
            proc.stdin.write(json.dumps({"path": job.path, "signature": job.signature}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            reply = json.loads(line) if line else {"error": f"worker exited ({proc.poll()})"}
            done.put((job, reply))
            if not line:
                break
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        proc.wait()


def _compile_all(
    todo: list[KernelJob],
    workers: int,
    target: str,
    cc,
    folder: Path,
    tid: str,
    report: PrecompileReport,
    progress: bool,
    device_index: int | None = None,
) -> None:
    from workbench.progress import bar

    jobs: queue.Queue[KernelJob] = queue.Queue()
    for job in todo:
        jobs.put(job)
    done: queue.Queue[tuple] = queue.Queue()
    threads = [
        threading.Thread(target=_serve, args=(_start_worker(target, cc, device_index), jobs, done), daemon=True)
        for _ in range(workers)
    ]
    for t in threads:
        t.start()
    times = []
    with bar(
        total=len(todo),
        desc=f"compiling {len(todo)} kernels on {workers} processes",
        unit="kernel",
        disable=not progress,
    ) as pbar:
        for _ in todo:
            job, reply = done.get()
            if "error" in reply:
                report.errors.append((job.label, reply["error"]))
            else:
                _write_marker(_marker(folder, tid, job), {"label": job.label, "seconds": reply["seconds"]})
                times.append((job.label, round(reply["seconds"], 2)))
                report.compiled += 1
            pbar.update(1)
    for t in threads:
        t.join()
    report.slowest = sorted(times, key=lambda x: -x[1])[:5]


def precompile(
    ops: Sequence[OpSite],
    dtype: str,
    *,
    device: Any = None,
    target: str = "device",
    cc: tuple[int, int] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> PrecompileReport:
    """Compile every generated kernel that force training launches for ``ops`` (where a model
    uses each op, :class:`~workbench.kernels.launches.OpSite`) in ``dtype``, in parallel worker
    processes, under the node lock.

    ``target="device"``: for this process's GPU (``device``, a CUDA ``torch.device``), into
    numba's cache; ``"ptx"``: PTX then ``ptxas`` for ``cc`` (default 9.0), no GPU needed,
    markers only. Kernels whose marker exists are skipped. A kernel that fails to compile is
    listed in ``errors`` (it compiles again at its launch, where the error is raised)."""
    from workbench.kernels.numba.cache_folder import KernelCacheWarning, source_dir, unwritable

    if target not in ("device", "ptx"):
        raise ValueError(f"precompile: unknown target {target!r}; choose 'device' or 'ptx'")
    if target == "ptx" and cc is None:
        cc = (9, 0)
    t0 = time.perf_counter()
    tid = target_id(target, cc)
    report = PrecompileReport(target=tid)
    jobs, _ = kernel_jobs(ops, dtype, device if target == "device" else None)
    report.jobs = len(jobs)
    folder = source_dir()
    if all(_marker(folder, tid, j).exists() for j in jobs):  # all done: no need to queue behind another compile
        report.cached = len(jobs)
        report.seconds = round(time.perf_counter() - t0, 3)
        return report
    why = unwritable(folder)
    if why:  # a read-only or full cache: a run goes on, its kernels compile at their launch
        warnings.warn(
            KernelCacheWarning(f"kernel cache {folder}: cannot write ({why}); kernels compile at their first launch"),
            stacklevel=2,
        )
        report.seconds = round(time.perf_counter() - t0, 3)
        return report
    with node_lock(folder) as waited:
        report.waited_s = round(waited, 3)
        todo = [j for j in jobs if not _marker(folder, tid, j).exists()]
        report.cached = len(jobs) - len(todo)
        if todo:
            report.workers = max(1, min(len(todo), workers or kernel_options().precompile_workers or usable_cores()))
            index = getattr(device, "index", None) if target == "device" else None
            _compile_all(todo, report.workers, target, cc, folder, tid, report, progress, index)
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


# ----------------------------------------------------------------------------- worker side
def _compile_job(path: str, signature: Sequence, target: str, cc: tuple[int, int] | None, ptxas: str | None) -> float:
    from workbench.kernels.numba.generated import load_module

    text = Path(path).read_text()
    kernel = load_module(text, GENERATED_PREFIX).kernel
    types = decode_types(signature)
    t0 = time.perf_counter()
    if target == "device":
        kernel.compile(types)  # binds (builds the cubin) and saves to numba's cache
        return time.perf_counter() - t0
    from numba import cuda

    ptx, _ = cuda.compile_ptx(kernel.py_func, types, cc=cc)
    if ptxas:
        from workbench.kernels.numba.gpu.toolkit import assembled

        with assembled(ptx, cc, ptxas, timeout=900):
            pass
    return time.perf_counter() - t0


def _worker(target: str, cc: tuple[int, int] | None) -> int:
    """Answer one JSON line per job read from stdin: ``{"seconds"}`` or ``{"error"}``."""
    import traceback

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # numba's and the compiler's chatter must not reach the reply channel
    ptxas = None
    if target == "ptx":
        from workbench.kernels.numba.gpu.toolkit import find_ptxas

        ptxas = find_ptxas()
    for line in sys.stdin:
        job = json.loads(line)
        try:
            reply = {"seconds": _compile_job(job["path"], job["signature"], target, cc, ptxas)}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        replies.write(json.dumps(reply) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="a precompile worker process (started by precompile())")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--target", choices=("device", "ptx"), required=True)
    ap.add_argument("--cc", default=None)
    args = ap.parse_args(argv)
    cc = tuple(int(v) for v in args.cc.split(".")) if args.cc else None
    return _worker(args.target, cc)


if __name__ == "__main__":
    sys.exit(main())
