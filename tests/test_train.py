"""Training: torchrun DDP on gloo, exact resume after a kill, rank failure under --max-restarts, MD."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from fault_injection import fault_env
from train_fixtures import run_cli, tiny

from workbench.data.embedded import EMBEDDED_PATH
from workbench.train import TrainConfig
from workbench.train.rundir import RunDir, read_steps

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")


def steps(run_dir: Path, rank: int = 0) -> list[dict]:
    """Step records as the run finally saw them: a step redone after a restart replaces the lost one."""
    return read_steps(run_dir, rank)


def final_weights(run_dir: Path) -> dict:
    return torch.load(RunDir(run_dir).checkpoint, weights_only=False)["model"]


def test_config_yaml_roundtrip_and_errors(tmp_path):
    cfg = TrainConfig(name="x", sampler="fixed-count", batch_size=6, backend="e3nn")
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert TrainConfig.from_yaml(path) == cfg
    defaults = TrainConfig()
    assert (
        defaults.hidden_irreps,
        defaults.max_ell,
        defaults.correlation,
        defaults.num_bessel,
        defaults.cutoff,
        defaults.lr,
        defaults.num_interactions,
    ) == ("128x0e+128x1o", 3, 3, 8, 4.5, 0.005, 2)
    with pytest.raises(ValueError, match="TrainConfig.sampler: 'greedy'"):
        TrainConfig(sampler="greedy")
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="hidden_irreps"):
        TrainConfig(hidden_irreps="128 scalars")


def test_errors_before_process_group(tmp_path):
    from workbench.train import train

    with pytest.raises(ValueError, match="cueq.*CUDA"):
        train(tiny(tmp_path, "e1", backend="cueq", device="cpu"))
    with pytest.raises(
        ValueError,
        match=r"graph\(s\) exceed TrainConfig.capacity 30: graph \d+ \(size \d+\).*Raise TrainConfig.capacity to at least \d+",
    ):
        train(tiny(tmp_path, "e2", capacity=30))
    with pytest.raises(ValueError, match="no labelled structures"):
        train(tiny(tmp_path, "e3", families=["no_such_family"]))
    empty = tmp_path / "empty.extxyz"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.extxyz.*no structures"):
        train(tiny(tmp_path, "e4", dataset=str(empty)))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    cfg = tiny(tmp, "ddp")
    # No restart budget: the rank-failure test compares against this uninterrupted run.
    out = run_cli(cfg, tmp, nproc=2, restarts=0)
    assert out.returncode == 0, out.stderr[-4000:]
    return cfg, tmp


def test_torchrun_two_ranks_gloo_loss_decreases(ddp_run):
    cfg, _ = ddp_run
    r0, r1 = steps(cfg.run_dir, 0), steps(cfg.run_dir, 1)
    assert len(r0) == len(r1) == cfg.max_steps
    loss = np.array([(a["loss"] + b["loss"]) / 2 for a, b in zip(r0, r1)])
    assert loss[-10:].mean() < 0.85 * loss[:10].mean(), loss
    # Both ranks ran different graphs at every step, and the all-reduce wait was measured.
    assert all(a["batch_hash"] != b["batch_hash"] for a, b in zip(r0, r1))
    assert sum(a["allreduce_s"] for a in r0 + r1) > 0
    for rec in r0:
        assert rec["compute_s"] > 0 and rec["atoms"] <= cfg.capacity and rec["edges"] > 0
    epochs = [json.loads(x) for x in RunDir(cfg.run_dir).epoch_log.read_text().splitlines()]
    assert epochs and all(0 <= e["compute_share"] <= 1 for e in epochs)
    assert epochs[-1]["valid_f_mae_mev_a"] < 0.9 * epochs[0]["valid_f_mae_mev_a"]
    assert RunDir(cfg.run_dir).model.exists()


def test_rank_failure_restarts_group_from_checkpoint(ddp_run, tmp_path):
    ref_cfg, _ = ddp_run
    cfg = tiny(tmp_path, "ddp")  # same run, other directory
    out = run_cli(cfg, tmp_path, nproc=2, restarts=3, env_extra=fault_env(10, rank=1))
    assert out.returncode == 0, out.stderr[-4000:]
    raw = [json.loads(x) for x in RunDir(cfg.run_dir).step_log(1).read_text().splitlines()]
    # Steps 9-10 ran twice (the group restarted from the step-8 checkpoint) but are logged once.
    assert [r["global_step"] for r in raw] == list(range(1, cfg.max_steps + 1))
    assert re.search(r"resume: from step 8; [12] step\(s\) logged after it will run again", out.stderr)
    for rank in (0, 1):
        assert [s["batch_hash"] for s in steps(cfg.run_dir, rank)] == [
            s["batch_hash"] for s in steps(ref_cfg.run_dir, rank)
        ]
    ref, got = final_weights(ref_cfg.run_dir), final_weights(cfg.run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_kill_and_resume_is_exact(tmp_path):
    ref = tiny(tmp_path, "ref", max_steps=14, checkpoint_every=3)
    assert run_cli(ref, tmp_path).returncode == 0
    cut = tiny(tmp_path, "cut", max_steps=14, checkpoint_every=3)
    killed = run_cli(cut, tmp_path, env_extra=fault_env(8))
    assert killed.returncode != 0  # died mid-epoch after step 8; last checkpoint at step 6
    assert len(steps(cut.run_dir)) == 8
    resumed = run_cli(cut, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = steps(ref.run_dir), steps(cut.run_dir)
    assert [s["batch_hash"] for s in a] == [s["batch_hash"] for s in b]
    assert [s["loss"] for s in a] == [s["loss"] for s in b]
    wa, wb = final_weights(ref.run_dir), final_weights(cut.run_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_md_with_mace_calculator(ddp_run):
    from ase import units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet
    from mace.calculators import MACECalculator

    from workbench.data import load_embedded

    cfg, _ = ddp_run
    calc = MACECalculator(model_paths=str(RunDir(cfg.run_dir).model), device="cpu", default_dtype="float32")
    atoms = next(a for a in load_embedded() if a.info["config_type"] == "water_clusters").copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    energies = []
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=1)
    dyn.run(20)
    assert len(energies) == 21 and np.all(np.isfinite(energies))
    assert np.isfinite(atoms.positions).all()


def test_cost_model_fit_from_logs(ddp_run):
    from workbench.packing.cost import fit_step_times
    from workbench.train.rundir import read_steps

    cfg, _ = ddp_run
    recs = read_steps(cfg.run_dir)
    assert len(recs) == 2 * cfg.max_steps
    kept = [r for r in recs if r["global_step"] > 2]
    measured = np.array([r["compute_s"] for r in kept])
    sizes = np.array([r["atoms"] for r in kept]), np.array([r["edges"] for r in kept])
    # Least squares with an intercept is unbiased on its own data. (The default non-negative fit
    # is not once it clamps the intercept to 0, which timing noise does now and then: batches
    # span only 140-200 atoms, so the intercept is an extrapolation.)
    free, _ = fit_step_times(recs, nonnegative=False)
    assert abs(free.batch_seconds(*sizes).mean() - measured.mean()) < 1e-6 + 1e-9 * measured.mean()
    # The default fit stays close on average (within 5%: CI saw 0.1% when it clamped the intercept).
    model, desc = fit_step_times(recs, source="run 'x'")
    assert desc.startswith(f"cost model: NNLS fit to {len(kept)} measured step compute times of run 'x'")
    assert abs(model.batch_seconds(*sizes).mean() - measured.mean()) < 0.05 * measured.mean()
    assert model.b * 200 + model.c * 4000 > 0


def test_numba_backend_trains_like_e3nn(tmp_path, monkeypatch):
    """The kernels are a drop-in: the same run with backend="numba" follows the e3nn run's losses.
    On the default CPU kernels (the suite runs the interpreter, tests/conftest.py): this small
    model's message passes run fused, so MACE training covers them end to end."""
    from fused_spy import spy_fused_runs

    from workbench.train import train
    from workbench.train.rundir import read_steps

    monkeypatch.delenv("WORKBENCH_CPU_KERNELS", raising=False)
    fused = spy_fused_runs(monkeypatch)

    losses = {}
    for backend in ("e3nn", "numba"):
        cfg = tiny(tmp_path, f"b_{backend}", backend=backend, max_steps=4, checkpoint_every=0, dtype="float64")
        result = train(cfg, resume=False)
        losses[backend] = [s["loss"] for s in read_steps(cfg.run_dir)]
        assert result.model_path.exists()
    np.testing.assert_allclose(losses["numba"], losses["e3nn"], rtol=1e-9)
    assert fused, "no fused pass ran"
    # The exported model.model is plain mace-torch (e3nn), and the numba form is kept beside it.
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    model = torch.load(RunDir(tmp_path / "b_numba").model, weights_only=False)
    assert any(isinstance(m, MaceSC) for m in model.modules())
    assert (tmp_path / "b_numba" / "model_numba.model").exists()


