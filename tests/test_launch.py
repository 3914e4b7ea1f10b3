"""workbench.launch: real SLURM (LocalSlurm daemons), real torchrun, real mace-torch training.

Order matters for the time budget: the 2-task SLURM reference run (module fixture) is also
the reference the requeued and the cancelled-then-relaunched local runs are compared to.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from local_slurm import LocalSlurm, missing_daemons

from workbench.data.embedded import EMBEDDED_PATH
from workbench.launch import LaunchError, RunFailed, attach, launch
from workbench.launch.slurm import parse_time
from workbench.train import TrainConfig
from workbench.train.presets import small_dataset
from workbench.train.presets import tiny_config as preset
from workbench.train.rundir import RunDir

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

MAX_STEPS = 24
START_TIMEOUT = 300  # s; a rank's start (torch + mace import) is slow on a loaded 2-core machine


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def raw_steps(run_dir: Path, rank: int) -> list[dict]:
    """Every step record a rank ever wrote, repeats included."""
    path = RunDir(run_dir).step_log(rank)
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def final_weights(run_dir: Path) -> dict:
    return torch.load(RunDir(run_dir).checkpoint, weights_only=False)["model"]


def assert_same_training(run_dir: Path, ref_dir: Path, ranks=(0, 1)) -> None:
    """Each step ran exactly once (nothing lost or repeated) on the same batches as the reference."""
    for rank in ranks:
        got, ref = raw_steps(run_dir, rank), raw_steps(ref_dir, rank)
        assert [s["global_step"] for s in got] == list(range(1, MAX_STEPS + 1)), f"rank {rank} steps"
        assert [s["batch_hash"] for s in got] == [s["batch_hash"] for s in ref]
        assert [s["loss"] for s in got] == [s["loss"] for s in ref]
    a, b = final_weights(run_dir), final_weights(ref_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("data") / "small.extxyz")


def tiny_config(tmp: Path, name: str, dataset: Path, **kw) -> TrainConfig:
    return preset(tmp, name, dataset=str(dataset), device="cpu", **kw)


def cfg(tmp: Path, name: str, dataset: Path, **kw) -> TrainConfig:
    return tiny_config(tmp, name, dataset, max_steps=MAX_STEPS, **kw)


# --------------------------------------------------------------------------- no cluster needed
def test_dry_run_slurm_185_nodes(tmp_path):
    script = launch(TrainConfig(output_dir=str(tmp_path)), backend="slurm", nodes=185, gpus_per_node=4, dry_run=True)
    lines = script.splitlines()
    for expected in (
        "#SBATCH --nodes=185",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=60",
        "#SBATCH --job-name=mace",
        "#SBATCH --open-mode=append",
        "export SUBMITIT_EXECUTOR=slurm",
    ):
        assert expected in lines, expected
    srun = next(x for x in lines if x.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "-m submitit.core._submit" in srun
    assert str(tmp_path / "mace" / "slurm") in srun
    assert not (tmp_path / "mace").exists()  # a dry run writes nothing

    script = launch(
        TrainConfig(output_dir=str(tmp_path), device="cpu"),
        backend="slurm",
        nodes=2,
        gpus_per_node=2,
        dry_run=True,
        account="chem",
        partition="gpu",
        qos="high",
        time="1-02:03:04",
        constraint="a100",
        cpus_per_task=8,
        mem="64G",
        sbatch_lines=["#SBATCH --exclusive", "--reservation=big"],
        setup=["module load cuda"],
        env={"NCCL_DEBUG": "INFO"},
        signal_delay_s=300,
    )
    lines = script.splitlines()
    for expected in (
        "#SBATCH --account=chem",
        "#SBATCH --partition=gpu",
        "#SBATCH --qos=high",
        "#SBATCH --time=1564",
        "#SBATCH --constraint=a100",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=64G",
        "#SBATCH --exclusive",
        "#SBATCH --reservation=big",
        "#SBATCH --signal=USR2@300",
        "module load cuda",
        "export NCCL_DEBUG=INFO",
    ):
        assert expected in lines, expected
    assert not any("--gpus-per-node" in x for x in lines)  # device="cpu": ranks are CPU tasks


def test_dry_run_local_and_cli(tmp_path, capsys):
    from workbench.cli import main

    text = launch(TrainConfig(output_dir=str(tmp_path), device="cpu"), backend="local", gpus_per_node=2, dry_run=True)
    assert "torch.distributed.run --standalone --nproc-per-node=2" in text
    assert text.endswith(f"-m workbench.launch.worker {RunDir(tmp_path / 'mace').launch_config}")
    path = tmp_path / "c.yaml"
    TrainConfig(name="cli", output_dir=str(tmp_path)).to_yaml(path)
    assert (
        main(
            [
                "launch",
                "--config",
                str(path),
                "--backend",
                "slurm",
                "--nodes",
                "3",
                "--gpus-per-node",
                "4",
                "--dry-run",
                "--set",
                "name=viacli",
                "--time",
                "02:00:00",
                "--partition",
                "gpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in out and "#SBATCH --job-name=viacli" in out and "#SBATCH --time=120" in out
    assert "#SBATCH --partition=gpu" in out
    assert (
        main(["launch", "--backend", "local", "--dry-run", "--partition", "x"]) == 2
    )  # a user error: one line, exit 2
    assert "--partition is a SLURM option" in capsys.readouterr().err


def test_parse_time():
    assert [parse_time(x) for x in ("30", "5:30", "01:00:00", "2-0", "1-02:30", "0-00:00:59", 90, 0.5)] == [
        30,
        6,
        60,
        2880,
        1590,
        1,
        90,
        1,
    ]
    for bad in ("abc", "1:2:3:4", "01:60:00", "1-25:00", "0:00", "-5", "", True, 0):
        with pytest.raises(ValueError, match="time="):
            parse_time(bad)


def test_invalid_requests(tmp_path):
    c = TrainConfig(output_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="time='4 hours' is not a SLURM time limit.*HH:MM:SS"):
        launch(c, backend="slurm", time="4 hours", dry_run=True)
    with pytest.raises(ValueError, match=r"time='01:75:00': field 75 is out of range"):
        launch(c, backend="slurm", time="01:75:00", dry_run=True)
    with pytest.raises(ValueError, match="backend='auto': choose 'local' or 'slurm'"):
        launch(c, backend="auto")
    with pytest.raises(TypeError):
        launch(c)  # the backend is never guessed
    with pytest.raises(ValueError, match="nodes=0: must be a positive integer"):
        launch(c, backend="slurm", nodes=0, dry_run=True)
    paired = TrainConfig(output_dir=str(tmp_path), device="cpu", sampler="mace-order")
    with pytest.raises(ValueError, match=r"'mace-order' .* on one rank, not 8 \(nodes=2, gpus_per_node=4\)"):
        launch(paired, backend="slurm", nodes=2, gpus_per_node=4, dry_run=True)
    assert "workbench" in launch(paired, backend="local", dry_run=True)  # one rank is fine
    with pytest.raises(TypeError, match=r"unknown SLURM option\(s\) \['partiton'\]"):
        launch(c, backend="slurm", partiton="gpu", dry_run=True)
    with pytest.raises(ValueError, match=r"SLURM option\(s\) \['partition'\] given with backend='local'"):
        launch(c, backend="local", partition="gpu")
    with pytest.raises(ValueError, match="nodes=2: backend='local' runs on this machine only"):
        launch(c, backend="local", nodes=2)
    n = (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"gpus_per_node={n}: without CUDA each rank is a CPU process"):
        launch(c, backend="local", gpus_per_node=n)
    with pytest.raises(ValueError, match="signal_delay_s=600.*before the time limit"):
        launch(c, backend="slurm", time=5, signal_delay_s=600, dry_run=True)
    with pytest.raises(ValueError, match="sbatch_lines entry 'exclusive'"):
        launch(c, backend="slurm", sbatch_lines=["exclusive"], dry_run=True)
    assert not (tmp_path / "mace").exists()


def test_no_slurm_commands_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="needs the SLURM client commands on PATH, but sbatch, srun.*not found"):
        launch(TrainConfig(output_dir=str(tmp_path), device="cpu"), backend="slurm")
    assert not (tmp_path / "mace").exists()


@pytest.mark.skipif(bool(missing_daemons()), reason="SLURM client commands not installed")
def test_cluster_not_answering(tmp_path, monkeypatch):
    dead = LocalSlurm(root=tmp_path / "dead")
    dead.root.mkdir()
    dead._write_files()  # a valid slurm.conf whose controller was never started
    monkeypatch.setenv("SLURM_CONF", str(dead.conf_path))
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"SLURM controller is not answering: `scontrol ping` says .*DOWN"):
        launch(TrainConfig(output_dir=str(tmp_path), device="cpu"), backend="slurm")
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- real SLURM
@pytest.fixture(scope="module")
def slurm_env(slurm_cluster):
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = slurm_cluster.env["SLURM_CONF"]
    yield slurm_cluster
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="module")
def slurm_ref(slurm_env, dataset, tmp_path_factory):
    """A 2-task SLURM training run, completed: the reference of the resume tests."""
    tmp = tmp_path_factory.mktemp("slurm")
    config = cfg(tmp, "ref", dataset)
    run = launch(config, backend="slurm", nodes=1, gpus_per_node=2, time="00:30:00")
    seen = {run.status}
    deadline = time.monotonic() + START_TIMEOUT
    while run.status not in ("done", "failed") and time.monotonic() < deadline:
        seen.add(run.status)
        time.sleep(0.3)
    assert run.wait(timeout=5) == "done", run.logs()
    return config, run, seen


def test_slurm_two_task_run_completes(slurm_ref, tmp_path):
    config, run, seen = slurm_ref
    assert "running" in seen and run.status == "done" and run.reason.startswith(f"finished {MAX_STEPS} steps")
    m = run.metrics()
    assert m.ranks == [0, 1] and m.global_step == MAX_STEPS and len(m.steps) == 2 * MAX_STEPS
    # DDP: different graphs on the two ranks at every step; the loss went down.
    assert all(a["batch_hash"] != b["batch_hash"] for a, b in zip(m.steps[::2], m.steps[1::2]))
    curve = [loss for _, loss in m.loss_curve()]
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5
    assert set(m.step_time_per_rank()) == {0, 1} and all(t > 0 for t in m.step_time_per_rank().values())
    assert m.epochs and m.epochs[-1]["global_step"] == MAX_STEPS
    assert RunDir(config.run_dir).model.exists()
    # The script submitted is exactly the dry run's.
    submitted = (config.run_dir / "slurm" / f"{run.job_id}_submission.sh").read_text()
    assert submitted == launch(config, backend="slurm", gpus_per_node=2, time="00:30:00", dry_run=True)
    logs = run.logs(tail=20)
    assert f"{run.job_id}_0_log.out" in logs and f"{run.job_id}_1_log.err" in logs
    # Reattach from the run directory alone.
    again = attach(config.run_dir)
    assert (again.backend, again.job_id, again.status) == ("slurm", run.job_id, "done")
    assert again.metrics().steps == m.steps and [a["restart_count"] for a in again.attempts()] == [0]


def test_panel_shows_status_loss_and_rank_times(slurm_ref):
    from workbench.launch import RunPanel

    _, run, _ = slurm_ref
    panel = run.panel()
    assert isinstance(panel, RunPanel) and panel.status == "done"
    assert panel._thread is None  # a finished run needs no refresh thread
    assert "done" in panel.header.value and f"SLURM job {run.job_id}" in panel.header.value
    assert f"step <b>{MAX_STEPS}</b>" in panel.loss.value and f"{run.metrics().last_loss:.5g}" in panel.loss.value
    assert panel.ranks.value.count("<tr>") == 3 and " ms</td>" in panel.ranks.value
    assert panel.cancel_button.disabled


def _release(cluster: LocalSlurm, run, attempt: int) -> None:
    """Wait for the requeued job to be held (BeginTime: SLURM keeps a requeued job back for the
    credential lifetime, 6 s on the test cluster) and then to start again by itself."""
    from workbench.launch import slurm

    def held():
        info = slurm.job_info(run.job_id)
        return info is not None and info.state == "PENDING" and info.restarts == attempt and info.reason == "BeginTime"

    wait_until(held, 60, f"job {run.job_id} to be requeued (attempt {attempt + 1})")
    assert run.status == "pending" and "BeginTime" in run.reason
    wait_until(lambda: run.status != "pending", 60, f"attempt {attempt + 1} to start")


def test_slurm_requeue_and_time_limit_signal_resume_exactly(slurm_env, slurm_ref, dataset, tmp_path):
    """`scontrol requeue` (SIGTERM), then SIGUSR2 (time limit ahead): the job resumes twice, exactly.

    No mid-epoch checkpoints (checkpoint_every=0): had the workers not checkpointed at the
    signal, the resumed attempts would repeat steps from the epoch start.
    """
    cluster = slurm_env
    ref_config, _, _ = slurm_ref
    config = cfg(tmp_path, "requeued", dataset, checkpoint_every=0)
    run = launch(config, backend="slurm", gpus_per_node=2, time="00:30:00")

    wait_until(lambda: run.metrics().global_step >= 3, START_TIMEOUT, "the first attempt to train 3 steps")
    assert cluster.run("scontrol", "requeue", run.job_id).returncode == 0
    _release(cluster, run, attempt=1)
    first_stop = run.metrics().global_step
    assert first_stop < MAX_STEPS

    wait_until(lambda: run.metrics().global_step >= first_stop + 3, START_TIMEOUT, "the second attempt to train")
    assert cluster.run("scancel", "--signal=USR2", run.job_id).returncode == 0
    _release(cluster, run, attempt=2)
    second_stop = run.metrics().global_step
    assert first_stop < second_stop < MAX_STEPS

    assert run.wait(timeout=START_TIMEOUT) == "done"
    assert [a["restart_count"] for a in run.attempts()] == [0, 1, 2]
    assert_same_training(config.run_dir, ref_config.run_dir)
    logs = run.logs(tail=0)
    assert f"stopped by SIGTERM after step {first_stop}" in logs
    assert f"stopped by SIGUSR2 after step {second_stop}" in logs and f"job {run.job_id} requeued" in logs


def test_slurm_failed_job_raises_with_traceback(slurm_env, dataset, tmp_path):
    config = cfg(tmp_path, "bad", dataset, capacity=30)  # smaller than the graphs: the trainer raises
    run = launch(config, backend="slurm", gpus_per_node=1, time="00:10:00")
    with pytest.raises(
        RunFailed, match=r"(?s)rank 0 failed: ValueError: \d+ graph\(s\) exceed TrainConfig.capacity 30:.*Traceback"
    ) as err:
        run.wait(timeout=START_TIMEOUT)
    assert "Raise TrainConfig.capacity to at least" in err.value.traceback
    assert run.status == "failed" and "capacity 30" in run.reason
    assert "Traceback" in run.logs(tail=200)


def test_slurm_cancel_and_active_run_guard(slurm_env, dataset, tmp_path):
    config = cfg(tmp_path, "cancelme", dataset)
    run = launch(config, backend="slurm", gpus_per_node=1, sbatch_lines=["--begin=now+3600"])
    assert run.status == "pending" and "BeginTime" in run.reason
    with pytest.raises(LaunchError, match=f"already has an active run \\(SLURM job {run.job_id}, pending: .*BeginTime"):
        launch(config, backend="slurm", gpus_per_node=1)
    run.cancel()
    assert run.status == "failed" and run.reason.startswith("cancelled by user")
    assert "JobState=CANCELLED" in slurm_env.run("scontrol", "show", "job", run.job_id).stdout
    assert run.wait(timeout=10) == "failed"  # a cancel is not an error to raise


def test_slurm_cancel_running_job_checkpoints_first(slurm_env, dataset, tmp_path):
    """cancel() on a running job: the rank checkpoints at a step boundary, then the job ends CANCELLED."""
    config = tiny_config(tmp_path, "cancel-running", dataset, checkpoint_every=0, max_steps=10_000)
    run = launch(config, backend="slurm", gpus_per_node=1)
    wait_until(lambda: run.metrics().global_step >= 2, START_TIMEOUT, "the SLURM job to train 2 steps")
    assert run.status == "running"
    run.cancel(timeout=120)
    assert run.status == "failed" and run.reason.startswith("cancelled by user")
    assert "JobState=CANCELLED" in slurm_env.run("scontrol", "show", "job", run.job_id).stdout
    ckpt = torch.load(RunDir(config.run_dir).checkpoint, weights_only=False)
    done = run.metrics().global_step
    assert ckpt["global_step"] == done >= 2  # the checkpoint holds every step that ran, none more


def test_slurm_invalid_resources(slurm_env, tmp_path):
    cpu = TrainConfig(output_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match=r"gpus_per_node=2 but nodes in partition 'debug' have at most 0 GPU\(s\)"):
        launch(TrainConfig(output_dir=str(tmp_path)), backend="slurm", gpus_per_node=2)  # device auto asks for GPUs
    with pytest.raises(ValueError, match=r"nodes=185 but partition 'debug' has 1 node\(s\)"):
        launch(cpu, backend="slurm", nodes=185, gpus_per_node=1)
    n = slurm_env.cpus + 1
    with pytest.raises(ValueError, match=f"gpus_per_node={n} tasks x cpus_per_task=1 = {n} CPUs per node"):
        launch(cpu, backend="slurm", gpus_per_node=n)
    with pytest.raises(ValueError, match="partition='a100' does not exist on this cluster; partitions: debug"):
        launch(cpu, backend="slurm", partition="a100")
    with pytest.raises(LaunchError, match="sbatch rejected the job: .*[Ii]nvalid feature"):
        launch(cpu, backend="slurm", constraint="no_such_feature")


# --------------------------------------------------------------------------- local torchrun
def test_local_cancel_then_relaunch_resumes_exactly(dataset, tmp_path, request):
    """A running 2-rank torchrun run: cancel() checkpoints at a step boundary; launching again finishes it."""
    config = cfg(tmp_path, "local", dataset, checkpoint_every=0)
    run = launch(config, backend="local", gpus_per_node=2)
    assert run.status == "running" and run.pid
    panel = run.panel(refresh_s=0.3)  # refreshes itself from a thread while the test goes on
    assert panel._thread.is_alive() and not panel.cancel_button.disabled
    wait_until(lambda: run.metrics().global_step >= 3, START_TIMEOUT, "the local run to train 3 steps")
    wait_until(lambda: "training, step" in panel.header.value, 10, "the panel to show training progress")
    run.cancel(timeout=120)
    panel._thread.join(timeout=10)
    assert not panel._thread.is_alive() and panel.status == "failed" and "cancelled by user" in panel.header.value
    stop = run.metrics().global_step
    assert run.status == "failed"
    assert run.reason.startswith("cancelled by user; stopped cleanly by SIGTERM after step")
    assert stop < MAX_STEPS and f"after step {stop}" in run.reason
    assert run.wait() == "failed"

    again = launch(config, backend="local", gpus_per_node=2)
    assert again.wait(timeout=START_TIMEOUT) == "done"
    assert again.reason.startswith(f"finished {MAX_STEPS} steps") and attach(config.run_dir).status == "done"
    assert len(again.attempts()) == 2 and again.metrics().global_step == MAX_STEPS
    try:
        ref_config = request.getfixturevalue("slurm_ref")[0]
    except pytest.skip.Exception:  # no SLURM here: still check that no step was lost or repeated
        for rank in (0, 1):
            assert [s["global_step"] for s in raw_steps(config.run_dir, rank)] == list(range(1, MAX_STEPS + 1))
        return
    # Same config, other backend: the same batches, losses and weights as the SLURM reference.
    assert_same_training(config.run_dir, ref_config.run_dir)


def test_local_failed_run_raises_with_traceback(dataset, tmp_path):
    run = launch(cfg(tmp_path, "localbad", dataset, capacity=30), backend="local", gpus_per_node=1)
    with pytest.raises(
        RunFailed, match=r"(?s)rank 0 failed: ValueError: \d+ graph\(s\) exceed TrainConfig.capacity 30:.*Traceback"
    ):
        run.wait(timeout=START_TIMEOUT)
    assert run.status == "failed" and "Traceback" in run.logs(tail=200)


def test_preempt_guard_records_signals_and_restores_handlers(monkeypatch):
    import signal

    from workbench.train import preempt

    before = signal.getsignal(signal.SIGUSR2)
    monkeypatch.delenv(preempt.ENV_VAR, raising=False)
    with preempt.guard():
        assert preempt.requested(1, "cpu") is None  # opt-in only: no env, no guard
    monkeypatch.setenv(preempt.ENV_VAR, "TERM,USR2")
    with preempt.guard():
        assert preempt.requested(1, "cpu") is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal; the highest number wins
        assert preempt.requested(1, "cpu") == "TERM"
    assert signal.getsignal(signal.SIGUSR2) is before and preempt.requested(1, "cpu") is None
    monkeypatch.setenv(preempt.ENV_VAR, "TERM,NOPE")
    with pytest.raises(ValueError, match="'NOPE' is not a signal name"), preempt.guard():
        pass
    monkeypatch.delenv(preempt.ENV_VAR)
    with preempt.guard("USR2"):  # the value train(preempt_signals=...) passes; no variable needed
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preempt.requested(1, "cpu") == "USR2"
    with preempt.guard(""):  # named, but none: no guard
        assert preempt.requested(1, "cpu") is None


def test_a_failed_rank_decides_only_once_the_job_has_ended(tmp_path, monkeypatch):
    """Between a rank's death and the failover's requeue the job is still RUNNING: the run is
    'running' (the reason names the rank), not 'failed', so wait() does not give up on a run
    that will resume; once SLURM says the job ended, the marker decides."""
    from workbench.launch import slurm
    from workbench.launch.run import Run

    paths = RunDir(tmp_path / "run")
    paths.launch.mkdir(parents=True)
    error = "RuntimeError: [gloo] Read error: Connection reset by peer"
    paths.rank_marker(0).write_text(json.dumps({"rank": 0, "attempt": "42.0", "state": "failed", "error": error}))
    paths.rank_marker(1).write_text(json.dumps({"rank": 1, "attempt": "42.0", "state": "running"}))
    state = {"now": "RUNNING"}
    monkeypatch.setattr(slurm, "job_info", lambda job_id: slurm.JobInfo(job_id, state["now"], "None", 0, "0:0"))
    run = Run(tmp_path / "run", {"backend": "slurm", "job_id": "42"})
    status, reason = run.refresh()
    assert status == "running" and f"rank 0 failed: {error}" in reason and "decides whether to fail over" in reason
    state["now"] = "FAILED"
    assert run.refresh() == ("failed", f"rank 0 failed: {error}")
