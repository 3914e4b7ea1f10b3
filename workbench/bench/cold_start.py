"""``workbench bench cold-start``: from ``accelerate()`` on a node with an empty kernel cache to the
first optimizer step.

A fresh process per measurement, each with the kernel cache it is given:

* ``cold``: an empty cache folder. On a GPU the clock runs from ``accelerate(model)`` (which
  compiles every kernel of a force-training step in parallel processes,
  :mod:`workbench.kernels.precompile`) through the first step (energy + force loss, backward,
  Adam step, synchronised). Without a GPU the same kernels are compiled to PTX and assembled by
  ``ptxas`` for sm_90 in the same worker processes (what a GPU node pays for the compile), and
  the clock stops there.
* ``warm``: the same cache again, as the next job on a shared filesystem finds it.
* ``serial`` (``--serial``): an empty cache, one worker: what compiling kernel after kernel costs.

Model: the paper configuration (128x0e+128x1o, max_ell 3, correlation 3, two layers) on a
periodic water box (3072 atoms by default). JSON (``benchmarks/results/cold_start_<machine>.json``):
``{"machines": {"<name>": {"seconds": <cold>, "runs": {...}}}}``, merged with what is there.

    workbench bench cold-start                       # here: PTX + ptxas, 2 cores
    workbench bench cold-start --serial --workers 16 # on a GPU node
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workbench.bench.table import RESULTS_DIR, Column, read_json, render, verdict, write_json
from workbench.kernels.options import child_environment, overridden
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["DEFAULT_OUT", "TARGET_S", "cold_start", "format_table", "main", "measure"]

#: the target, seconds from accelerate() to the first optimizer step (paper config, float32)
TARGET_S = 60.0
DEFAULT_OUT = str(RESULTS_DIR / "cold_start_{machine}.json")


def _machine_name() -> str:
    import torch

    from workbench.kernels.precompile import usable_cores

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = f"cpu-{usable_cores()}-cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _generated_kernel_stats() -> dict[str, int]:
    """How the generated kernels loaded so far got their machine code: ``compiled`` in this
    process, or ``loaded`` from numba's cache."""
    from workbench.kernels.precompile import GENERATED_PREFIX

    hits = misses = 0
    for name, mod in list(sys.modules.items()):
        kernel = getattr(mod, "kernel", None) if name.startswith(GENERATED_PREFIX) else None
        if kernel is not None and hasattr(kernel, "_cache_hits"):
            hits += sum(kernel._cache_hits.values())
            misses += sum(kernel._cache_misses.values())
    return {"compiled_in_process": misses, "loaded_from_cache": hits}


def measure(
    hidden: str, max_ell: int, correlation: int, atoms: int, dtype: str, target: str, workers: int | None
) -> dict[str, Any]:
    """One measurement in this process (the kernel cache is whatever ``$WORKBENCH_KERNEL_CACHE`` says)."""
    t_import = time.perf_counter()
    import torch

    from workbench.bench.step_model import train_step
    from workbench.bench.workloads import system_batch
    from workbench.kernels import accelerate
    from workbench.kernels.acceleration import precompile_model
    from workbench.kernels.tools.models import random_scaleshift_mace

    device = "cuda" if target == "device" else "cpu"
    batch, zs, info = system_batch(f"water-{atoms}", dtype)
    batch = {k: v.to(device) for k, v in batch.items()}
    model = random_scaleshift_mace(
        hidden, max_ell, correlation, zs, info["edges"] / info["atoms"], getattr(torch, dtype), device
    )
    res: dict[str, Any] = {
        "setup_s": round(time.perf_counter() - t_import, 2),
        "atoms": info["atoms"],
        "edges": info["edges"],
        "target": target,
    }
    t0 = time.perf_counter()
    model = accelerate(model, backend=DEFAULT_BACKEND, precompile=False)
    report = precompile_model(model, target=target, workers=workers)
    res["precompile"] = report.as_dict()
    res["precompile_s"] = round(time.perf_counter() - t0, 2)
    if target == "device":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        t1 = time.perf_counter()
        res["loss"] = float(train_step(model, optimizer, batch))
        torch.cuda.synchronize()
        res["first_step_s"] = round(time.perf_counter() - t1, 2)
        t2 = time.perf_counter()
        train_step(model, optimizer, batch)
        torch.cuda.synchronize()
        res["second_step_s"] = round(time.perf_counter() - t2, 3)
        res["seconds"] = round(t2 - t0, 2)
        res.update(_generated_kernel_stats())
    else:
        res["seconds"] = res["precompile_s"]
    return res


