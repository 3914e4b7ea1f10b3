"""The process a rank runs in: its rank and world from the environment, its device, the checks
that must fail before a process group starts, the process group itself and the DDP wrapper.

Run as one process, or under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): DDP with nccl on GPUs
and gloo on CPUs.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from workbench.train.config import TrainConfig
from workbench.train.session import Session
from workbench.train.timing import AllreduceTimer


def dist_env() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from torchrun's environment (``0, 1, 0`` without it)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def pick_device(config: TrainConfig, local_rank: int) -> torch.device:
    """``config.device`` for this rank (``auto``: its local GPU when there is one, else the CPU)."""
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
    """Errors that must surface before any process group starts: the backend (from the kernel
    registry) runs on this device and is usable on this machine."""
    from workbench.kernels.registry import BACKENDS, get_backend

    backend = get_backend(config.backend)
    here = [n for n, b in BACKENDS.items() if device.type in b.devices and b.available]
    if device.type not in backend.devices:
        raise ValueError(
            f"TrainConfig.backend: {backend.name!r} runs on {', '.join(backend.devices)} only ({backend.description}), "
            f"and this run is on {device.type}; usable here: {', '.join(here)}"
        )
    reason = backend.unavailable()
    if reason:
        raise ValueError(
            f"TrainConfig.backend: {backend.name!r} is unavailable here: {reason}; usable: {', '.join(here)}"
        )


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.PrefixStore:
    """The rendezvous store, namespaced by torchrun's restart attempt.

    torchrun keeps one agent store across ``--max-restarts`` attempts, so the keys the dead
    attempt's ranks published (their gloo/nccl listening addresses) are still there and the new
    ranks would dial dead ports. A per-attempt prefix keeps each attempt's keys apart.
    """
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host, port, world_size=world, is_master=not agent and rank == 0, timeout=timeout, wait_for_workers=False
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"workbench/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{attempt}", store)


def init_process_group(config: TrainConfig, rank: int, world: int, device: torch.device) -> None:
    """Join the process group (nccl on GPUs, gloo on CPUs); nothing on one rank or when joined."""
    if world == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
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


def wrap_ddp(s: Session) -> None:
    """``s.net``: the model, in DDP with an all-reduce timer on several ranks."""
    s.net = s.model
    if s.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        s.net = DDP(s.model, device_ids=[s.device.index] if s.device.type == "cuda" else None)
        s.timer = AllreduceTimer()
        s.net.register_comm_hook(None, s.timer.hook)
