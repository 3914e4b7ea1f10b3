"""One epoch on one rank: its batches (resumed mid-epoch when the checkpoint says so), the steps
until it ends, ``max_steps`` or a preemption, then validation and the epoch's log record."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from workbench.train import preempt
from workbench.train.evaluation import TENSOR_METRICS, evaluate
from workbench.train.graph_step import take_graph_step
from workbench.train.hooks import step_hook
from workbench.train.padding import pad_to_ladder
from workbench.train.resume import checkpoint
from workbench.train.rundir import JsonlLog
from workbench.train.samplers import RecordingSampler
from workbench.train.session import Session
from workbench.train.step import StepTotals, accumulate, check_skipped_share, step_record, take_step


def _epoch_batches(s: Session, epoch: int) -> tuple[Iterator, RecordingSampler, int]:
    """This epoch's batches (resumed mid-epoch when the checkpoint says so) and batches already done.

    One DataLoader serves every epoch, so with ``persistent_workers`` its worker processes
    start once; the sampler is set to the epoch before each pass.
    """
    from mace.tools.torch_geometric import DataLoader

    s.sampler.set_epoch(epoch)
    consumed = 0
    if s.resume_sampler is not None and s.resume_sampler["epoch"] == epoch:
        s.sampler.load_state_dict(s.resume_sampler)
        consumed = s.resume_sampler["batches_done"]
    s.resume_sampler = None
    if s.loader is None:
        config = s.config
        s.recording = RecordingSampler(s.sampler)
        workers = (
            {"prefetch_factor": config.prefetch_factor, "persistent_workers": config.persistent_workers}
            if config.num_workers > 0
            else {}
        )
        s.loader = DataLoader(s.data.train, batch_sampler=s.recording, num_workers=config.num_workers, **workers)
    s.recording.queue.clear()  # batches an interrupted pass drew but never delivered
    return iter(s.loader), s.recording, consumed


def train_one_epoch(s: Session, epoch: int, step_log: JsonlLog, bar) -> tuple[StepTotals, int]:
    """Steps of one epoch until it ends, ``max_steps`` is reached or a preemption stops all ranks.

    ``bar``: the :func:`progress` bar, or None. Returns this rank's totals and the number of the
    epoch's batches consumed.
    """
    config = s.config
    it, recording, consumed = _epoch_batches(s, epoch)
    s.model.train()
    totals = StepTotals()
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        indices = recording.queue.popleft()
        if s.shapes is not None:
            batch = pad_to_ladder(batch, s.shapes, s.r_max, indices)
        batch = batch.to(s.device)
        t1 = time.perf_counter()
        loss, out, blocked, skipped = (take_step if s.graphs is None else take_graph_step)(s, batch, indices)
        t = (t0, t1, time.perf_counter())
        consumed += 1
        s.global_step += 1
        s.last_loss = float(loss.detach())
        accumulate(totals, batch, out, t, blocked)
        step_log.write({**step_record(s, epoch, consumed, batch, indices, t, blocked), "skipped": skipped})
        s.steps_run, s.steps_skipped = s.steps_run + 1, s.steps_skipped + int(skipped)
        check_skipped_share(s, s.steps_skipped, s.steps_run)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{s.last_loss:.4g}", epoch=epoch)
        if (hook := step_hook()) is not None:
            hook(s.global_step, s.rank)
        if config.checkpoint_every and s.global_step % config.checkpoint_every == 0:
            checkpoint(s, epoch, consumed)
        if config.max_steps is not None and s.global_step >= config.max_steps:
            s.done = True
            break
        # All ranks stop at this step boundary together (workbench.train.preempt).
        stop = preempt.requested(s.world, s.device) if consumed < len(s.sampler) else None
        if stop:
            checkpoint(s, epoch, consumed)
            raise preempt.Preempted(stop, s.global_step)
    return totals, consumed


def validate(s: Session, epoch: int) -> dict:
    """Validation errors and loss with the EMA weights (when kept), then the plateau scheduler's
    step on the loss (as mace_run_train); with ``keep="best"`` the weights of the epoch with the
    lowest loss so far are kept for the export."""
    with s.ema.average_parameters() if s.ema is not None else contextlib.nullcontext():
        valid = _evaluate_heads(s)
        loss = valid.get("loss", float("nan"))
        if (
            s.config.keep == "best"
            and s.rank == 0
            and math.isfinite(loss)
            and (s.best is None or loss < s.best["loss"])
        ):
            s.best = {
                "epoch": epoch,
                "loss": loss,
                "model": {k: v.detach().clone() for k, v in s.model.state_dict().items()},
            }
    if math.isfinite(loss):
        s.scheduler.step(loss)
    return valid


def _evaluate_heads(s: Session) -> dict:
    """The validation errors; with several heads, each head's graphs on their own (as mace's
    loaders per head), under ``heads``, and the last head's (new data) on top:
    its loss drives the scheduler and ``keep: best``, as mace's last head does."""
    from torch.utils.data import Subset

    def run(data, families) -> dict:
        return evaluate(
            s.model,
            data,
            s.device,
            batch_size=s.config.batch_size,
            num_workers=s.config.num_workers,
            families=families,
            loss_fn=s.loss_fn,
            **s.outputs,
        )

    if not s.data.valid_heads:
        return run(s.data.valid, s.data.valid_families)
    per = {}
    for head in s.data.heads:
        mine = [i for i, h in enumerate(s.data.valid_heads) if h == head]
        per[head] = run(Subset(s.data.valid, mine), [s.data.valid_families[i] for i in mine])
    return {**per[s.data.heads[-1]], "heads": per}


