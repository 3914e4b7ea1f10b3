r"""``workbench bench quality``: model quality against mace-torch's own trainer, and what packing costs.

One command trains, on the same split of the embedded mixture, in the same dtype, for the same
number of optimiser steps and with the same recipe as far as both trainers allow:

* ``mace_run_train`` (mace-torch's trainer, batches of ``batch_size`` graphs), and
* ``workbench train`` with

  - ``mace-order``: mace's own batches of ``batch_size`` graphs in mace's order for the same
    seed, mace's statistics passes and its choice of final model (``keep="best"``), so each
    seed's run pairs with mace's (:mod:`workbench.train.mace_order`);
  - ``fixed-count``: batches of ``batch_size`` graphs from the workbench's own shuffle, the
    final weights exported (the defaults a user gets);
  - ``paper`` and ``shuffled-paper``: batches packed to ``capacity`` atoms, set so that a batch
    holds ``batch_size`` graphs on average,

each over several seeds (the workbench's hot ops on ``backend``: e3nn as in mace, or the numba
kernels, equal to e3nn within 1e-10 in float64), then evaluates every final model with one function
(:func:`~workbench.train.evaluation.evaluate_file`) on the same validation file. It prints a table,
writes JSON, and checks:

* **parity, paired**: ``mace-order`` against ``mace_run_train`` seed by seed: the 95% interval of
  the mean per-seed ratio of validation energy and force MAE lies within 1 ± 5%
  (:func:`~workbench.bench.quality_summary.paired_interval`). With the batches, statistics, initial weights and final-model
  choice shared, the seed noise cancels and what remains is the trainers' difference;
* **parity, unpaired**: ``fixed-count`` against ``mace_run_train``, means over seeds, with each
  ratio's 95% interval over seeds and the seeds per trainer that would resolve ±5%
  (:func:`~workbench.bench.quality_summary.ratio_interval`): what a different shuffle of the same batches costs, i.e. seed noise;
* **packing costs no accuracy**: ``paper`` and ``shuffled-paper`` are no worse than
  ``fixed-count`` by more than the seed-to-seed spread (the larger standard deviation of the two).

The recipe is otherwise identical: mace's ``ScaleShiftMACE`` with the same initial weights for
the same seed (both seed torch just before building the model), E0s by least squares,
``avg_num_neighbors``, scale = RMS force and shift = mean interaction energy per atom from
mace's own functions, the same loss (``--loss``, mace's definitions; ``weighted`` by default), Adam with amsgrad and mace's weight decay
(5e-7 on the interactions' linear and skip weights and the products), EMA, gradient clipping,
``ReduceLROnPlateau`` on the validation loss. In float64 on e3nn a ``mace-order`` run repeats
mace's training losses step for step (equal in our runs; ``tests/test_mace_order.py`` allows 1e-9).

What differs for the workbench's own samplers (``mace-order`` removes all but the last):

* **statistics**: mace computes ``avg_num_neighbors``, scale and shift over its shuffled
  training loader, which drops the last incomplete batch (7 of 1,583 graphs in the standard
  preset: 34.362 against 34.351 neighbours, shift 0.0589 against 0.0587 eV/atom); the workbench
  over every training graph.
* **final model**: ``mace_run_train`` keeps the checkpoint of the epoch with the lowest
  validation loss; ``workbench train`` exports the weights (EMA) after the last step unless
  ``keep="best"``.
* **epochs**: mace drops the last incomplete batch of an epoch, the workbench keeps it, so
  the same number of steps splits into slightly different epochs; the scheduler steps once per
  epoch in both.
* **batch order**: each shuffles with its own seeded generator, so the same seed does not give
  the same batches.
* **loss normalisation under packing**: the loss is a mean over a batch's graphs (energy) and
  atoms (forces), so a packed batch of many small graphs weighs each graph less than a batch of
  few large ones; fixed-count batches, as in mace, weigh each batch equally.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.bench.quality_summary import MACE_ORDER, format_table, summarise
from workbench.bench.table import write_json

if TYPE_CHECKING:
    from workbench.train.config import TrainConfig

__all__ = [
    "MACE_RECIPE",
    "PRESETS",
    "SAMPLERS",
    "Preset",
    "base_config",
    "bench_quality",
    "format_table",
    "mace_command",
    "run_mace",
    "run_workbench",
    "write_split",
]

SAMPLERS = (MACE_ORDER, "fixed-count", "paper", "shuffled-paper")


@dataclass(frozen=True)
class Preset:
    """A model and a training length for the comparison."""

    hidden_irreps: str
    max_ell: int
    correlation: int
    epochs: int  # mace epochs; the workbench runs the same number of steps
    max_structures: int | None  # labelled structures taken (before the split); None: all
    radial_mlp: list[int] = field(default_factory=lambda: [64, 64, 64])
    num_bessel: int = 8

    def train_fields(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields this preset sets: all but ``epochs`` (the workbench runs steps)."""
        return {k: v for k, v in asdict(self).items() if k != "epochs"}


