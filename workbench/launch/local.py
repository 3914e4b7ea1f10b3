"""Local backend: ``torchrun --standalone`` (or, for one rank, the worker itself) in a subprocess of its own session.

The subprocess outlives the notebook kernel that started it (own session, so a kernel
interrupt or restart does not reach it); :func:`workbench.launch.attach` finds it again.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# Variables of an enclosing distributed job that must not leak into torchrun's workers.
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


def command(config_yaml: Path, gpus_per_node: int, max_restarts: int) -> list[str]:
    """The torchrun command line (one process per GPU, or per CPU rank on a machine without CUDA).

    A single rank without restarts runs the worker directly: torchrun would add nothing but
    a second interpreter start (seconds of torch import).
    """
    if gpus_per_node == 1 and max_restarts == 0:
        return [sys.executable, "-m", "workbench.launch.worker", str(config_yaml)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus_per_node}",
        f"--max-restarts={max_restarts}",
        "-m",
        "workbench.launch.worker",
        str(config_yaml),
    ]


def train_cli_command(config_yaml: Path, nproc: int = 1, max_restarts: int = 0) -> list[str]:
    """``workbench train --config`` as a user runs it: directly for one rank, else under
    ``torchrun --standalone`` with ``nproc`` ranks (the benches and tests that drive the CLI)."""
    cli = [str(Path(sys.executable).parent / "workbench"), "train", "--config", str(config_yaml)]
    if nproc == 1 and max_restarts == 0:
        return cli
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, f"--max-restarts={max_restarts}", "--no-python", *cli]


def command_text(cmd: list[str], env: dict[str, str]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def check_resources(config, nodes: int, gpus_per_node: int) -> None:
    """Raise ``ValueError`` when this machine cannot hold the request."""
    if nodes != 1:
        raise ValueError(
            f"nodes={nodes}: backend='local' runs on this machine only; use nodes=1, "
            "or backend='slurm' for several nodes"
        )
    import torch

    wants_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        have = torch.cuda.device_count()
        if gpus_per_node > have:
            raise ValueError(f"gpus_per_node={gpus_per_node} but this machine has {have} CUDA GPU(s)")
    else:
        have = os.cpu_count() or 1
        if gpus_per_node > have:
            raise ValueError(
                f"gpus_per_node={gpus_per_node}: without CUDA each rank is a CPU process, and this "
                f"machine has {have} CPU core(s); use gpus_per_node <= {have}"
            )


def start(cmd: list[str], log_path: Path, env_extra: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(env_extra)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
