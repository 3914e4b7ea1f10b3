"""What a SLURM job does once its ``srun`` step has ended: finish, or go back in the queue.

The job script runs this after ``srun`` (submitit's ``teardown``), on the job's first node::

    python -m workbench.launch.failover RUN_DIR --step-exit $? --max-restarts N

It reads the rank markers of the attempt that just ended (``<run_dir>/launch/rank<r>.json``,
written by :mod:`workbench.launch.worker`) and decides:

===========================================  ===============================================
the ranks say                                the job
===========================================  ===============================================
done                                         ends (exit 0)
stopped by SIGUSR2 (time limit ahead)        is requeued; the next attempt resumes exactly
stopped by SIGTERM, the job no longer         SLURM already decided (requeue, scancel, preemption)
  RUNNING
stopped by SIGTERM, the job still RUNNING    is requeued, up to ``STRAY_SIGTERM_LIMIT`` times a
                                             job, without spending a failover: SLURM decided
                                             nothing. A kill meant for an earlier attempt does
                                             this: after a requeue, a terminate request that timed
                                             out is sent again and reaches the new attempt, which
                                             has the same job and step ids
a rank raised an error of its own            ends FAILED: the same error would come back
a rank vanished (killed, OOM, node lost)     is requeued while fewer than ``N`` failovers of
  and the others lost their peers            this job have happened; otherwise ends FAILED
===========================================  ===============================================

Each requeue is one line in ``<run_dir>/launch/failovers.jsonl`` (``kind``: ``failover`` or
``stray-sigterm``). A requeue from here is safe where one from inside a rank was not: the step is over, so SLURM
never sees a job whose tasks are still winding down. The exit code is the step's, so a job that is not
requeued keeps the state its step earned.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from workbench.train.rundir import JsonlLog, RunDir, read_jsonl

# How a rank reports losing a peer: the collective it waited in failed. Not a bug of its own.
PEER_LOST = ("DistBackendError", "DistNetworkError", "DistStoreError", "Connection closed by peer", "Connection reset")
PEER_LOST_PREFIXES = ("RuntimeError: [", "RuntimeError: Gloo", "RuntimeError: NCCL")


#: requeues of one job after a SIGTERM that SLURM followed with nothing (a stale kill); a bound,
#: so that a job someone keeps signalling with ``scancel -s TERM`` ends
STRAY_SIGTERM_LIMIT = 3
FAILOVER, STRAY = "failover", "stray-sigterm"


@dataclass
class Decision:
    requeue: bool
    why: str
    kind: str | None = None  # what the requeue is logged as: FAILOVER spends one of max_restarts


def peer_lost(error: str) -> bool:
    """True when a rank's error text says a collective failed because another rank went away."""
    if any(key in error for key in PEER_LOST):
        return True
    return error.startswith(PEER_LOST_PREFIXES) and ("gloo" in error.lower() or "nccl" in error.lower())


def decide(
    markers: dict[int, dict],
    step_exit: int,
    world_size: int,
    used: int,
    max_restarts: int,
    job_state: str | None = None,
    strays: int = 0,
) -> Decision:
    """The decision table of the module docstring, from one attempt's rank markers and the job's
    state as ``scontrol`` sees it once the step has ended (None: unknown). ``used`` failovers and
    ``strays`` stray-SIGTERM requeues of this job have happened."""
    states = {r: m.get("state") for r, m in markers.items()}
    if states.get(0) == "done":
        return Decision(False, "finished")
    signals = {m.get("signal") for m in markers.values() if m.get("state") == "preempted"}
    if "USR2" in signals:
        return Decision(True, "time limit ahead (SIGUSR2): requeued to resume from the checkpoint")
    vanished = sorted(r for r in range(world_size) if states.get(r) in (None, "running"))
    if "TERM" in signals and not vanished:
        if job_state != "RUNNING":
            return Decision(False, "stopped by SIGTERM; SLURM decides what follows")
        who = "a SIGTERM that SLURM followed with no cancel, requeue or preemption (a stale kill)"
        if strays >= STRAY_SIGTERM_LIMIT:
            return Decision(False, f"{who}; not requeued: {strays} such requeues of this job already")
        return Decision(
            True, f"{who}: requeued to resume from the checkpoint ({strays + 1} of {STRAY_SIGTERM_LIMIT})", STRAY
        )
    own = sorted(r for r, m in markers.items() if m.get("state") == "failed" and not peer_lost(m.get("error", "")))
    if own:
        return Decision(False, f"rank {own[0]} failed: {markers[own[0]].get('error', '?')[:300]}; not requeued")
    if step_exit == 0 and not vanished:
        return Decision(False, "the step ended without a failure")
    who = f"rank(s) {', '.join(map(str, vanished))} vanished" if vanished else f"the step failed ({step_exit})"
    return _failover(who, used, max_restarts)


def _failover(who: str, used: int, max_restarts: int) -> Decision:
    if used >= max_restarts:
        return Decision(False, f"{who}; no failover left ({used} of max_restarts={max_restarts} used)")
    why = f"{who}; failover {used + 1} of {max_restarts}: requeued to resume from the checkpoint"
    return Decision(True, why, FAILOVER)


def _job_state(job: str) -> str | None:
    """``JobState`` of ``job`` now; None when SLURM cannot say (the decision then leaves it to SLURM)."""
    from workbench.launch.errors import LaunchError
    from workbench.launch.slurm import job_info

    try:
        info = job_info(job) if job else None
    except (LaunchError, OSError):
        return None
    return info.state if info is not None else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.launch.failover", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step-exit", type=int, required=True, help="srun's exit code ($?)")
    parser.add_argument("--max-restarts", type=int, default=0, help="failovers allowed after a rank or node failure")
    args = parser.parse_args(argv)
    job = os.environ.get("SLURM_JOB_ID", "")
    attempt = f"{job}.{int(os.environ.get('SLURM_RESTART_COUNT') or 0)}"
    paths = RunDir(args.run_dir)
    kinds = [r.get("kind", FAILOVER) for r in read_jsonl(paths.failovers) if str(r.get("job_id")) == job]
    used, strays = kinds.count(FAILOVER), kinds.count(STRAY)
    world = int(os.environ.get("SLURM_NTASKS") or 0) or len(paths.rank_markers())
    markers = paths.read_rank_markers(attempt)
    stopped_by_term = any(m.get("signal") == "TERM" for m in markers.values())
    state = _job_state(job) if stopped_by_term else None  # asked only where the table needs it
    d = decide(markers, args.step_exit, world, used, args.max_restarts, job_state=state, strays=strays)
    print(f"workbench: job {job} attempt {attempt}: {d.why}", file=sys.stderr, flush=True)
    if d.requeue:
        if d.kind is not None:  # not a time-limit requeue
            nodes = os.environ.get("SLURM_JOB_NODELIST")
            record = {"job_id": job, "attempt": attempt, "kind": d.kind, "nodes": nodes, "why": d.why}
            with JsonlLog(paths.failovers) as log:
                log.write({**record, "time": time.time()})
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        msg = "requeued" if out.returncode == 0 else f"could not requeue: {out.stderr.strip()}"
        print(f"workbench: job {job} {msg}", file=sys.stderr, flush=True)
    return args.step_exit


if __name__ == "__main__":
    sys.exit(main())
