"""``train(config)``: single-process or DDP training of a mace-torch ScaleShiftMACE.

Run it as one process, or under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): DDP
with nccl on GPUs and gloo on CPUs. Every rank builds the same data split, the
same statistics and the same packing from the seed, so nothing but gradients is
communicated.

Run directory ``<output_dir>/<name>/``::

    config.yaml           the config used
    metrics/rank<r>.jsonl one line per step per rank (timing, sizes, loss, lr, batch hash)
    metrics.jsonl         one line per epoch (MAEs, epoch time, compute/wait shares), rank 0
    checkpoint.pt         latest checkpoint (resume point)
    model.model           final model (EMA weights, e3nn backend): mace's MACECalculator loads it
    model_<backend>.model the accelerated model, when a kernel backend was used
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.train import preempt
from workbench.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from workbench.train.config import TrainConfig
from workbench.train.data import TrainData
from workbench.train.timing import AllreduceTimer, sync

PACKERS = ("paper", "shuffled-paper", "dynamic", "ffd", "lpt")


@dataclass
class TrainResult:
    run_dir: Path
    global_step: int
    epochs_done: int
    final_loss: float
    model_path: Path | None


def _dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _device(config: TrainConfig, local_rank: int) -> torch.device:
    if config.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(config.device)


def preflight(config: TrainConfig, device: torch.device) -> None:
    """Errors that must surface before any process group starts."""
    if config.backend == "cueq":
        if device.type != "cuda":
            raise ValueError("backend 'cueq' needs a CUDA GPU (cuEquivariance has no CPU kernels); "
                             "use backend='e3nn' or 'numba' on this machine")
        try:
            import cuequivariance_torch  # noqa: F401
        except ImportError:
            raise ValueError("backend 'cueq' needs cuequivariance-torch: pip install 'cfm-workbench[cuda]'") from None
    if config.backend == "numba":
        try:
            from workbench.kernels import accelerate  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"backend 'numba' is unavailable: {exc}") from None


def make_sampler(config: TrainConfig, atoms: np.ndarray, edges: np.ndarray, num_replicas: int, rank: int):
    from workbench.packing import BinPackingBatchSampler

    if config.sampler in PACKERS:
        big = int(np.argmax(atoms))
        if atoms[big] > config.capacity:
            raise ValueError(f"capacity {config.capacity} atoms is smaller than training graph {big} "
                             f"({int(atoms[big])} atoms); raise TrainConfig.capacity to at least {int(atoms.max())}")
        return BinPackingBatchSampler(atoms, capacity=config.capacity, num_replicas=num_replicas, rank=rank,
                                      shuffle=True, seed=config.seed, algorithm=config.sampler)
    return BinPackingBatchSampler(atoms, capacity=config.capacity, num_replicas=num_replicas, rank=rank,
                                  shuffle=True, seed=config.seed, algorithm="fixed-count",
                                  graphs_per_batch=config.batch_size)


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


def _batch_hash(indices) -> int:
    return zlib.crc32(np.asarray(indices, dtype=np.int64).tobytes())


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def evaluate(model, data: list, device: torch.device, batch_size: int = 16) -> dict:
    """Energy MAE per atom (meV/atom) and force MAE (meV/Å) of ``model`` on ``data``."""
    from mace.tools.torch_geometric import DataLoader

    if not data:
        return {"e_mae_mev_atom": float("nan"), "f_mae_mev_a": float("nan")}
    model.eval()
    e_err, f_err, n_atoms_f = 0.0, 0.0, 0
    for batch in DataLoader(data, batch_size=batch_size, shuffle=False):
        batch = batch.to(device)
        out = model(batch.to_dict(), training=False, compute_force=True)
        n = (batch.ptr[1:] - batch.ptr[:-1]).to(out["energy"].dtype)
        e_err += float(((out["energy"].detach() - batch.energy).abs() / n).sum())
        f_err += float((out["forces"].detach() - batch.forces).abs().mean(dim=1).sum())
        n_atoms_f += int(batch.forces.shape[0])
    return {"e_mae_mev_atom": 1000 * e_err / len(data), "f_mae_mev_a": 1000 * f_err / max(n_atoms_f, 1)}


def _maybe_fail(global_step: int, rank: int) -> None:
    # Fault injection for the resume and rank-failure tests: die at a given step, first attempt only.
    at = os.environ.get("WORKBENCH_FAIL_AT_STEP")
    if at is None or int(at) != global_step:
        return
    if int(os.environ.get("WORKBENCH_FAIL_RANK", rank)) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > int(os.environ.get("WORKBENCH_FAIL_ATTEMPTS", 1)) - 1:
        return
    os._exit(int(os.environ.get("WORKBENCH_FAIL_CODE", 17)))


def train(config: TrainConfig, structures: list | None = None, resume: bool = True,
          data: TrainData | None = None) -> TrainResult:
    """Train ``config``; resume from ``<run_dir>/checkpoint.pt`` when present and ``resume``.

    ``data``: already prepared by ``prepare_data`` for a config equal to ``config`` on
    ``PREPARE_FIELDS`` (``structures`` is then unused); several runs can share it.
    The torch default dtype is ``config.dtype`` while it runs (mace builds its data and
    buffers in the default dtype) and is restored afterwards.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, config.dtype))
    try:
        with preempt.guard_from_env():  # preemption hook (workbench.train.preempt); opt-in via env
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
    store = dist.TCPStore(host, port, world_size=world, is_master=not agent and rank == 0, timeout=timeout,
                          wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"workbench/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{attempt}", store)