PRESETS = {
    # About 7 minutes on 2 cores (15 runs of 66 steps): a smoke test of the comparison, noisy.
    "small": Preset(
        hidden_irreps="8x0e+8x1o",
        max_ell=1,
        correlation=2,
        epochs=2,
        max_structures=300,
        radial_mlp=[32, 32],
        num_bessel=6,
    ),
    # The reference comparison: 32x0e+32x1o, max_ell 2, correlation 2, 3 epochs of the whole mixture.
    "standard": Preset(hidden_irreps="32x0e+32x1o", max_ell=2, correlation=2, epochs=3, max_structures=None),
}


#: mace_run_train's defaults for the optimiser knobs the workbench shares, each a ``TrainConfig``
#: field and mace's flag ``--<field>``; pinned, so the comparison does not follow a change of
#: ``TrainConfig``'s own defaults.
MACE_RECIPE: dict[str, float] = {
    "lr": 0.01,
    "weight_decay": 5e-7,
    "ema_decay": 0.99,
    "energy_weight": 1.0,
    "forces_weight": 100.0,
    "clip_grad": 10.0,
    "lr_factor": 0.8,
    "scheduler_patience": 50,
}


def base_config(
    preset: Preset,
    workdir: Path,
    dtype: str = "float64",
    batch_size: int = 8,
    seed: int = 0,
    loss: str = "weighted",
    stress_weight: float = 0.0,
) -> TrainConfig:
    """The shared recipe (mace_run_train's defaults where the workbench has the same knob); ``loss``
    and ``stress_weight`` as mace's ``--loss`` and ``--stress_weight``."""
    from workbench.train.config import TrainConfig

    return TrainConfig(
        loss=loss,
        stress_weight=stress_weight,
        name="quality",
        output_dir=str(workdir),
        seed=seed,
        **preset.train_fields(),
        num_interactions=2,
        dtype=dtype,
        amsgrad=True,
        **MACE_RECIPE,
        sampler="fixed-count",
        batch_size=batch_size,
        progress=False,
        checkpoint_every=0,
        export=True,
    )


def write_split(config: TrainConfig, workdir: Path) -> dict:
    """Write the training and validation structures of ``config``'s split as two extxyz files."""
    from workbench.data.io import write_structures
    from workbench.train.data import load_structures, split_order

    structures = load_structures(config)
    train_pos, valid_pos = split_order(len(structures), config)
    train = [structures[i] for i in train_pos]
    valid = [structures[i] for i in valid_pos]
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"train": workdir / "train.extxyz", "valid": workdir / "valid.extxyz"}
    write_structures(paths["train"], train)
    write_structures(paths["valid"], valid)
    atoms = np.array([len(a) for a in train])
    return {
        "train": str(paths["train"]),
        "valid": str(paths["valid"]),
        "n_train": len(train),
        "n_valid": len(valid),
        "mean_atoms": float(atoms.mean()),
        "max_atoms": int(atoms.max()),
    }


