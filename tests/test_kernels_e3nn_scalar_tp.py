"""e3nn's ``FullyConnectedTensorProduct`` with a scalar second input, one product per path
(:mod:`workbench.kernels.e3nn.scalar_tp`): e3nn's values and gradients to every input and the
weights (float64 to rounding, float32 against float64), gradcheck and gradgradcheck, irreps out
of order and outputs no path reaches, the products it refuses, pickling and the swap in place
and back with the state dict kept."""

import copy
import pickle

import pytest
import torch
from e3nn import o3
from kernel_fixtures import rel_max, weight_as_input
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import scalar_tp as e3nn_scalar_tp
from workbench.kernels.e3nn.scalar_tp import SWAP

CASES = {  # (irreps_in1, irreps_in2, irreps_out)
    "nequip-layer1": ("16x0e+16x1o", "16x0e", "48x0e+16x1o+16x1e"),  # 1e: no path reaches it
    "nequip-layer2": ("16x0e+16x1e+16x1o", "16x0e", "16x0e"),
    "mixed-order": ("3x1o+2x0e+4x2e+2x1o", "3x0e+2x0e", "2x2e+3x1o+1x0e+2x0o"),
    "empty-irreps": ("2x0e+0x1o", "1x0e", "2x0e+1x1o+0x2e"),  # paths of no weights, outputs of no width
}


def _swapped(case: str, dtype=torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(len(case))
    tp = o3.FullyConnectedTensorProduct(*CASES[case]).to(dtype)
    ours = copy.deepcopy(tp)
    SWAP.check(ours)
    SWAP.swap(ours, "numba")
    return tp, ours


def _inputs(tp, shape=(5, 2), dtype=torch.float64, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dims = (tp.irreps_in1.dim, tp.irreps_in2.dim)
    return tuple(torch.randn(*shape, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for d in dims)


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_e3nn_in_float64(case):
    tp, ours = _swapped(case)
    assert isinstance(ours, e3nn_scalar_tp.WorkbenchScalarTP)
    x, s = _inputs(tp)
    for m in (tp, ours):
        y = m(x, s)
        dx, ds = torch.autograd.grad((y * torch.cos(y)).sum(), [x, s], create_graph=True)
        m.result = [y, dx, ds, *torch.autograd.grad(dx.pow(2).sum() + ds.sin().sum(), [x, s, m.weight])]
    assert tp.result[0].shape == ours.result[0].shape == (5, 2, tp.irreps_out.dim)
    for i, (a, b) in enumerate(zip(ours.result, tp.result)):
        assert rel_max(a, b) <= 1e-12, i


def test_gradcheck_and_gradgradcheck():
    tp, ours = _swapped("mixed-order")
    x, s = _inputs(tp, (3,))
    assert gradcheck(ours, (x, s)) and gradgradcheck(ours, (x, s))
    with_weight, weight = weight_as_input(ours)
    assert gradcheck(with_weight, (x, s, weight)) and gradgradcheck(with_weight, (x, s, weight))


def test_float32_against_float64():
    tp64, _ = _swapped("nequip-layer1")
    ours32 = copy.deepcopy(tp64).float()
    SWAP.swap(ours32, "numba")
    x, s = _inputs(tp64, (40,))
    assert rel_max(ours32(x.detach().float(), s.detach().float()), tp64(x, s)) <= 1e-5


@pytest.mark.parametrize(
    "args, why",
    [
        (("4x0e+2x1o", "3x0e+1x1o", "4x0e+2x1o"), "not even scalars"),
        (("4x0e+2x1o", "3x0o", "4x0o+2x1e"), "not even scalars"),
    ],
)
def test_products_of_another_form_are_refused(args, why):
    with pytest.raises(ValueError, match=why):
        SWAP.check(o3.FullyConnectedTensorProduct(*args))
    external = o3.FullyConnectedTensorProduct("4x0e", "3x0e", "2x0e", internal_weights=False, shared_weights=False)
    with pytest.raises(ValueError, match="internal, shared"):
        SWAP.check(external)


def test_explicit_weights_pickles_and_the_swap_goes_back():
    tp, ours = _swapped("nequip-layer1")
    before = {k: v.clone() for k, v in tp.state_dict().items()}
    x, s = _inputs(tp, (4,))
    w = torch.randn(tp.weight_numel, dtype=torch.float64)
    assert rel_max(ours(x, s, w), tp(x, s, w)) <= 1e-12
    assert rel_max(ours(x, s[:1]), tp(x, s[:1])) <= 1e-12  # broadcast second input: e3nn's path
    ours(x, s)  # builds the plan
    again = pickle.loads(pickle.dumps(ours))
    assert "_wb_op" not in again.__dict__ and rel_max(again(x, s), tp(x, s)) <= 1e-12
    SWAP.unswap(ours)
    assert type(ours) is o3.FullyConnectedTensorProduct and "_wb_op" not in ours.__dict__
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())
