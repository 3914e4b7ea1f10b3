"""SLURM backend: job script through submitit, job state from ``scontrol``, errors that say what is wrong.

One SLURM task per rank (``--ntasks-per-node = gpus_per_node``), started by the ``srun``
line of submitit's job script; each task runs :class:`workbench.launch.worker.TrainTask`,
which exports the torch distributed variables from the task's SLURM environment. See
:mod:`workbench.launch` for why this and not ``srun torchrun``.

The cluster is always SLURM here, chosen by the caller: we build a
``submitit.SlurmExecutor`` directly, never ``AutoExecutor`` (which would pick SLURM merely
because ``srun`` is on PATH).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.launch import validate
from workbench.launch.errors import LaunchError
from workbench.train.rundir import RunDir

CLIENT_COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
PING_TIMEOUT_S = 20.0
PREEMPT_SIGNAL = "USR2"  # submitit's default; NCCL may use USR1, so not that one

# scontrol JobState -> launcher status. States not listed are terminal failures.
PENDING_STATES = {
    "PENDING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "RESV_DEL_HOLD",
    "SPECIAL_EXIT",
    "RESIZING",
}
RUNNING_STATES = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED"}


def check_commands() -> None:
    """Raise :class:`LaunchError` naming the SLURM client commands missing from PATH."""
    missing = [c for c in CLIENT_COMMANDS if shutil.which(c) is None]
    if missing:
        raise LaunchError(
            f"backend='slurm' needs the SLURM client commands on PATH, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not found (PATH={os.environ.get('PATH', '')}). "
            "Run on a cluster login node, or use backend='local'."
        )


def _run(args: list[str], timeout: float = PING_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"the SLURM controller did not answer `{shlex.join(args)}` within {timeout:.0f} s "
            f"(SLURM_CONF={os.environ.get('SLURM_CONF', '<default>')})"
        ) from None
    except FileNotFoundError:
        check_commands()
        raise


def ping() -> None:
    """Raise :class:`LaunchError` unless a SLURM controller answers ``scontrol ping``."""
    check_commands()
    out = _run(["scontrol", "ping"])
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or " is UP" not in text:
        first = text.splitlines()[0] if text else f"exit code {out.returncode}"
        raise LaunchError(
            f"the SLURM controller is not answering: `scontrol ping` says {first!r} "
            f"(SLURM_CONF={os.environ.get('SLURM_CONF', '<default>')}); check that slurmctld runs "
            "and that this machine can reach it"
        )


# --------------------------------------------------------------------------- time limits
_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def parse_time(value: str | int | float) -> int:
    """A SLURM time limit in whole minutes (rounded up).

    Accepts minutes as a number, or SLURM's formats: ``M``, ``M:S``, ``H:M:S``, ``D-H``,
    ``D-H:M``, ``D-H:M:S``. Raises ``ValueError`` naming the expected formats otherwise.
    """
    formats = "minutes, 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS'"
    if isinstance(value, bool):
        raise ValueError(f"time={value!r}: expected {formats}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"time={value!r}: the time limit must be positive")
        return math.ceil(value)
    m = _TIME_RE.match(str(value).strip())
    if not m:
        raise ValueError(f"time={value!r} is not a SLURM time limit; expected {formats}")
    d, a, b, c = (int(x) if x is not None else None for x in m.group("d", "a", "b", "c"))
    if d is not None:  # D-H[:M[:S]]
        seconds = d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
        fields = [(a, 24), (b, 60), (c, 60)]
    elif c is not None:  # H:M:S
        seconds, fields = a * 3600 + b * 60 + c, [(b, 60), (c, 60)]
    elif b is not None:  # M:S
        seconds, fields = a * 60 + b, [(b, 60)]
    else:  # M
        seconds, fields = a * 60, []
    for v, limit in fields:
        if v is not None and v >= limit:
            raise ValueError(f"time={value!r}: field {v} is out of range (must be < {limit}); expected {formats}")
    if seconds <= 0:
        raise ValueError(f"time={value!r}: the time limit must be positive")
    return math.ceil(seconds / 60)


# --------------------------------------------------------------------------- options
@dataclass
class SlurmOptions:
    """sbatch settings of a run. ``None`` leaves a setting to the cluster's default.

    ``sbatch_lines`` are extra directives, each ``"--key=value"``, ``"--flag"`` or a full
    ``"#SBATCH --key=value"`` line. ``setup`` are shell lines run before ``srun`` (``module
    load ...``, ``source venv/bin/activate``). ``gpus_per_node_request`` decides whether the
    job asks for ``--gpus-per-node``: by default yes unless the config trains on CPU.
    """

    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    time: str | int = "01:00:00"
    constraint: str | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    sbatch_lines: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    signal_delay_s: int = 120
    request_gpus: bool | None = None
    job_name: str | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SlurmOptions:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"launch(): unknown SLURM option(s) {unknown}; valid: {sorted(known)}")
        opts = cls(**kwargs)
        opts.sbatch_lines = [opts.sbatch_lines] if isinstance(opts.sbatch_lines, str) else list(opts.sbatch_lines)
        opts.setup = [opts.setup] if isinstance(opts.setup, str) else list(opts.setup)
        opts.check()
        return opts

    def check(self) -> None:
        """Refuse, naming the option, any value that would not be one valid sbatch setting."""
        for key in ("account", "partition", "qos"):
            if getattr(self, key) is not None:
                validate.check_slurm_name(key, getattr(self, key))
        for key in ("constraint", "job_name"):  # constraints have their own syntax (&, |, [...], *)
            if getattr(self, key) is not None:
                validate.check_text(key, getattr(self, key))
        for key in ("gpus_per_task", "cpus_per_task"):
            if getattr(self, key) is not None:
                validate.check_count(key, getattr(self, key))
        validate.check_count("signal_delay_s", self.signal_delay_s, minimum=0)
        if self.mem is not None:
            self.mem = validate.check_mem(self.mem)
        if self.request_gpus is not None and not isinstance(self.request_gpus, bool):
            raise ValueError(f"request_gpus={self.request_gpus!r}: must be True, False or None")
        for line in self.setup:
            validate.check_text("setup line", line, tabs=True, empty=True)


def sbatch_parameters(
    config, nodes: int, gpus_per_node: int, opts: SlurmOptions, max_restarts: int = 0
) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters for this run (also what the dry run prints).

    ``max_restarts``: how often the job requeues itself after a rank or a node is lost
    (:mod:`workbench.launch.failover`, run after ``srun`` by the script's teardown line).
    """
    validate.check_text("output_dir", str(config.output_dir))  # it names the log files in #SBATCH lines
    minutes = parse_time(opts.time)
    if opts.signal_delay_s < 0 or opts.signal_delay_s >= minutes * 60:
        raise ValueError(
            f"signal_delay_s={opts.signal_delay_s}: the pre-time-limit checkpoint signal must come "
            f"after the start and before the time limit ({minutes} min)"
        )
    request_gpus = opts.request_gpus if opts.request_gpus is not None else config.device != "cpu"
    params: dict[str, Any] = {
        "job_name": opts.job_name or config.name,
        "nodes": nodes,
        "ntasks_per_node": gpus_per_node,  # one task per rank
        "time": minutes,
        "signal_delay_s": int(opts.signal_delay_s),
        "stderr_to_stdout": False,
        # One failing rank ends the step at once instead of leaving the others in a collective.
        "srun_args": ["--kill-on-bad-exit=1"],
        "additional_parameters": {"requeue": True},
    }
    if request_gpus:
        if opts.gpus_per_task is not None:
            params["gpus_per_task"] = opts.gpus_per_task
        else:
            params["gpus_per_node"] = gpus_per_node
    for key in ("account", "partition", "qos", "constraint", "cpus_per_task", "mem"):
        value = getattr(opts, key)
        if value is not None:
            params[key] = value
    # A comment in the script saying what it trains (the task itself is submitit's pickled callable).
    params["setup"] = [
        f"# workbench: trains {RunDir(Path(config.run_dir).absolute()).launch_config}, one task per rank"
    ] + list(opts.setup)
    params["teardown"] = [failover_line(config, max_restarts)]
    params["additional_parameters"].update(validate.extra_directives(opts.sbatch_lines, opts.mem is not None))
    validate.check_params(params)
    return params