def mace_command(config: TrainConfig, split: dict, workdir: Path, epochs: int) -> list[str]:
    """``mace_run_train`` with the recipe of ``config`` on the written split."""
    exe = shutil.which("mace_run_train", path=str(Path(sys.executable).parent)) or "mace_run_train"
    options: dict[str, Any] = {  # flag -> value; None: a switch
        "--name": "mace",
        "--seed": config.seed,
        "--work_dir": workdir,
        "--device": "cpu",
        "--default_dtype": config.dtype,
        "--model": "ScaleShiftMACE",
        "--train_file": split["train"],
        "--valid_file": split["valid"],
        "--energy_key": config.energy_key,
        "--forces_key": config.forces_key,
        "--stress_key": config.stress_key,
        "--virials_key": config.virials_key,
        "--E0s": "average",
        "--r_max": config.cutoff,
        "--num_radial_basis": config.num_bessel,
        "--num_cutoff_basis": config.num_polynomial_cutoff,
        "--max_ell": config.max_ell,
        "--correlation": config.correlation,
        "--num_interactions": config.num_interactions,
        "--hidden_irreps": config.hidden_irreps,
        "--MLP_irreps": config.mlp_irreps,
        "--radial_MLP": "[" + ",".join(str(x) for x in config.radial_mlp) + "]",
        "--batch_size": config.batch_size,
        "--valid_batch_size": config.batch_size,
        "--max_num_epochs": epochs,
        **{f"--{knob}": getattr(config, knob) for knob in MACE_RECIPE},
        "--amsgrad": None,
        "--ema": None,
        "--scheduler": "ReduceLROnPlateau",
        "--loss": config.loss,
        "--stress_weight": config.stress_weight,
        "--virials_weight": config.virials_weight,
        "--huber_delta": config.huber_delta,
        "--scaling": "rms_forces_scaling",
        "--eval_interval": 1,
        "--patience": 100000,
    }
    from workbench.train.foundation import mace_run_train_flags

    options.update(mace_run_train_flags(config, split if "pt_train" in split else None))
    cmd = [exe]
    for flag, value in options.items():
        cmd += [flag] if value is None else [flag, str(value)]
    return cmd


def _run(cmd: list[str], log: Path, threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        done = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {done.returncode}); log {log}:\n" + "\n".join(tail))
    return time.perf_counter() - t0