def _train(config: TrainConfig, structures: list | None, resume: bool, data: TrainData | None) -> TrainResult:
    import torch.distributed as dist
    from mace.modules.loss import WeightedEnergyForcesLoss
    from mace.tools.torch_geometric import DataLoader

    from workbench.train.data import prepare_data
    from workbench.train.model import ModelStats, build_model, compute_stats

    rank, world, local_rank = _dist_env()
    device = _device(config, local_rank)
    preflight(config, device)
    if data is None:
        data = prepare_data(config, structures)
    sampler = make_sampler(config, data.train_atoms, data.train_edges, world, rank)
    run_dir = config.run_dir
    ckpt_path = run_dir / CHECKPOINT_NAME
    if rank == 0:
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        config.to_yaml(run_dir / "config.yaml")

    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from datetime import timedelta

        if device.type != "cuda" and os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world):
            # One node: keep gloo on loopback rather than whatever the hostname resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=config.dist_timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=_attempt_store(rank, world, timeout),
                                rank=rank, world_size=world, timeout=timeout)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)

    ckpt = load_checkpoint(ckpt_path) if resume else None
    if ckpt:
        stats = ModelStats(**ckpt["stats"])
    else:
        if data.stats is None:
            data.stats = compute_stats(data.train_configs, data.train, data.z_table)
        stats = data.stats
    model = build_model(config, stats).to(device)
    if config.backend != "e3nn":
        from workbench.kernels import accelerate

        model = accelerate(model, backend=config.backend).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, amsgrad=config.amsgrad,
                                 weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=config.lr_factor,
                                                           patience=config.scheduler_patience)
    ema = None
    if config.ema_decay is not None:
        from torch_ema import ExponentialMovingAverage

        ema = ExponentialMovingAverage(model.parameters(), decay=config.ema_decay)
    loss_fn = WeightedEnergyForcesLoss(energy_weight=config.energy_weight, forces_weight=config.forces_weight).to(device)

    start_epoch, global_step, resume_sampler = 0, 0, None
    if ckpt:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if ema is not None and ckpt.get("ema") is not None:
            ema.load_state_dict(ckpt["ema"])
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]
        resume_sampler = ckpt["sampler"][rank] if world == len(ckpt["sampler"]) else None
        if resume_sampler is None:
            raise ValueError(f"{ckpt_path}: checkpoint was written by {len(ckpt['sampler'])} ranks, "
                             f"this run has {world}; resume with the same number of ranks")
        set_rng_state(ckpt["rng"][rank] if isinstance(ckpt["rng"], list) else ckpt["rng"])

    timer = None
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        timer = AllreduceTimer()
        net.register_comm_hook(None, timer.hook)

    step_log = open(run_dir / "metrics" / f"rank{rank}.jsonl", "a")
    epoch_log = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    bar = None
    total_steps = config.max_steps or config.epochs * len(sampler)
    if rank == 0 and config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=min(global_step, total_steps), desc=config.name, unit="step")

    def checkpoint(epoch: int, consumed: int) -> None:
        # Every rank's sampler position and RNG go into one file written by rank 0.
        mine = {"sampler": sampler.state_dict(consumed=consumed), "rng": rng_state()}
        gathered = [None] * world
        if world > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if rank == 0:
            save_checkpoint(ckpt_path, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "epoch": epoch, "global_step": global_step, "stats": stats.to_dict(),
                "sampler": [g["sampler"] for g in gathered], "rng": [g["rng"] for g in gathered],
                "config": config.to_dict(),
            })
        if world > 1:
            dist.barrier()

    last_loss = float("nan")
    done = config.max_steps is not None and global_step >= config.max_steps
    epoch = start_epoch
    while epoch < config.epochs and not done:
        sampler.set_epoch(epoch)
        consumed = 0
        if resume_sampler is not None and resume_sampler["epoch"] == epoch:
            sampler.load_state_dict(resume_sampler)
            consumed = resume_sampler["batches_done"]
        resume_sampler = None
        recording = _Recording(sampler)
        loader = DataLoader(data.train, batch_sampler=recording, num_workers=config.num_workers)
        model.train()
        t_epoch = time.perf_counter()
        sums = {"data": 0.0, "compute": 0.0, "allreduce": 0.0, "e_abs": 0.0, "f_abs": 0.0, "graphs": 0, "fatoms": 0}
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            indices = recording.queue.popleft()
            batch = batch.to(device)
            t1 = time.perf_counter()
            if timer is not None:
                timer.reset()
            optimizer.zero_grad(set_to_none=True)
            out = net(batch.to_dict(), training=True, compute_force=True)
            loss = loss_fn(pred=out, ref=batch, ddp=False)
            loss.backward()
            sync(device)
            t2 = time.perf_counter()
            if config.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
            optimizer.step()
            if ema is not None:
                ema.update()
            sync(device)
            t3 = time.perf_counter()
            blocked = max(t2 - timer.last_ready, 0.0) if timer is not None and timer.last_ready else 0.0
            consumed += 1
            global_step += 1
            last_loss = float(loss.detach())
            n = (batch.ptr[1:] - batch.ptr[:-1]).to(out["energy"].dtype)
            sums["e_abs"] += float(((out["energy"].detach() - batch.energy).abs() / n).sum())
            sums["f_abs"] += float((out["forces"].detach() - batch.forces).abs().mean(dim=1).sum())
            sums["graphs"] += int(batch.num_graphs)
            sums["fatoms"] += int(batch.forces.shape[0])
            sums["data"] += t1 - t0
            sums["compute"] += (t3 - t1) - blocked
            sums["allreduce"] += blocked
            step_log.write(json.dumps({
                "type": "step", "rank": rank, "epoch": epoch, "step": consumed - 1, "global_step": global_step,
                "data_s": round(t1 - t0, 6), "compute_s": round((t3 - t1) - blocked, 6),
                "allreduce_s": round(blocked, 6), "step_s": round(t3 - t0, 6),
                "atoms": int(batch.num_nodes), "edges": int(batch.edge_index.shape[1]), "graphs": int(batch.num_graphs),
                "loss": last_loss, "lr": optimizer.param_groups[0]["lr"], "batch_hash": _batch_hash(indices),
                "time": time.time(),
            }) + "\n")
            step_log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4g}", epoch=epoch)
            _maybe_fail(global_step, rank)
            if config.checkpoint_every and global_step % config.checkpoint_every == 0:
                checkpoint(epoch, consumed)
            if config.max_steps is not None and global_step >= config.max_steps:
                done = True
                break
            # -- preemption hook (workbench.train.preempt): all ranks stop at this step boundary together
            stop = preempt.requested(world, device) if consumed < len(sampler) else None
            if stop:
                checkpoint(epoch, consumed)
                raise preempt.Preempted(stop, global_step)
            # -- end preemption hook
        epoch_s = time.perf_counter() - t_epoch
        totals = torch.tensor([sums["e_abs"], sums["f_abs"], sums["graphs"], sums["fatoms"], sums["compute"],
                               sums["allreduce"], sums["data"]], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(totals)
        valid = {}
        if ema is not None:
            with ema.average_parameters():
                valid = evaluate(model, data.valid, device)
        else:
            valid = evaluate(model, data.valid, device)
        if not math.isnan(valid.get("e_mae_mev_atom", float("nan"))):
            scheduler.step(valid["e_mae_mev_atom"] + valid["f_mae_mev_a"])
        finished_epoch = not done or consumed == len(sampler)
        if rank == 0:
            busy = float(totals[4] + totals[5] + totals[6]) or 1.0
            epoch_log.write(json.dumps({
                "type": "epoch", "epoch": epoch, "complete": finished_epoch, "global_step": global_step,
                "epoch_s": round(epoch_s, 4),
                "train_e_mae_mev_atom": 1000 * float(totals[0]) / max(float(totals[2]), 1),
                "train_f_mae_mev_a": 1000 * float(totals[1]) / max(float(totals[3]), 1),
                "valid_e_mae_mev_atom": valid["e_mae_mev_atom"], "valid_f_mae_mev_a": valid["f_mae_mev_a"],
                "compute_share": float(totals[4]) / busy, "allreduce_share": float(totals[5]) / busy,
                "data_share": float(totals[6]) / busy, "loss": last_loss, "lr": optimizer.param_groups[0]["lr"],
                "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            }) + "\n")
            epoch_log.flush()
        model.train()
        if finished_epoch:
            epoch += 1
            checkpoint(epoch, 0)
        else:
            checkpoint(epoch, consumed)
    if bar is not None:
        bar.close()
    step_log.close()
    model_path = None
    if rank == 0 and config.export:
        from workbench.train.export import export_models

        model_path = export_models(model, ema, config, run_dir)
    if epoch_log is not None:
        epoch_log.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return TrainResult(run_dir, global_step, epoch, last_loss, model_path)
