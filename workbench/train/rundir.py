"""The run directory: its layout, its log-record schema and one tolerant reader.

Every module that writes or reads a run goes through here, so a file name is spelled once::

    <output_dir>/<name>/
        config.yaml             the config used                          RunDir.config
        run.json                what ran: ranks, device, data, commit    RunDir.info
        packing.npz             epoch 0's packing, graph families        RunDir.packing
        metrics/rank<r>.jsonl   one step record per line, per rank       RunDir.step_log(r)
        metrics.jsonl           one epoch record per line (rank 0)       RunDir.epoch_log
        checkpoint.pt           latest checkpoint (resume point)         RunDir.checkpoint
        checkpoint.prev.pt      the one before (fallback if the latest is damaged)
        run.lock                held by the training run's rank 0         RunDir.lock, RunLock
        model.model             final model, e3nn modules (MACECalculator loads it)
        model_<backend>.model   the accelerated model, when a kernel backend was used
        report.html             the run report
        finished.json           written last by a run that reached its end    RunDir.finished
        superseded/<time>/      an earlier run's records, moved aside by a fresh start   RunDir.supersede
        launch/                 the launcher's state (launch.json, rank<r>.json, attempts.jsonl, ...)
        slurm/                  submitit's folder (SLURM backend)

Logs are JSON Lines. A monitor polls them while ranks append, so :func:`read_jsonl` skips a
last line that has no newline yet (it is still being written) and reads it once it is
complete; a broken line anywhere else is corruption and raises, naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Record schema: the keys every step / epoch record carries (writers may add more).
STEP_FIELDS = (
    "type",
    "rank",
    "epoch",
    "step",
    "global_step",
    "data_s",
    "compute_s",
    "allreduce_s",
    "step_s",
    "atoms",
    "edges",
    "graphs",
    "loss",
    "lr",
    "batch_hash",
    "time",
    "peak_rss_mb",
)
EPOCH_FIELDS = (
    "type",
    "epoch",
    "complete",
    "global_step",
    "epoch_s",
    "train_e_mae_mev_atom",
    "train_f_mae_mev_a",
    "valid_e_mae_mev_atom",
    "valid_f_mae_mev_a",
    "valid_families",
    "compute_share",
    "allreduce_share",
    "data_share",
    "loss",
    "lr",
    "peak_mem_gb",
)


def previous_path(path: Path) -> Path:
    """Where the checkpoint before the latest is kept (the fallback when the latest is damaged)."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def _file(name: str, under: str = "") -> property:
    """A :class:`RunDir` property: the path ``name`` in the run directory, or in its folder
    ``under`` (another such property), so each name is spelled once."""

    def path(run: RunDir) -> Path:
        return (getattr(run, under) if under else run.path) / name

    return property(path, doc=f"``{name}``")


class RunDir:
    """Paths of one run directory (nothing is created until a writer needs it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- trainer
    config = _file("config.yaml")
    checkpoint = _file("checkpoint.pt")
    info = _file("run.json")
    packing = _file("packing.npz")
    lock = _file("run.lock")
    metrics_dir = _file("metrics")

    def step_log(self, rank: int) -> Path:
        return self.metrics_dir / f"rank{int(rank)}.jsonl"

    def step_logs(self) -> list[Path]:
        """Every rank's step log, in rank order."""
        files = self.metrics_dir.glob("rank*.jsonl") if self.metrics_dir.is_dir() else []
        return sorted(files, key=lambda f: int(f.stem.removeprefix("rank") or 0))

    epoch_log = _file("metrics.jsonl")
    model = _file("model.model")

    def accelerated_model(self, backend: str) -> Path:
        return self.path / f"model_{backend}.model"

    report = _file("report.html")
    finished = _file("finished.json")

    def records(self) -> list[Path]:
        """Everything a training run wrote here (not the lock, the launcher's state or superseded runs)."""
        fixed = [self.config, self.info, self.packing, self.metrics_dir, self.epoch_log, self.report, self.finished]
        fixed += [self.checkpoint, previous_path(self.checkpoint), self.model]
        return [p for p in [*fixed, *sorted(self.path.glob("model_*.model"))] if p.exists()]

    def supersede(self) -> Path | None:
        """Move an earlier run's records into ``superseded/<UTC time>/`` (a fresh start never mixes
        its logs with them, and never deletes them); returns that folder, or None when there were none."""
        import time

        found = self.records()
        if not found:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = self.path / "superseded" / stamp
        k = 1
        while dest.exists():
            dest, k = self.path / "superseded" / f"{stamp}-{k}", k + 1
        dest.mkdir(parents=True)
        for p in found:
            os.replace(p, dest / p.name)
        return dest

    # -- launcher
    launch = _file("launch")
    launch_info = _file("launch.json", under="launch")
    launch_config = _file("config.yaml", under="launch")

    def rank_marker(self, rank: int) -> Path:
        return self.launch / f"rank{int(rank)}.json"

    def rank_markers(self) -> list[Path]:
        return sorted(self.launch.glob("rank*.json"))

    def read_rank_markers(self, attempt: str | None = None) -> dict[int, dict]:
        """Each rank's marker of ``attempt`` (None: of any attempt), by rank. A marker that cannot
        be read (a worker is writing it) is left out: the caller looks again later."""
        out = {}
        for f in self.rank_markers():
            try:
                m = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if attempt is None or m.get("attempt") == attempt:
                out[int(m["rank"])] = m
        return out

    def rank_error(self, rank: int) -> Path:
        return self.launch / f"error_rank{int(rank)}.txt"

    def rank_errors(self) -> list[tuple[int, Path]]:
        return sorted((int(f.stem.removeprefix("error_rank")), f) for f in self.launch.glob("error_rank*.txt"))

    attempts = _file("attempts.jsonl", under="launch")
    failovers = _file("failovers.jsonl", under="launch")
    exit_status = _file("exit.json", under="launch")
    cancelled = _file("cancelled.json", under="launch")
    local_log = _file("local.log", under="launch")
    slurm = _file("slurm")

    def launch_state_files(self) -> list[Path]:
        """One launch's state, cleared before the next (``attempts.jsonl`` keeps the history)."""
        return [*self.rank_markers(), *(f for _, f in self.rank_errors()), self.cancelled, self.exit_status]

    def logs(self) -> list[Path]:
        """Files that hold log records (epoch log first)."""
        return [self.epoch_log, *self.step_logs()]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSON Lines file; a missing file is empty, a half-written last line is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    if lines and lines[-1].strip():  # no newline yet: a writer is still on this line
        lines = lines[:-1]
    out = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {k}: not a JSON record ({exc.msg}); the log is corrupt") from None
    return out


