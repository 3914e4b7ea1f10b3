"""A real single-node SLURM cluster on 127.0.0.1, for tests, CI and notebook demos.

``LocalSlurm`` starts ``munged``, ``slurmctld`` and ``slurmd`` by hand (no systemd) from
Debian's ``slurm-wlm`` and ``munge`` packages, each in the foreground under its own PID,
with everything (munge key, sockets, state, spool, logs, ``slurm.conf``) in a fresh
private temporary directory. Clients find the cluster through ``SLURM_CONF``::

    from workbench.launch.testing import LocalSlurm

    with LocalSlurm() as cluster:            # idle and accepting jobs when this returns
        os.environ.update(cluster.env)       # SLURM_CONF for sbatch/squeue/scontrol (and submitit)
        run = launch(config, backend="slurm", gpus_per_node=2)

Choices, and why:

* ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no cgroups needed,
  so it runs inside containers and CI runners.
* No accounting (``accounting_storage/none``): no database. There is then no ``sacct``;
  ``workbench.launch`` derives job state from ``squeue``/``scontrol`` and the run directory.
* ``NodeName`` is ``hostname -s`` (what ``slurmd`` identifies itself as) with
  ``NodeAddr=127.0.0.1``; CPUs and memory match the machine.
* Controller and node ports are picked free at start, so several clusters (parallel CI
  jobs, a notebook next to the tests) do not collide.
* ``KillWait`` is short (10 s): after SIGTERM a job's tasks have that long to checkpoint.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_daemons() -> list[str]:
    """Names of the SLURM/munge programs this machine lacks (empty when a cluster can start)."""
    return [d for d in DAEMONS + ("sbatch", "squeue", "scontrol", "sinfo") if _which(d) is None]


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which is not on every user's PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WaitError(RuntimeError):
    """``wait_for`` gave up; ``proc`` names the process that exited, or is None on a timeout."""

    def __init__(self, message: str, proc: str | None = None) -> None:
        super().__init__(message)
        self.proc = proc


def wait_for(
    check: Callable[[], bool],
    what: str,
    timeout_s: float,
    procs: Mapping[str, subprocess.Popen] | None = None,
    interval_s: float = 0.25,
) -> None:
    """Poll ``check()`` until it is true; raise ``WaitError`` on timeout or when one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in (procs or {}).items():
            if proc.poll() is not None:
                raise WaitError(f"{name} exited with code {proc.returncode} while waiting for {what}", name)
        if check():
            return
        time.sleep(interval_s)
    raise WaitError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop_process(proc: subprocess.Popen, timeout_s: float, kill_timeout_s: float = 5) -> None:
    """SIGTERM ``proc`` and wait ``timeout_s``; SIGKILL it if it is still running then."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=kill_timeout_s)


def http_ok(url: str, timeout_s: float = 5) -> bool:
    """True when a GET of ``url`` answers 200 (a server still starting answers nothing)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def _memory_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                # Leave some room: slurmd refuses to register a node claiming more than it has.
                return max(int(line.split()[1]) // 1024 - 512, 256)
    except OSError:
        pass
    return 1024


class SlurmStartError(RuntimeError):
    """The local cluster did not come up; the message includes the daemon's log tail."""


class LocalSlurm:
    """A single-node SLURM cluster on 127.0.0.1, owned by this process.

    Parameters
    ----------
    cpus:
        CPUs the node advertises (default: ``os.cpu_count()``).
    partition:
        Name of the single (default) partition.
    kill_wait:
        Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or times out.
    root:
        Directory to use (default: a fresh ``tempfile.mkdtemp``); removed by ``stop()``
        only when it was created here.
    """

    def __init__(
        self,
        cpus: int | None = None,
        partition: str = "debug",
        kill_wait: int = 10,
        root: str | os.PathLike | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.cpus = int(cpus or os.cpu_count() or 1)
        self.partition = partition
        self.kill_wait = int(kill_wait)
        self.start_timeout_s = float(start_timeout_s)
        self._own_root = root is None
        self.root = Path(root) if root is not None else None
        self.hostname = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # -- paths
    @property
    def conf_path(self) -> Path:
        assert self.root is not None, "LocalSlurm.start() has not run"
        return self.root / "slurm.conf"

    def log_path(self, daemon: str) -> Path:
        assert self.root is not None
        return self.root / "log" / f"{daemon}.log"

    # -- lifecycle
    def start(self) -> LocalSlurm:
        """Write the configuration, start the three daemons and wait until the node is idle."""
        missing = missing_daemons()
        if missing:
            raise SlurmStartError(
                f"cannot start a local SLURM: {', '.join(missing)} not installed "
                "(Debian: apt-get install slurm-wlm munge)"
            )
        if self.procs:
            return self
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="workbench-slurm-"))
        try:
            self._write_files()
            self._start_munge()
            self._start("slurmctld", [_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf_path)])
            self._wait_for(
                lambda: self._run("scontrol", "ping").returncode == 0,
                "slurmctld to answer 'scontrol ping'",
                "slurmctld",
            )
            self._start("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf_path), "-N", self.hostname])
            self._wait_for(self._node_idle, f"node {self.hostname} to be idle in sinfo", "slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the daemons by PID (SIGTERM, then SIGKILL) and remove the directory if it was ours."""
        # slurmd first: it reaps job steps; then the controller; munge last (the others need it to shut down).
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            stop_process(proc, 15)
        self._kill_leftover_steps()
        if self._own_root and self.root is not None and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        self.env = {}

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs.values())

    # -- helpers for tests and notebooks
    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``cluster.run("squeue")``) against this cluster."""
        return self._run(*args, timeout=timeout)

    def logs(self, daemon: str = "slurmctld", tail: int = 40) -> str:
        path = self.log_path(daemon)
        if not path.exists():
            return f"({path} does not exist)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])

    # -- internals
    def _write_files(self) -> None:
        root = self.root
        assert root is not None
        for sub in ("munge", "state", "spool", "log", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "munge", 0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # a fresh key per cluster: no shared secret with the system's munge
        os.chmod(key, 0o400)
        (root / "plugstack.conf").write_text("")  # keep /etc/slurm/plugstack.conf's SPANK plugins out
        user = getpass.getuser()
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        # submitit derives a job's MASTER_PORT from its job id: two clusters numbering jobs from 1
        # (test modules on parallel workers) would hand their jobs the same port
        first_job_id = 1000 + int.from_bytes(os.urandom(3), "little") % 1_000_000
        conf = f"""\
