"""Full mace-torch models (and mace's symmetric contraction alone) accelerated with the numba kernels match
the e3nn originals."""

import copy
import io
import os
import subprocess
import sys

import pytest
import torch
from e3nn import o3
from kernel_fixtures import build_model, contraction_errors, energy_force_grads, random_batch, rel_err

from workbench.kernels import SymmetricContraction, accelerate
from workbench.kernels.mace.adapter import use_companions

# (class, hidden irreps, max_ell, correlation, elements)
# every correlation TrainConfig accepts (1-4); 4 was wrong (issue 47, AC03)
CONFIGS = [
    ("MACE", "8x0e+8x1o", 3, 3, 3),
    ("ScaleShiftMACE", "8x0e", 1, 1, 2),
    ("MACE", "4x0e+4x1o", 2, 2, 4),
    ("MACE", "4x0e+4x1o", 2, 4, 2),
]


def _compare(ref, acc, tol):
    (E0, F0, G0), (E1, F1, G1) = ref, acc
    errs = {"energy": rel_err(E1, E0), "forces": rel_err(F1, F0)}
    assert len(G0) == len(G1)
    if tol >= 1e-6:
        # float32 vs float64: relative to the largest parameter gradient (a per-tensor max would
        # measure float32 rounding of the smallest tensors: e3nn's own float32 model shows 5e-6)
        errs["param_grads"] = rel_err(torch.cat([g.flatten() for g in G1]), torch.cat([g.flatten() for g in G0]))
    else:
        errs["param_grads"] = max(rel_err(a, b) for a, b in zip(G1, G0) if b.abs().max() > 0)
    assert sum(int(b.abs().max() > 0) for b in G0) > len(G0) // 2  # the loss really reaches the weights
    for k, v in errs.items():
        assert v <= tol, (k, v, errs)
    return errs


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}-l{c[2]}-corr{c[3]}-z{c[4]}")
def test_accelerated_model_matches_e3nn_float64(cfg):
    model = build_model(*cfg, dtype=torch.float64)
    data = random_batch(cfg[4], dtype=torch.float64)
    ref = energy_force_grads(model, data)
    fast = accelerate(copy.deepcopy(model), backend="numba")
    n_swapped = sum(isinstance(m, SymmetricContraction) for m in fast.modules())
    assert n_swapped == 2  # both product blocks
    errs = _compare(ref, energy_force_grads(fast, data), tol=1e-10)
    print(cfg, errs)


@pytest.mark.parametrize("kind,correlation", [("interpreter", 4), ("interpreter", 5), ("generated", 4), ("fused", 4)])
def test_contraction_matches_mace_at_correlation_4_and_5(monkeypatch, kind, correlation):
    """mace's module alone against the numba one: from correlation 4 a monomial has four factors
    of ``x`` (their vector programs added shorter products in: the forward was off by 40-300%,
    at correlation 5 the gradients too). The generated and fused code run the forward only:
    their kernels of the derivatives take minutes to compile."""
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", kind)
    errs = contraction_errors(correlation, derivatives=kind == "interpreter")
    assert max(errs) <= 1e-12, errs


def test_float32_accelerated_matches_float64_original():
    cfg = CONFIGS[0]
    model = build_model(*cfg, dtype=torch.float64)
    data = random_batch(cfg[4], dtype=torch.float64)
    ref = energy_force_grads(model, data)
    fast32 = accelerate(copy.deepcopy(model).float(), backend="numba")
    data32 = {k: (v.float() if v.is_floating_point() else v) for k, v in data.items()}
    errs = _compare(ref, energy_force_grads(fast32, data32), tol=1e-5)
    print(errs)


def test_energies_under_inference_mode():
    """``torch.inference_mode()`` (energies only): its tensors keep no version counter, so the
    edge graph of one forward is not kept for the next."""
    cfg = CONFIGS[0]
    model = build_model(*cfg, dtype=torch.float64)
    fast = accelerate(copy.deepcopy(model), backend="numba")
    data = random_batch(cfg[4], dtype=torch.float64)
    with torch.inference_mode():
        ref = model({k: v.clone() for k, v in data.items()}, compute_force=False)["energy"]
        got = [fast({k: v.clone() for k, v in data.items()}, compute_force=False)["energy"] for _ in range(2)]
    assert all(rel_err(g, ref) <= 1e-10 for g in got)


