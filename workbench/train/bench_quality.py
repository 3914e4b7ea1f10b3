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
(:func:`~workbench.train.evaluate.evaluate_file`) on the same validation file. It prints a table,
writes JSON, and checks:

* **parity, paired**: ``mace-order`` against ``mace_run_train`` seed by seed: the 95% interval of
  the mean per-seed ratio of validation energy and force MAE lies within 1 ± 5%
  (:func:`paired_interval`). With the batches, statistics, initial weights and final-model
  choice shared, the seed noise cancels and what remains is the trainers' difference;
* **parity, unpaired**: ``fixed-count`` against ``mace_run_train``, means over seeds, with each
  ratio's 95% interval over seeds and the seeds per trainer that would resolve ±5%
  (:func:`ratio_interval`): what a different shuffle of the same batches costs, i.e. seed noise;
* **packing costs no accuracy**: ``paper`` and ``shuffled-paper`` are no worse than
  ``fixed-count`` by more than the seed-to-seed spread (the larger standard deviation of the two).

The recipe is otherwise identical: mace's ``ScaleShiftMACE`` with the same initial weights for
the same seed (both seed torch just before building the model), E0s by least squares,
``avg_num_neighbors``, scale = RMS force and shift = mean interaction energy per atom from
mace's own functions, ``WeightedEnergyForcesLoss``, Adam with amsgrad and mace's weight decay
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from workbench.train.config import TrainConfig
from workbench.train.mace_order import NAME as MACE_ORDER

SAMPLERS = (MACE_ORDER, "fixed-count", "paper", "shuffled-paper")
PARITY_TOLERANCE = 0.05  # relative, on the means over seeds


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
    # The comparison of issue 20: 32x0e+32x1o, max_ell 2, correlation 2, 3 epochs of the whole mixture.
    "standard": Preset(hidden_irreps="32x0e+32x1o", max_ell=2, correlation=2, epochs=3, max_structures=None),
}