def read_steps(run_dir: str | os.PathLike, rank: int | None = None) -> list[dict]:
    """Step records of one rank (or all ranks), as the run finally saw them.

    A step redone after a restart from a checkpoint replaces the record of the attempt
    that was lost, so each ``(rank, global_step)`` appears once; sorted by (step, rank).
    """
    run = RunDir(run_dir)
    files = [run.step_log(rank)] if rank is not None else run.step_logs()
    last: dict[tuple[int, int], dict] = {}
    for f in files:
        for rec in read_jsonl(f):
            if rec.get("type", "step") == "step":
                last[(rec["rank"], rec["global_step"])] = rec
    return [last[k] for k in sorted(last, key=lambda k: (k[1], k[0]))]


def read_epochs(run_dir: str | os.PathLike) -> list[dict]:
    """Epoch records (rank 0's ``metrics.jsonl``)."""
    return read_jsonl(RunDir(run_dir).epoch_log)


def drop_after(path: str | os.PathLike, global_step: int) -> int:
    """Rewrite a log without the records past ``global_step`` (steps a resumed run replays, so
    each is logged once); returns how many were dropped. Atomic: a temporary file renamed."""
    path = Path(path)
    records = read_jsonl(path)
    keep = [r for r in records if r.get("global_step", 0) <= global_step]
    if len(keep) == len(records):
        return 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    return len(records) - len(keep)


class RunDirUnusable(ValueError):
    """The run directory cannot be created or written."""


class RunDirBusy(ValueError):
    """Another live process is training into this run directory."""


class RunLock:
    """An exclusive lock on a run directory, held while a run trains into it.

    ``fcntl.flock`` on ``run.lock``: the kernel releases it when the holder dies, so a lock left
    by a killed run is simply taken over. The file names the holder (host, pid, start time) for
    the error a second run gets.
    """

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self._fh = None
        self.taken_over: dict | None = None  # the dead holder's record, when there was one

    def __enter__(self) -> RunLock:
        import fcntl
        import socket
        import time

        try:
            self.run.path.mkdir(parents=True, exist_ok=True)
            fh = open(self.run.lock, "a+")
        except OSError as exc:
            raise RunDirUnusable(
                f"{self.run.path}: cannot write the run directory ({exc.strerror or exc}); choose a writable output_dir"
            ) from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "{}"
            fh.close()
            info = json.loads(holder) if holder.startswith("{") else {}
            raise RunDirBusy(
                f"{self.run.path}: another run is training here (host {info.get('host', '?')}, "
                f"pid {info.get('pid', '?')}, since {info.get('started', '?')}); wait for it to "
                "finish, or use another name"
            ) from None
        fh.seek(0)
        previous = fh.read().strip()
        self.taken_over = json.loads(previous) if previous.startswith("{") else None
        fh.seek(0)
        fh.truncate()
        fh.write(
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            )
            + "\n"
        )
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fh is not None:
            self._fh.seek(0)
            self._fh.truncate()  # an empty file: nobody holds it
            self._fh.close()  # releases the flock
            self._fh = None


class JsonlLog:
    """Append records to a JSON Lines file, one flushed line each; use as a context manager."""

    def __init__(self, path: str | os.PathLike, fields: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.fields = fields
        self._fh = None

    def __enter__(self) -> JsonlLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in self.fields if k not in record]
        if missing:
            raise KeyError(f"{self.path.name} record lacks {missing}")
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()


def iter_runs(root: str | os.PathLike) -> Iterator[RunDir]:
    """Run directories directly under ``root`` that hold step logs."""
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        run = RunDir(d)
        if run.step_logs():
            yield run


def latest_run(root: str | os.PathLike = "runs", min_steps: int = 6) -> RunDir | None:
    """The run under ``root`` whose step logs changed last, among those with ``min_steps`` steps."""
    best = None
    for run in iter_runs(root):
        files = run.step_logs()
        if sum(len(read_jsonl(f)) for f in files) >= min_steps:
            t = max(f.stat().st_mtime for f in files)
            if best is None or t > best[0]:
                best = (t, run)
    return best[1] if best else None
