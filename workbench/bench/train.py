"""``workbench bench train``: one epoch per variant, baseline against packer and kernels, in one run.

Variants (paper §5.4–5.6): ``baseline`` (``fixed-count`` batches of ``batch_size`` graphs, e3nn),
``packer-e3nn``, ``packer-numba`` and ``packer-cueq`` (the ``paper`` packer at ``capacity`` atoms);
``packer-numba-fixed`` and ``packer-cueq-fixed`` on fixed-shape batches, ``packer-numba-graph``
with the step as a CUDA graph per shape (its captures fall in the timed epoch, as in a run).
Each variant first runs ``warmup_steps`` steps in a throw-away run directory, so JIT compilation
(numba, cuEquivariance, cuBLAS handles) stays out of the timed epoch, then trains one full epoch
over the same training split. That split (mace ``AtomicData`` with neighbour lists, E0s and the other
statistics) is prepared once and shared by every run, so no variant's time includes it. The table
gives epoch time (sum of step wall times), atoms/s, peak GPU memory, the compute / data-wait /
all-reduce split and the ratios against the baseline and against ``packer-cueq``.

The mixture is the embedded dataset's labelled structures, tiled to ``structures`` with rattled
copies (0.02 Å, labels copied): the copies are for timing only, their labels are not physical.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.bench.table import Column, render, verdict, write_json
from workbench.kernels.registry import DEFAULT_BACKEND

if TYPE_CHECKING:
    from workbench.train.config import TrainConfig

__all__ = ["VARIANTS", "bench_structures", "bench_train", "format_table"]

#: name -> (sampler, backend, other TrainConfig fields)
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "baseline": ("fixed-count", "e3nn", {}),
    "packer-e3nn": ("paper", "e3nn", {}),
    f"packer-{DEFAULT_BACKEND}": ("paper", DEFAULT_BACKEND, {}),
    "packer-cueq": ("paper", "cueq", {}),
    # fixed-shape batches, and the step as one CUDA graph per shape
    f"packer-{DEFAULT_BACKEND}-fixed": ("paper", DEFAULT_BACKEND, {"fixed_shapes": True}),
    f"packer-{DEFAULT_BACKEND}-graph": ("paper", DEFAULT_BACKEND, {"fixed_shapes": True, "cuda_graph": True}),
    "packer-cueq-fixed": ("paper", "cueq", {"fixed_shapes": True}),
}
#: per-step reference timings the project was set against: one H100, paper config (128x0e+128x1o,
#: max_ell 3, correlation 3), 3072 atoms at ~48 edges per atom, float32
ANCHORS = {"e3nn_step_ms_3072": 286.0, "e3nn_peak_gb_3072": 21.5, "cueq_step_ms_3072": 91.0, "cueq_peak_gb_3072": 4.5}


def bench_structures(n: int, seed: int = 0, config: TrainConfig | None = None) -> list:
    """``n`` labelled structures: ``config``'s dataset and families, tiled with rattled copies.

    The family mix of the source is kept (copies cycle through a seeded permutation).
    """
    from workbench.train.config import TrainConfig
    from workbench.train.data import load_structures

    base = load_structures(config or TrainConfig())
    rng = np.random.default_rng(seed)
    out = list(base[:n])
    order = rng.permutation(len(base))
    i = 0
    while len(out) < n:
        a = base[order[i % len(base)]].copy()  # info (REF_energy) and arrays (REF_forces) come along
        a.positions = a.positions + rng.normal(scale=0.02, size=a.positions.shape)
        a.info["bench_copy"] = True
        out.append(a)
        i += 1
    return out


def _available(backend: str) -> str | None:
    """None when ``backend`` can run here, else why not."""
    import torch

    if backend == "cueq":
        if not torch.cuda.is_available():
            return "cuEquivariance needs a CUDA GPU"
        try:
            import cuequivariance_torch  # noqa: F401
        except ImportError:
            return "cuequivariance-torch is not installed"
    return None


def _summarise(run_dir: Path, wall_s: float) -> dict:
    from workbench.train.rundir import read_epochs, read_steps

    steps = read_steps(run_dir, rank=0)
    epoch = read_epochs(run_dir)[-1]
    step_s = np.array([s["step_s"] for s in steps])
    atoms = int(sum(s["atoms"] for s in steps))
    total = float(step_s.sum())
    return {
        "steps": len(steps),
        "atoms": atoms,
        "edges": int(sum(s["edges"] for s in steps)),
        "epoch_s": total,
        "wall_s": wall_s,
        "atoms_per_s": atoms / total if total else float("nan"),
        "step_ms_median": 1000 * float(np.median(step_s)),
        "step_ms_max": 1000 * float(step_s.max()),
        "atoms_per_step_mean": atoms / max(len(steps), 1),
        "compute_share": epoch["compute_share"],
        "data_share": epoch["data_share"],
        "allreduce_share": epoch["allreduce_share"],
        "peak_mem_gb": epoch.get("peak_mem_gb"),
        "final_loss": epoch["loss"],
    }


class _Prepared:
    """The training data, prepared once per set of fields that feed preparation: the variants
    differ only in fields that do not, so a bench prepares once."""

    def __init__(self, structures: list) -> None:
        self.structures, self.cache = structures, {}

    def __call__(self, cfg: TrainConfig):
        from workbench.train.data import PREPARE_FIELDS, prepare_data

        key = repr([getattr(cfg, f) for f in PREPARE_FIELDS])
        if key not in self.cache:
            self.cache[key] = prepare_data(cfg, self.structures)
        return self.cache[key]


def _variant(name: str, cfg: TrainConfig, root: Path, data, warmup_steps: int, keep_runs: bool) -> dict:
    """Warm up in a throw-away run, then time one epoch of ``cfg``; the summary of the epoch."""
    import torch

    from workbench.train.loop import train

    for d in (cfg.run_dir, root / f"{name}-warmup"):
        shutil.rmtree(d, ignore_errors=True)
    if warmup_steps:
        train(cfg.replace(name=f"{name}-warmup", max_steps=warmup_steps, progress=False), resume=False, data=data)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(cfg, resume=False, data=data)
    row = {"sampler": cfg.sampler, "backend": cfg.backend, **_summarise(cfg.run_dir, time.perf_counter() - t0)}
    if not keep_runs:
        shutil.rmtree(root / f"{name}-warmup", ignore_errors=True)
    return row


def _ratios(v: dict) -> tuple[dict, dict]:
    """Epoch-time ratios against the baseline and numba against cueq, and the two targets."""
    ratios = {}
    if "baseline" in v:
        for name, r in v.items():
            ratios[f"baseline/{name}"] = v["baseline"]["epoch_s"] / r["epoch_s"]
    for ours, theirs in (
        ("packer-numba", "packer-cueq"),
        ("packer-numba-graph", "packer-cueq"),
        ("packer-numba-graph", "packer-cueq-fixed"),
    ):
        if ours in v and theirs in v:
            ratios[f"{ours}/{theirs}"] = v[ours]["epoch_s"] / v[theirs]["epoch_s"]
    speed, vs_cueq = ratios.get("baseline/packer-numba"), ratios.get("packer-numba/packer-cueq")
    targets = {
        "packer-numba >= 3x faster than baseline": None if speed is None else speed >= 3.0,
        "packer-numba not slower than packer-cueq": None if vs_cueq is None else vs_cueq <= 1.0,
    }
    return ratios, targets


def _setup(config: TrainConfig, structures: int, batch_size: int, warmup_steps: int) -> dict:
    import torch

    return {
        "structures": structures,
        "batch_size": batch_size,
        "capacity": config.capacity,
        "dtype": config.dtype,
        "hidden_irreps": config.hidden_irreps,
        "max_ell": config.max_ell,
        "correlation": config.correlation,
        "num_interactions": config.num_interactions,
        "warmup_steps": warmup_steps,
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or 'x86_64'}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "anchors": ANCHORS,
        "note": "rattled copies of the embedded labelled structures; labels of copies are for timing only",
    }


def bench_train(
    config: TrainConfig,
    structures: int = 5000,
    batch_size: int = 7,
    variants: Sequence[str] = tuple(VARIANTS),
    warmup_steps: int = 3,
    seed: int = 0,
    out: str | os.PathLike | None = "runs/bench/train.json",
    keep_runs: bool = False,
) -> dict:
    """Time one epoch for each of ``variants``; return (and write to ``out``) the results.

    ``config`` gives the model and the capacity (default: the paper's settings); its ``sampler``,
    ``backend``, ``epochs`` and run directory are set per variant.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose among {list(VARIANTS)}")
    prepared = _Prepared(bench_structures(structures, seed=seed, config=config))
    root = Path(config.output_dir) / "bench-train"
    results: dict = {"variants": {}, "skipped": {}}
    for name in variants:
        sampler, backend, extra = VARIANTS[name]
        why = _available(backend)
        if why:
            results["skipped"][name] = why
            print(f"[bench train] skip {name}: {why}", flush=True)
            continue
        cfg = config.replace(
            name=name,
            output_dir=str(root),
            sampler=sampler,
            backend=backend,
            batch_size=batch_size,
            epochs=1,
            max_steps=None,
            checkpoint_every=0,
            seed=seed,
            export=False,
            **extra,
        )
        results["variants"][name] = _variant(name, cfg, root, prepared(cfg), warmup_steps, keep_runs)
    results["ratios"], results["targets"] = _ratios(results["variants"])
    results["setup"] = _setup(config, structures, batch_size, warmup_steps)
    if out:
        write_json(out, results, indent=2)
    return results


def format_table(results: dict) -> str:
    """The results as a fixed-width table with ratios."""
    base = results["variants"].get("baseline")
    rows = [{"name": name, **r} for name, r in results["variants"].items()]
    columns = [
        Column("variant", "name", width=14, align="<"),
        Column("steps", "steps", "d", 6),
        Column("epoch s", "epoch_s", ".2f", 9),
        Column("atoms/s", "atoms_per_s", ".0f", 10),
        Column("step ms", "step_ms_median", ".1f", 8),
        Column("peak GB", "peak_mem_gb", ".2f", 8),
        Column("compute", "compute_share", ".0%", 8),
        Column("data", "data_share", ".0%", 6),
        Column("allred", "allreduce_share", ".0%", 7),
        Column("x base", lambda r: base["epoch_s"] / r["epoch_s"] if base else float("nan"), ".2f", 7),
    ]
    lines = [render(rows, columns)]
    lines += [f"{name:<14} skipped: {why}" for name, why in results.get("skipped", {}).items()]
    lines += [f"target {k}: {verdict(ok)}" for k, ok in results.get("targets", {}).items()]
    return "\n".join(lines)