def test_restore_state_dict_and_pickle():
    cfg = CONFIGS[2]
    model = build_model(*cfg, dtype=torch.float64)
    data = random_batch(cfg[4], dtype=torch.float64)
    ref = energy_force_grads(model, data)
    params_before = {id(p) for p in model.parameters()}
    sd_keys = set(model.state_dict())
    linears = [m for m in model.modules() if type(m) is o3.Linear]
    skips = [m for m in model.modules() if type(m) is o3.FullyConnectedTensorProduct]
    reshapes = [m for m in model.modules() if type(m).__name__ == "reshape_irreps"]
    accelerate(model, backend="numba")
    assert all(type(m) is o3.Linear for m in linears)  # training keeps e3nn's linears ...
    use_companions(model, "numba")
    assert linears and all(type(m).__name__ == "WorkbenchLinear" for m in linears)  # ... MD takes ours
    assert skips and all(type(m).__name__ == "WorkbenchScalarTP" for m in skips)  # the self-connections too
    assert reshapes and all(type(m).__name__ == "WorkbenchReshapeIrreps" for m in reshapes)
    assert {id(p) for p in model.parameters()} == params_before  # same Parameter objects: optimizers keep working
    assert set(model.state_dict()) == sd_keys  # state dicts load into the e3nn original and back
    # torch.save / torch.load of the accelerated model (no GPU here: runs on the CPU path)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _compare(ref, energy_force_grads(loaded, data), tol=1e-10)
    # back to mace's own module, same weights
    accelerate(model, backend="e3nn")
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    assert sum(isinstance(m, MaceSC) for m in model.modules()) == 2
    assert not any(isinstance(m, SymmetricContraction) for m in model.modules())
    assert all(type(m) is o3.Linear for m in linears)
    assert all(type(m) is o3.FullyConnectedTensorProduct for m in skips)
    assert all(type(m).__name__ == "reshape_irreps" for m in reshapes)
    _compare(ref, energy_force_grads(model, data), tol=1e-12)
    fresh = build_model(*cfg, dtype=torch.float64, seed=5)
    fresh.load_state_dict(model.state_dict())
    _compare(ref, energy_force_grads(fresh, data), tol=1e-12)


def test_accelerate_arguments():
    model = build_model(*CONFIGS[1], dtype=torch.float64)
    with pytest.raises(ValueError):
        accelerate(model, backend="triton")
    with pytest.raises(ValueError):
        accelerate(model, ops=("no_such_op",))
    assert accelerate(model, ops=("channelwise_tp",)) is model
    assert getattr(model.interactions[0], "conv_fusion", None) is not None
    try:
        import cuequivariance_torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="cuequivariance"):
            accelerate(model, backend="cueq")
    assert accelerate(model, ops=("symmetric_contraction",)) is model
    assert accelerate(model) is model  # again: already on the workbench kernels, nothing to say
    with pytest.raises(TypeError, match="Sequential: no registered model family holds it"):
        accelerate(torch.nn.Sequential(torch.nn.Linear(3, 3)))


def test_one_op_may_be_named_alone():
    """``ops="symmetric_contraction"`` is that op, not its letters (issue 47, AC23); a wrong name
    is refused with the valid ones listed."""
    from workbench.kernels.acceleration import model_ops

    model = build_model(*CONFIGS[1], dtype=torch.float64)
    assert accelerate(model, ops="symmetric_contraction") is model
    assert sum(isinstance(m, SymmetricContraction) for m in model.modules()) == 2
    assert getattr(model.interactions[0], "conv_fusion", None) is None  # the other op untouched
    n = len(model_ops(model))
    accelerate(model, ops="channelwise_tp")
    assert len(model_ops(model)) > n
    for bad in ("symmetric", ["symmetric_contraction", 3]):
        with pytest.raises(ValueError, match=r"unknown op .* valid ops: symmetric_contraction, channelwise_tp"):
            accelerate(model, ops=bad)


def test_saved_model_loads_in_a_process_without_cuda(tmp_path):
    """A fresh interpreter (no GPU, no CUDA target) loads the pickled model and runs it."""
    cfg = CONFIGS[1]
    model = accelerate(build_model(*cfg, dtype=torch.float64), backend="numba")
    path = tmp_path / "model.pt"
    torch.save(model, path)
    code = (
        f"import sys, torch; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from kernel_fixtures import random_batch\n"
        f"m = torch.load({str(path)!r}, weights_only=False)\n"
        f"out = m(random_batch({cfg[4]}), training=False, compute_force=True)\n"
        "assert torch.isfinite(out['forces']).all(); print('ok', type(m.products[0].symmetric_contractions).__name__)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok SymmetricContraction" in res.stdout


def test_a_correlation_beyond_the_proven_ones_is_refused():
    """mace builds any correlation; the kernels are checked for 1-5, so 6 stays e3nn's, by name."""
    from e3nn import o3
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    holder = torch.nn.Sequential(
        MaceSC(o3.Irreps("1x0e+1x1o"), o3.Irreps("1x0e"), correlation=6, num_elements=1).double()
    )
    with pytest.raises(
        TypeError, match="correlation 6: the workbench kernels are checked against mace for correlation 1-5"
    ):
        accelerate(holder, backend="numba")
    assert type(holder[0]) is MaceSC  # left as it was