def test_initial_weights_and_weight_decay_follow_mace_run_train(tmp_path):
    """The initial weights depend on the seed only (random numbers drawn before, as data loaders
    draw them, change nothing) and equal a ScaleShiftMACE built right after seeding, as
    mace_run_train builds it; with weight decay, the decayed parameters are those of mace's own
    ``get_params_options``."""
    import argparse

    import torch
    from mace.tools.scripts_utils import get_params_options

    from workbench.train import loop
    from workbench.train.model import build_model

    cfg = tiny(tmp_path, "init", weight_decay=5e-7, seed=11)
    s = loop.set_up(cfg, None, None)
    loop.build_training(s, None)
    first = {k: v.clone() for k, v in s.model.state_dict().items()}
    torch.rand(1000)  # a different global RNG state before the second build
    loop.build_training(s, None)
    assert all(torch.equal(first[k], v) for k, v in s.model.state_dict().items())
    torch.manual_seed(11)
    ref = build_model(cfg, s.stats)
    assert all(torch.equal(first[k], v) for k, v in ref.state_dict().items())
    torch.manual_seed(12)
    other = build_model(cfg, s.stats)
    assert not all(torch.equal(first[k], v) for k, v in other.state_dict().items())

    args = argparse.Namespace(lr_params_factors="{}", freeze=0, weight_decay=5e-7, lr=0.01, amsgrad=True, beta=0.9)
    theirs = {id(p) for g in get_params_options(args, s.model)["params"] if g["weight_decay"] > 0 for p in g["params"]}
    groups = s.optimizer.param_groups
    ours = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert ours == theirs and len(ours) > 0
    assert {g["weight_decay"] for g in groups} == {5e-7, 0.0}
    assert sum(len(g["params"]) for g in groups) == len(list(s.model.parameters()))
    assert len(loop.param_groups(s.model, 0.0)) == 1
    old = {"model": s.model.state_dict(), "optimizer": torch.optim.Adam(s.model.parameters()).state_dict()}
    with pytest.raises(ValueError, match=r"1 parameter group\(s\), this run has 2.*--fresh"):
        loop.restore(s, old)  # a checkpoint from before the weight-decay groups
