"""Launch training runs from a notebook cell: locally with torchrun, or on SLURM through submitit.

>>> from workbench.launch import launch, attach
>>> run = launch(config, backend="slurm", nodes=2, gpus_per_node=4, partition="gpu", time="04:00:00")
>>> run.status, run.reason        # "pending" | "running" | "done" | "failed", and why
>>> run.panel()                   # ipywidgets: status, latest loss, per-rank step time, log tail
>>> run.metrics().loss_curve()    # the trainer's own JSONL logs
>>> run.wait()                    # raises RunFailed with the failing rank's traceback
>>> print(launch(config, backend="slurm", nodes=185, gpus_per_node=4, dry_run=True))  # the job script

Multi-node strategy: one SLURM task per GPU, set up by submitit
-----------------------------------------------------------------
A SLURM run is one job with ``--nodes=N --ntasks-per-node=G`` (and ``--gpus-per-node=G``);
submitit's job script starts the ``N*G`` tasks with a single ``srun``, and each task calls
:class:`workbench.launch.worker.TrainTask`, which turns SLURM's task variables into torch's
``env://`` ones with ``submitit.helpers.TorchDistributedEnvironment`` (``RANK`` =
``SLURM_PROCID``, ``LOCAL_RANK`` = ``SLURM_LOCALID``, ``MASTER_ADDR`` = first node of the
allocation, ``MASTER_PORT`` derived from the job id) and then runs the trainer. We chose this
over ``srun torchrun --rdzv-backend=c10d`` because:

* SLURM already is the process manager: it starts, places, binds and kills every rank, and its
  signals (``--signal=USR2@N`` before the time limit, SIGTERM on requeue, preemption or
  ``scancel``) reach each rank directly. Clean preemption needs exactly that: every rank records
  the signal and all stop together at the next step boundary after one checkpoint
  (:mod:`workbench.train.preempt`). Under torchrun, a second supervisor sits between SLURM and
  the ranks and handles these signals itself.
* No extra rendezvous service: no c10d store host/port to choose, no rendezvous timeouts at 185
  nodes, and ``--kill-on-bad-exit`` ends the whole job as soon as one rank fails.
* torchrun's in-allocation restarts do not help at scale: a lost node takes its ranks and the
  job with it. Recovery is SLURM's requeue plus the trainer's exact resume from checkpoint:
  SLURM requeues a job whose node failed; after a lost rank, the job script's last line
  (:mod:`workbench.launch.failover`) requeues it, ``max_restarts`` times at most.
* submitit is the same machinery on one node and on 185, and its pickled-callable tasks give
  us the worker's traceback in its own log; the job script it writes is what ``dry_run`` shows.

The local backend keeps torchrun (``--standalone``), which is the natural process manager on one
machine. Either way the trainer only sees torch's standard environment variables.

Status without accounting
-------------------------
Clusters without ``sacct`` (and this project's CI cluster) leave submitit with state UNKNOWN,
so a ``Run`` derives its status from ``scontrol show job`` (or the torchrun process) together
with the files every rank writes under ``<run_dir>/launch/``.
"""

from workbench.launch.api import launch
from workbench.launch.errors import LaunchError, LaunchRefused, RunFailed
from workbench.launch.run import Run, RunMetrics, attach, read_metrics


def __getattr__(name: str):
    # The panel imports ipywidgets; keep it out of plain `import workbench.launch`.
    if name == "RunPanel":
        from workbench.launch.panel import RunPanel

        return RunPanel
    raise AttributeError(name)


__all__ = [
    "LaunchError",
    "LaunchRefused",
    "Run",
    "RunFailed",
    "RunMetrics",
    "RunPanel",
    "attach",
    "launch",
    "read_metrics",
]
