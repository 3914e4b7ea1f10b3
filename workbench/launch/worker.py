"""What every rank of a launched run executes, on either backend.

* local: ``torchrun ... -m workbench.launch.worker <run_dir>/launch/config.yaml``;
  torchrun has already set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``.
* slurm: submitit runs one task per rank and calls a pickled :class:`TrainTask`; it
  exports the torch distributed variables from SLURM's task environment
  (``submitit.helpers.TorchDistributedEnvironment``) before training.

Besides training, the worker leaves the files the launcher derives a run's status from,
under ``<run_dir>/launch/``:

``rank<r>.json``        this rank's state in the current attempt: running, done,
                        preempted or failed (+ attempt id, host, pid, times, step)
``error_rank<r>.txt``   the traceback when this rank failed
``attempts.jsonl``      one line per attempt (rank 0): start time, job id, restart count

A SIGTERM or SIGUSR2 during training makes every rank stop at the same step boundary after a
checkpoint (:mod:`workbench.train.preempt`). What the job does next (requeue after SIGUSR2, which
SLURM sends ``signal_delay_s`` before the time limit, or after a rank vanished) is decided once the
step is over, by :mod:`workbench.launch.failover`; after SIGTERM (``scontrol requeue``,
preemption, ``scancel``) SLURM already decided.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from workbench.switches import switch
from workbench.train.rundir import JsonlLog, RunDir

ATTEMPT_ENV = "WORKBENCH_ATTEMPT"


def _now() -> float:
    return round(time.time(), 3)


def attempt_id() -> str:
    """Identifies one start of the run: ``<jobid>.<restart count>`` on SLURM, a launcher token locally."""
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return f"{os.environ['SLURM_JOB_ID']}.{int(os.environ.get('SLURM_RESTART_COUNT') or 0)}"
    return switch(ATTEMPT_ENV, f"pid{os.getpid()}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Write-and-rename: a reader polling the file never sees half of it.
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class _Markers:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.paths = RunDir(run_dir)
        self.dir = self.paths.launch
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.base = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "attempt": attempt_id(),
            "host": socket.gethostname(),
            # A cluster's node names; SLURM tasks on one machine (the test cluster) share a hostname.
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "pid": os.getpid(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "started": _now(),
        }

    def write(self, state: str, **extra: Any) -> None:
        _write_json(self.paths.rank_marker(self.rank), {**self.base, "state": state, "time": _now(), **extra})


def run_rank(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Train ``config_dict`` as this rank (distributed env already exported); returns a summary dict."""
    from workbench.train import preempt
    from workbench.train.config import TrainConfig

    config = TrainConfig.from_dict(config_dict)
    rank = int(os.environ.get("RANK", "0"))
    # The trainer records these signals and stops all ranks at one step boundary (see module docstring).
    signals = switch(preempt.ENV_VAR, "TERM,USR2")
    markers = _Markers(config.run_dir, rank)
    if rank == 0:
        with JsonlLog(markers.paths.attempts) as attempts:
            attempts.write(
                {
                    "attempt": attempt_id(),
                    "job_id": os.environ.get("SLURM_JOB_ID"),
                    "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                    "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                    "host": socket.gethostname(),
                    "nodes": os.environ.get("SLURM_JOB_NODELIST") or socket.gethostname(),
                    "time": _now(),
                }
            )
    markers.write("running")
    try:
        from workbench.train.loop import train

        result = train(config, resume=True, preempt_signals=signals)
    except preempt.Preempted as exc:
        markers.write("preempted", signal=exc.signal_name, global_step=exc.global_step)
        print(f"workbench: rank {rank}: {exc}", file=sys.stderr, flush=True)
        _shutdown_group()
        return {"state": "preempted", "signal": exc.signal_name, "global_step": exc.global_step}
    except BaseException as exc:
        text = traceback.format_exc()
        markers.paths.rank_error(rank).write_text(text)
        markers.write("failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    summary = {
        "global_step": result.global_step,
        "epochs_done": result.epochs_done,
        "final_loss": result.final_loss,
        "model_path": str(result.model_path) if result.model_path else None,
    }
    markers.write("done", **summary)
    return {"state": "done", **summary}


def _shutdown_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class TrainTask:
    """The callable submitit pickles for a SLURM run: one call per task (rank)."""

    def __init__(self, config_dict: dict[str, Any]) -> None:
        self.config_dict = config_dict

    def __call__(self) -> dict[str, Any]:
        # Like torchrun: one OpenMP thread per CPU the task was given, unless the user chose. Without
        # this every rank spins up a thread per core and the ranks of a node fight over the cores.
        os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from submitit.helpers import TorchDistributedEnvironment

        # RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE from SLURM_PROCID etc., MASTER_ADDR = first node,
        # MASTER_PORT derived from the job id (the same after a requeue). CUDA_VISIBLE_DEVICES is kept:
        # every task sees the node's GPUs and the trainer picks cuda:LOCAL_RANK.
        env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        if env.local_world_size > 1 and torch.cuda.is_available() and torch.cuda.device_count() == 1:
            # --gpus-per-task on a cluster that confines devices: each task sees only its own GPU,
            # as cuda:0, while the trainer would pick cuda:LOCAL_RANK.
            os.environ["LOCAL_RANK"] = "0"
        return run_rank(self.config_dict)

    def __repr__(self) -> str:
        return f"TrainTask(name={self.config_dict.get('name')!r})"


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``torchrun -m workbench.launch.worker CONFIG_YAML`` (local backend)."""
    import workbench  # noqa: F401 - applies the import-time fixes before mace/e3nn load
    from workbench.train.config import TrainConfig

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workbench.launch.worker CONFIG_YAML", file=sys.stderr)
        return 2
    out = run_rank(TrainConfig.from_yaml(args[0]).to_dict())
    return 0 if out["state"] in ("done", "preempted") else 1


if __name__ == "__main__":
    sys.exit(main())