def base_config(
    preset: Preset, workdir: Path, dtype: str = "float64", batch_size: int = 8, seed: int = 0
) -> TrainConfig:
    """The shared recipe (mace_run_train's defaults where the workbench has the same knob)."""
    return TrainConfig(
        name="quality",
        output_dir=str(workdir),
        seed=seed,
        max_structures=preset.max_structures,
        hidden_irreps=preset.hidden_irreps,
        max_ell=preset.max_ell,
        correlation=preset.correlation,
        num_bessel=preset.num_bessel,
        radial_mlp=list(preset.radial_mlp),
        num_interactions=2,
        dtype=dtype,
        lr=0.01,
        weight_decay=5e-7,
        amsgrad=True,
        ema_decay=0.99,
        energy_weight=1.0,
        forces_weight=100.0,
        lr_factor=0.8,
        scheduler_patience=50,
        clip_grad=10.0,
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
    radial = "[" + ",".join(str(x) for x in config.radial_mlp) + "]"
    return [
        exe,
        "--name",
        "mace",
        "--seed",
        str(config.seed),
        "--work_dir",
        str(workdir),
        "--device",
        "cpu",
        "--default_dtype",
        config.dtype,
        "--model",
        "ScaleShiftMACE",
        "--train_file",
        split["train"],
        "--valid_file",
        split["valid"],
        "--energy_key",
        config.energy_key,
        "--forces_key",
        config.forces_key,
        "--E0s",
        "average",
        "--r_max",
        str(config.cutoff),
        "--num_radial_basis",
        str(config.num_bessel),
        "--num_cutoff_basis",
        str(config.num_polynomial_cutoff),
        "--max_ell",
        str(config.max_ell),
        "--correlation",
        str(config.correlation),
        "--num_interactions",
        str(config.num_interactions),
        "--hidden_irreps",
        config.hidden_irreps,
        "--MLP_irreps",
        config.mlp_irreps,
        "--radial_MLP",
        radial,
        "--batch_size",
        str(config.batch_size),
        "--valid_batch_size",
        str(config.batch_size),
        "--max_num_epochs",
        str(epochs),
        "--lr",
        str(config.lr),
        "--weight_decay",
        str(config.weight_decay),
        "--amsgrad",
        "--ema",
        "--ema_decay",
        str(config.ema_decay),
        "--energy_weight",
        str(config.energy_weight),
        "--forces_weight",
        str(config.forces_weight),
        "--clip_grad",
        str(config.clip_grad),
        "--scheduler",
        "ReduceLROnPlateau",
        "--lr_factor",
        str(config.lr_factor),
        "--scheduler_patience",
        str(config.scheduler_patience),
        "--loss",
        "weighted",
        "--scaling",
        "rms_forces_scaling",
        "--eval_interval",
        "1",
        "--patience",
        "100000",
    ]


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


def _row(trainer: str, sampler: str, seed: int, steps: int, wall: float, result: dict) -> dict:
    return {
        "trainer": trainer,
        "sampler": sampler,
        "seed": seed,
        "steps": steps,
        "wall_s": wall,
        "e_mae_mev_atom": result["e_mae_mev_atom"],
        "f_mae_mev_a": result["f_mae_mev_a"],
        "e_rmse_mev_atom": result["e_rmse_mev_atom"],
        "f_rmse_mev_a": result["f_rmse_mev_a"],
        "families": {
            k: {"e_mae_mev_atom": v["e_mae_mev_atom"], "f_mae_mev_a": v["f_mae_mev_a"], "graphs": v["graphs"]}
            for k, v in result["families"].items()
        },
    }


def ratio_interval(ref: dict, other: dict, q: str, level: float = 0.95, tolerance: float = PARITY_TOLERANCE) -> dict:
    r"""How well the seeds pin down ``other``'s mean over ``ref``'s for quantity ``q`` (``"e"`` or ``"f"``).

    The ratio's ``level`` confidence interval is :math:`1 + (\bar b - \bar a \pm t\,\mathrm{SE}) / \bar a`
    with Welch's standard error :math:`\mathrm{SE} = \sqrt{s_a^2/n_a + s_b^2/n_b}` and its
    Welch-Satterthwaite degrees of freedom (``ref``'s mean taken as exact). ``seeds_needed``:
    seeds per trainer for that interval to be no wider than ``±tolerance`` at the same standard
    deviations (normal quantile), so that "within 5%" can be told apart from the seed noise.
    ``ci_low``/``ci_high`` are None with fewer than two seeds on either side."""
    from scipy import stats

    a_mean, b_mean = ref[f"{q}_mean"], other[f"{q}_mean"]
    va, vb = ref[f"{q}_std"] ** 2 / ref["seeds"], other[f"{q}_std"] ** 2 / other["seeds"]
    if ref["seeds"] < 2 or other["seeds"] < 2 or va + vb == 0:
        return {"ci_low": None, "ci_high": None, "seeds_needed": None}
    se = np.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (ref["seeds"] - 1) + vb**2 / (other["seeds"] - 1))
    half = float(stats.t.ppf(0.5 + level / 2, dof) * se)
    z = float(stats.norm.ppf(0.5 + level / 2))
    pooled = (ref[f"{q}_std"] ** 2 + other[f"{q}_std"] ** 2) / 2
    needed = int(np.ceil(2 * pooled * (z / (tolerance * a_mean)) ** 2))
    return {
        "ci_low": 1 + (b_mean - a_mean - half) / a_mean,
        "ci_high": 1 + (b_mean - a_mean + half) / a_mean,
        "seeds_needed": needed,
    }


def paired_interval(
    ref_rows: list[dict], other_rows: list[dict], key: str, level: float = 0.95, tolerance: float = PARITY_TOLERANCE
) -> dict | None:
    r"""Seed-by-seed ratio ``other / ref`` of ``key`` (e.g. ``"e_mae_mev_atom"``) over the seeds both ran.

    For paired runs (same seed, batches, statistics and initial weights) the seed noise cancels
    in the ratios :math:`r_s`: their mean and its ``level`` Student-t interval
    :math:`\bar r \pm t_{n-1}\, s_r / \sqrt n` say whether the two agree within ``tolerance``
    (``met``: the interval lies inside :math:`1 \pm` ``tolerance``). None without a common seed."""
    from scipy import stats

    ref = {r["seed"]: r[key] for r in ref_rows}
    pairs = [(ref[r["seed"]], r[key]) for r in other_rows if r["seed"] in ref]
    if not pairs:
        return None
    ratios = np.array([b / a for a, b in pairs])
    mean = float(ratios.mean())
    half = (
        float(stats.t.ppf(0.5 + level / 2, ratios.size - 1) * ratios.std(ddof=1) / np.sqrt(ratios.size))
        if ratios.size > 1
        else float("nan")
    )
    low, high = mean - half, mean + half
    return {
        "seeds": int(ratios.size),
        "ratios": ratios.tolist(),
        "mean": mean,
        "ci_low": low,
        "ci_high": high,
        "met": bool(ratios.size > 1 and 1 - tolerance <= low and high <= 1 + tolerance),
    }


