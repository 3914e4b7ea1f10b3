"""Checkpoints of a running session: write one (every rank's sampler position and RNG state, in
one file written by rank 0), refuse one of another run, and continue from one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.train.checkpoint import (
    CheckpointError,
    remove_stale_temporaries,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from workbench.train.config import RUN_IDENTITY
from workbench.train.rundir import drop_after
from workbench.train.session import Session


def check_resume(s: Session, ckpt: dict | None) -> None:
    """Refuse a checkpoint of a different run (model, data, split, packing, precision, seed)."""
    if not ckpt:
        return
    changed = s.config.identity_changes(ckpt.get("config", {}))
    if changed:
        raise ValueError(
            f"{s.run.checkpoint}: the checkpoint belongs to a run with other settings ({'; '.join(changed)}); "
            "resume with the same settings, or start afresh with --fresh (or another name)"
        )
    _check_foundation(s, ckpt)
    saved = ckpt.get("data_fingerprint")
    if saved and s.data.fingerprint and saved != s.data.fingerprint:
        raise ValueError(
            f"{s.run.checkpoint}: the training data changed since this checkpoint (its graphs, labels or split "
            f"differ: data fingerprint {saved[:12]} then, {s.data.fingerprint[:12]} now); resume on the same data, "
            "or start afresh with --fresh (or another name)"
        )
    if s.world != len(ckpt["sampler"]):
        raise ValueError(
            f"{s.run.checkpoint}: checkpoint was written by {len(ckpt['sampler'])} ranks, "
            f"this run has {s.world}; resume with the same number of ranks"
        )


def _check_foundation(s: Session, ckpt: dict) -> None:
    """A fine-tuning run resumes only from the same foundation model file (by content)."""
    now, saved = _foundation_sha256(s), ckpt.get("foundation_sha256")
    if now is not None and saved != now:
        raise ValueError(
            f"{s.run.checkpoint}: the foundation model {s.config.foundation_model} changed since this checkpoint "
            f"(sha256 {str(saved)[:12]} then, {now[:12]} now); resume with the same file, or start afresh with --fresh"
        )


def restore(s: Session, ckpt: dict | None) -> None:
    """Continue from ``ckpt``: weights, optimiser, scheduler, EMA, counters, sampler position and RNG.

    Fields outside the run's identity that changed (``lr``, ``epochs``, ``max_steps``, ...) are
    applied and said; steps logged after the checkpoint, which this run replays, are dropped from
    the logs so each step is logged once.
    """
    if not ckpt:
        return
    s.model.load_state_dict(ckpt["model"])
    saved = len(ckpt["optimizer"]["param_groups"])
    if saved != len(s.optimizer.param_groups):
        raise ValueError(
            f"{s.run.checkpoint}: the optimiser was saved with {saved} parameter group(s), this run has "
            f"{len(s.optimizer.param_groups)} (weight decay is now applied to mace-torch's parameter "
            "groups; checkpoints with weight_decay > 0 from before cannot resume); start afresh with --fresh"
        )
    _load_optimizer(s.optimizer, ckpt["optimizer"])
    s.scheduler.load_state_dict(ckpt["scheduler"])
    if s.ema is not None and ckpt.get("ema") is not None:
        s.ema.load_state_dict(ckpt["ema"])
    s.best = ckpt.get("best")
    s.epoch, s.global_step = ckpt["epoch"], ckpt["global_step"]
    s.last_loss = float(ckpt.get("last_loss", float("nan")))  # absent before format of 2026-12
    saved = ckpt["config"]
    if saved.get("lr") is not None and saved["lr"] != s.config.lr:
        for group in s.optimizer.param_groups:
            group["lr"] = s.config.lr
    changed = [
        f"{k} {saved[k]!r} -> {v!r}"
        for k, v in s.config.to_dict().items()
        if k in saved and k not in RUN_IDENTITY + ("name", "output_dir") and saved[k] != v
    ]
    if changed:
        s.say(f"resume: applied {'; '.join(changed)}")
    s.resume_sampler = _sampler_state(s, ckpt["sampler"][s.rank])
    set_rng_state(ckpt["rng"][s.rank] if isinstance(ckpt["rng"], list) else ckpt["rng"])
    dropped = drop_after(s.run.step_log(s.rank), s.global_step)
    if s.rank == 0:  # said even when nothing after it was logged (a rank killed before it wrote its step)
        drop_after(s.run.epoch_log, s.global_step)
        again = f"{dropped} step(s) logged after it will run again" if dropped else "no step after it was logged"
        s.say(f"resume: from step {s.global_step}; {again}")


def _sampler_state(s: Session, state) -> dict:
    """This rank's sampler state, checked against its sampler now rather than at its epoch (an
    older state, without the settings recorded since, comes back completed, after a warning)."""
    try:
        return s.sampler.check_state(state)
    except ValueError as exc:
        raise CheckpointError(
            f"{s.run.checkpoint}: rank {s.rank}: {exc}; start afresh with --fresh (or another name)"
        ) from None


def checkpoint(s: Session, epoch: int, consumed: int) -> None:
    """One file, written by rank 0, with every rank's sampler position and RNG state."""
    mine = {"sampler": s.sampler.state_dict(consumed=consumed), "rng": rng_state()}
    gathered = [None] * s.world
    if s.world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if s.rank == 0:
        _save(
            s.run.checkpoint,
            {
                "model": s.model.state_dict(),
                "optimizer": s.optimizer.state_dict(),
                "scheduler": s.scheduler.state_dict(),
                "ema": s.ema.state_dict() if s.ema is not None else None,
                "epoch": epoch,
                "global_step": s.global_step,
                "last_loss": s.last_loss,  # a rerun of a finished run reports it (it takes no step)
                "stats": s.stats.to_dict(),
                "sampler": [g["sampler"] for g in gathered],
                "rng": [g["rng"] for g in gathered],
                "config": s.config.to_dict(),
                "best": s.best,
                "data_fingerprint": s.data.fingerprint,
                "foundation_sha256": _foundation_sha256(s),
            },
        )
    if s.world > 1:
        dist.barrier()


def _foundation_sha256(s: Session) -> str | None:
    if not s.config.foundation_model:
        return None
    from workbench.train.foundation import foundation_of

    return foundation_of(s.config).sha256


def _save(path, state: dict) -> None:
    """:func:`save_checkpoint`; a full or read-only disk is one line, and the last good checkpoint stays."""
    try:
        save_checkpoint(path, state)
    except OSError as exc:
        remove_stale_temporaries(path)
        raise CheckpointError(
            f"{path}: cannot write the checkpoint ({exc.strerror or exc}); the last good one is kept: free space "
            "(or make the run directory writable) and run the same command again to resume from it"
        ) from None


#: how the optimiser runs, not what it learnt: this run's setting wins over the checkpoint's
_IMPLEMENTATION = ("fused", "capturable", "foreach")


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``state``, keeping this run's implementation flags (``cuda_graph`` turns on fused,
    capturable Adam; a checkpoint written without it must not turn them off), with the step
    counts where fused and capturable Adam keep them: float32 on the parameter's device."""
    flags = [{k: g[k] for k in _IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, flags):
        group.update(kept)
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
