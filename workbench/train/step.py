"""One optimiser step and what is recorded of it: forward, loss, backward, clipping, the
optimiser and EMA update, the non-finite check, the step's log record and the epoch's sums."""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from workbench.train.padding import real_size
from workbench.train.session import Session
from workbench.train.timing import sync


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def batch_hash(indices: list[int]) -> int:
    """CRC-32 of a batch's graph indices (int64): the step log's ``batch_hash``."""
    return zlib.crc32(np.asarray(indices, dtype=np.int64).tobytes())


@dataclass
class StepTotals:
    """Sums over an epoch's steps on one rank; :meth:`all_reduce` sums them over ranks."""

    e_abs: float = 0.0  # sum over graphs of |E error| / atoms, eV/atom
    f_abs: float = 0.0  # sum over atoms of mean |F error| component, eV/Å
    s_abs: float = 0.0  # sum over stress-labelled graphs of mean |stress error| component, eV/Å³
    stress_graphs: int = 0
    graphs: int = 0
    force_atoms: int = 0
    compute_s: float = 0.0
    allreduce_s: float = 0.0
    data_s: float = 0.0

    def all_reduce(self, world: int) -> StepTotals:
        if world == 1:
            return self
        t = torch.tensor(astuple(self), dtype=torch.float64)
        dist.all_reduce(t)
        return StepTotals(**{f.name: type(getattr(self, f.name))(v) for f, v in zip(fields(self), t.tolist())})

    @property
    def busy_s(self) -> float:
        return (self.compute_s + self.allreduce_s + self.data_s) or 1.0


class NonFiniteStep(ValueError):
    """A NaN or infinite loss or gradient (``on_nonfinite="stop"``, or too many skipped under
    ``"skip"``); names the step and the graphs."""


#: ``on_nonfinite="skip"`` stops the run once more than this share of its steps were skipped ...
MAX_SKIPPED_SHARE = 0.25
#: ... counted from this many steps on (one bad batch early on is not a diverging run)
MIN_STEPS_FOR_SHARE = 4


def check_skipped_share(s: Session, skipped: int, steps: int) -> None:
    """Raise :class:`NonFiniteStep` when ``skipped`` of this run's ``steps`` pass the bound: a run
    that skips most of its steps is diverging, not stepping over a bad structure."""
    if steps >= MIN_STEPS_FOR_SHARE and skipped > MAX_SKIPPED_SHARE * steps:
        raise NonFiniteStep(
            f"step {s.global_step}: {skipped} of the {steps} steps of this run had a non-finite loss or gradient "
            f"and were skipped (on_nonfinite=skip stops above {MAX_SKIPPED_SHARE:.0%}); the run is diverging. "
            "Stopped; the last checkpoint is kept. Lower lr or check the structures named above"
        )


def take_step(s: Session, batch, indices: Sequence[int] = ()) -> tuple[torch.Tensor, dict, float, bool]:
    """Forward (stress and virials when the loss trains them), loss, backward, clip, optimiser and EMA update.

    Returns ``(loss, output, blocked, skipped)``: ``blocked`` is the time spent waiting in the
    gradient all-reduce (DDP), measured by the comm hook; ``skipped`` is True when a non-finite
    loss or gradient made the step be skipped (``on_nonfinite="skip"``). Gradients are summed
    over ranks before the check, so every rank reaches the same verdict at the same step.
    """
    config = s.config
    if s.timer is not None:
        s.timer.reset()
    s.optimizer.zero_grad(set_to_none=True)
    out = s.net(batch.to_dict(), training=True, compute_force=True, **s.outputs)
    loss = s.loss_fn(pred=out, ref=batch, ddp=False)
    loss.backward()
    sync(s.device)
    t_backward = time.perf_counter()
    norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), config.clip_grad or float("inf"))
    skipped = not (torch.isfinite(norm) and torch.isfinite(loss.detach()))
    if skipped:
        _non_finite(s, float(loss.detach()), float(norm), _culprits(out, batch, indices))
    else:
        s.optimizer.step()
        if s.ema is not None:
            s.ema.update()
    sync(s.device)
    timer = s.timer
    blocked = max(t_backward - timer.last_ready, 0.0) if timer is not None and timer.last_ready else 0.0
    return loss, out, blocked, skipped