def failover_line(config, max_restarts: int) -> str:
    """The job script's line after ``srun``: requeue or end (it must come first, to read ``$?``)."""
    run_dir = shlex.quote(str(Path(config.run_dir).absolute()))
    return (
        f"{shlex.quote(sys.executable)} -u -m workbench.launch.failover {run_dir} "
        f"--step-exit $? --max-restarts {int(max_restarts)}"
    )


def _folder(config) -> Path:
    return RunDir(config.run_dir).slurm


def job_script(config, params: dict[str, Any]) -> str:
    """The exact sbatch script submitit writes for these parameters."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = _folder(config).absolute()
    # Same command string as SlurmExecutor._submitit_command_str (python running submitit's task loader).
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **params)


# --------------------------------------------------------------------------- cluster queries
@dataclass
class NodeInfo:
    name: str
    cpus: int
    gpus: int
    state: str


def partition_nodes(partition: str | None) -> tuple[str, list[NodeInfo]]:
    """(partition name, its nodes) from ``sinfo``; the default partition when ``partition`` is None."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N|%c|%G|%P|%t"])
    if out.returncode != 0:
        raise LaunchError(f"`sinfo` failed: {out.stderr.strip() or out.stdout.strip()}")
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 4]
    names = sorted({r[3].rstrip("*") for r in rows})
    if partition is None:
        defaults = sorted({r[3].rstrip("*") for r in rows if r[3].endswith("*")})
        if not defaults:
            raise ValueError(f"partition=None but the cluster has no default partition; choose one of {names}")
        partition = defaults[0]
    nodes = {}
    for name, cpus, gres, part, state in rows:
        if part.rstrip("*") == partition:
            nodes[name] = NodeInfo(name, int(cpus), _gres_gpus(gres), state)
    if not nodes:
        raise ValueError(f"partition={partition!r} does not exist on this cluster; partitions: {', '.join(names)}")
    return partition, list(nodes.values())


