"""e3nn's ``o3.Linear`` with frozen weights (:mod:`workbench.kernels.e3nn.linear_inference`), the
form MD runs: e3nn's values and input derivatives of first and second order in float64, gradcheck
and gradgradcheck, float32 against float64, strided inputs, outputs no input reaches and inputs
no output uses; unfreezing the weights goes back to the differentiable form."""

import copy

import pytest
import torch
from e3nn import o3
from kernel_fixtures import random_features, rel_max, swapped_copy
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import linear as e3nn_linear
from workbench.kernels.e3nn import linear_inference
from workbench.kernels.e3nn.linear import SWAP

CASES = {
    "nequip-tutorial": ("32x0e+32x1o+16x1e", "48x0e+16x1o+16x1e"),
    "mixed-order": ("4x1o+3x0e+2x1o+5x2e+2x3o", "3x1o+2x0e+4x2e+2x0o"),  # 2x0o: no input; 2x3o: unused
    "parity-twins": ("5x0e+3x1o+2x1e+2x2o", "4x1e+2x0e+3x1o+1x2o"),
    "mace-message": ("4x0e+3x1o+4x2e+2x3o+3x0e+4x1o+2x2e+4x3o+2x1o+3x2e", "5x0e+4x1o+3x2e+2x3o"),
}


@pytest.fixture
def calls(monkeypatch):
    """Every call to ``apply_frozen``, each linear forced onto the per-dimension plan."""
    monkeypatch.setattr(e3nn_linear, "DENSE_MAX_MACS", -1)
    seen = []
    real = linear_inference.apply_frozen
    monkeypatch.setattr(linear_inference, "apply_frozen", lambda *a: seen.append(tuple(a[0].shape)) or real(*a))
    return seen


def _frozen(case: str, dtype=torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(len(case))
    lin = o3.Linear(*CASES[case]).to(dtype)
    lin.weight.data.normal_()  # e3nn's initial weights are random already; a fresh draw per case
    ours = swapped_copy(lin, SWAP)
    for m in (lin, ours):
        m.requires_grad_(False)
    return lin, ours


@pytest.mark.parametrize("case", CASES)
def test_values_and_input_derivatives_match_e3nn_in_float64(case, calls):
    lin, ours = _frozen(case)
    x = random_features(lin, (7, 3), seed=len(case))
    results = []
    for m in (lin, ours):
        y = m(x)
        (dx,) = torch.autograd.grad((y * torch.cos(y)).sum(), x, create_graph=True)
        results.append([y, dx, *torch.autograd.grad(dx.pow(2).sum(), x)])
    assert calls == [(21, lin.irreps_in.dim)]
    assert results[1][0].shape == (7, 3, lin.irreps_out.dim)
    for i, (a, b) in enumerate(zip(*reversed(results))):
        assert rel_max(a, b) <= 1e-12, i


def test_gradcheck_and_gradgradcheck(calls):
    lin, ours = _frozen("mixed-order")
    x = random_features(lin, (3,), seed=1)
    assert gradcheck(ours, (x,)) and gradgradcheck(ours, (x,))
    assert calls


def test_unused_inputs_get_zero_gradient_and_unreached_outputs_are_zero(calls):
    lin, ours = _frozen("mixed-order")
    x = random_features(lin, (5,), seed=2)
    y = ours(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    unused = slice(lin.irreps_in.dim - 6, lin.irreps_in.dim)  # the trailing 2x3o
    unreached = slice(lin.irreps_out.dim - 2, lin.irreps_out.dim)  # the trailing 2x0o
    assert torch.equal(dx[:, unused], torch.zeros_like(dx[:, unused]))
    assert torch.equal(y[:, unreached], torch.zeros_like(y[:, unreached]))
    (dx_e3nn,) = torch.autograd.grad(lin(x).sum(), x)
    assert rel_max(dx, dx_e3nn) <= 1e-12


def test_strided_input_matches_a_contiguous_one(calls):
    lin, ours = _frozen("mace-message")
    wide = torch.randn(lin.irreps_in.dim, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = wide.t()[2:8]  # a transposed view: column stride 9
    assert x.stride(-1) != 1
    assert rel_max(ours(x), lin(x.contiguous())) <= 1e-12


def test_float32_against_float64(calls):
    lin64, ours64 = _frozen("mace-message")
    ours32 = copy.deepcopy(ours64).float()
    x = random_features(lin64, (40,), seed=4)
    y32 = ours32(x.detach().float().requires_grad_())
    assert rel_max(y32, lin64(x)) <= 1e-5


def test_batched_second_derivatives_and_forward_mode_as_mace_hessians_take_them(calls):
    """mace's Hessians vmap the second backward (``torch.vmap`` over ``autograd.grad``); forward-mode
    derivatives go through the same map."""
    lin, ours = _frozen("mace-message")
    x = random_features(lin, (4,), seed=7)
    results = []
    for m in (lin, ours):
        y = m(x)
        (dx,) = torch.autograd.grad((y * torch.cos(y)).sum(), x, create_graph=True)
        flat = dx.reshape(-1)
        rows = torch.eye(flat.numel(), dtype=torch.float64)[::7]
        hessian = torch.vmap(lambda v, flat=flat: torch.autograd.grad(flat, x, v, retain_graph=True)[0])(rows)
        tangent = torch.func.jvp(m, (x.detach(),), (torch.sin(x.detach()),))[1]
        results.append((hessian, tangent))
    assert rel_max(results[1][0], results[0][0]) <= 1e-12 and rel_max(results[1][1], results[0][1]) <= 1e-12


def test_traces_keep_the_differentiable_form(calls, monkeypatch):
    lin, ours = _frozen("parity-twins")
    x = random_features(lin, (4,), seed=8)
    monkeypatch.setattr(e3nn_linear, "no_sync", lambda: True)  # as under torch.compile
    assert rel_max(ours(x), lin(x)) <= 1e-12 and calls == []


def test_unfrozen_weights_take_the_differentiable_form(calls):
    lin, ours = _frozen("parity-twins")
    ours.weight.requires_grad_(True)
    x = random_features(lin, (4,), seed=5)
    ours(x).pow(2).sum().backward()
    assert calls == [] and ours.weight.grad is not None and ours.weight.grad.abs().max() > 0
