"""``train(config)``: single-process or DDP training of a mace-torch ScaleShiftMACE.

Run it as one process, or under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): DDP
with nccl on GPUs and gloo on CPUs. Every rank builds the same data split, the
same statistics and the same packing from the seed, so nothing but gradients is
communicated.

The run directory's layout and log records are owned by :mod:`workbench.train.rundir`.

The loop is split the way mace-torch's is: :func:`set_up` (process group, data, sampler,
model, optimiser), :func:`restore` (from the checkpoint), :func:`train_one_epoch` over
:func:`take_step`, :func:`evaluate`, :func:`log_epoch` and :func:`checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.train import mace_order, preempt
from workbench.train.checkpoint import (
    load_checkpoint,
    remove_stale_temporaries,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from workbench.train.config import RUN_IDENTITY, TrainConfig
from workbench.train.data import TrainData
from workbench.train.evaluate import evaluate
from workbench.train.rundir import EPOCH_FIELDS, STEP_FIELDS, JsonlLog, RunDir, RunLock, drop_after
from workbench.train.timing import AllreduceTimer, sync

COUNT_SAMPLERS = ("fixed-count",)  # batches by graph count (TrainConfig.batch_size); the rest pack to capacity


@dataclass
class TrainResult:
    run_dir: Path
    global_step: int
    epochs_done: int
    final_loss: float
    model_path: Path | None


def _dist_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def _device(config: TrainConfig, local_rank: int) -> torch.device:
    if config.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if config.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"TrainConfig.device: {config.device!r}, but no CUDA GPU is visible here "
                "(torch.cuda.is_available() is False); use device=auto or cpu"
            )
        index = int(config.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"TrainConfig.device: {config.device!r}, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
    return torch.device(config.device)


def preflight(config: TrainConfig, device: torch.device) -> None:
    """Errors that must surface before any process group starts."""
    if config.backend == "cueq":
        if device.type != "cuda":
            raise ValueError(
                "backend 'cueq' needs a CUDA GPU (cuEquivariance has no CPU kernels); "
                "use backend='e3nn' or 'numba' on this machine"
            )
        try:
            import cuequivariance_torch  # noqa: F401
        except ImportError:
            raise ValueError("backend 'cueq' needs cuequivariance-torch: pip install 'cfm-workbench[cuda]'") from None
    if config.backend == "numba":
        try:
            from workbench.kernels import accelerate  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"backend 'numba' is unavailable: {exc}") from None


def make_sampler(
    config: TrainConfig,
    atoms: np.ndarray,
    edges: np.ndarray,
    num_replicas: int,
    rank: int,
    file_order: np.ndarray | None = None,
):
    """The training batch sampler of ``config.sampler``. ``file_order``: for ``mace-order``, the
    dataset index of each training-file position (:func:`workbench.train.mace_order.file_order`)."""
    from workbench.packing import BinPackingBatchSampler

    if config.sampler == mace_order.NAME:
        mace_order.check_ranks(num_replicas)
        return mace_order.MaceOrderSampler(
            len(atoms), config.batch_size, seed=config.seed, order=file_order, atoms=atoms
        )

    if config.sampler not in COUNT_SAMPLERS:
        big = int(np.argmax(atoms))
        if atoms[big] > config.capacity:
            raise ValueError(
                f"capacity {config.capacity} atoms is smaller than training graph {big} "
                f"({int(atoms[big])} atoms); raise TrainConfig.capacity to at least {int(atoms.max())}"
            )
        return BinPackingBatchSampler(
            atoms,
            capacity=config.capacity,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=config.seed,
            algorithm=config.sampler,
        )
    return BinPackingBatchSampler(
        atoms,
        capacity=config.capacity,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=True,
        seed=config.seed,
        algorithm="fixed-count",
        graphs_per_batch=config.batch_size,
    )


class _Recording(torch.utils.data.Sampler):
    """Pass batches through and remember them, so the trainer knows which graphs each step saw."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.queue: deque = deque()

    def __iter__(self):
        for batch in self.sampler:
            self.queue.append(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _batch_hash(indices) -> int:
    return zlib.crc32(np.asarray(indices, dtype=np.int64).tobytes())


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _maybe_fail(global_step: int, rank: int) -> None:
    # Fault injection for the resume and rank-failure tests: die at a given step, first attempt only.
    at = os.environ.get("WORKBENCH_FAIL_AT_STEP")
    if at is None or int(at) != global_step:
        return
    if int(os.environ.get("WORKBENCH_FAIL_RANK", str(rank))) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > int(os.environ.get("WORKBENCH_FAIL_ATTEMPTS", "1")) - 1:
        return
    os._exit(int(os.environ.get("WORKBENCH_FAIL_CODE", "17")))


def train(
    config: TrainConfig, structures: list | None = None, resume: bool = True, data: TrainData | None = None
) -> TrainResult:
    """Train ``config``; resume from ``<run_dir>/checkpoint.pt`` when present and ``resume``.

    ``data``: already prepared by ``prepare_data`` for a config equal to ``config`` on
    ``PREPARE_FIELDS`` (``structures`` is then unused); several runs can share it.
    The torch default dtype is ``config.dtype`` while it runs (mace builds its data and
    buffers in the default dtype) and is restored afterwards.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, config.dtype))
    try:
        with preempt.guard_from_env():  # opt-in via env: workbench.train.preempt
            return _train(config, structures, resume, data)
    finally:
        torch.set_default_dtype(previous)


def _attempt_store(rank: int, world: int, timeout):
    """The rendezvous store, namespaced by torchrun's restart attempt.

    torchrun keeps one agent store across ``--max-restarts`` attempts, so the keys the dead
    attempt's ranks published (their gloo/nccl listening addresses) are still there and the new
    ranks would dial dead ports. A per-attempt prefix keeps each attempt's keys apart.
    """
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host, port, world_size=world, is_master=not agent and rank == 0, timeout=timeout, wait_for_workers=False
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"workbench/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{attempt}", store)


@dataclass
class StepTotals:
    """Sums over an epoch's steps on one rank; :meth:`all_reduce` sums them over ranks."""

    e_abs: float = 0.0  # sum over graphs of |E error| / atoms, eV/atom
    f_abs: float = 0.0  # sum over atoms of mean |F error| component, eV/Å
    graphs: int = 0
    force_atoms: int = 0
    compute_s: float = 0.0
    allreduce_s: float = 0.0
    data_s: float = 0.0

    def all_reduce(self, world: int) -> StepTotals:
        if world == 1:
            return self
        import torch.distributed as dist

        t = torch.tensor(astuple(self), dtype=torch.float64)
        dist.all_reduce(t)
        return StepTotals(**{f.name: type(getattr(self, f.name))(v) for f, v in zip(fields(self), t.tolist())})

    @property
    def busy_s(self) -> float:
        return (self.compute_s + self.allreduce_s + self.data_s) or 1.0


@dataclass
class Session:
    """Everything one rank holds while it trains."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    data: TrainData
    sampler: Any
    run: RunDir
    stats: Any = None
    model: Any = None
    net: Any = None  # the DDP wrapper (or the model itself on one rank)
    optimizer: Any = None
    scheduler: Any = None
    ema: Any = None
    loss_fn: Any = None
    timer: AllreduceTimer | None = None
    epoch: int = 0
    global_step: int = 0
    resume_sampler: dict | None = None
    loader: Any = None  # the training DataLoader, kept across epochs (its workers persist)
    recording: Any = None
    last_loss: float = float("nan")
    best: dict | None = None  # keep="best": {"epoch", "loss", "model": state dict (EMA weights)} of the best epoch
    done: bool = False
    extra: dict = field(default_factory=dict)


def _init_process_group(config: TrainConfig, rank: int, world: int, device: torch.device) -> None:
    import torch.distributed as dist

    if world == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from datetime import timedelta

    if device.type != "cuda" and os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world):
        # One node: keep gloo on loopback rather than whatever the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=config.dist_timeout_s)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=_attempt_store(rank, world, timeout),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def set_up(config: TrainConfig, structures: list | None, data: TrainData | None) -> Session:
    """Device, data, sampler and process group; the run directory's config (rank 0)."""
    from workbench.train.data import prepare_data

    rank, world, local_rank = _dist_env()
    device = _device(config, local_rank)
    preflight(config, device)
    if data is None:
        data = prepare_data(config, structures)
    sampler = make_sampler(config, data.train_atoms, data.train_edges, world, rank, mace_order.file_order(data))
    run = RunDir(config.run_dir)
    if rank == 0:
        from workbench.train.record import write_run_record

        run.metrics_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(run.config)
        write_run_record(run, config, data, world, device, sampler)
    _init_process_group(config, rank, world, device)
    # Deterministic kernels where torch has a choice (warn, not fail, where a CUDA op has none).
    torch.use_deterministic_algorithms(config.deterministic, warn_only=True)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    return Session(config, rank, world, device, data, sampler, run)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The optimiser's parameter groups. Without weight decay, one group. With it, mace-torch's
    split: decay on the interactions' ``linear.weight`` and ``skip_tp_full.weight`` and on the
    products, none on the embedding, the other interaction weights and the readouts."""
    if not weight_decay:
        return [{"params": list(model.parameters()), "weight_decay": 0.0}]
    decay = [p for n, p in model.interactions.named_parameters() if "linear.weight" in n or "skip_tp_full.weight" in n]
    decay += list(model.products.parameters())
    chosen = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_training(s: Session, ckpt: dict | None) -> None:
    """Model (accelerated when asked), optimiser, scheduler, EMA and loss."""
    from mace.modules.loss import WeightedEnergyForcesLoss

    from workbench.train.model import build_model
    from workbench.train.stats import ModelStats, compute_stats

    config = s.config
    if ckpt:
        s.stats = ModelStats(**ckpt["stats"])
    elif config.sampler == mace_order.NAME:  # mace's statistics passes: particular to this seed and batch size
        if not s.data.train_configs:
            raise ValueError(
                f"sampler {mace_order.NAME!r} needs the structures in memory (an extxyz dataset), "
                "not a prepared dataset"
            )
        s.stats = compute_stats(s.data.train_configs, s.data.train, s.data.z_table, *s.sampler.statistics_rows())
    else:
        if s.data.stats is None:
            s.data.stats = compute_stats(s.data.train_configs, s.data.train, s.data.z_table)
        s.stats = s.data.stats
    # the initial weights depend on the seed and the model only, not on what drew random numbers
    # before (data loaders do): the same as mace_run_train's for the same seed and recipe
    torch.manual_seed(config.seed)
    s.model = build_model(config, s.stats).to(s.device)
    if config.backend != "e3nn":
        from workbench.kernels import accelerate

        if config.kernel_cache:  # the precompile workers and numba's cache read it from the environment
            from workbench.kernels.backends.generated import KERNEL_CACHE_ENV

            os.environ[KERNEL_CACHE_ENV] = str(Path(config.kernel_cache).expanduser().resolve())
        # on a GPU, numba's kernels compile here, in parallel, once per node (rank 0 of a node
        # compiles under a file lock, the others wait and load the cache)
        s.model = accelerate(s.model, backend=config.backend).to(s.device)
    s.optimizer = torch.optim.Adam(param_groups(s.model, config.weight_decay), lr=config.lr, amsgrad=config.amsgrad)
    s.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        s.optimizer, factor=config.lr_factor, patience=config.scheduler_patience
    )
    if config.ema_decay is not None:
        from torch_ema import ExponentialMovingAverage

        s.ema = ExponentialMovingAverage(s.model.parameters(), decay=config.ema_decay)
    s.loss_fn = WeightedEnergyForcesLoss(energy_weight=config.energy_weight, forces_weight=config.forces_weight).to(
        s.device
    )


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
    if s.world != len(ckpt["sampler"]):
        raise ValueError(
            f"{s.run.checkpoint}: checkpoint was written by {len(ckpt['sampler'])} ranks, "
            f"this run has {s.world}; resume with the same number of ranks"
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
    s.optimizer.load_state_dict(ckpt["optimizer"])
    s.scheduler.load_state_dict(ckpt["scheduler"])
    if s.ema is not None and ckpt.get("ema") is not None:
        s.ema.load_state_dict(ckpt["ema"])
    s.best = ckpt.get("best")
    s.epoch, s.global_step = ckpt["epoch"], ckpt["global_step"]
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
        _say(s, f"resume: applied {'; '.join(changed)}")
    s.resume_sampler = ckpt["sampler"][s.rank]
    set_rng_state(ckpt["rng"][s.rank] if isinstance(ckpt["rng"], list) else ckpt["rng"])
    dropped = drop_after(s.run.step_log(s.rank), s.global_step)
    if s.rank == 0:
        drop_after(s.run.epoch_log, s.global_step)
        if dropped:
            _say(s, f"resume: from step {s.global_step}; {dropped} step(s) logged after it will run again")


def _say(s: Session, message: str) -> None:
    if s.rank == 0:
        print(f"workbench: {message}", file=sys.stderr, flush=True)


def wrap_ddp(s: Session) -> None:
    s.net = s.model
    if s.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        s.net = DDP(s.model, device_ids=[s.device.index] if s.device.type == "cuda" else None)
        s.timer = AllreduceTimer()
        s.net.register_comm_hook(None, s.timer.hook)


def checkpoint(s: Session, epoch: int, consumed: int) -> None:
    """One file, written by rank 0, with every rank's sampler position and RNG state."""
    import torch.distributed as dist

    mine = {"sampler": s.sampler.state_dict(consumed=consumed), "rng": rng_state()}
    gathered = [None] * s.world
    if s.world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if s.rank == 0:
        save_checkpoint(
            s.run.checkpoint,
            {
                "model": s.model.state_dict(),
                "optimizer": s.optimizer.state_dict(),
                "scheduler": s.scheduler.state_dict(),
                "ema": s.ema.state_dict() if s.ema is not None else None,
                "epoch": epoch,
                "global_step": s.global_step,
                "stats": s.stats.to_dict(),
                "sampler": [g["sampler"] for g in gathered],
                "rng": [g["rng"] for g in gathered],
                "config": s.config.to_dict(),
                "best": s.best,
            },
        )
    if s.world > 1:
        dist.barrier()


class NonFiniteStep(ValueError):
    """A NaN or infinite loss or gradient (``on_nonfinite="stop"``); names the step and the graphs."""


def take_step(s: Session, batch, indices=()) -> tuple[Any, dict, float, bool]:
    """Forward, energy+forces loss, backward, clip, optimiser and EMA update.

    Returns ``(loss, output, blocked, skipped)``: ``blocked`` is the time spent waiting in the
    gradient all-reduce (DDP), measured by the comm hook; ``skipped`` is True when a non-finite
    loss or gradient made the step be skipped (``on_nonfinite="skip"``). Gradients are summed
    over ranks before the check, so every rank reaches the same verdict at the same step.
    """
    config = s.config
    if s.timer is not None:
        s.timer.reset()
    s.optimizer.zero_grad(set_to_none=True)
    out = s.net(batch.to_dict(), training=True, compute_force=True)
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
    """The batch's graphs whose squared energy or force error is not finite (all, if none is)."""
    indices = list(indices)
    with torch.no_grad():
        n = (batch.ptr[1:] - batch.ptr[:-1]).to(out["energy"].dtype)
        e_bad = ~torch.isfinite(((out["energy"] - batch.energy) / n) ** 2)
        f_bad = ~torch.isfinite(((out["forces"] - batch.forces) ** 2).sum(dim=1))
        bad = e_bad | torch.zeros_like(e_bad).index_put_((batch.batch,), f_bad, accumulate=True)
    picked = [indices[k] for k in torch.nonzero(bad).flatten().tolist() if k < len(indices)]
    return (picked, True) if picked else (indices, False)


def _non_finite(s: Session, loss: float, norm: float, culprits: tuple[list[int], bool]) -> None:
    graphs, found = culprits
    which = "graphs with a non-finite error" if found else "this rank's batch (no single graph stands out)"
    where = (
        f"step {s.global_step + 1} (epoch {s.epoch}), rank {s.rank}: non-finite loss {loss:.4g} / gradient "
        f"norm {norm:.4g}; {which}: {s.data.describe(graphs)}"
    )
    if s.config.on_nonfinite == "skip":
        s.optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"{where}; step skipped (on_nonfinite=skip)", stacklevel=3)
        return
    raise NonFiniteStep(
        f"{where}. Stopped; the last checkpoint is kept. Lower lr, check those structures, "
        "or set on_nonfinite=skip to skip such steps"
    )