def log_epoch(
    s: Session, epoch_log: JsonlLog | None, epoch: int, complete: bool, epoch_s: float, totals: StepTotals, valid: dict
) -> None:
    """The epoch's record (rank 0 holds ``epoch_log``; the others pass None): training errors and
    time shares from ``totals`` (summed over ranks), the validation errors of ``valid``."""
    if epoch_log is None:
        return
    busy = totals.busy_s
    epoch_log.write(
        {
            "type": "epoch",
            "epoch": epoch,
            "complete": complete,
            "global_step": s.global_step,
            "epoch_s": round(epoch_s, 4),
            "train_e_mae_mev_atom": 1000 * totals.e_abs / max(totals.graphs, 1),
            "train_f_mae_mev_a": 1000 * totals.f_abs / max(totals.force_atoms, 1),
            "valid_e_mae_mev_atom": valid["e_mae_mev_atom"],
            "valid_f_mae_mev_a": valid["f_mae_mev_a"],
            "valid_e_rmse_mev_atom": valid["e_rmse_mev_atom"],
            "valid_f_rmse_mev_a": valid["f_rmse_mev_a"],
            "train_s_mae_mev_a3": 1000 * totals.s_abs / totals.stress_graphs if totals.stress_graphs else None,
            **{f"valid_{k}": _finite_or_none(valid.get(k)) for k in TENSOR_METRICS},
            "valid_families": valid["families"],
            "valid_loss": valid.get("loss"),
            **({"valid_heads": _heads_record(valid["heads"])} if "heads" in valid else {}),
            "compute_share": totals.compute_s / busy,
            "allreduce_share": totals.allreduce_s / busy,
            "data_share": totals.data_s / busy,
            "loss": s.last_loss,
            "lr": s.optimizer.param_groups[0]["lr"],
            "peak_mem_gb": torch.cuda.max_memory_allocated(s.device) / 1e9 if s.device.type == "cuda" else None,
        }
    )


def _heads_record(heads: dict) -> dict:
    """Per head: its errors (null where none), loss and families, for the epoch record."""
    return {
        head: {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in result.items()}
        for head, result in heads.items()
    }


def _finite_or_none(value) -> float | None:
    # JSON has no NaN: a metric nothing was measured for is null in metrics.jsonl
    return float(value) if value is not None and math.isfinite(value) else None


@contextlib.contextmanager
def progress(s: Session) -> Iterator:
    """A progress bar over the run's steps on rank 0 when ``config.progress`` (else None), closed after."""
    bar = None
    if s.rank == 0 and s.config.progress:
        from workbench.progress import bar as progress_bar

        total = s.config.max_steps or s.config.epochs * len(s.sampler)
        bar = progress_bar(total=total, initial=min(s.global_step, total), desc=s.config.name, unit="step")
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()