def _gres_gpus(gres: str) -> int:
    # e.g. "gpu:a100:4(S:0-1),nvme:1" or "gpu:4" or "(null)"
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def check_resources(config, nodes: int, gpus_per_node: int, opts: SlurmOptions) -> str:
    """Compare the request with the partition's nodes; returns the partition used."""
    partition, infos = partition_nodes(opts.partition)
    if nodes > len(infos):
        raise ValueError(f"nodes={nodes} but partition {partition!r} has {len(infos)} node(s)")
    request_gpus = opts.request_gpus if opts.request_gpus is not None else config.device != "cpu"
    if request_gpus:
        per_node = (opts.gpus_per_task or 1) * gpus_per_node if opts.gpus_per_task else gpus_per_node
        most = max(i.gpus for i in infos)
        if per_node > most:
            hint = " (no gres/gpu); set TrainConfig.device='cpu' to run the ranks on CPUs" if most == 0 else ""
            raise ValueError(
                f"gpus_per_node={per_node} but nodes in partition {partition!r} have at most {most} GPU(s){hint}"
            )
    cpus = gpus_per_node * (opts.cpus_per_task or 1)
    most_cpus = max(i.cpus for i in infos)
    if cpus > most_cpus:
        raise ValueError(
            f"gpus_per_node={gpus_per_node} tasks x cpus_per_task={opts.cpus_per_task or 1} = {cpus} "
            f"CPUs per node, but nodes in partition {partition!r} have at most {most_cpus} CPUs"
        )
    return partition


@dataclass
class JobInfo:
    job_id: str
    state: str
    reason: str
    restarts: int
    exit_code: str


def job_info(job_id: str) -> JobInfo | None:
    """The job as ``scontrol show job`` sees it; None once SLURM forgot it (after ``MinJobAge``)."""
    out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    text = out.stdout.strip()
    if out.returncode != 0 or not text:
        err = out.stderr.strip()
        if "Invalid job id" in err or "not found" in err.lower():
            return None
        raise LaunchError(f"`scontrol show job {job_id}` failed: {err or 'no output'}")
    fields = dict(re.findall(r"(\w+)=(\S*)", text.splitlines()[0]))
    return JobInfo(
        job_id=str(job_id),
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        restarts=int(fields.get("Restarts", 0) or 0),
        exit_code=fields.get("ExitCode", ""),
    )


def down_nodes() -> list[str]:
    """Nodes SLURM holds unusable now (down, drained, failing)."""
    out = _run(["sinfo", "-h", "-N", "-t", "down,drain,fail", "-o", "%N"])
    return sorted(set(out.stdout.split())) if out.returncode == 0 else []


def pending_reason(reason: str) -> str:
    """SLURM's reason for a pending job, naming the nodes it waits for when some are down.

    A run's world size is fixed (its batches and its exact resume depend on it), so a job
    requeued after a node failure waits for as many nodes as it asked for.
    """
    if "DOWN" in reason or "ReqNodeNotAvail" in reason:
        down = down_nodes()
        if down:
            return f"waiting for nodes; down now: {', '.join(down)} ({reason})"
    return reason


def submit(config, params: dict[str, Any]) -> str:
    """Submit the run with submitit; returns the SLURM job id."""
    import submitit
    from submitit.core.utils import FailedJobError

    from workbench.launch.worker import TrainTask

    executor = submitit.SlurmExecutor(folder=_folder(config).absolute(), max_num_timeout=0)
    executor.update_parameters(**params)
    try:
        job = executor.submit(TrainTask(config.to_dict()))
    except (FailedJobError, subprocess.CalledProcessError) as exc:
        detail = str(exc).strip().splitlines()
        raise LaunchError(
            "sbatch rejected the job: " + " ".join(x.strip() for x in detail if x.strip())[-1500:]
        ) from None
    return str(job.job_id)


def cancel(job_id: str) -> None:
    out = _run(["scancel", str(job_id)])
    if out.returncode != 0 and "already completing or completed" not in out.stderr:
        raise LaunchError(f"`scancel {job_id}` failed: {out.stderr.strip()}")
