"""e3nn's ``o3.Linear`` as one product per irrep dimension or one dense product
(:mod:`workbench.kernels.e3nn.linear`), each form: e3nn's values and gradients (float64 to
rounding, float32 against float64), gradcheck and gradgradcheck, irreps out of order, outputs no
input reaches; which form runs at how many rows; the linears it refuses, and the swap in place
and back with the state dict kept."""

import copy
import pickle

import pytest
import torch
from e3nn import o3
from kernel_fixtures import random_features, rel_max, swapped_copy, weight_as_input
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import linear as e3nn_linear
from workbench.kernels.e3nn.linear import SWAP

CASES = {
    "nequip-tutorial": ("32x0e+32x1o+16x1e", "48x0e+16x1o+16x1e"),
    "scalars-only": ("16x0e", "8x0e"),
    "mixed-order": ("4x1o+3x0e+2x1o+5x2e", "3x1o+2x0e+4x2e+2x0o"),  # 2x0o: no input reaches it
    "parity-twins": ("5x0e+3x1o+2x1e+2x2o", "4x1e+2x0e+3x1o+1x2o"),
    # MACE's message -> node features: each irrep repeated, the repeats apart
    "mace-message": ("4x0e+3x1o+4x2e+2x3o+3x0e+4x1o+2x2e+4x3o+2x1o+3x2e", "5x0e+4x1o+3x2e+2x3o"),
}


@pytest.fixture(params=["per-dimension", "dense"])
def form(request, monkeypatch):
    """Runs the test with every call on one form (the threshold at 0 or above any size)."""
    monkeypatch.setattr(e3nn_linear, "DENSE_MAX_MACS", -1 if request.param == "per-dimension" else 1 << 62)
    return request.param


def _swapped(irreps_in: str, irreps_out: str, dtype=torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(len(irreps_in) + len(irreps_out))
    lin = o3.Linear(irreps_in, irreps_out).to(dtype)
    return lin, swapped_copy(lin, SWAP)


def _x(lin, shape=(6, 2), dtype=torch.float64, seed=0) -> torch.Tensor:
    return random_features(lin, shape, dtype, seed)


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_e3nn_in_float64(case, form):
    lin, ours = _swapped(*CASES[case])
    assert isinstance(ours, e3nn_linear.WorkbenchLinear)
    x = _x(lin)
    for m in (lin, ours):
        y = m(x)
        (dx,) = torch.autograd.grad((y * torch.cos(y)).sum(), x, create_graph=True)
        m.result = [y, dx, *torch.autograd.grad(dx.pow(2).sum(), [x, m.weight])]
    assert lin.result[0].shape == ours.result[0].shape == (6, 2, lin.irreps_out.dim)
    for i, (a, b) in enumerate(zip(ours.result, lin.result)):
        assert rel_max(a, b) <= 1e-12, i


def test_gradcheck_and_gradgradcheck(form):
    lin, ours = _swapped(*CASES["mixed-order"])
    x = _x(lin, (3,))
    assert gradcheck(ours, (x,)) and gradgradcheck(ours, (x,))
    with_weight, weight = weight_as_input(ours)
    assert gradcheck(with_weight, (x, weight)) and gradgradcheck(with_weight, (x, weight))


def test_float32_against_float64(form):
    lin64, ours64 = _swapped(*CASES["nequip-tutorial"])
    ours32 = copy.deepcopy(ours64).float()
    x = _x(lin64, (40,))
    assert rel_max(ours32(x.detach().float()), lin64(x)) <= 1e-5


def test_the_dense_form_runs_up_to_the_threshold(monkeypatch):
    lin, ours = _swapped(*CASES["nequip-tutorial"])
    calls = []
    for name in ("apply_dense", "apply_plan"):
        real = getattr(e3nn_linear, name)
        monkeypatch.setattr(e3nn_linear, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    per_row = lin.irreps_in.dim * lin.irreps_out.dim
    monkeypatch.setattr(e3nn_linear, "DENSE_MAX_MACS", 10 * per_row)
    for rows in (10, 11, 3):
        x = _x(lin, (rows,))
        assert rel_max(ours(x), lin(x)) <= 1e-12
    assert calls == ["apply_dense", "apply_plan", "apply_dense"]


def test_refused_linears_stay_e3nns():
    biased = o3.Linear("4x0e+2x1o", "3x0e", biases=True)
    external = o3.Linear("4x0e", "3x0e", internal_weights=False, shared_weights=False)
    for lin in (biased, external):
        with pytest.raises(ValueError, match="internal, shared weights without biases"):
            SWAP.check(lin)
    repeated = o3.Linear("2x0e", "2x0e", instructions=[(0, 0), (0, 0)])  # weights summed on one block
    with pytest.raises(ValueError, match="repeated"):
        SWAP.check(repeated)


def test_explicit_weights_take_e3nns_path_and_the_swap_goes_back():
    lin, ours = _swapped(*CASES["parity-twins"])
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    x, w = _x(lin, (4,)), torch.randn(lin.weight_numel, dtype=torch.float64)
    assert rel_max(ours(x, w), lin(x, w)) <= 1e-12
    ours(x)  # builds the plan
    again = pickle.loads(pickle.dumps(ours))
    assert "_wb_op" not in again.__dict__ and rel_max(again(x), lin(x)) <= 1e-12
    SWAP.unswap(ours)
    assert type(ours) is o3.Linear and "_wb_op" not in ours.__dict__
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())
