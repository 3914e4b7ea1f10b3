"""``launch()``: start a training run locally (torchrun) or on SLURM (submitit), or print how it would start."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from workbench.launch import local, slurm, validate
from workbench.launch.errors import LaunchRefused
from workbench.launch.run import Run, _pid_start_time, attach, load_info
from workbench.train.rundir import RunDir

LAUNCH_BACKENDS = ("local", "slurm")


def _as_config(config):
    from workbench.train.config import TrainConfig

    if isinstance(config, TrainConfig):
        return config
    if isinstance(config, dict):
        return TrainConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return TrainConfig.from_yaml(config)
    raise TypeError(f"config must be a TrainConfig, a dict of its fields or a YAML path, got {type(config).__name__}")


def _absolute(config):
    # The job may start in another directory (a SLURM node, a torchrun worker): pin the paths.
    from workbench.train.config import PATH_FIELDS

    changes: dict[str, Any] = {"output_dir": str(Path(config.output_dir).absolute())}
    for name in PATH_FIELDS:
        changes[name] = _pinned(getattr(config, name))
    if config.heads:
        changes["heads"] = {
            head: {**spec, **{k: _pinned(spec.get(k)) for k in ("dataset", "valid_dataset") if spec.get(k)}}
            for head, spec in config.heads.items()
        }
    return config.replace(**changes)


def _pinned(path: str | None) -> str | None:
    """``path`` made absolute when it names something here (None and absolute paths stay)."""
    if path and not os.path.isabs(path) and Path(path).exists():
        return str(Path(path).absolute())
    return path


def _prepare_run_dir(config, fresh: bool) -> Path:
    run_dir = Path(config.run_dir)
    previous = load_info(run_dir)
    if previous is not None:
        old = Run(run_dir, previous)
        status = old.status
        if status in ("pending", "running"):
            where = f"SLURM job {old.job_id}" if old.backend == "slurm" else f"torchrun pid {old.pid}"
            raise LaunchRefused(
                f"{run_dir} already has an active run ({where}, {status}: {old.reason}); "
                "use workbench.launch.attach(run_dir) to follow it, or cancel it first"
            )
    if fresh and run_dir.exists():
        if not (RunDir(run_dir).launch.exists() or RunDir(run_dir).config.exists()):
            raise LaunchRefused(
                f"fresh=True (--fresh): {run_dir} does not look like a run directory (no launch/ or config.yaml); "
                "not deleting it. Choose another output_dir or name, or delete it yourself"
            )
        shutil.rmtree(run_dir)
    paths = RunDir(run_dir)
    paths.launch.mkdir(parents=True, exist_ok=True)
    for f in paths.launch_state_files():  # the previous launch's; the attempts log keeps the history
        f.unlink(missing_ok=True)
    return run_dir


def _check_sampler_ranks(sampler: str, nodes: int, gpus_per_node: int) -> None:
    from workbench.train import mace_order  # here: building the CLI parser must not import torch

    if sampler == mace_order.NAME:
        mace_order.check_ranks(nodes * gpus_per_node, f" (nodes={nodes}, gpus_per_node={gpus_per_node})")


def _checked_request(
    backend: str, nodes: int, gpus_per_node: int, max_restarts: int, env: dict[str, str] | None
) -> tuple[int, int, int, dict[str, str]]:
    if backend not in LAUNCH_BACKENDS:
        raise ValueError(f"backend={backend!r}: choose 'local' or 'slurm' explicitly")
    nodes = validate.check_count("nodes", nodes)
    gpus_per_node = validate.check_count("gpus_per_node", gpus_per_node)
    max_restarts = validate.check_count("max_restarts", max_restarts, minimum=0)
    env = {str(k): str(v) for k, v in (env or {}).items()}
    validate.check_env(env)
    return nodes, gpus_per_node, max_restarts, env


def launch(
    config,
    backend: str,
    nodes: int = 1,
    gpus_per_node: int = 1,
    *,
    dry_run: bool = False,
    fresh: bool = False,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    **slurm_options: Any,
) -> Run | str:
    """Start training ``config`` and return its :class:`~workbench.launch.run.Run`.

    Parameters
    ----------
    config:
        A ``TrainConfig``, a dict of its fields, or a path to its YAML.
    backend:
        ``"local"`` (torchrun on this machine) or ``"slurm"`` (sbatch through submitit). Required:
        it is never guessed from what is on PATH.
    nodes, gpus_per_node:
        World size is ``nodes * gpus_per_node``, one rank per GPU. With ``TrainConfig.device="cpu"``
        (or no CUDA, locally) ranks are CPU processes and no GPUs are requested.
    dry_run:
        Return the exact job script (slurm) or command line (local) as text; nothing is written
        or submitted, and no cluster is contacted.
    fresh:
        Delete the run directory first. Otherwise a run resumes from its checkpoint.
    env:
        Extra environment variables for the workers (``export`` lines in the job script).
    max_restarts:
        After a rank or a node is lost, start again from the last checkpoint at most this many
        times: torchrun restarts the worker group (local); the job requeues itself (slurm, see
        :mod:`workbench.launch.failover`). A rank that raised an error of its own is not retried.
    **slurm_options:
        slurm only, see :class:`~workbench.launch.slurm.SlurmOptions`: ``account, partition, qos,
        time ("HH:MM:SS", "D-HH:MM", minutes...), constraint, gpus_per_task, cpus_per_task, mem,
        sbatch_lines (extra directives), setup (shell lines before srun), signal_delay_s (SIGUSR2
        this long before the time limit: checkpoint and requeue), request_gpus, job_name``.

    Raises
    ------
    ValueError
        An invalid request, naming the argument (:class:`LaunchRefused`, also a
        :class:`LaunchError`, when the run directory forbids it).
    LaunchError
        SLURM is missing, is not answering, or refuses the job.
    """
    nodes, gpus_per_node, max_restarts, env = _checked_request(backend, nodes, gpus_per_node, max_restarts, env)
    config = _absolute(_as_config(config))
    _check_sampler_ranks(config.sampler, nodes, gpus_per_node)
    if backend == "local":
        if slurm_options:
            raise ValueError(f"SLURM option(s) {sorted(slurm_options)} given with backend='local'")
        return _launch_local(config, nodes, gpus_per_node, dry_run, fresh, env, max_restarts)
    opts = slurm.SlurmOptions.from_kwargs(slurm_options)
    return _launch_slurm(config, nodes, gpus_per_node, dry_run, fresh, env, opts, max_restarts)


def _write_info(run_dir: Path, info: dict[str, Any]) -> None:
    path = RunDir(run_dir).launch_info
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)


def _launch_local(config, nodes, gpus_per_node, dry_run, fresh, env, max_restarts) -> Run | str:
    config_yaml = RunDir(config.run_dir).launch_config
    cmd = local.command(config_yaml, gpus_per_node, max_restarts)
    if dry_run:
        if nodes != 1:
            local.check_resources(config, nodes, gpus_per_node)
        return local.command_text(cmd, env)
    local.check_resources(config, nodes, gpus_per_node)
    run_dir = _prepare_run_dir(config, fresh)
    config.to_yaml(config_yaml)
    attempt = f"local-{uuid.uuid4().hex[:12]}"
    log = RunDir(run_dir).local_log
    from workbench.launch.worker import ATTEMPT_ENV

    proc = local.start(cmd, log, {**env, ATTEMPT_ENV: attempt})
    info = {
        "backend": "local",
        "name": config.name,
        "run_dir": str(run_dir),
        "nodes": 1,
        "gpus_per_node": gpus_per_node,
        "pid": proc.pid,
        "pid_start": _pid_start_time(proc.pid),
        "attempt": attempt,
        "command": cmd,
        "env": env,
        "log": str(log),
        "submitted": time.time(),
    }
    _write_info(run_dir, info)
    return Run(run_dir, info, process=proc)


def _launch_slurm(config, nodes, gpus_per_node, dry_run, fresh, env, opts, max_restarts) -> Run | str:
    params = slurm.sbatch_parameters(config, nodes, gpus_per_node, opts, max_restarts)
    if env:
        params["setup"] = params["setup"] + [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    script = slurm.job_script(config, params)
    if dry_run:
        return script
    slurm.ping()  # also checks the client commands
    partition = slurm.check_resources(config, nodes, gpus_per_node, opts)
    run_dir = _prepare_run_dir(config, fresh)
    config.to_yaml(RunDir(run_dir).launch_config)
    job_id = slurm.submit(config, params)
    info = {
        "backend": "slurm",
        "name": config.name,
        "run_dir": str(run_dir),
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "max_restarts": max_restarts,
        "job_id": job_id,
        "partition": partition,
        "env": env,
        "script": script,
        "submitted": time.time(),
    }
    _write_info(run_dir, info)
    return Run(run_dir, info)


__all__ = ["LAUNCH_BACKENDS", "attach", "launch"]