def _run_child(args: dict, cache: Path) -> dict:
    """:func:`measure` in a fresh interpreter with ``cache`` as its kernel cache."""
    with overridden(kernel_cache=str(cache)):
        env = {**child_environment(), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.bench.cold_start", "--child", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        env=env,
        timeout=3600,
    )
    if proc.returncode != 0:
        return {"error": f"child exited {proc.returncode}", "wall_s": round(time.perf_counter() - t0, 1)}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = round(time.perf_counter() - t0, 2)
    return res


def cold_start(
    hidden: str = "128x0e+128x1o",
    max_ell: int = 3,
    correlation: int = 3,
    atoms: int = 3072,
    dtype: str = "float32",
    target: str = "auto",
    workers: int | None = None,
    serial: bool = False,
    cache: str | None = None,
) -> dict[str, Any]:
    """Measure ``cold`` (and ``warm``, and with ``serial`` one worker from empty) in fresh processes.
    ``target``: ``"device"`` (a GPU), ``"ptx"`` (no GPU needed) or ``"auto"``. ``cache``: the
    folder for the cold run (must be empty or absent; default a new temporary folder)."""
    import torch

    from workbench.kernels.precompile import usable_cores

    if target == "auto":
        target = "device" if torch.cuda.is_available() else "ptx"
    args = dict(hidden=hidden, max_ell=max_ell, correlation=correlation, atoms=atoms, dtype=dtype)
    args.update(target=target, workers=workers)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="wb-kernel-cache-") as tmp:
        folder = Path(cache) if cache else Path(tmp) / "cold"
        if folder.exists() and any(folder.iterdir()):
            raise ValueError(f"cold start: {folder} is not empty; a cold start needs an empty kernel cache")
        print(f"cold start: {target}, kernel cache {folder} (empty)", file=sys.stderr, flush=True)
        runs["cold"] = _run_child(args, folder)
        print("warm start: the same cache again", file=sys.stderr, flush=True)
        runs["warm"] = _run_child(args, folder)
        if serial:
            print("serial: one worker, empty cache", file=sys.stderr, flush=True)
            runs["serial"] = _run_child({**args, "workers": 1}, Path(tmp) / "serial")
    cold = runs["cold"]
    return {
        "seconds": cold.get("seconds"),
        "target_s": TARGET_S,
        "what": _what(target),
        "config": args,
        "cores": usable_cores(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.node(),
        "runs": runs,
    }


def _what(target: str) -> str:
    if target == "device":
        return "accelerate() with an empty kernel cache to the end of the first optimizer step (synchronised)"
    return (
        "accelerate() with an empty kernel cache to every kernel of a force-training step compiled to PTX and "
        "assembled by ptxas for sm_90 (no GPU here: the first step itself is not run)"
    )


def format_table(name: str, res: dict) -> str:
    """Each run's seconds and what its compile did, and the target's verdict."""

    def pre(key: str):
        return lambda r: r["precompile"][key] if "precompile" in r else None

    columns = [
        Column("run", "run", width=7, align="<"),
        Column("seconds", lambda r: r.get("error") or r["seconds"], ".1f", 8),
        Column("compiled", pre("compiled")),
        Column("cached", pre("cached")),
        Column("workers", pre("workers")),
        Column("compile s", "precompile_s", ".2f"),
        Column("first step s", "first_step_s", ".2f"),
        Column("compiled in process", "compiled_in_process"),
    ]
    rows = [{"run": run, **r} for run, r in res["runs"].items()]
    title = f"cold start on {name} ({res['cores']} cores, {res['what']}):"
    ok = res["seconds"] is not None and res["seconds"] <= TARGET_S
    return render(rows, columns, title=title, indent="  ") + f"\n  target <= {TARGET_S:.0f} s: {verdict(ok)}"


def main(args) -> int:
    """``workbench bench cold-start``: measure, print, and merge the result into ``--out``."""
    res = cold_start(
        args.hidden,
        args.max_ell,
        args.correlation,
        args.atoms,
        args.dtype,
        args.target,
        args.workers,
        args.serial,
        args.cache,
    )
    name = args.name or _machine_name()
    print(format_table(name, res))
    if args.out:
        path = Path(args.out.format(machine=name))
        data = read_json(path, default={})
        data.setdefault("machines", {})[name] = res
        write_json(path, data)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(**json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} is run by `workbench bench cold-start`")
