"""A real SLURM cluster on this machine (one node, or several), for the tests (kept out of the library).

``LocalSlurm`` starts ``munged``, ``slurmctld`` and one ``slurmd`` per node by hand (no
systemd) from Debian's ``slurm-wlm`` and ``munge`` packages, each in the foreground under its
own PID, with everything (munge key, sockets, state, spool, logs, ``slurm.conf``) in a fresh
private temporary directory. Clients find the cluster through ``SLURM_CONF``::

    from local_slurm import LocalSlurm

    with LocalSlurm() as cluster:            # idle and accepting jobs when this returns
        os.environ.update(cluster.env)       # SLURM_CONF for sbatch/squeue/scontrol (and submitit)
        run = launch(config, backend="slurm", gpus_per_node=2)

    with LocalSlurm(nodes=2) as cluster:     # two slurmd: nodes 127.0.0.2 and 127.0.0.3
        ...
        cluster.stop_node("127.0.0.3")       # it hangs: SLURM marks it DOWN, requeues its jobs
        cluster.start_node("127.0.0.3")      # it reboots and comes back

Choices, and why:

* ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no cgroups needed,
  so it runs inside containers and CI runners.
* No accounting (``accounting_storage/none``): no database. There is then no ``sacct``;
  ``workbench.launch`` derives job state from ``squeue``/``scontrol`` and the run directory.
* One node: ``NodeName`` is ``hostname -s`` (what ``slurmd`` identifies itself as) with
  ``NodeAddr=127.0.0.1``; CPUs and memory match the machine.
* Several nodes (``nodes=2``): Debian's slurmd is built with multiple-slurmd support, so
  each node is one ``slurmd -N NAME`` with its own port, spool, PID and log file (``%n``).
  Nodes are named by their own loopback address (``127.0.0.2``, ``127.0.0.3``, ...), which
  is also their ``NodeAddr``: a job's first node name is then an address every rank can
  reach, as a cluster's node names are, and torch's rendezvous really goes through it.
  Tasks tell their node by ``SLURMD_NODENAME``/``SLURM_NODEID`` (they share one hostname).
  :meth:`LocalSlurm.stop_node` / :meth:`LocalSlurm.start_node` take a node down and back.
* Controller and node ports are picked free at start, so several clusters (parallel CI
  jobs, a notebook next to the tests) do not collide.
* ``KillWait`` is short (10 s): after SIGTERM a job's tasks have that long to checkpoint.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

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
    check: Callable[[], Any],
    what: str,
    timeout_s: float,
    procs: Mapping[str, subprocess.Popen] | None = None,
    interval_s: float = 0.25,
) -> Any:
    """Poll ``check()`` until it returns something true, and return that; raise ``WaitError`` on
    timeout or when one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in (procs or {}).items():
            if proc.poll() is not None:
                raise WaitError(f"{name} exited with code {proc.returncode} while waiting for {what}", name)
        value = check()
        if value:
            return value
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
    nodes:
        How many nodes (one ``slurmd`` each); each advertises ``cpus``.
    slurmd_timeout:
        Seconds without an answer from a ``slurmd`` before its node is marked DOWN (and its
        jobs requeued); short here so that a node failure shows within a test.
    requeue_delay_s:
        A requeued job may start again this long after it stopped (SLURM holds it for the
        credential lifetime, 121 s by default; ``AuthInfo=cred_expire``, at least 5).
    message_timeout:
        Seconds an RPC between the daemons may take (``MessageTimeout``); with
        ``slurmd_timeout`` it sets how soon a dead node is noticed.
    """

    def __init__(
        self,
        cpus: int | None = None,
        partition: str = "debug",
        kill_wait: int = 10,
        root: str | os.PathLike | None = None,
        start_timeout_s: float = 60.0,
        nodes: int = 1,
        slurmd_timeout: int = 300,
        requeue_delay_s: int | None = None,
        message_timeout: int = 10,
    ) -> None:
        if int(nodes) < 1:
            raise ValueError(f"nodes={nodes}: a cluster needs at least one node")
        if requeue_delay_s is not None and int(requeue_delay_s) < 6:
            raise ValueError(f"requeue_delay_s={requeue_delay_s}: SLURM's credential lifetime is at least 5 s (so 6)")
        self.cpus = int(cpus or os.cpu_count() or 1)
        self.nodes = int(nodes)
        self.slurmd_timeout = int(slurmd_timeout)
        self.requeue_delay_s = requeue_delay_s
        self.message_timeout = int(message_timeout)
        self.partition = partition
        self.kill_wait = int(kill_wait)
        self.start_timeout_s = float(start_timeout_s)
        self._own_root = root is None
        self.root = Path(root) if root is not None else None
        self.hostname = socket.gethostname().split(".")[0]
        #: The nodes' names, in SLURM's order (the first is a multi-node job's rendezvous host).
        self.node_names = [self.hostname] if self.nodes == 1 else [f"127.0.0.{i + 2}" for i in range(self.nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}
        self._hung: dict[str, list[int]] = {}

    # -- paths
    @property
    def conf_path(self) -> Path:
        assert self.root is not None, "LocalSlurm.start() has not run"
        return self.root / "slurm.conf"

    def log_path(self, daemon: str) -> Path:
        """A daemon's log: ``munged``, ``slurmctld``, or ``slurmd`` / ``slurmd-<node>``."""
        assert self.root is not None
        return self.root / "log" / f"{daemon}.log"

    def _slurmd(self, node: str) -> str:
        return "slurmd" if self.nodes == 1 else f"slurmd-{node}"

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
            for node in self.node_names:
                self.start_node(node, wait=False)
            self._wait_for(self._nodes_idle, f"node(s) {', '.join(self.node_names)} to be idle in sinfo", "slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the daemons by PID (SIGTERM, then SIGKILL) and remove the directory if it was ours."""
        # slurmd first: it reaps job steps; then the controller; munge last (the others need it to shut down).
        for name in (*(self._slurmd(n) for n in self.node_names), "slurmctld", "munged"):
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

    # -- nodes
    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo`` shows it (``idle``, ``alloc``, ``down*``, ...)."""
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)

    def stop_node(self, node: str) -> None:
        """``node`` hangs: its ``slurmd`` dies and its job steps' processes freeze (SIGSTOP).

        Nothing is reported: the controller finds out when the node stops answering
        (``slurmd_timeout``), marks it DOWN and requeues its jobs, as on a real cluster. The
        ranks elsewhere see a peer that stopped responding, not one that exited.
        """
        node = self._node(node)
        proc = self.procs.pop(self._slurmd(node), None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        self._hung[node] = self._node_pids(node)
        for pid in self._hung[node]:
            _signal(pid, signal.SIGSTOP)

    def start_node(self, node: str, wait: bool = True) -> None:
        """(Re)boot ``node``: whatever it ran before is gone, a fresh ``slurmd`` starts; with
        ``wait``, until SLURM lists the node as usable."""
        node = self._node(node)
        for pid in {*self._hung.pop(node, []), *self._node_pids(node)}:
            _signal(pid, signal.SIGKILL)
        cmd = [_which("slurmd"), "-D", "-f", str(self.conf_path), "-N", node]
        self._start(self._slurmd(node), cmd)
        if wait:
            usable = ("idle", "alloc", "mix")
            self._wait_for(lambda: self.node_states().get(node) in usable, f"node {node} to be up", self._slurmd(node))

    def _node_pids(self, node: str) -> list[int]:
        """The processes of ``node``'s job steps: the tasks, which know their node, and their slurmstepd."""
        tasks = self._pids(f"SLURMD_NODENAME={node}".encode())
        parents = set()
        for pid in tasks:
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if Path(f"/proc/{ppid}/cmdline").read_bytes().startswith(b"slurmstepd"):
                    parents.add(ppid)
            except (OSError, ValueError, IndexError):
                continue
        return sorted({*tasks, *parents})

    def _node(self, node: str) -> str:
        if node not in self.node_names:
            raise ValueError(f"node {node!r} is not in this cluster; nodes: {', '.join(self.node_names)}")
        return node

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
        if self.nodes > 1:
            for node in self.node_names:  # slurmd does not create its %n spool folder itself
                (root / "spool" / node).mkdir(exist_ok=True)
        os.chmod(root / "munge", 0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # a fresh key per cluster: no shared secret with the system's munge
        os.chmod(key, 0o400)
        (root / "plugstack.conf").write_text("")  # keep /etc/slurm/plugstack.conf's SPANK plugins out
        self.conf_path.write_text(self._conf_text() + self._nodes_text())
        self.env = {"SLURM_CONF": str(self.conf_path)}

    def _conf_text(self) -> str:
        root, user = self.root, getpass.getuser()
        self.ctld_port = free_port()
        # submitit derives a job's MASTER_PORT from its job id: two clusters numbering jobs from 1
        # (test modules on parallel workers) would hand their jobs the same port
        first_job_id = 1000 + int.from_bytes(os.urandom(3), "little") % 1_000_000
        per_node = "" if self.nodes == 1 else "-%n"
        spool = f"{root}/spool" + ("" if self.nodes == 1 else "/%n")
        expire = "" if self.requeue_delay_s is None else f",cred_expire={int(self.requeue_delay_s) - 1}"
        return f"""\
# Written by local_slurm.LocalSlurm
ClusterName=workbench
FirstJobId={first_job_id}
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket{expire}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{per_node}.pid
SlurmctldLogFile={self.log_path("slurmctld")}
SlurmdLogFile={root}/log/slurmd{per_node}.log
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
SlurmdTimeout={self.slurmd_timeout}
MessageTimeout={self.message_timeout}
MinJobAge=600
MailProg=/bin/true
SlurmctldDebug=info
SlurmdDebug=info
"""

    def _nodes_text(self) -> str:
        memory = _memory_mb() // self.nodes
        lines = []
        for node in self.node_names:
            # One node: its hostname, on 127.0.0.1. Several: each its own address and slurmd port.
            addr = "127.0.0.1" if self.nodes == 1 else node
            host = "" if self.nodes == 1 else f" NodeHostname={self.hostname}"
            lines.append(
                f"NodeName={node}{host} NodeAddr={addr} Port={free_port()} CPUs={self.cpus} "
                f"RealMemory={memory} State=UNKNOWN"
            )
        nodes = ",".join(self.node_names)
        lines.append(f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

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

    def _nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n in self.node_names)

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
        if self.root is not None:
            for pid in self._pids():
                _signal(pid, signal.SIGKILL)

    def _pids(self, also: bytes | None = None) -> list[int]:
        """Processes started by this cluster (our ``SLURM_CONF`` in their environment), and with ``also`` there."""
        marker = f"SLURM_CONF={self.conf_path}".encode()
        found = []
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
                continue
            try:
                env = (proc_dir / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in env and (also is None or also in env):
                found.append(int(proc_dir.name))
        return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
