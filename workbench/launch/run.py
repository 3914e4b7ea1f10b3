"""``Run``: the handle of a launched training run (local torchrun or SLURM job).

Status is derived, not asked of submitit (without SLURM accounting submitit can only say
UNKNOWN): the scheduler's view (``scontrol show job``, or the torchrun process) is combined
with the files the workers leave in ``<run_dir>/launch/`` (see :mod:`workbench.launch.worker`).
Everything a ``Run`` knows is in the run directory, so :func:`attach` rebuilds the handle
in another kernel or after a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.launch.errors import LaunchError, RunFailed
from workbench.train.rundir import RunDir, read_epochs, read_jsonl, read_steps

STATUSES = ("pending", "running", "done", "failed")


# --------------------------------------------------------------------------- metrics
@dataclass
class RunMetrics:
    """What the trainer has logged so far.

    ``steps``: per-step records, one per ``(rank, global_step)`` (a step redone after a restart
    replaces the lost attempt), sorted by ``(global_step, rank)``; keys as the trainer writes them:
    ``rank, epoch, step, global_step, loss, lr, step_s, compute_s, data_s, allreduce_s, atoms,
    edges, graphs, batch_hash, time``.
    ``epochs``: per-epoch records from ``metrics.jsonl`` (rank 0): ``epoch, complete, global_step,
    epoch_s, train_/valid_ MAEs, compute_share, allreduce_share, data_share, loss, lr``.
    """

    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({s["rank"] for s in self.steps})

    @property
    def global_step(self) -> int:
        """Latest step every rank has finished (0 before the first)."""
        if not self.steps:
            return 0
        last: dict[int, int] = {}
        for s in self.steps:
            last[s["rank"]] = max(last.get(s["rank"], 0), s["global_step"])
        return min(last.values())

    def loss_curve(self) -> list[tuple[int, float]]:
        """(global_step, loss averaged over the ranks that logged that step)."""
        by_step: dict[int, list[float]] = {}
        for s in self.steps:
            by_step.setdefault(s["global_step"], []).append(s["loss"])
        return [(k, sum(v) / len(v)) for k, v in sorted(by_step.items())]

    @property
    def last_loss(self) -> float | None:
        curve = self.loss_curve()
        return curve[-1][1] if curve else None

    def step_time_per_rank(self, window: int = 10) -> dict[int, float]:
        """Mean wall time of each rank's last ``window`` steps, in seconds."""
        out: dict[int, float] = {}
        for r in self.ranks:
            times = [s["step_s"] for s in self.steps if s["rank"] == r][-window:]
            out[r] = sum(times) / len(times)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "epochs": self.epochs,
            "global_step": self.global_step,
            "last_loss": self.last_loss,
            "step_time_per_rank": self.step_time_per_rank(),
        }


def read_metrics(run_dir: str | os.PathLike) -> RunMetrics:
    """:class:`RunMetrics` of a run directory, tolerant of a line being written while it reads."""
    return RunMetrics(steps=read_steps(run_dir), epochs=read_epochs(run_dir))


# --------------------------------------------------------------------------- the handle
def _still_running(progress: str, failed: tuple[str, str] | None, decider: str) -> tuple[str, str]:
    """``running`` while the job or torchrun runs: a failed rank (``failed``) decides only once
    it has ended, since its failover or restart may still resume the run."""
    return "running", progress + (f"; {failed[1][:200]} ({decider})" if failed else "")