def run_mace(config: TrainConfig, split: dict, workdir: Path, epochs: int, threads: int) -> tuple[Path, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    wall = _run(mace_command(config, split, workdir, epochs), workdir / "mace_run_train.log", threads)
    model = workdir / "mace.model"
    if not model.exists():
        raise RuntimeError(f"mace_run_train finished without {model}; see {workdir / 'mace_run_train.log'}")
    return model, wall


def run_workbench(config: TrainConfig, workdir: Path, threads: int) -> tuple[Path, float]:
    from workbench.train.rundir import RunDir

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{config.name}.yaml"
    config.to_yaml(path)
    exe = str(Path(sys.executable).parent / "workbench")
    wall = _run([exe, "train", "--config", str(path)], workdir / "train.log", threads)
    return RunDir(config.run_dir).model, wall


#: the validation errors a row keeps (the stress ones where the split has stress labels)
ROW_METRICS = ("e_mae_mev_atom", "f_mae_mev_a", "e_rmse_mev_atom", "f_rmse_mev_a", "s_mae_mev_a3", "s_rmse_mev_a3")


def _row(trainer: str, sampler: str, seed: int, steps: int, wall: float, result: dict) -> dict:
    family_keys = ("e_mae_mev_atom", "f_mae_mev_a", "s_mae_mev_a3", "graphs")
    return {
        "trainer": trainer,
        "sampler": sampler,
        "seed": seed,
        "steps": steps,
        "wall_s": wall,
        **{k: result.get(k) for k in ROW_METRICS},
        "families": {k: {m: v.get(m) for m in family_keys} for k, v in result["families"].items()},
    }


def _settings(
    preset: str, dtype: str, batch_size: int, backend: str, samplers: Sequence[str], loss: str, stress_weight: float
) -> dict:
    """What a resumed bench must share with the one it resumes; unknown names are an error."""
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    unknown = sorted(set(samplers) - set(SAMPLERS))
    if unknown:
        raise KeyError(f"unknown sampler(s) {unknown}; choose from {', '.join(SAMPLERS)}")
    return {
        "preset": preset,
        "preset_config": asdict(PRESETS[preset]),
        "dtype": dtype,
        "batch_size": batch_size,
        "backend": backend,
        "loss": loss,
        "stress_weight": stress_weight,
    }


def _start(workdir: Path, settings: dict, resume: bool) -> list[dict]:
    """The rows kept from an earlier bench (``resume``), else an empty ``workdir``."""
    rows = _resumed_rows(workdir, settings) if resume else None
    if rows is None:
        if workdir.exists():
            shutil.rmtree(workdir)
        rows = []
    return rows


@dataclass(frozen=True)
class _Plan:
    """What every run of one bench shares."""

    settings: dict
    workdir: Path
    preset: Preset
    threads: int
    seeds: list[int]
    capacity: int
    steps: int


def _one_run(base: TrainConfig, job: tuple[int, str], split: dict, plan: _Plan) -> tuple[str, str, Path, float]:
    """One job (``(seed, "mace" or sampler)``) in its own folder: ``(trainer, sampler, model, wall)``."""
    seed, what = job
    where = plan.workdir / f"{what}-seed{seed}"
    if where.exists():
        shutil.rmtree(where)  # a run cut off part-way starts again
    if what == "mace":
        model, wall = run_mace(replace(base, seed=seed), split, where, plan.preset.epochs, plan.threads)
        return "mace_run_train", f"fixed {base.batch_size}", model, wall
    # mace-order pairs with mace_run_train entirely: its batches, statistics and final-model choice
    cfg = replace(
        base,
        name=f"{what}-seed{seed}",
        output_dir=str(plan.workdir),
        seed=seed,
        sampler=what,
        capacity=plan.capacity,
        dataset=split["train"],
        valid_dataset=split["valid"],
        max_structures=None,
        epochs=10 * plan.preset.epochs + 10,
        max_steps=plan.steps,
        keep="best" if what == MACE_ORDER else "last",
    )
    model, wall = run_workbench(cfg, where, plan.threads)
    return "workbench", what, model, wall


def _evaluated_run(base: TrainConfig, job: tuple[int, str], split: dict, plan: _Plan) -> dict:
    """One job run and its final model evaluated on the validation file: the job's row."""
    from workbench.train.evaluation import evaluate_file

    trainer, sampler, model, wall = _one_run(base, job, split, plan)
    keys = {k: getattr(base, k) for k in ("energy_key", "forces_key", "stress_key", "virials_key")}
    return _row(trainer, sampler, job[0], plan.steps, wall, evaluate_file(model, split["valid"], **keys))


def _result(plan: _Plan, rows: list[dict], jobs: list, split: dict) -> dict:
    """The JSON of the bench so far: settings, the rows of ``jobs`` finished, and their summary."""
    import torch

    kept = [r for r in rows if _job(r) in jobs]
    return {
        "bench": "quality",
        **plan.settings,
        "capacity": plan.capacity,
        "steps": plan.steps,
        "seeds": plan.seeds,
        "split": split,
        "threads": plan.threads,
        "torch": torch.__version__,
        "mace": _version("mace-torch"),
        "complete": len(kept) == len(jobs),
        "rows": kept,
        "summary": summarise(kept),
    }


def bench_quality(
    preset: str = "small",
    seeds: Sequence[int] = (0, 1, 2),
    samplers: Sequence[str] = SAMPLERS,
    mace: bool = True,
    dtype: str = "float64",
    batch_size: int = 8,
    threads: int = 2,
    backend: str = "e3nn",
    loss: str = "weighted",
    stress_weight: float = 0.0,
    workdir: str | os.PathLike = "runs/bench/quality",
    out: str | os.PathLike = "runs/bench/quality.json",
    resume: bool = False,
    progress: Callable[[str], object] = print,
) -> dict:
    """Run the comparison (see the module docstring); returns and writes the results.

    Each finished run appends its row to ``<workdir>/rows.jsonl`` and the JSON at ``out`` is rewritten
    after every run, so an interrupted bench keeps what it measured. With ``resume`` the runs already in
    ``rows.jsonl`` are kept (only if the bench's settings are the same) and the rest are run; without it
    ``workdir`` is replaced. Runs go seed by seed, so a partial bench compares every trainer on the
    seeds it reached. ``loss`` and ``stress_weight`` train both trainers with stress (``mace_run_train
    --loss stress --stress_weight ...``); the rows then carry the stress errors too.
    """
    settings = _settings(preset, dtype, batch_size, backend, samplers, loss, stress_weight)
    workdir = Path(workdir)
    # the workbench runs' backend and loss, checked by the config before anything is replaced
    recipe = base_config(PRESETS[preset], workdir, dtype, batch_size, loss=loss, stress_weight=stress_weight)
    base = replace(recipe, backend=backend)
    rows = _start(workdir, settings, resume)
    split = write_split(base, workdir / "split")
    (workdir / "bench.json").write_text(json.dumps(settings, indent=1) + "\n")
    steps = PRESETS[preset].epochs * (split["n_train"] // batch_size)  # mace drops the last incomplete batch
    capacity = max(split["max_atoms"], round(batch_size * split["mean_atoms"]))
    progress(
        f"split: {split['n_train']} training / {split['n_valid']} validation graphs "
        f"(mean {split['mean_atoms']:.0f} atoms); {steps} steps; packers at capacity {capacity} atoms"
    )
    done = {_job(r) for r in rows}
    if done:
        progress(f"resuming: {len(done)} run(s) kept from {workdir / 'rows.jsonl'}")
    jobs = [(seed, what) for seed in seeds for what in ((["mace"] if mace else []) + list(samplers))]
    plan = _Plan(settings, workdir, PRESETS[preset], threads, list(seeds), capacity, steps)
    for k, job in enumerate(jobs, 1):
        if job in done:
            continue
        row = _evaluated_run(base, job, split, plan)
        rows.append(row)
        with open(workdir / "rows.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        write_json(out, _result(plan, rows, jobs, split))
        stress = f", S MAE {row['s_mae_mev_a3']:.2f} meV/Å³" if row.get("s_mae_mev_a3") is not None else ""
        progress(
            f"[{k}/{len(jobs)}] {row['trainer']:<15} {row['sampler']:<15} seed {job[0]}: E MAE "
            f"{row['e_mae_mev_atom']:.1f} meV/atom, F MAE {row['f_mae_mev_a']:.1f} meV/Å{stress} ({row['wall_s']:.0f} s)"
        )
    final = _result(plan, rows, jobs, split)
    write_json(out, final)
    return final


def _job(row: dict) -> tuple[int, str]:
    """``(seed, "mace" or sampler)``: the job a result row came from."""
    return row["seed"], "mace" if row["trainer"] == "mace_run_train" else row["sampler"]


def _resumed_rows(workdir: Path, settings: dict) -> list[dict] | None:
    """The rows of an earlier bench in ``workdir`` with the same settings; None when there is none."""
    manifest, rows = workdir / "bench.json", workdir / "rows.jsonl"
    if not manifest.exists():
        return None
    before = json.loads(manifest.read_text())
    if before != settings:
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        raise ValueError(
            f"cannot resume the bench in {workdir}: its settings differ ({', '.join(changed)}); "
            "rerun without --resume to start afresh, or pass the same settings"
        )
    if not rows.exists():
        return []
    return [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