def _step_record(
    s: Session, epoch: int, consumed: int, batch, indices, t: tuple[float, float, float], blocked: float
) -> dict:
    t0, t1, t3 = t
    return {
        "type": "step",
        "rank": s.rank,
        "epoch": epoch,
        "step": consumed - 1,
        "global_step": s.global_step,
        "data_s": round(t1 - t0, 6),
        "compute_s": round((t3 - t1) - blocked, 6),
        "allreduce_s": round(blocked, 6),
        "step_s": round(t3 - t0, 6),
        "atoms": int(batch.num_nodes),
        "edges": int(batch.edge_index.shape[1]),
        "graphs": int(batch.num_graphs),
        "loss": s.last_loss,
        "lr": s.optimizer.param_groups[0]["lr"],
        "batch_hash": _batch_hash(indices),
        "time": time.time(),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def _accumulate(totals: StepTotals, batch, out, t: tuple[float, float, float], blocked: float) -> None:
    t0, t1, t3 = t
    n = (batch.ptr[1:] - batch.ptr[:-1]).to(out["energy"].dtype)
    totals.e_abs += float(((out["energy"].detach() - batch.energy).abs() / n).sum())
    totals.f_abs += float((out["forces"].detach() - batch.forces).abs().mean(dim=1).sum())
    totals.graphs += int(batch.num_graphs)
    totals.force_atoms += int(batch.forces.shape[0])
    totals.data_s += t1 - t0
    totals.compute_s += (t3 - t1) - blocked
    totals.allreduce_s += blocked


def _epoch_batches(s: Session, epoch: int) -> tuple[Iterator, _Recording, int]:
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
        s.recording = _Recording(s.sampler)
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

    Returns this rank's totals and the number of the epoch's batches consumed.
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
        batch = batch.to(s.device)
        t1 = time.perf_counter()
        loss, out, blocked, skipped = take_step(s, batch, indices)
        t = (t0, t1, time.perf_counter())
        consumed += 1
        s.global_step += 1
        s.last_loss = float(loss.detach())
        _accumulate(totals, batch, out, t, blocked)
        step_log.write({**_step_record(s, epoch, consumed, batch, indices, t, blocked), "skipped": skipped})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{s.last_loss:.4g}", epoch=epoch)
        _maybe_fail(s.global_step, s.rank)
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
        valid = evaluate(
            s.model,
            s.data.valid,
            s.device,
            batch_size=s.config.batch_size,
            num_workers=s.config.num_workers,
            families=s.data.valid_families,
            loss_fn=s.loss_fn,
        )
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


def log_epoch(
    s: Session, epoch_log: JsonlLog | None, epoch: int, complete: bool, epoch_s: float, totals: StepTotals, valid: dict
) -> None:
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
            "valid_families": valid["families"],
            "valid_loss": valid.get("loss"),
            "compute_share": totals.compute_s / busy,
            "allreduce_share": totals.allreduce_s / busy,
            "data_share": totals.data_s / busy,
            "loss": s.last_loss,
            "lr": s.optimizer.param_groups[0]["lr"],
            "peak_mem_gb": torch.cuda.max_memory_allocated(s.device) / 1e9 if s.device.type == "cuda" else None,
        }
    )