def summarise(rows: list[dict]) -> dict:
    """Mean and standard deviation over seeds per (trainer, sampler), and the two verdicts."""
    groups: dict[str, dict] = {}
    for r in rows:
        key = f"{r['trainer']}/{r['sampler']}"
        g = groups.setdefault(key, {"e": [], "f": []})
        g["e"].append(r["e_mae_mev_atom"])
        g["f"].append(r["f_mae_mev_a"])
    stats = {
        k: {
            "seeds": len(g["e"]),
            "e_mean": float(np.mean(g["e"])),
            "e_std": float(np.std(g["e"], ddof=1)) if len(g["e"]) > 1 else 0.0,
            "f_mean": float(np.mean(g["f"])),
            "f_std": float(np.std(g["f"], ddof=1)) if len(g["f"]) > 1 else 0.0,
        }
        for k, g in groups.items()
    }
    out: dict = {"groups": stats}
    mace, fc = stats.get("mace_run_train/fixed 8"), stats.get("workbench/fixed-count")
    if mace and fc:
        ratio_e, ratio_f = fc["e_mean"] / mace["e_mean"], fc["f_mean"] / mace["f_mean"]
        out["parity"] = {
            "e_ratio": ratio_e,
            "f_ratio": ratio_f,
            "tolerance": PARITY_TOLERANCE,
            "e_spread": max(mace["e_std"], fc["e_std"]) / mace["e_mean"],
            "f_spread": max(mace["f_std"], fc["f_std"]) / mace["f_mean"],
            "met": bool(abs(ratio_e - 1) <= PARITY_TOLERANCE and abs(ratio_f - 1) <= PARITY_TOLERANCE),
        }
        for q in ("e", "f"):
            out["parity"].update({f"{q}_{k}": v for k, v in ratio_interval(mace, fc, q).items()})
    paired = [r for r in rows if r["trainer"] == "workbench" and r["sampler"] == MACE_ORDER]
    maces = [r for r in rows if r["trainer"] == "mace_run_train"]
    if paired and maces:
        got = {q: paired_interval(maces, paired, key) for q, key in (("e", "e_mae_mev_atom"), ("f", "f_mae_mev_a"))}
        if got["e"] is not None:
            out["paired"] = {
                **{f"{q}_{k}": v for q, g in got.items() for k, v in g.items() if k != "met"},
                "tolerance": PARITY_TOLERANCE,
                "met": got["e"]["met"] and got["f"]["met"],
            }
    if fc:
        packing = {}
        for s in ("paper", "shuffled-paper"):
            g = stats.get(f"workbench/{s}")
            if g is None:
                continue
            spread_e, spread_f = max(fc["e_std"], g["e_std"]), max(fc["f_std"], g["f_std"])
            packing[s] = {
                "e_excess": g["e_mean"] - fc["e_mean"],
                "f_excess": g["f_mean"] - fc["f_mean"],
                "e_spread": spread_e,
                "f_spread": spread_f,
                "met": bool(g["e_mean"] - fc["e_mean"] <= spread_e and g["f_mean"] - fc["f_mean"] <= spread_f),
            }
        out["packing"] = packing
    return out