def _culprits(out: dict, batch, indices) -> tuple[list[int], bool]:
    """The batch's graphs whose squared energy, force, stress or virial error is not finite (all,
    if none is); stress and virials where the model computed them."""
    indices = list(indices)
    with torch.no_grad():
        n = (batch.ptr[1:] - batch.ptr[:-1]).to(out["energy"].dtype)
        e_bad = ~torch.isfinite(((out["energy"] - batch.energy) / n) ** 2)
        f_bad = ~torch.isfinite(((out["forces"] - batch.forces) ** 2).sum(dim=1))
        bad = e_bad | torch.zeros_like(e_bad).index_put_((batch.batch,), f_bad, accumulate=True)
        for key in ("stress", "virials"):
            got, want = out.get(key), getattr(batch, key, None)
            if got is not None and want is not None:
                bad |= ~torch.isfinite(((got - want) ** 2).reshape(len(bad), -1).sum(dim=1))
    picked = [indices[k] for k in torch.nonzero(bad).flatten().tolist() if k < len(indices)]
    return (picked, True) if picked else (indices, False)


def _non_finite(s: Session, loss: float, norm: float, culprits: tuple[list[int], bool]) -> None:
    graphs, found = culprits
    which = "graphs with a non-finite error" if found else "this rank's batch (no single graph stands out)"
    where = (
        f"step {s.global_step + 1} (epoch {s.epoch}), rank {s.rank}: non-finite loss {loss:.4g} / gradient "
        f"norm {norm:.4g}; {which}: {s.data.describe(graphs)}"
    )
    if s.config.on_nonfinite == "skip":  # the next step zeroes the gradients (a graph's keep their memory)
        warnings.warn(f"{where}; step skipped (on_nonfinite=skip)", stacklevel=3)
        return
    raise NonFiniteStep(
        f"{where}. Stopped; the last checkpoint is kept. Lower lr, check those structures, "
        "or set on_nonfinite=skip to skip such steps"
    )


def step_record(
    s: Session, epoch: int, consumed: int, batch, indices, t: tuple[float, float, float], blocked: float
) -> dict:
    t0, t1, t3 = t
    record = {
        "type": "step",
        "rank": s.rank,
        "epoch": epoch,
        "step": consumed - 1,
        "global_step": s.global_step,
        "data_s": round(t1 - t0, 6),
        "compute_s": round((t3 - t1) - blocked, 6),
        "allreduce_s": round(blocked, 6),
        "step_s": round(t3 - t0, 6),
        **dict(zip(("atoms", "edges", "graphs"), real_size(batch))),
        "loss": s.last_loss,
        "lr": s.optimizer.param_groups[0]["lr"],
        "batch_hash": batch_hash(indices),
        "time": time.time(),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if s.shapes is not None:  # fixed_shapes: what padding this batch to its shape added
        record["ghost_atoms"] = int(batch.num_nodes) - record["atoms"]
        record["ghost_edges"] = int(batch.edge_index.shape[1]) - record["edges"]
    if s.config.log_graph_ids:
        record["graph_ids"] = [int(i) for i in indices]
    return record


def accumulate(totals: StepTotals, batch, out, t: tuple[float, float, float], blocked: float) -> None:
    """Add a step's errors and times to ``totals``: the real graphs' (a padded batch's ghosts
    are left out: they lead no field, so slicing drops them)."""
    t0, t1, t3 = t
    atoms, _, graphs = real_size(batch)
    n = (batch.ptr[1 : graphs + 1] - batch.ptr[:graphs]).to(out["energy"].dtype)
    totals.e_abs += float(((out["energy"].detach()[:graphs] - batch.energy[:graphs]).abs() / n).sum())
    totals.f_abs += float((out["forces"].detach()[:atoms] - batch.forces[:atoms]).abs().mean(dim=1).sum())
    if out.get("stress") is not None:  # the graphs validation counts too: weight and stress weight above 0
        labelled = ((batch.weight[:graphs] * batch.stress_weight[:graphs]) > 0).to(out["stress"].dtype)
        err = ((out["stress"].detach()[:graphs] - batch.stress[:graphs]).abs().mean(dim=(1, 2)) * labelled).sum()
        s_abs, n = torch.stack([err, labelled.sum()]).tolist()  # one transfer from the device
        totals.s_abs += s_abs
        totals.stress_graphs += int(n)
    totals.graphs += graphs
    totals.force_atoms += atoms
    totals.data_s += t1 - t0
    totals.compute_s += (t3 - t1) - blocked
    totals.allreduce_s += blocked
