"""``train(config)``: single-process or DDP training of a mace-torch ScaleShiftMACE.

Run it as one process, or under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): DDP
with nccl on GPUs and gloo on CPUs. Every rank builds the same data split, the
same statistics and the same packing from the seed, so nothing but gradients is
communicated.

The run directory's layout and log records are owned by :mod:`workbench.train.rundir`.

The loop is split the way mace-torch's is, one module a step: :func:`set_up` (here: process
group, data, sampler; :mod:`~workbench.train.distributed`, :mod:`~workbench.train.samplers`),
:func:`~workbench.train.build.build_training` (model, optimiser), :func:`~workbench.train.resume.restore`
(from the checkpoint), :func:`~workbench.train.epoch.train_one_epoch` over
:func:`~workbench.train.step.take_step`, :func:`~workbench.train.epoch.validate`,
:func:`~workbench.train.epoch.log_epoch` and :func:`~workbench.train.resume.checkpoint`, all
on one :class:`~workbench.train.session.Session`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.dtypes import default_dtype
from workbench.train import mace_order, preempt
from workbench.train.build import build_training, param_groups
from workbench.train.checkpoint import load_checkpoint, remove_stale_temporaries
from workbench.train.config import TrainConfig
from workbench.train.data import TrainData, prepare_data
from workbench.train.distributed import dist_env, init_process_group, pick_device, preflight, wrap_ddp
from workbench.train.epoch import log_epoch, progress, train_one_epoch, validate
from workbench.train.evaluation import evaluate
from workbench.train.resume import check_resume, checkpoint, restore
from workbench.train.rundir import EPOCH_FIELDS, STEP_FIELDS, JsonlLog, RunDir, RunLock
from workbench.train.samplers import make_sampler
from workbench.train.session import Session
from workbench.train.step import NonFiniteStep, take_step

__all__ = [
    "NonFiniteStep",
    "Session",
    "TrainResult",
    "build_training",
    "checkpoint",
    "evaluate",
    "make_sampler",
    "param_groups",
    "pick_device",
    "preflight",
    "restore",
    "set_up",
    "take_step",
    "train",
    "train_one_epoch",
    "validate",
    "wrap_ddp",
]


@dataclass
class TrainResult:
    """What a finished (or ``max_steps``-stopped) run leaves: its directory, counters, last loss and
    the exported model (None without ``export`` and on ranks other than 0)."""

    run_dir: Path
    global_step: int
    epochs_done: int
    final_loss: float
    model_path: Path | None
    steps_run: int = 0  # optimiser steps this call took (0: the run was already complete)


def train(
    config: TrainConfig,
    structures: list | None = None,
    resume: bool = True,
    data: TrainData | None = None,
    preempt_signals: str | None = None,
) -> TrainResult:
    """Train ``config``; resume from ``<run_dir>/checkpoint.pt`` when present and ``resume``.

    ``data``: already prepared by ``prepare_data`` for a config equal to ``config`` on
    ``PREPARE_FIELDS`` (``structures`` is then unused); several runs can share it.
    The torch default dtype is ``config.dtype`` while it runs (mace builds its data and
    buffers in the default dtype) and is restored afterwards. ``preempt_signals``: the signals
    (``"TERM,USR2"``) that stop every rank at one step boundary with a checkpoint
    (:mod:`~workbench.train.preempt`); None: ``$WORKBENCH_PREEMPT_SIGNALS``, else none.
    """
    from workbench.train.foundation import resolve

    config = resolve(config)  # fine-tuning: the foundation model's architecture
    with default_dtype(config.dtype), preempt.guard(preempt_signals):
        return _train(config, structures, resume, data)


def set_up(config: TrainConfig, structures: list | None, data: TrainData | None, resume: bool = True) -> Session:
    """Device, data, sampler and process group; the run directory's config (rank 0). Without
    ``resume``, rank 0 first moves an earlier run's records aside (:meth:`RunDir.supersede`)."""
    rank, world, local_rank = dist_env()
    device = pick_device(config, local_rank)
    preflight(config, device)
    if data is None:
        data = prepare_data(config, structures)
    if data.replay_note and rank == 0:
        print(f"workbench: {data.replay_note}", file=sys.stderr, flush=True)
    sampler = make_sampler(config, data.train_atoms, world, rank, mace_order.file_order(data))
    run = RunDir(config.run_dir)
    if rank == 0:
        from workbench.train.record import write_run_record

        moved = None if resume else run.supersede()
        if moved is not None:
            print(f"workbench: a fresh start: the earlier run's records are in {moved}", file=sys.stderr, flush=True)
        run.finished.unlink(missing_ok=True)  # written again when this run reaches its end
        run.metrics_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(run.config)
        write_run_record(run, config, data, world, device, sampler)
    init_process_group(config, rank, world, device)
    # Deterministic kernels where torch has a choice (warn, not fail, where a CUDA op has none).
    torch.use_deterministic_algorithms(config.deterministic, warn_only=True)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    return Session(config, rank, world, device, data, sampler, run)


