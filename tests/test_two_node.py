"""Multi-node for real: a two-node SLURM (two slurmd under one slurmctld) on this machine.

The reference is an uninterrupted run across both nodes. The fault run meets, in turn, a rank
killed on the second node and one on the first (each time the job fails over: it requeues
itself), the second node hanging
(SLURM marks it DOWN and requeues; the job waits for the node) and ``scancel`` (a clean stop;
launching again resumes). Its steps, losses, graphs per epoch and final weights must equal the
reference's, bit for bit.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from local_slurm import LocalSlurm, WaitError, missing_daemons, wait_for

from workbench.data.embedded import EMBEDDED_PATH
from workbench.launch import attach, launch
from workbench.launch.failover import FAILOVER, STRAY, STRAY_SIGTERM_LIMIT, decide, peer_lost
from workbench.train.presets import small_dataset, tiny_config
from workbench.train.rundir import RunDir, read_jsonl, read_steps

EPOCHS = 8
START_TIMEOUT = 300  # s: a rank's start (torch + mace import) is slow on a loaded 2-core machine


def wait_until(check, timeout: float, what: str, run=None, cluster=None):
    """``wait_for``; a timeout also says where the run and the cluster stood (CI keeps only the output)."""
    try:
        return wait_for(check, what, timeout, interval_s=0.1)
    except WaitError as e:
        if run is None:
            raise
        raise WaitError(f"{e}\n{_where_things_stand(run, cluster)}") from None


def _where_things_stand(run, cluster) -> str:
    """The run's and the cluster's state, each part on its own: one that fails says so."""
    parts = {
        "run": lambda: "{}: {}".format(*run.refresh()),
        "rank markers": lambda: run.rank_states(),  # noqa: PLW0108 (evaluated inside the try)
        "failovers": lambda: run.paths.failovers.read_text() if run.paths.failovers.exists() else "(none)",
        "global step": lambda: run.metrics().global_step,
        "logs": lambda: run.logs(tail=30),
        "sinfo": lambda: cluster.node_states(),  # noqa: PLW0108
        "scontrol show job": lambda: cluster.run("scontrol", "show", "job", str(run.job_id)).stdout,
        **{
            f"{d} log": (lambda d=d: cluster.logs(d, tail=60))
            for d in ("slurmctld", *(f"slurmd-{n}" for n in cluster.node_names))
        },
    }
    lines = []
    for name, part in parts.items():
        try:
            lines.append(f"==> {name}: {part()}")
        except Exception as e:  # a diagnostic must not hide the timeout it explains
            lines.append(f"==> {name}: unavailable ({e!r})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def cluster():
    missing = missing_daemons()
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing); `make system-deps`")
    root = os.environ.get("WORKBENCH_TEST_SLURM_ROOT")  # keep the daemons' logs there, to read after a failure
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    kw = dict(slurmd_timeout=10, message_timeout=5, requeue_delay_s=6, kill_wait=10)
    with LocalSlurm(nodes=2, root=root or None, **kw) as c:
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = c.env["SLURM_CONF"]
        try:
            yield c
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    if not EMBEDDED_PATH.exists():
        pytest.skip("embedded dataset missing")
    return small_dataset(tmp_path_factory.mktemp("data") / "small.extxyz")


def config(tmp: Path, name: str, dataset: Path):
    return tiny_config(tmp, name, dataset=str(dataset), device="cpu", epochs=EPOCHS, max_steps=None, log_graph_ids=True)


@pytest.fixture(scope="module")
def reference(cluster, dataset, tmp_path_factory):
    """An uninterrupted run on both nodes, one rank each."""
    cfg = config(tmp_path_factory.mktemp("ref"), "ref", dataset)
    run = launch(cfg, backend="slurm", nodes=2, gpus_per_node=1, time="00:30:00")
    assert run.wait(timeout=START_TIMEOUT) == "done", run.logs()
    return cfg, run


def graphs_per_epoch(run_dir: Path) -> dict[int, Counter]:
    """How often each graph was trained on in each epoch, over the steps that count."""
    out: dict[int, Counter] = {}
    for s in read_steps(run_dir):
        out.setdefault(s["epoch"], Counter()).update(s["graph_ids"])
    return out


def test_two_node_run_spans_both_nodes_and_covers_every_graph_once(cluster, reference):
    cfg, run = reference
    first, second = cluster.node_names
    ranks = run.rank_states()
    assert {r: m["node"] for r, m in ranks.items()} == {0: first, 1: second}
    assert all(m["local_rank"] == 0 for m in ranks.values())  # one rank per node
    assert {m["master_addr"] for m in ranks.values()} == {first}  # rendezvous on the first node's address
    assert run.attempts()[0]["nodes"] == f"127.0.0.[{first[-1]}-{second[-1]}]"
    epochs = graphs_per_epoch(cfg.run_dir)
    assert sorted(epochs) == list(range(EPOCHS))
    every = set(epochs[0])
    assert len(every) >= 40 and every == set(range(len(every)))  # the training set, by dataset index
    for epoch, seen in epochs.items():
        assert set(seen) == every and max(seen.values()) == 1, f"epoch {epoch}: a graph lost or repeated"
    # the job script asks for both nodes and ends with the failover line
    script = (cfg.run_dir / "slurm" / f"{run.job_id}_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert script.rstrip().splitlines()[-1].endswith("--step-exit $? --max-restarts 0")
    steps = read_steps(cfg.run_dir)
    assert {s["rank"] for s in steps} == {0, 1}


def _kill_rank_on(run, node: str) -> int:
    rank, marker = next((r, m) for r, m in run.rank_states().items() if m["node"] == node)
    os.kill(marker["pid"], signal.SIGKILL)
    return rank


def _attempt_running(run, attempt: int, steps_past: int):
    """Every rank runs ``attempt`` (or a later one) and the run is past ``steps_past``. Every 2 s the wait stops
    if the run has ended for good (a rank that died while the job runs leaves it "running")."""
    polls = itertools.count(1)

    def ok():
        if next(polls) % 20 == 0:
            status, reason = run.refresh()
            if status in ("done", "failed"):
                raise WaitError(f"the run ended while waiting for attempt {attempt}: {status}: {reason}")
        states = run.rank_states()
        return (
            len(states) == 2
            and all(int(m["attempt"].rsplit(".", 1)[1]) >= attempt for m in states.values())
            and all(m["state"] == "running" for m in states.values())
            and run.metrics().global_step >= steps_past
        )

    return ok


def _next_attempt(run, cluster, attempt: int, what: str) -> None:
    """Wait until every rank runs ``attempt`` and it has trained 2 steps past the run's last."""
    steps_past = run.metrics().global_step + 2
    wait_until(_attempt_running(run, attempt, steps_past), START_TIMEOUT, what, run, cluster)


