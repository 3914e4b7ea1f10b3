"""Adversarial probes of the config, the CLI and the packer: every bad value gets one clear line."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench.packing import BinPackingBatchSampler, pack
from workbench.train import TrainConfig
from workbench.train.presets import tiny_config

BIN = Path(sys.executable).parent


# -- config: numbers as a user means them, every field checked by name --------------------------


def test_numbers_are_parsed_the_way_users_write_them(tmp_path):
    c = TrainConfig().with_overrides(["lr=1e-3", "correlation='3'", "families=mptrj", "seed=7", "clip_grad=null"])
    assert (c.lr, c.correlation, c.families, c.seed, c.clip_grad) == (0.001, 3, ["mptrj"], 7, None)
    assert isinstance(c.lr, float) and isinstance(c.correlation, int)
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nweight_decay: 5E-7\nfamilies: mptrj,hea\nmax_structures: 100.0\n")
    c = TrainConfig.from_yaml(path)
    assert (c.lr, c.weight_decay, c.families, c.max_structures) == (0.001, 5e-7, ["mptrj", "hea"], 100)


@pytest.mark.parametrize(
    "item, message",
    [
        ("lr=inf", r"TrainConfig.lr: must be a finite number > 0, got inf"),
        ("lr=0", r"TrainConfig.lr: must be a finite number > 0"),
        ("forces_weight=-100", r"TrainConfig.forces_weight: must be a finite number >= 0, got -100"),
        ("clip_grad=-1", r"TrainConfig.clip_grad: must be a finite number > 0 or null, got -1"),
        ("max_structures=-5", r"TrainConfig.max_structures: must be an integer >= 1 or null, got -5"),
        ("cutoff=1000", r"TrainConfig.cutoff: must be a finite number in \(0, 15\], got 1000"),
        ("seed=abc", r"TrainConfig.seed: expected an integer, got 'abc'"),
        ("seed=-1", r"TrainConfig.seed: must be an integer >= 0, got -1"),
        ("radial_mlp=64", r"TrainConfig.radial_mlp: expected a list like \[64, 64\], got 64"),
        ("device=tpu", r"TrainConfig.device: 'tpu' is not one of auto, cpu, cuda, cuda:N"),
        ("capacity=abc", r"TrainConfig.capacity: expected an integer, got 'abc'"),
        ("capacity=.nan", r"TrainConfig.capacity: expected an integer, got nan"),
        ("correlation=x", r"TrainConfig.correlation: expected an integer, got 'x'"),
        ("lr=[1", r"--set lr, line 1: not valid YAML"),
    ],
)
def test_bad_values_name_the_field(item, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig().with_overrides([item])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lr: 0.01\nfamilies: [mptrj\nseed: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml, line \d: not valid YAML"):
        TrainConfig.from_yaml(path)


def test_device_cuda_without_gpu_is_a_clear_error(tmp_path):
    import torch

    from workbench.train.distributed import pick_device

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(ValueError, match=r"TrainConfig.device: 'cuda', but no CUDA GPU is visible"):
        pick_device(TrainConfig(device="cuda"), 0)


def test_cli_error_convention(tmp_path):
    res = subprocess.run([str(BIN / "workbench"), "train", "--set", "lr=abc"], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip() == "workbench: error: TrainConfig.lr: expected a number, got 'abc'"
    res = subprocess.run(
        [str(BIN / "workbench"), "--debug", "train", "--set", "lr=abc"], capture_output=True, text=True
    )
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr


def test_absurd_cutoff_is_refused_before_building_graphs():
    from workbench.data import read_structures
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.train.data import check_graph_memory

    structures = read_structures(EMBEDDED_PATH)
    assert check_graph_memory(structures, 4.5) < 2**30  # the embedded set at 4.5 Å: well under a GiB
    with pytest.raises(ValueError, match=r"cutoff 14.0 Å: about \d+ neighbours per atom.*GiB"):
        check_graph_memory(structures, 14.0, fraction=0.01)


# -- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["paper", "shuffled-paper", "ffd"])
def test_non_finite_capacity_and_huge_costs(algorithm):
    costs = np.arange(1, 41)
    for capacity in (float("inf"), float("nan"), -1, "abc"):
        with pytest.raises(ValueError, match="capacity must be a finite number > 0"):
            pack(costs, capacity, 2, algorithm=algorithm)
    huge = costs.astype(np.float64).copy()
    huge[7] = 2.0**63
    with pytest.raises(ValueError, match=r"graph 7 has cost .* beyond .*2\*\*53"):
        pack(huge, 1000, 2, algorithm=algorithm)
    with pytest.raises(ValueError, match=r"capacity .* is beyond .*2\*\*53"):
        pack(costs, 2.0**60, 2, algorithm=algorithm)


def test_sampler_state_from_other_data_or_packing_is_refused():
    rng = np.random.default_rng(0)
    costs = rng.integers(5, 100, 400)
    s = BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    assert state["n_graphs"] == 400 and state["capacity"] == 512
    for other, what in (
        (BinPackingBatchSampler(costs[:300], capacity=512, num_replicas=2, rank=0), "n_graphs=400"),
        (BinPackingBatchSampler(costs, capacity=256, num_replicas=2, rank=0), "capacity=512"),
        (BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0, seed=1), "seed=0"),
        (BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0, algorithm="ffd"), "algorithm='paper'"),
    ):
        with pytest.raises(ValueError, match=rf"sampler state was saved with {what}"):
            other.load_state_dict(state)
    same = BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0)
    same.load_state_dict(state)
    assert list(same) == s.rank_batches()[2:]


# -- training: safe resume, one run per directory, non-finite steps ------------------------------


def _tiny(tmp_path, name="run", **kw) -> TrainConfig:
    """Smaller than the shared tiny model (8x0e, correlation 1): these tests train many short runs."""
    base = dict(hidden_irreps="8x0e", correlation=1, radial_mlp=[8], families=["hea"], valid_fraction=0.2)
    base.update(epochs=20, max_steps=4, checkpoint_every=2, lr=0.005, export=False, seed=1)
    return tiny_config(tmp_path, name, **{**base, **kw})


def test_resume_refuses_another_run_and_applies_a_new_lr(tmp_path, capfd):
    import torch

    from workbench.train import train
    from workbench.train.rundir import RunDir, read_jsonl

    train(_tiny(tmp_path))
    for change, text in (
        ({"capacity": 300}, "capacity: 200 -> 300"),
        ({"dtype": "float64"}, "dtype: 'float32' -> 'float64'"),
        ({"hidden_irreps": "16x0e"}, "hidden_irreps: '8x0e' -> '16x0e'"),
    ):
        with pytest.raises(
            ValueError, match=rf"checkpoint.pt: the checkpoint belongs to a run with other settings \({text}"
        ):
            train(_tiny(tmp_path, max_steps=6, **change))
    capfd.readouterr()
    train(_tiny(tmp_path, max_steps=6, lr=0.002))
    assert "resume: applied lr 0.005 -> 0.002; max_steps 4 -> 6" in capfd.readouterr().err
    ckpt = torch.load(RunDir(tmp_path / "run").checkpoint, weights_only=False)
    assert ckpt["global_step"] == 6 and ckpt["optimizer"]["param_groups"][0]["lr"] == 0.002
    steps = [r["global_step"] for r in read_jsonl(RunDir(tmp_path / "run").step_log(0))]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_damaged_checkpoint_falls_back_then_names_the_file(tmp_path):
    from workbench.train import train
    from workbench.train.checkpoint import CheckpointError, load_checkpoint
    from workbench.train.rundir import RunDir, previous_path

    train(_tiny(tmp_path, checkpoint_every=3))  # checkpoints at step 3, then 4 at the end
    run = RunDir(tmp_path / "run")
    stale = run.path / "checkpoint.pt.tmp4242"
    stale.write_bytes(b"half a checkpoint")
    good = run.checkpoint.read_bytes()
    for damage in (
        good[: len(good) // 2],
        b"",
        np.random.default_rng(0).bytes(4096),
        good[:100] + bytes([good[100] ^ 0xFF]) + good[101:],
    ):
        run.checkpoint.write_bytes(damage)
        with pytest.warns(
            UserWarning,
            match=r"checkpoint.pt: not a .*resuming from the previous checkpoint checkpoint.prev.pt \(step 3\)",
        ):
            assert load_checkpoint(run.checkpoint)["global_step"] == 3
    previous_path(run.checkpoint).write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint.pt: not a readable checkpoint .*No usable earlier checkpoint: start afresh with --fresh",
    ):
        load_checkpoint(run.checkpoint)
    run.checkpoint.write_bytes(good)
    train(_tiny(tmp_path, max_steps=6))  # resumes from the good one and cleans the writer's leftovers
    assert not stale.exists()


def test_one_run_per_directory(tmp_path):
    import os
    import signal
    import time

    from workbench.train import train
    from workbench.train.rundir import RunDirBusy

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from workbench.train.rundir import RunDir, RunLock\n"
                f"with RunLock(RunDir({str(tmp_path / 'run')!r})):\n    print('held', flush=True); time.sleep(600)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"another run is training here \(host .*, pid {holder.pid}, since "):
            train(_tiny(tmp_path))
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    t0 = time.time()
    train(_tiny(tmp_path, max_steps=2))  # the dead holder's lock is taken over
    assert time.time() - t0 < 120


def test_absurd_labels_are_input_errors(tmp_path):
    from workbench.data import StructureError, read_structures, write_structures
    from workbench.data.embedded import EMBEDDED_PATH

    hea = [a for a in read_structures(EMBEDDED_PATH) if a.info["config_type"] == "hea"][:6]
    hea[5].info["REF_energy"] = 1e200
    hea[3].arrays["REF_forces"][2, 1] = -3e7
    with pytest.raises(StructureError, match=r"hea\.extxyz, frame 3: force 'REF_forces' on atom 2 is 3e\+07 eV/Å"):
        read_structures(write_structures(tmp_path / "hea.extxyz", hea))
    with pytest.raises(StructureError, match=r"hea5\.extxyz, frame 4: energy label 'REF_energy' is 1e\+200 eV"):
        read_structures(write_structures(tmp_path / "hea5.extxyz", hea[:3] + hea[4:]))


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_non_finite_step_names_the_graphs(tmp_path, mode):
    import torch

    from workbench.train import train
    from workbench.train.loop import NonFiniteStep
    from workbench.train.rundir import RunDir, read_jsonl

    # lr 1e9 diverges: step 1 still finite, step 2 overflows to NaN.
    cfg = _tiny(tmp_path, lr=1e9, clip_grad=None, max_steps=4, checkpoint_every=1, on_nonfinite=mode)
    run = RunDir(cfg.run_dir)
    if mode == "stop":
        with pytest.raises(
            NonFiniteStep,
            match=r"step 2 \(epoch 0\), rank 0: non-finite loss nan / gradient norm nan; "
            r"graphs with a non-finite error: \S*mixture\.extxyz\.gz, frame \d+.*"
            r"Stopped; the last checkpoint is kept",
        ):
            train(cfg)
        assert torch.load(run.checkpoint, weights_only=False)["global_step"] == 1
        return
    # Skipping a bad step is fine; skipping most steps is a diverging run: it stops above 25 % (3 of 4 here).
    with (
        pytest.warns(UserWarning, match=r"step 2 .*non-finite loss .*; step skipped \(on_nonfinite=skip\)"),
        pytest.raises(NonFiniteStep, match=r"step 4: 3 of the 4 steps of this run .* skipped .*stops above 25%"),
    ):
        train(cfg)
    assert [r["skipped"] for r in read_jsonl(run.step_log(0))] == [False, True, True, True]
    assert not run.finished.exists()
    weights = torch.load(run.checkpoint, weights_only=False)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())  # skipped steps never touched them


def test_uninterrupted_runs_are_bit_identical_with_two_threads(tmp_path):
    import torch

    from workbench.train import train
    from workbench.train.rundir import RunDir

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weights = []
        for k in range(2):
            cfg = tiny_config(tmp_path, f"r{k}", families=["water_clusters", "hea"], max_steps=8, export=False, seed=1)
            train(cfg)
            weights.append(torch.load(RunDir(cfg.run_dir).checkpoint, weights_only=False)["model"])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_preempted_run_exits_75_after_its_checkpoint(tmp_path):
    import os
    import signal
    import time

    import torch

    from workbench.train.rundir import RunDir, read_jsonl

    cfg = _tiny(tmp_path, max_steps=500, checkpoint_every=0)
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    proc = subprocess.Popen(
        [str(BIN / "workbench"), "train", "--config", str(path)],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, WORKBENCH_PREEMPT_SIGNALS="TERM"),
    )
    log = RunDir(cfg.run_dir).step_log(0)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_jsonl(log)) < 3:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    step = torch.load(RunDir(cfg.run_dir).checkpoint, weights_only=False)["global_step"]
    assert 3 <= step < 500
    assert f"workbench: preempted: stopped by SIGTERM after step {step}" in err and "Traceback" not in err


def test_unwritable_output_directory_is_one_line():
    res = subprocess.run(
        [str(BIN / "workbench"), "train", "--set", "output_dir=/sys/workbench-probe", "--set", "max_steps=1"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "workbench: error: /sys/workbench-probe/mace: cannot write the run directory "
        "(Operation not permitted); choose a writable output_dir"
    )
