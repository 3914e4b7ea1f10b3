"""The CUDA-graph train step on the CPU (workbench.train.graph_step, workbench.train.host_sync):
the step reads nothing back to the host for every loss and kernel backend, while the plain
step does; it trains as the plain fixed-shape step; a non-finite step is skipped on the device;
and the config refuses what a capture cannot take. The capture itself needs a GPU."""

import contextlib
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.train.host_sync import HostSync, no_host_sync

R_MAX = 4.0


def _config(tmp_path: Path, name: str, **kw):
    from train_fixtures import tiny

    from workbench.train.presets import small_dataset

    src = tmp_path / "mix.extxyz"
    if not src.exists():
        small_dataset(src, n=40, families=("water_clusters", "hea", "mptrj"))
    run = dict(dataset=str(src), dtype="float64", capacity=300, max_steps=4, fixed_shapes=True, backend="numba")
    run |= dict(families=None, max_structures=None, export=False)
    run |= kw
    return tiny(tmp_path, name, **run)


def _run(tmp_path: Path, name: str, **kw):
    from workbench.train.loop import train

    return train(_config(tmp_path, name, **kw), resume=False)


_ONE, _PAIR = torch.tensor(1), torch.tensor([1, 2])  # built outside the guard, which refuses torch.tensor


@pytest.mark.parametrize(
    "code, what",
    [
        (lambda x: x.sum().item(), "_local_scalar_dense"),
        (lambda x: bool(x.sum() > 0), "_local_scalar_dense"),
        (lambda x: x[_ONE], "0-d tensor as an index"),
        (lambda x: x[x > 0.5], "boolean mask"),
        (torch.nonzero, "nonzero"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: torch.repeat_interleave(_PAIR), "give output_size"),
        (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), "a copy from the host"),
    ],
)
def test_the_guard_names_each_host_sync(code, what):
    x = torch.rand(5)
    with pytest.raises(HostSync, match=what), no_host_sync():
        code(x)
    code(x)  # and outside the block, nothing is refused


def test_the_guard_lets_device_side_forms_through():
    from workbench.kernels.library import host_side

    x = torch.rand(5)
    with no_host_sync():
        torch.where(x > 0.5, x, 0.0)
        x.index_select(0, _ONE.view(1))
        torch.repeat_interleave(_PAIR, output_size=3)
        with host_side():  # a CPU-only branch says so
            torch.tensor([1.0])
    assert x.tolist() == x.tolist()  # restored


def _guarded(monkeypatch, module, name: str) -> list[int]:
    """Run ``module.name`` under :func:`no_host_sync`; returns a list its calls are counted in."""
    calls, original = [], getattr(module, name)

    def guarded(*args, **kwargs):
        calls.append(1)
        with no_host_sync():
            return original(*args, **kwargs)

    monkeypatch.setattr(module, name, guarded)
    return calls


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_the_graph_step_never_syncs_with_the_host(backend):
    """Every loss, on a padded batch, from zeroing the gradients to the EMA update: under the guard."""
    from kernel_fixtures import build_model
    from test_padding import _padded

    from workbench.kernels.compiling import capture_ready
    from workbench.train.graph_step import device_step
    from workbench.train.losses import LOSSES, outputs_needed

    with torch.device("cpu"), _float64():
        model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=1)
        capture_ready(model, backend)
        batch, _ = _padded(_labelled_batch())
        for name in LOSSES:
            stress, virials = (0.7 if "stress" in LOSSES[name].uses else 0.0), (0.4 if name == "virials" else 0.0)
            s = _session(model, name, stress, virials)
            compute = outputs_needed(name, stress, virials)
            rate = torch.tensor(0.1)
            device_step(s, batch, rate)  # the warm-up, outside: what builds on first use builds here
            for _ in range(2):  # then as a capture takes it, with optimiser state and moments
                with no_host_sync():
                    out = device_step(s, batch, rate)
            assert bool(out["finite"]) and all(k in out for k, on in zip(("stress", "virials"), compute) if on)


def test_a_run_takes_its_steps_through_the_graph_step(tmp_path, monkeypatch):
    from workbench.train import graph_step

    calls = _guarded(monkeypatch, graph_step, "device_step")
    _run(tmp_path, "universal", loss="universal", stress_weight=5.0, cuda_graph=True, max_steps=3)
    assert len(calls) == 3


def test_the_plain_step_does_sync(tmp_path, monkeypatch):
    """The guard sees real syncs: the eager step's non-finite check reads the loss."""
    from workbench.train import epoch

    _guarded(monkeypatch, epoch, "take_step")
    with pytest.raises(HostSync, match="_local_scalar_dense"):
        _run(tmp_path, "plain", max_steps=1)