class Run:
    """A launched run. Create with :func:`workbench.launch.launch` or :func:`workbench.launch.attach`.

    ``status`` is one of ``"pending"``, ``"running"``, ``"done"``, ``"failed"``; ``reason`` says
    why in one line (a cancelled run is ``"failed"`` with reason ``"cancelled by user ..."``). A
    rank that failed while the job (or torchrun) still runs leaves it ``"running"``, the reason
    naming the rank, until the failover has decided: it may requeue and resume.
    """

    def __init__(
        self, run_dir: str | os.PathLike, info: dict[str, Any], process: subprocess.Popen | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.paths = RunDir(self.run_dir)
        self.info = info
        self._process = process
        self._last = ("pending", "submitted")

    # -- identity
    @property
    def backend(self) -> str:
        return self.info["backend"]

    @property
    def name(self) -> str:
        return self.info.get("name", self.run_dir.name)

    @property
    def job_id(self) -> str | None:
        """SLURM job id (slurm backend), else None."""
        return self.info.get("job_id")

    @property
    def pid(self) -> int | None:
        """torchrun's process id (local backend), else None."""
        return self.info.get("pid")

    @property
    def launch_dir(self) -> Path:
        return self.paths.launch

    def __repr__(self) -> str:
        where = f"slurm job {self.job_id}" if self.backend == "slurm" else f"pid {self.pid}"
        return f"<Run {self.name} ({self.backend}, {where}) {self.status}: {self.reason}>"

    # -- status
    @property
    def status(self) -> str:
        """``pending``, ``running``, ``done`` or ``failed``; re-evaluated on every access."""
        return self.refresh()[0]

    @property
    def reason(self) -> str:
        """One line explaining the latest status."""
        return self._last[1]

    def refresh(self) -> tuple[str, str]:
        """Re-derive ``(status, reason)`` from the scheduler and the run directory."""
        try:
            self._last = self._evaluate_slurm() if self.backend == "slurm" else self._evaluate_local()
        except LaunchError as exc:  # the cluster stopped answering: keep the last known status
            self._last = (self._last[0], f"cannot query SLURM: {exc}")
        return self._last

    def _latest_attempt(self) -> str | None:
        if self.backend != "slurm":
            return self.info.get("attempt")
        attempts = [
            str(m.get("attempt", ""))
            for m in self.paths.read_rank_markers().values()
            if str(m.get("attempt", "")).startswith(f"{self.job_id}.")
        ]
        return max(attempts, key=lambda a: int(a.split(".")[1]), default=None)

    def rank_states(self) -> dict[int, dict]:
        """Each rank of the latest attempt as its marker says: ``state``, ``node``, ``local_rank``,
        ``host``, ``pid``, ``master_addr``, ``global_step`` (when stopped) ...; ``{}`` before any started."""
        attempt = self._latest_attempt()
        return self.paths.read_rank_markers(attempt) if attempt else {}

    def _from_markers(self, markers: dict[int, dict]) -> tuple[str, str] | None:
        failed = sorted(r for r, m in markers.items() if m["state"] == "failed")
        if failed:
            return "failed", f"rank {failed[0]} failed: {markers[failed[0]].get('error', 'see logs')}"
        if markers.get(0, {}).get("state") == "done":
            m = markers[0]
            loss = m.get("final_loss")
            return "done", f"finished {m.get('global_step')} steps" + (
                f", final loss {loss:.4g}" if loss is not None else ""
            )
        return None

    def _stopped_reason(self, markers: dict[int, dict], default: str) -> str:
        cancelled = self.paths.cancelled.exists()
        pre = [m for m in markers.values() if m["state"] == "preempted"]
        text = "cancelled by user" if cancelled else default
        if pre:
            text += (
                f"; stopped cleanly by SIG{pre[0].get('signal')} after step {pre[0].get('global_step')} "
                "(checkpoint saved: launch it again to resume)"
            )
        return text

    def _progress(self) -> str:
        step = read_metrics(self.run_dir).global_step
        return f"training, step {step}" if step else "starting"

    def _evaluate_local(self) -> tuple[str, str]:
        markers = self.paths.read_rank_markers(self.info.get("attempt"))
        rc = self._local_returncode()
        decided = self._from_markers(markers)
        if rc is None and (not decided or decided[0] == "failed"):
            return _still_running(self._progress(), decided, "torchrun decides whether to restart")
        if decided:
            return decided
        if rc == 0 and not markers:
            return "failed", "the local process exited before any worker started; see logs()"
        code = "an unknown exit code" if rc == -1 else f"exit code {rc}"
        return "failed", self._stopped_reason(markers, f"the local process (torchrun) ended with {code}")

    def _local_returncode(self) -> int | None:
        """None while torchrun runs; its exit code after (or -1 when it cannot be known)."""
        exit_file = self.paths.exit_status
        if self._process is not None:
            rc = self._process.poll()
            if rc is not None and not exit_file.exists():
                exit_file.write_text(json.dumps({"returncode": rc, "time": time.time()}))
            return rc
        if exit_file.exists():
            return int(json.loads(exit_file.read_text())["returncode"])
        pid = self.pid
        if pid and _pid_is(pid, self.info.get("pid_start")):
            return None
        return -1

    def _evaluate_slurm(self) -> tuple[str, str]:
        from workbench.launch import slurm

        info = slurm.job_info(self.job_id)
        attempt = f"{self.job_id}.{info.restarts}" if info is not None else self._latest_attempt()
        markers = self.paths.read_rank_markers(attempt) if attempt else {}
        if info is not None and info.state in slurm.PENDING_STATES:
            why = slurm.pending_reason(info.reason) if info.reason not in ("", "None") else "queued"
            return "pending", f"job {self.job_id} {info.state.lower()} ({why})" + (
                f", attempt {info.restarts + 1}" if info.restarts else ""
            )
        decided = self._from_markers(markers)
        if info is not None and info.state in slurm.RUNNING_STATES and (not decided or decided[0] == "failed"):
            progress = f"job {self.job_id}: " + self._progress()
            return _still_running(progress, decided, "the job decides whether to fail over")
        if decided:
            return decided
        if info is None:
            return "failed", self._stopped_reason(
                markers, f"job {self.job_id} is no longer known to SLURM and left no result"
            )
        state = info.state
        if state == "CANCELLED":
            return "failed", self._stopped_reason(markers, f"job {self.job_id} was cancelled (scancel or preemption)")
        if state == "TIMEOUT":
            return "failed", self._stopped_reason(markers, f"job {self.job_id} hit its time limit")
        return "failed", self._stopped_reason(
            markers, f"job {self.job_id} ended in state {state} (exit code {info.exit_code}) without a result"
        )

    # -- outputs
    def log_files(self) -> list[Path]:
        """The run's log files: torchrun's output (local) or each task's stderr/stdout (slurm)."""
        if self.backend == "local":
            return [self.paths.local_log]
        folder = self.paths.slurm

        def key(p: Path) -> tuple[int, int]:
            parts = p.name.split("_")
            return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0, 0 if p.suffix == ".err" else 1)

        return sorted(folder.glob(f"{self.job_id}_*_log.*"), key=key)

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of each log file, each under a ``==> name <==`` header."""
        parts = []
        for f in self.log_files():
            if not f.exists():
                continue
            lines = f.read_text(errors="replace").splitlines()
            parts.append(f"==> {f.name} <==\n" + "\n".join(lines[-tail:] if tail else lines))
        return "\n".join(parts) if parts else "(no logs yet)"

    def traceback(self) -> str:
        """The traceback of the first failed rank of the current attempt ('' when none)."""
        for rank, f in self.paths.rank_errors():
            marker = self.paths.read_rank_markers().get(rank)
            if marker and marker.get("state") == "failed":
                return f.read_text()
        # A crash before the worker could write its file (import error, OOM kill): search the logs.
        for f in self.log_files():
            if f.exists():
                text = f.read_text(errors="replace")
                if "Traceback (most recent call last)" in text:
                    return text[text.rindex("Traceback (most recent call last)") :]
        return ""

    def metrics(self) -> RunMetrics:
        """Per-step and per-epoch records logged so far (see :class:`RunMetrics`)."""
        return read_metrics(self.run_dir)

    def attempts(self) -> list[dict]:
        """One record per start of the run (a requeued SLURM job has several)."""
        return [
            a
            for a in read_jsonl(self.paths.attempts)
            if self.backend != "slurm" or str(a.get("job_id")) == str(self.job_id)
        ]

    # -- control
    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the run is done or failed; returns ``"done"``.

        Raises :class:`RunFailed` (with the traceback tail) when it failed, unless it was
        cancelled through :meth:`cancel` (then returns ``"failed"``), and ``TimeoutError``
        after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status, reason = self.refresh()
            if status == "done":
                return status
            if status == "failed":
                if self.paths.cancelled.exists():
                    return status
                raise RunFailed(self.run_dir, reason, self.traceback(), self.logs(tail=30))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run_dir} still {status} after {timeout:.0f} s ({reason})")
            time.sleep(poll_s)

    def cancel(self, wait: bool = True, timeout: float = 90.0) -> None:
        """Stop the run: SIGTERM to torchrun (local) or ``scancel`` (slurm).

        The workers checkpoint at the next step boundary before they exit, so launching the
        same config again resumes. With ``wait`` it returns once the run has stopped
        (status ``failed``, reason ``cancelled by user ...``).
        """
        if self.refresh()[0] in ("done", "failed"):
            return
        self.paths.cancelled.write_text(json.dumps({"time": time.time()}))
        if self.backend == "slurm":
            from workbench.launch import slurm

            slurm.cancel(self.job_id)
        else:
            self._signal_local(signal.SIGTERM)
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while self.refresh()[0] not in ("done", "failed"):
            if time.monotonic() > deadline:
                if self.backend == "local":
                    self._signal_local(signal.SIGKILL, group=True)
                    self._local_wait(10)
                    break
                raise TimeoutError(f"run {self.run_dir} did not stop within {timeout:.0f} s of cancel()")
            time.sleep(0.5)
        # slurm: the job may still be COMPLETING; local: reap torchrun.
        if self.backend == "local":
            self._local_wait(10)

    def _signal_local(self, sig: int, group: bool = False) -> None:
        pid = self.pid
        if not pid or not _pid_is(pid, self.info.get("pid_start")):
            return
        # torchrun forwards SIGTERM to its workers; SIGKILL goes to the whole session at once.
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(pid, sig)

    def _local_wait(self, timeout: float) -> None:
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=timeout)
            self._local_returncode()

    def panel(self, refresh_s: float = 2.0):
        """An ipywidgets panel (status, latest loss, per-rank step time, log tail) that refreshes itself."""
        from workbench.launch.panel import RunPanel

        return RunPanel(self, refresh_s=refresh_s)

    def _ipython_display_(self) -> None:  # pragma: no cover - notebook only
        from IPython.display import display

        display(self.panel())


def _pid_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_is(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is alive and still the process we started (not a reused pid, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    if stat[0] == "Z":
        return False
    return start is None or stat[19] == start


def load_info(run_dir: Path) -> dict[str, Any] | None:
    path = RunDir(run_dir).launch_info
    if not path.exists():
        return None
    return json.loads(path.read_text())


def attach(run_dir: str | os.PathLike) -> Run:
    """The :class:`Run` of an existing run directory (launched earlier, from any process)."""
    run_dir = Path(run_dir).absolute()
    info = load_info(run_dir)
    if info is None:
        raise FileNotFoundError(
            f"{run_dir}: no {RunDir(run_dir).launch_info.relative_to(run_dir)}; was this run started with "
            "workbench.launch.launch()?"
        )
    return Run(run_dir, info)
