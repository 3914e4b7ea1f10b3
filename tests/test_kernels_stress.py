"""Stress through the kernels: the stress differentiates the energy through mace's symmetric
displacement, and a stress loss's parameter gradients take one more derivative. Energies, forces,
stress and every parameter gradient of an energy+force+stress loss match mace's e3nn model to
1e-10 in float64, on the CPU kernels and on the CUDA kernels under numba's simulator; float32
against float64 to 1e-5."""

import copy

import pytest
import torch
from kernel_fixtures import build_model, periodic_batch, rel_err, run_under_simulator, stress_grads

from workbench.kernels import accelerate

# (class, hidden irreps, max_ell, correlation, elements)
CONFIGS = [("ScaleShiftMACE", "8x0e+8x1o", 2, 3, 2), ("MACE", "4x0e+4x1o+4x2e", 3, 2, 3), ("MACE", "8x0e", 1, 1, 1)]


def _errors(ref, got, float32: bool = False) -> dict:
    errs = {name: rel_err(a, b) for name, a, b in zip(("energy", "forces", "stress"), got[:3], ref[:3])}
    if float32:  # against the largest gradient: float32 rounding of the smallest tensors is not the kernels'
        errs["param_grads"] = rel_err(
            torch.cat([g.flatten() for g in got[3]]), torch.cat([g.flatten() for g in ref[3]])
        )
    else:
        errs["param_grads"] = max(rel_err(a, b) for a, b in zip(got[3], ref[3]) if b.abs().max() > 0)
    return errs


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}-l{c[2]}-corr{c[3]}-z{c[4]}")
def test_stress_and_its_loss_gradients_match_e3nn_float64(cfg):
    model = build_model(*cfg, dtype=torch.float64)
    data = periodic_batch(cfg[4])
    ref = stress_grads(model, data)
    assert ref[2].abs().max() > 1e-6 and sum(int(g.abs().max() > 0) for g in ref[3]) > len(ref[3]) // 2
    errs = _errors(ref, stress_grads(accelerate(copy.deepcopy(model), backend="numba"), data))
    assert max(errs.values()) <= 1e-10, errs


def test_float32_stress_matches_float64_e3nn():
    cfg = CONFIGS[0]
    model = build_model(*cfg, dtype=torch.float64)
    data = periodic_batch(cfg[4])
    ref = stress_grads(model, data)
    data32 = {k: (v.float() if v.is_floating_point() else v) for k, v in data.items()}
    errs = _errors(ref, stress_grads(accelerate(copy.deepcopy(model).float(), backend="numba"), data32), True)
    assert max(errs.values()) <= 1e-5, errs


SCRIPT = r"""
import copy, json, sys, torch
sys.path.insert(0, {tests!r})
from kernel_fixtures import build_model, periodic_batch, rel_err, stress_grads
from workbench.kernels import accelerate
from workbench.kernels.numba.gpu import atom as kc
assert kc.cudasim_enabled() and kc.cuda_available()
errs = {{}}
cfg = ("ScaleShiftMACE", "2x0e+2x1o", 2, 2, 2)
m = build_model(*cfg)
d = periodic_batch(cfg[4])
ref = stress_grads(m, d)
got = stress_grads(accelerate(copy.deepcopy(m)), d)
errs["float64"] = [rel_err(a, b) for a, b in zip(got[:3], ref[:3])] + [
    max(rel_err(a, b) for a, b in zip(got[3], ref[3]) if b.abs().max() > 0)]
"""


def test_stress_under_the_cuda_simulator():
    # the unrolled kernels (the default kind); stress adds no op of its own, the table kernels run the same ops
    errs = run_under_simulator(SCRIPT, "unrolled")
    assert max(errs["float64"]) <= 1e-10, errs
