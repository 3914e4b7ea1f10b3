"""e3nn's ``nn.Gate`` as column gathers and one product (:mod:`workbench.kernels.e3nn.gate`):
e3nn's values and three derivative orders (float64 to rounding, float32 against float64),
gradcheck and gradgradcheck, gated irreps out of e3nn's sorted order, odd scalars, a gate with
nothing gated, the plan read off e3nn's modules, a product it refuses, pickling and the swap in
place and back."""

import pickle

import pytest
import torch
from e3nn import nn, o3
from kernel_fixtures import random_features, rel_max, swapped_copy
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import gate as e3nn_gate
from workbench.kernels.e3nn.gate import SWAP

silu, tanh = torch.nn.functional.silu, torch.tanh
CASES = {  # (irreps_scalars, act_scalars, irreps_gates, act_gates, irreps_gated)
    "nequip-layer1": ("16x0e", [silu], "32x0e", [silu], "16x1e+16x1o"),  # gated unsorted: 1e before 1o
    "odd-scalars": ("3x0e+2x0o", [silu, tanh], "2x0e+3x0e", [torch.sigmoid, silu], "2x1o+3x2e"),
    "scalars-only": ("5x0e", [silu], "", [], ""),
    "interleaved": ("2x0e", [silu], "1x0e+2x0e", [tanh, silu], "1x2o+2x1o"),
}


def _gates(case: str, dtype=torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    scalars, act_s, gates, act_g, gated = CASES[case]
    gate = nn.Gate(scalars, act_s, gates, act_g, gated).to(dtype)
    return gate, swapped_copy(gate, SWAP)


def _x(gate, shape=(5, 2), dtype=torch.float64, seed=0) -> torch.Tensor:
    return random_features(gate, shape, dtype, seed)


@pytest.mark.parametrize("case", CASES)
def test_values_and_three_derivative_orders_match_e3nn_in_float64(case):
    gate, ours = _gates(case)
    assert isinstance(ours, e3nn_gate.WorkbenchGate)
    x = _x(gate)
    for m in (gate, ours):
        y = m(x)
        (dx,) = torch.autograd.grad((y * torch.cos(y)).sum(), x, create_graph=True)
        (ddx,) = torch.autograd.grad(dx.pow(2).sum(), x, create_graph=True)
        m.result = [y, dx, ddx, *torch.autograd.grad(ddx.sin().sum(), x)]
    assert gate.result[0].shape == ours.result[0].shape == (5, 2, gate.irreps_out.dim)
    for i, (a, b) in enumerate(zip(ours.result, gate.result)):
        assert rel_max(a, b) <= 1e-12, i


def test_gradcheck_and_gradgradcheck():
    _, ours = _gates("odd-scalars")
    x = _x(ours, (3,))
    assert gradcheck(ours, (x,)) and gradgradcheck(ours, (x,))


def test_float32_against_float64():
    gate64, _ = _gates("nequip-layer1")
    _, ours32 = _gates("nequip-layer1", torch.float32)
    x = _x(gate64, (40,))
    assert rel_max(ours32(x.detach().float()), gate64(x)) <= 1e-5


def test_the_plan_follows_e3nns_columns():
    gate, _ = _gates("nequip-layer1")
    plan = e3nn_gate.gate_plan(gate, torch.device("cpu"))
    # input sorted by e3nn: 48x0e (16 scalars, 32 gates), 16x1o (48:96), 16x1e (96:144); output gated 1e first
    assert plan.scalars == slice(0, 16) and plan.gates == slice(16, 48) and plan.coef is None
    assert plan.gated.tolist() == list(range(96, 144)) + list(range(48, 96))
    assert plan.gate_of.tolist() == [k for k in range(32) for _ in range(3)]


def test_a_product_of_another_form_is_refused():
    gate, _ = _gates("interleaved")

    class SumOfGates(torch.nn.Module):  # every column scaled by all gates: not one gate per column
        def forward(self, gated, gates):
            return gated * gates.sum(-1, keepdim=True)

    gate.mul = SumOfGates()
    with pytest.raises(ValueError, match="not one gate times one column"):
        SWAP.check(gate)


def test_pickles_and_the_swap_goes_back():
    gate, ours = _gates("interleaved")
    x = _x(gate, (4,))
    ours(x)  # builds the plan
    again = pickle.loads(pickle.dumps(ours))
    assert "_wb_op" not in again.__dict__ and rel_max(again(x), gate(x)) <= 1e-12
    SWAP.unswap(ours)
    assert type(ours) is nn.Gate and "_wb_op" not in ours.__dict__
    assert rel_max(ours(x), gate(x)) == 0.0


def test_user_hooks_stay_and_never_fire_on_the_plans_probes():
    gate, ours = _gates("nequip-layer1")
    fired: list[str] = []
    for name, m in ours.named_modules():
        if not isinstance(m, torch.jit.ScriptModule):
            m.register_forward_hook(lambda m, i, o, name=name: fired.append(name))
    x = _x(gate, (4,))
    assert rel_max(ours(x), gate(x)) <= 1e-12  # builds the plan on a probe copy
    assert fired == ["act_scalars.acts.0", "act_scalars", "act_gates.acts.0", "act_gates", ""]


def test_odd_gated_irreps_keep_parity_under_inversion():
    _, ours = _gates("odd-scalars")
    x = _x(ours, (6,)).detach()
    parity = ours.irreps_in.D_from_angles(*[torch.zeros((), dtype=torch.float64)] * 3, torch.tensor(1))
    parity_out = ours.irreps_out.D_from_angles(*[torch.zeros((), dtype=torch.float64)] * 3, torch.tensor(1))
    assert rel_max(ours(x @ parity.T), ours(x) @ parity_out.T) <= 1e-12
    assert o3.Irreps(ours.irreps_out) == o3.Irreps("3x0e+2x0o+2x1o+3x2e")