@contextlib.contextmanager
def _progress(s: Session):
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


def _finish(s: Session) -> TrainResult:
    import torch.distributed as dist

    model_path = None
    if s.rank == 0 and s.config.export:
        from workbench.train.export import export_models

        if s.best is not None:  # keep="best": the weights of the epoch with the lowest validation loss
            s.model.load_state_dict(s.best["model"])
            _say(s, f"export: the weights of epoch {s.best['epoch']} (lowest validation loss, {s.best['loss']:.6g})")
            model_path = export_models(s.model, None, s.config, s.run.path)
        else:
            model_path = export_models(s.model, s.ema, s.config, s.run.path)
    if s.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return TrainResult(s.run.path, s.global_step, s.epoch, s.last_loss, model_path)


def _train(config: TrainConfig, structures: list | None, resume: bool, data: TrainData | None) -> TrainResult:
    # One run per directory: rank 0 holds the lock for the whole run (released if it dies).
    lock = RunLock(RunDir(config.run_dir)) if _dist_env()[0] == 0 else contextlib.nullcontext()
    with lock:
        if getattr(lock, "taken_over", None):
            print(
                f"workbench: took over {RunDir(config.run_dir).lock} left by pid {lock.taken_over.get('pid')} "
                f"on {lock.taken_over.get('host')} (no longer running)",
                file=sys.stderr,
            )
        return _train_locked(config, structures, resume, data)


def _train_locked(config: TrainConfig, structures: list | None, resume: bool, data: TrainData | None) -> TrainResult:
    s = set_up(config, structures, data)
    if s.rank == 0:
        remove_stale_temporaries(s.run.checkpoint)
    ckpt = load_checkpoint(s.run.checkpoint) if resume else None
    check_resume(s, ckpt)
    build_training(s, ckpt)
    restore(s, ckpt)
    wrap_ddp(s)
    s.done = config.max_steps is not None and s.global_step >= config.max_steps
    epoch_log = JsonlLog(s.run.epoch_log, EPOCH_FIELDS) if s.rank == 0 else contextlib.nullcontext()
    with JsonlLog(s.run.step_log(s.rank), STEP_FIELDS) as step_log, epoch_log as epoch_log, _progress(s) as bar:
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
    return _finish(s)