def test_a_graph_step_run_trains_as_the_plain_run(tmp_path):
    """Same losses at every step, same EMA weights in the exported model (fused Adam against
    Adam's loop: rounding only), and the export holds mace's own modules."""
    from workbench.train.model_file import refused_globals

    kw = dict(loss="stress", stress_weight=5.0, max_steps=6, export=True)
    plain, graph = (_run(tmp_path, f"g{g}", cuda_graph=g, **kw) for g in (False, True))
    from train_fixtures import step_losses

    a, b = np.array(step_losses(plain.run_dir)), np.array(step_losses(graph.run_dir))
    assert len(a) == 6 and np.all(np.abs(a - b) <= 1e-12 * np.abs(a))
    models = [torch.load(r.run_dir / "model.model", weights_only=False) for r in (plain, graph)]
    assert [type(m).__name__ for m in models[0].modules()] == [type(m).__name__ for m in models[1].modules()]
    assert not refused_globals(graph.run_dir / "model.model")
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-13)


@contextlib.contextmanager
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _labelled_batch():
    from test_losses import _batch

    return _batch(stress_everywhere=True)[0]


def _session(model, loss: str = "weighted", stress: float = 0.0, virials: float = 0.0, ema_decay: float = 0.9):
    from torch_ema import ExponentialMovingAverage

    from workbench.train.config import TrainConfig
    from workbench.train.losses import build_loss, outputs_needed

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True, fused=True)
    optimizer.found_inf = torch.zeros((), dtype=torch.float32)  # as fused Adam reads it
    return types.SimpleNamespace(
        model=model,
        optimizer=optimizer,
        ema=ExponentialMovingAverage(model.parameters(), decay=ema_decay),
        loss_fn=build_loss(TrainConfig(loss=loss, stress_weight=stress, virials_weight=virials)),
        outputs=dict(zip(("compute_stress", "compute_virials"), outputs_needed(loss, stress, virials))),
        config=types.SimpleNamespace(clip_grad=10.0),
    )


def test_a_non_finite_step_leaves_weights_moments_and_averages_as_they_were():
    from kernel_fixtures import build_model
    from test_losses import _batch

    from workbench.kernels.compiling import capture_ready
    from workbench.train.graph_step import device_step

    with _float64():
        model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=1)
        capture_ready(model, "numba")
        s = _session(model)
        batch, _ = _batch(stress_everywhere=False)
        rate = torch.tensor(0.1)
        assert bool(device_step(s, batch, rate)["finite"])  # a finite step: moments and averages exist
        before = [t.clone() for t in (*model.parameters(), *s.ema.shadow_params)]
        state = [t.clone() for st in s.optimizer.state.values() for t in st.values()]
        batch.energy[1] = float("nan")
        out = device_step(s, batch, rate)
        assert not bool(out["finite"]) and not torch.isfinite(out["loss"])
        after = [*model.parameters(), *s.ema.shadow_params]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert all(
            torch.equal(x, y) for x, y in zip(state, [t for st in s.optimizer.state.values() for t in st.values()])
        )
        batch.energy[1] = 0.5
        assert bool(device_step(s, batch, rate)["finite"])
        assert not torch.equal(before[0], next(model.parameters()))  # the next finite step updates again


def test_on_nonfinite_skip_works_through_the_graph_step(tmp_path):
    from workbench.train.loop import NonFiniteStep, train
    from workbench.train.rundir import RunDir, read_jsonl

    cfg = _config(tmp_path, "diverge", lr=1e9, clip_grad=None, cuda_graph=True, on_nonfinite="skip", checkpoint_every=1)
    with (
        pytest.warns(UserWarning, match=r"non-finite loss .*; step skipped \(on_nonfinite=skip\)"),
        pytest.raises(NonFiniteStep, match=r"of the 4 steps of this run .* skipped"),
    ):
        train(cfg, resume=False)
    run = RunDir(cfg.run_dir)
    assert next(r["skipped"] for r in read_jsonl(run.step_log(0))) is False
    weights = torch.load(run.checkpoint, weights_only=False)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"fixed_shapes": False}, "set fixed_shapes: true too"),
        ({"backend": "e3nn"}, "backend 'e3nn' runs TorchScript .* choose one of numba, torch"),
    ],
)
def test_the_config_refuses_what_a_capture_cannot_take(kw, match):
    from workbench.train.config import TrainConfig
    from workbench.train.values import ConfigError

    with pytest.raises(ConfigError, match=f"TrainConfig.cuda_graph: .*{match}"):
        TrainConfig(**{"cuda_graph": True, "fixed_shapes": True, "backend": "numba", **kw})