def _finish(s: Session) -> TrainResult:
    import torch.distributed as dist

    model_path = None
    if s.rank == 0:
        _refuse_non_finite(s)
    if s.rank == 0 and s.config.export:
        from workbench.train.export import export_models

        if s.best is not None:  # keep="best": the weights of the epoch with the lowest validation loss
            s.model.load_state_dict(s.best["model"])
            s.say(f"export: the weights of epoch {s.best['epoch']} (lowest validation loss, {s.best['loss']:.6g})")
            model_path = export_models(s.model, None, s.config, s.run.path)
        else:
            model_path = export_models(s.model, s.ema, s.config, s.run.path)
    if s.rank == 0:
        _write_finished(s, model_path)
    if s.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return TrainResult(s.run.path, s.global_step, s.epoch, s.last_loss, model_path)


def _refuse_non_finite(s: Session) -> None:
    from workbench.train.model_file import nonfinite_parameters

    bad = nonfinite_parameters(s.model)
    if s.ema is not None:
        names = [n for n, _ in s.model.named_parameters()]
        bad += [f"EMA of {n}" for n, p in zip(names, s.ema.shadow_params) if not torch.isfinite(p).all()]
    if bad:
        raise NonFiniteStep(
            f"{s.run.path}: the trained weights are not finite ({len(bad)} parameter tensors, e.g. {bad[0]}); "
            "nothing exported. Lower lr, or resume from an earlier checkpoint"
        )


def _write_finished(s: Session, model_path: Path | None) -> None:
    import json

    record = {"global_step": s.global_step, "epochs": s.epoch, "model": str(model_path) if model_path else None}
    record["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    s.run.finished.write_text(json.dumps(record) + "\n")


def _train(config: TrainConfig, structures: list | None, resume: bool, data: TrainData | None) -> TrainResult:
    # One run per directory: rank 0 holds the lock for the whole run (released if it dies).
    lock = RunLock(RunDir(config.run_dir)) if dist_env()[0] == 0 else contextlib.nullcontext()
    with lock:
        if getattr(lock, "taken_over", None):
            print(
                f"workbench: took over {RunDir(config.run_dir).lock} left by pid {lock.taken_over.get('pid')} "
                f"on {lock.taken_over.get('host')} (no longer running)",
                file=sys.stderr,
            )
        return _train_locked(config, structures, resume, data)


def _train_locked(config: TrainConfig, structures: list | None, resume: bool, data: TrainData | None) -> TrainResult:
    s = set_up(config, structures, data, resume)
    if s.rank == 0:
        remove_stale_temporaries(s.run.checkpoint)
    ckpt = load_checkpoint(s.run.checkpoint, trust=config.trust_checkpoint) if resume else None
    check_resume(s, ckpt)
    build_training(s, ckpt)
    restore(s, ckpt)
    wrap_ddp(s)
    s.done = config.max_steps is not None and s.global_step >= config.max_steps
    first_step = s.global_step
    epoch_log = JsonlLog(s.run.epoch_log, EPOCH_FIELDS) if s.rank == 0 else contextlib.nullcontext()
    with JsonlLog(s.run.step_log(s.rank), STEP_FIELDS) as step_log, epoch_log as epoch_log, progress(s) as bar:
        while s.epoch < config.epochs and not s.done:
            t_epoch = time.perf_counter()
            totals, consumed = train_one_epoch(s, s.epoch, step_log, bar)
            epoch_s = time.perf_counter() - t_epoch
            totals = totals.all_reduce(s.world)
            valid = validate(s, s.epoch)
            complete = not s.done or consumed == len(s.sampler)
            log_epoch(s, epoch_log, s.epoch, complete, epoch_s, totals, valid)
            s.model.train()
            if complete:
                s.epoch += 1
                checkpoint(s, s.epoch, 0)
            else:
                checkpoint(s, s.epoch, consumed)
    return dataclasses.replace(_finish(s), steps_run=s.global_step - first_step)