# Written by workbench.launch.testing.LocalSlurm
ClusterName=workbench
FirstJobId={first_job_id}
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={self.log_path("slurmctld")}
SlurmdLogFile={self.log_path("slurmd")}
PlugStackConfig={root}/plugstack.conf
TmpFS={root}/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait={self.kill_wait}
MinJobAge=600
MailProg=/bin/true
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_memory_mb()} State=UNKNOWN
PartitionName={self.partition} Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf_path.write_text(conf)
        self.env = {"SLURM_CONF": str(self.conf_path)}

    def _start(self, name: str, cmd: list) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        env = dict(os.environ, SLURM_CONF=str(self.conf_path))
        # Own session: a Ctrl-C in the test runner does not hit the daemons before stop() does.
        self.procs[name] = subprocess.Popen(
            [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def _start_munge(self) -> None:
        root = self.root
        self._start(
            "munged",
            [
                _which("munged"),
                "-F",
                "--force",
                f"--key-file={root}/munge/munge.key",
                f"--socket={root}/munge/munge.socket",
                f"--pid-file={root}/munge/munged.pid",
                f"--log-file={self.log_path('munged')}",
                f"--seed-file={root}/munge/munged.seed",
            ],
        )
        self._wait_for((root / "munge" / "munge.socket").exists, "munged to create its socket", "munged")

    def _node_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t")
        return out.returncode == 0 and any(line.split()[1:2] == ["idle"] for line in out.stdout.splitlines())

    def _wait_for(self, check, what: str, daemon: str) -> None:
        try:
            wait_for(check, what, self.start_timeout_s, self.procs)
        except WaitError as exc:
            raise SlurmStartError(f"{exc}:\n{self._daemon_output(exc.proc or daemon)}") from None

    def _daemon_output(self, name: str) -> str:
        texts = []
        for path in (self.root / "log" / f"{name}.stdout", self.log_path(name)):
            if path.exists():
                texts.append("\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(texts) or "(no output)"

    def _run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = dict(os.environ, SLURM_CONF=str(self.conf_path))
        return subprocess.run(
            [_which(args[0]) or args[0], *args[1:]], env=env, capture_output=True, text=True, timeout=timeout
        )

    def _kill_leftover_steps(self) -> None:
        # slurmstepd processes of jobs still running when slurmd stopped would outlive the cluster;
        # they carry our slurm.conf path on their environment, so only ours are matched, by PID.
        if self.root is None:
            return
        marker = f"SLURM_CONF={self.conf_path}".encode()
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
                continue
            try:
                if marker in (proc_dir / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc_dir.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


# --------------------------------------------------------------------------- tiny training runs
def small_dataset(
    path: str | os.PathLike, n: int = 48, families: tuple[str, ...] = ("water_clusters", "hea"), scan: int = 400
) -> Path:
    """Write ``n`` small labelled structures of ``families`` from the embedded mixture to ``path``.

    Reading the whole embedded dataset takes tens of seconds on a small CI machine, and every
    rank of every launched run would pay it; this file takes well under a second to read.
    """
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.data.io import read_structures, write_structures

    path = Path(path)
    if path.exists():
        return path
    frames = read_structures(EMBEDDED_PATH, index=f":{scan}")
    chosen = [a for a in frames if a.info.get("config_type") in families and a.info.get("labelled", True)][:n]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} structures of {families} in the first {scan} frames; raise scan")
    tmp = path.with_suffix(path.suffix + ".tmp")
    write_structures(tmp, chosen)
    os.replace(tmp, path)
    return path


def tiny_config(output_dir: str | os.PathLike, name: str, dataset: str | os.PathLike, **overrides):
    """:func:`workbench.train.presets.tiny_config` on ``dataset``, on the CPU."""
    from workbench.train.presets import tiny_config as preset

    return preset(output_dir, name, dataset=str(dataset), device="cpu", **overrides)