def test_several_ranks_are_refused_by_name():
    from workbench.train.build import _prepare_capture
    from workbench.train.config import TrainConfig
    from workbench.train.values import ConfigError

    s = types.SimpleNamespace(world=2, config=TrainConfig(cuda_graph=True, fixed_shapes=True, backend="numba"))
    with pytest.raises(ConfigError, match="this run has 2 ranks"):
        _prepare_capture(s)


def test_bench_train_times_the_graph_step_as_a_variant(tmp_path):
    """``workbench bench train``'s graph variant: the same epoch as the fixed-shape one."""
    from workbench.bench.train import bench_train

    cfg = _config(tmp_path, "bench", max_steps=None)
    res = bench_train(
        cfg, structures=40, variants=["packer-numba-fixed", "packer-numba-graph"], warmup_steps=1, out=None
    )
    fixed, graph = res["variants"]["packer-numba-fixed"], res["variants"]["packer-numba-graph"]
    assert fixed["steps"] == graph["steps"] >= 2 and fixed["atoms"] == graph["atoms"]
    assert graph["final_loss"] == pytest.approx(fixed["final_loss"], rel=1e-12)


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on the CPU: replay runs the step again on the
    captured inputs and writes the results into the captured outputs, as a replay does."""

    def __init__(self, fn, inputs, out):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self):
        for k, v in self.fn(self.inputs).items():
            self.out[k].copy_(v)


class _CpuShapeGraphs:
    """:class:`ShapeGraphs` with the CUDA calls (side stream, capture) replaced by CPU runs, so
    that its own logic, the warm-up, one capture per key and the copy into the captured inputs,
    runs here."""

    @staticmethod
    def make(fn, warmup: int):
        from workbench.train.graph_step import ShapeGraphs

        class CpuShapeGraphs(ShapeGraphs):
            def _eager_on_side_stream(self, inputs):
                return self.fn(inputs)

            def _capture(self, key, inputs):
                out = {k: v.clone() for k, v in self.fn(inputs).items()}
                self.graphs[key] = (_ReplayByRerun(self.fn, inputs, out), inputs, out)
                self.captures += 1
                return out

        return CpuShapeGraphs(fn, torch.device("cuda"), warmup)  # a device name only: nothing runs there


def test_replays_copy_each_batch_into_the_captured_inputs():
    """Warm-up, capture, then replays on new batches of the same shape: the losses of an eager
    run of the same steps, to 1e-12; one capture; the captured inputs hold the last batch."""
    import copy

    from kernel_fixtures import build_model
    from test_padding import _padded

    from workbench.kernels.compiling import capture_ready
    from workbench.train.graph_step import batch_key, device_step

    with _float64():
        model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=1)
        capture_ready(model, "numba")
        sessions = [_session(model), _session(copy.deepcopy(model))]
        base, _ = _padded(_labelled_batch())
        batches = []
        for k in range(5):
            b = copy.deepcopy(base)
            b.positions = b.positions + 0.01 * k * torch.randn_like(b.positions)
            batches.append(b)
        rate = torch.tensor(0.1)
        runner = _CpuShapeGraphs.make(lambda b: device_step(sessions[0], b, rate), warmup=2)
        got = [float(runner(copy.deepcopy(b), batch_key(b))["loss"]) for b in batches]
        want = [float(device_step(sessions[1], b, rate)["loss"]) for b in batches]
    assert runner.captures == 1 and len(set(want)) == 5
    assert np.allclose(got, want, rtol=1e-12, atol=0)
    ((_, static, _),) = runner.graphs.values()
    assert torch.equal(static.positions, batches[-1].positions)


def test_a_run_resumed_with_cuda_graph_keeps_fused_adam(tmp_path):
    """A checkpoint written without cuda_graph resumes with it on: the run's fused Adam (which
    reads found_inf) is kept, not the checkpoint's plain one, and it trains on as the run
    resumed without graphs does."""
    from train_fixtures import step_losses

    from workbench.train.loop import train

    first = _config(tmp_path, "resumed", max_steps=2, checkpoint_every=1)
    train(first, resume=False)
    import shutil

    shutil.copytree(first.run_dir, tmp_path / "plain")
    graph = train(first.replace(max_steps=4, cuda_graph=True), resume=True)
    plain = train(first.replace(max_steps=4, output_dir=str(tmp_path), name="plain"), resume=True)
    a, b = np.array(step_losses(plain.run_dir)), np.array(step_losses(graph.run_dir))
    assert len(a) == len(b) == 4 and np.all(np.abs(a - b) <= 1e-12 * np.abs(a))