def bench_quality(
    preset: str = "small",
    seeds: Sequence[int] = (0, 1, 2),
    samplers: Sequence[str] = SAMPLERS,
    mace: bool = True,
    dtype: str = "float64",
    batch_size: int = 8,
    threads: int = 2,
    backend: str = "e3nn",
    workdir: str | os.PathLike = "runs/bench/quality",
    out: str | os.PathLike = "runs/bench/quality.json",
    resume: bool = False,
    progress=print,
) -> dict:
    """Run the comparison (see the module docstring); returns and writes the results.

    Each finished run appends its row to ``<workdir>/rows.jsonl`` and the JSON at ``out`` is rewritten
    after every run, so an interrupted bench keeps what it measured. With ``resume`` the runs already in
    ``rows.jsonl`` are kept (only if the bench's settings are the same) and the rest are run; without it
    ``workdir`` is replaced. Runs go seed by seed, so a partial bench compares every trainer on the
    seeds it reached.
    """
    from workbench.train.evaluate import evaluate_file

    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    from workbench.train.config import MODEL_BACKENDS

    if backend not in MODEL_BACKENDS:
        raise KeyError(f"unknown backend {backend!r}; choose from {', '.join(MODEL_BACKENDS)}")
    unknown = sorted(set(samplers) - set(SAMPLERS))
    if unknown:
        raise KeyError(f"unknown sampler(s) {unknown}; choose from {', '.join(SAMPLERS)}")
    p = PRESETS[preset]
    workdir = Path(workdir)
    settings = {
        "preset": preset,
        "preset_config": asdict(p),
        "dtype": dtype,
        "batch_size": batch_size,
        "backend": backend,
    }
    rows = _resumed_rows(workdir, settings) if resume else None
    if rows is None:
        if workdir.exists():
            shutil.rmtree(workdir)
        rows = []
    base = base_config(p, workdir, dtype=dtype, batch_size=batch_size)
    split = write_split(base, workdir / "split")
    (workdir / "bench.json").write_text(json.dumps(settings, indent=1) + "\n")
    steps = p.epochs * (split["n_train"] // batch_size)  # mace drops the last incomplete batch
    capacity = max(split["max_atoms"], round(batch_size * split["mean_atoms"]))
    progress(
        f"split: {split['n_train']} training / {split['n_valid']} validation graphs "
        f"(mean {split['mean_atoms']:.0f} atoms); {steps} steps; packers at capacity {capacity} atoms"
    )
    done = {_job(r) for r in rows}
    if done:
        progress(f"resuming: {len(done)} run(s) kept from {workdir / 'rows.jsonl'}")
    jobs = [(seed, what) for seed in seeds for what in ((["mace"] if mace else []) + list(samplers))]
    import torch

    def result() -> dict:
        kept = [r for r in rows if _job(r) in jobs]
        return {
            "bench": "quality",
            **settings,
            "capacity": capacity,
            "steps": steps,
            "seeds": list(seeds),
            "split": split,
            "threads": threads,
            "torch": torch.__version__,
            "mace": _version("mace-torch"),
            "complete": len(kept) == len(jobs),
            "rows": kept,
            "summary": summarise(kept),
        }

    for k, (seed, what) in enumerate(jobs, 1):
        if (seed, what) in done:
            continue
        where = workdir / f"{what}-seed{seed}"
        if where.exists():
            shutil.rmtree(where)  # a run cut off part-way starts again
        if what == "mace":
            model, wall = run_mace(replace(base, seed=seed), split, where, p.epochs, threads)
            trainer, sampler = "mace_run_train", f"fixed {batch_size}"
        else:
            # mace-order pairs with mace_run_train entirely: its batches, statistics and final-model choice
            cfg = replace(
                base,
                name=f"{what}-seed{seed}",
                output_dir=str(workdir),
                seed=seed,
                sampler=what,
                capacity=capacity,
                dataset=split["train"],
                valid_dataset=split["valid"],
                max_structures=None,
                epochs=10 * p.epochs + 10,
                max_steps=steps,
                backend=backend,
                keep="best" if what == MACE_ORDER else "last",
            )
            model, wall = run_workbench(cfg, where, threads)
            trainer, sampler = "workbench", what
        res = evaluate_file(model, split["valid"], energy_key=base.energy_key, forces_key=base.forces_key)
        rows.append(_row(trainer, sampler, seed, steps, wall, res))
        with open(workdir / "rows.jsonl", "a") as fh:
            fh.write(json.dumps(rows[-1]) + "\n")
        _write(out, result())
        progress(
            f"[{k}/{len(jobs)}] {trainer:<15} {sampler:<15} seed {seed}: E MAE {res['e_mae_mev_atom']:.1f} "
            f"meV/atom, F MAE {res['f_mae_mev_a']:.1f} meV/Å ({wall:.0f} s)"
        )
    final = result()
    _write(out, final)
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


def _write(out: str | os.PathLike, res: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{out}.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def format_table(res: dict) -> str:
    """The per-run table, the means over seeds and the two verdicts."""
    fams = sorted({f for r in res["rows"] for f in r["families"]})
    head = f"{'trainer':<15} {'sampler':<15} {'seed':>4} {'steps':>5} {'E MAE':>7} {'F MAE':>7}  " + " ".join(
        f"{f[:12]:>12}" for f in fams
    )
    lines = [
        f"Quality bench ({res['preset']}, {res['dtype']}, workbench on {res.get('backend', 'e3nn')}, "
        f"{res['split']['n_train']} train / "
        f"{res['split']['n_valid']} valid graphs, {res['steps']} steps, packers at capacity {res['capacity']})",
        "MAE: energy meV/atom, force meV/Å; per family: force MAE",
        head,
        "-" * len(head),
    ]
    if not res.get("complete", True):
        lines.insert(1, f"PARTIAL: {len(res['rows'])} runs finished; 'workbench bench quality --resume' runs the rest")
    for r in res["rows"]:
        lines.append(
            f"{r['trainer']:<15} {r['sampler']:<15} {r['seed']:>4} {r['steps']:>5} {r['e_mae_mev_atom']:>7.1f} "
            f"{r['f_mae_mev_a']:>7.1f}  "
            + " ".join(
                f"{r['families'][f]['f_mae_mev_a']:>12.1f}" if f in r["families"] else f"{'-':>12}" for f in fams
            )
        )
    s = res["summary"]
    lines += ["", f"{'group':<32} {'seeds':>5} {'E MAE mean ± sd':>18} {'F MAE mean ± sd':>18}"]
    for k, g in s["groups"].items():
        lines.append(
            f"{k:<32} {g['seeds']:>5} {g['e_mean']:>10.1f} ± {g['e_std']:<5.1f} {g['f_mean']:>10.1f} ± {g['f_std']:<5.1f}"
        )
    if "parity" in s:
        pa = s["parity"]
        noise = all(pa.get(f"{q}_ci_low") is not None and pa[f"{q}_ci_low"] <= 1 <= pa[f"{q}_ci_high"] for q in "ef")
        verdict = (
            "met"
            if pa["met"]
            else ("not within ±5%, but inside the seed noise (both intervals hold 1)" if noise else "NOT met")
        )
        lines.append(
            f"\nparity, unpaired (workbench fixed-count, its own shuffle / mace_run_train): E {pa['e_ratio']:.3f}, "
            f"F {pa['f_ratio']:.3f} (target within ±{pa['tolerance']:.0%}; seed spread E ±{pa['e_spread']:.0%}, "
            f"F ±{pa['f_spread']:.0%}): {verdict}"
        )
        for q, name in (("e", "E"), ("f", "F")):
            if pa.get(f"{q}_ci_low") is not None:
                lines.append(
                    f"  {name} ratio, 95% interval over seeds: {pa[f'{q}_ci_low']:.2f} to {pa[f'{q}_ci_high']:.2f}; "
                    f"telling ±{pa['tolerance']:.0%} from the seed noise takes ~{pa[f'{q}_seeds_needed']} seeds "
                    f"per trainer"
                )
    if "paired" in s:
        pa = s["paired"]
        per = ", ".join(f"{e:.6f}/{f:.6f}" for e, f in zip(pa["e_ratios"], pa["f_ratios"]))

        def interval(q):
            return f"{pa[f'{q}_ci_low']:.6f} to {pa[f'{q}_ci_high']:.6f}" if pa["e_seeds"] > 1 else "needs 2 seeds"

        lines += [
            f"\nparity, paired seed by seed (workbench mace-order / mace_run_train), per seed E/F: {per}",
            f"  E {pa['e_mean']:.6f} (95% {interval('e')}), F {pa['f_mean']:.6f} (95% {interval('f')}); "
            f"target ±{pa['tolerance']:.0%}: {'met' if pa['met'] else 'NOT met'}",
        ]
    for name, v in s.get("packing", {}).items():
        lines.append(
            f"{name} vs fixed-count: E {v['e_excess']:+.1f} (spread {v['e_spread']:.1f}), F {v['f_excess']:+.1f} "
            f"(spread {v['f_spread']:.1f}): {'no worse than the seed spread' if v['met'] else 'WORSE than the seed spread'}"
        )
    return "\n".join(lines)