def _hang_and_reboot(run, cluster, node: str) -> None:
    """``node`` hangs; SLURM marks it DOWN and requeues the job, which waits for it; it reboots.

    When it is back, SLURM may deliver the terminate request it queued for the DOWN node then, and
    it reaches the requeued attempt (same job and step ids): its ranks stop by SIGTERM while the job
    stays RUNNING. The failover requeues that without spending a failover; hence "attempt 3 or later"."""
    cluster.stop_node(node)
    wait_until(lambda: cluster.node_states().get(node, "").startswith("down"), 120, f"node {node} DOWN", run, cluster)

    def waiting_for_node():
        status, reason = run.refresh()
        return (status, reason) if "down now" in reason else None

    status, reason = wait_until(waiting_for_node, 90, "the requeued job to wait for the node", run, cluster)
    assert status == "pending" and f"waiting for nodes; down now: {node}" in reason and reason.endswith(", attempt 4")
    cluster.start_node(node)


def test_two_node_faults_resume_exactly(cluster, reference, dataset, tmp_path):
    """Kill a rank on each node, hang node 2, scancel: every graph once per epoch, the reference's losses and weights."""
    ref_cfg, _ = reference
    first, second = cluster.node_names
    cfg = config(tmp_path, "faults", dataset)
    run = launch(cfg, backend="slurm", nodes=2, gpus_per_node=1, time="00:30:00", max_restarts=2)

    # 1. a rank dies (SIGKILL) on either node: the job requeues itself (failovers 1 and 2 of 2)
    wait_until(_attempt_running(run, 0, 3), START_TIMEOUT, "attempt 1 to train 3 steps", run, cluster)
    assert _kill_rank_on(run, second) == 1
    _next_attempt(run, cluster, 1, "the first failover")
    assert _kill_rank_on(run, first) == 0  # the node that also runs the job script
    _next_attempt(run, cluster, 2, "the second failover")
    # (on a loaded machine a stale kill may also requeue an attempt: kind "stray-sigterm", see _hang_and_reboot)
    failovers = [f for f in read_jsonl(RunDir(cfg.run_dir).failovers) if f["kind"] == FAILOVER]
    assert [f["attempt"] for f in failovers] == [f"{run.job_id}.0", f"{run.job_id}.1"]
    assert "rank(s) 1 vanished" in failovers[0]["why"] and "rank(s) 0 vanished" in failovers[1]["why"]

    # 2. the second node hangs: SLURM marks it DOWN, requeues the job, which waits for two nodes
    _hang_and_reboot(run, cluster, second)
    _next_attempt(run, cluster, 3, "the attempt after the node")
    assert {m["node"] for m in run.rank_states().values()} == {first, second}

    # 3. scancel: every rank stops at one step boundary after a checkpoint; launching again resumes
    run.cancel(timeout=120)
    assert run.status == "failed" and run.reason.startswith("cancelled by user; stopped cleanly by SIGTERM")
    stopped = run.metrics().global_step
    assert torch.load(RunDir(cfg.run_dir).checkpoint, weights_only=False)["global_step"] == stopped
    again = launch(cfg, backend="slurm", nodes=2, gpus_per_node=1, time="00:30:00")
    assert again.wait(timeout=START_TIMEOUT) == "done", again.logs()
    assert attach(cfg.run_dir).job_id == again.job_id

    ref_steps = read_steps(ref_cfg.run_dir)
    got = read_steps(cfg.run_dir)
    assert [(s["rank"], s["global_step"]) for s in got] == [(s["rank"], s["global_step"]) for s in ref_steps]
    assert [s["graph_ids"] for s in got] == [s["graph_ids"] for s in ref_steps]
    assert [s["loss"] for s in got] == [s["loss"] for s in ref_steps]
    assert graphs_per_epoch(cfg.run_dir) == graphs_per_epoch(ref_cfg.run_dir)
    a = torch.load(RunDir(cfg.run_dir).checkpoint, weights_only=False)["model"]
    b = torch.load(RunDir(ref_cfg.run_dir).checkpoint, weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- the failover rule
def _m(state: str, **kw) -> dict:
    return {"state": state, **kw}


def test_failover_requeues_lost_ranks_not_bugs():
    gloo = (  # what rank 0 said when rank 1 was killed (torch 2.13, gloo)
        "RuntimeError: Got the following error when running the callback: RuntimeError: "
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:28064: Connection reset by peer."
    )
    assert peer_lost(gloo) and peer_lost("DistBackendError: NCCL error in: ...")
    assert not peer_lost("ValueError: capacity 30 atoms is smaller than graph 3 (45 atoms)")
    lost = {0: _m("failed", error=gloo), 1: _m("running")}
    assert decide(lost, 137, 2, used=0, max_restarts=1).requeue
    no_budget = decide(lost, 137, 2, used=1, max_restarts=1)
    assert not no_budget.requeue and "no failover left (1 of max_restarts=1 used)" in no_budget.why
    bug = {0: _m("failed", error="ValueError: capacity 30"), 1: _m("failed", error=gloo)}
    assert not decide(bug, 1, 2, used=0, max_restarts=5).requeue
    silent = decide({0: _m("running")}, 9, 2, used=0, max_restarts=2)  # rank 1 never wrote a marker
    assert silent.requeue and "rank(s) 0, 1 vanished" in silent.why
    usr2 = {0: _m("preempted", signal="USR2"), 1: _m("preempted", signal="USR2")}
    assert decide(usr2, 0, 2, used=9, max_restarts=0).requeue  # the time limit spends no failover
    assert not decide({0: _m("done"), 1: _m("done")}, 0, 2, used=0, max_restarts=1).requeue
    term = {0: _m("preempted", signal="TERM"), 1: _m("preempted", signal="TERM")}
    assert not decide(term, 0, 2, used=0, max_restarts=1).requeue
    assert not decide(term, 75, 2, used=0, max_restarts=1).requeue  # the trainer's clean-stop exit code
    for state in ("COMPLETING", "CANCELLED", "REQUEUED", "PREEMPTED", None):  # SLURM decided, or cannot say
        assert not decide(term, 0, 2, used=0, max_restarts=1, job_state=state).requeue
    stray = decide(term, 0, 2, used=5, max_restarts=0, job_state="RUNNING")  # a kill meant for an earlier attempt
    assert stray.requeue and stray.kind == STRAY and "no cancel, requeue" in stray.why and "(1 of 3)" in stray.why
    assert not decide(term, 0, 2, used=0, max_restarts=1, job_state="RUNNING", strays=STRAY_SIGTERM_LIMIT).requeue
    assert decide(usr2, 0, 2, used=0, max_restarts=0).kind is None  # a time-limit requeue is not logged
    assert decide(lost, 137, 2, used=0, max_restarts=1).kind == FAILOVER
    half = {0: _m("preempted", signal="TERM"), 1: _m("running")}  # rank 1 died before the stop
    assert decide(half, 137, 2, used=0, max_restarts=1).requeue


def test_a_sigterm_that_leaves_the_job_running_requeues_it(cluster, tmp_path):
    """The failover line on a real job: every rank stopped by SIGTERM while SLURM still runs the job
    (what a stale terminate for an earlier attempt does) requeues it without spending a failover;
    once SLURM has cancelled the job, the same markers leave it alone."""
    import json
    import subprocess
    import sys
    import time

    from workbench.launch.slurm import job_info

    out = cluster.run("sbatch", "--parsable", "--requeue", "-N", "1", "-o", "/dev/null", "--wrap", "sleep 300")
    job = out.stdout.strip().split(";")[0]
    wait_until(lambda: job_info(job).state == "RUNNING", 60, f"job {job} to run")
    paths = RunDir(tmp_path / "run")
    paths.launch.mkdir(parents=True)
    for rank in (0, 1):
        marker = {"rank": rank, "attempt": f"{job}.0", "state": "preempted", "signal": "TERM", "global_step": 6}
        paths.rank_marker(rank).write_text(json.dumps(marker))
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": "0", "SLURM_NTASKS": "2"}
    cmd = [
        sys.executable,
        "-m",
        "workbench.launch.failover",
        str(paths.path),
        "--step-exit",
        "0",
        "--max-restarts",
        "1",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "no cancel, requeue or preemption (a stale kill): requeued" in res.stderr
    assert "requeued" in res.stderr.splitlines()[-1]
    assert [(f["attempt"], f["kind"]) for f in read_jsonl(paths.failovers)] == [(f"{job}.0", STRAY)]
    wait_until(lambda: job_info(job).restarts == 1, 60, f"job {job} to be requeued")
    cluster.run("scancel", job)
    time.sleep(1)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert "SLURM decides what follows" in res.stderr and "requeued" not in res.stderr.splitlines()[-1], res.stderr
    assert len(read_jsonl(paths.failovers)) == 1


def test_failover_line_is_quoted_and_counts_restarts(tmp_path):
    from workbench.launch.slurm import failover_line

    cfg = tiny_config(tmp_path / "it's here", "q", device="cpu")
    line = failover_line(cfg, 3)
    assert "-m workbench.launch.failover '" in line and line.endswith("--step-exit $? --max-restarts 3")
    with pytest.raises(ValueError, match="max_restarts=-1: must be an integer >= 0"):
        launch(cfg, backend="slurm", dry_run=True, max_restarts=-1)
