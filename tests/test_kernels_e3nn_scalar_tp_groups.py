"""The self-connection by groups of equal scalar rows (:mod:`workbench.kernels.e3nn.scalar_tp_groups`),
what an ``eval()`` model runs when its scalars are a species embedding: e3nn's values and the
gradients of x, the scalars (per row, not per group) and the weights without a graph, every
order with one, gradcheck and gradgradcheck, float32 against float64, one group and several,
the groups found (NaN, too many, in place changes) and training mode on the outer product."""

import copy

import pytest
import torch
from e3nn import o3
from kernel_fixtures import rel_max, weight_as_input
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import scalar_tp_groups as groups_mod
from workbench.kernels.e3nn.scalar_tp import SWAP

CASES = {  # (irreps_in1, irreps_in2, irreps_out)
    "nequip-layer1": ("16x0e+16x1o", "16x0e", "48x0e+16x1o+16x1e"),
    "nequip-layer2": ("16x0e+16x1e+16x1o", "16x0e", "16x0e"),
    # two scalar blocks (paths share input and output blocks), an input no path reads (2o, between
    # two that are read) and an output no path writes (2e)
    "two-scalar-blocks": ("4x0e+2x2o+3x1o", "6x0e+5x0e", "5x0e+4x1o+2x2e"),
}


def _swapped(case: str, dtype=torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(len(case))
    tp = o3.FullyConnectedTensorProduct(*CASES[case]).to(dtype)
    with torch.no_grad():
        tp.weight.normal_()  # fresh weights, not e3nn's initial ones
    ours = copy.deepcopy(tp)
    SWAP.swap(ours, "numba")
    return tp, ours.eval()


def _inputs(tp, n: int, species: int, dtype=torch.float64, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[n, dim_in1]`` and scalars with ``species`` distinct rows (an embedding's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, tp.irreps_in1.dim, generator=g, dtype=torch.float64)
    table = torch.randn(species, tp.irreps_in2.dim, generator=g, dtype=torch.float64)
    s = table[torch.arange(n) % species]
    return x.to(dtype).requires_grad_(), s.to(dtype).requires_grad_()


def _calls(monkeypatch) -> list:
    seen: list = []
    real = groups_mod.GroupedScalarTP.forward

    def spy(ctx, plan, groups, *rest):
        seen.append(groups.size)
        return real(ctx, plan, groups, *rest)

    monkeypatch.setattr(groups_mod.GroupedScalarTP, "forward", staticmethod(spy))
    return seen


@pytest.mark.parametrize(
    "case, species", [("nequip-layer1", 1), ("nequip-layer1", 2), ("nequip-layer2", 3), ("two-scalar-blocks", 2)]
)
def test_values_and_first_derivatives_without_a_graph_match_e3nn(case, species, monkeypatch):
    seen = _calls(monkeypatch)
    tp, ours = _swapped(case)
    x, s = _inputs(tp, 12, species)
    v = torch.randn(12, tp.irreps_out.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for m in (tp, ours):
        y = m(x, s)
        m.result = [y, *torch.autograd.grad((y * v).sum(), [x, s, m.weight])]
    assert seen == [species]
    for i, (a, b) in enumerate(zip(ours.result, tp.result)):
        assert rel_max(a, b) <= 1e-12, i  # the scalars' gradient is each row's own


@pytest.mark.parametrize("case", CASES)
def test_every_order_with_a_graph_matches_e3nn(case, monkeypatch):
    seen = _calls(monkeypatch)
    tp, ours = _swapped(case)
    x, s = _inputs(tp, 9, 2)
    for m in (tp, ours):
        y = m(x, s)
        dx, ds = torch.autograd.grad((y * torch.cos(y)).sum(), [x, s], create_graph=True)
        m.result = [y, dx, ds, *torch.autograd.grad(dx.pow(2).sum() + ds.sin().sum(), [x, s, m.weight])]
    assert seen == [2]
    for i, (a, b) in enumerate(zip(ours.result, tp.result)):
        assert rel_max(a, b) <= 1e-12, i


def test_gradcheck_and_gradgradcheck(monkeypatch):
    seen = _calls(monkeypatch)
    _, ours = _swapped("two-scalar-blocks")
    x, s = _inputs(ours, 4, 2)
    with_weight, weight = weight_as_input(ours)
    assert gradcheck(with_weight, (x, s, weight)) and gradgradcheck(with_weight, (x, s, weight))
    assert 2 in seen  # the analytical side ran by groups (the numerical one perturbs rows apart)


def test_float32_against_float64():
    tp, ours64 = _swapped("nequip-layer1")
    ours32 = copy.deepcopy(ours64).float()
    x, s = _inputs(tp, 40, 2)
    assert rel_max(ours32(x.detach().float(), s.detach().float()), tp(x, s)) <= 1e-5


def test_groups_are_exact_rows_and_follow_in_place_changes():
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    g = groups_mod.row_groups(s)
    assert g.inverse.tolist() == [g.inverse[0].item(), g.inverse[1].item()] * 2 + [g.inverse[4].item()]
    assert len(set(g.inverse.tolist())) == 3 and sorted(g.first.tolist()) == [0, 1, 4]
    assert torch.equal(s[g.first][g.inverse], s)
    assert groups_mod.shared_row_groups(s, 2) is None  # more groups than asked for
    assert groups_mod.row_groups(torch.tensor([[float("nan"), 1.0], [float("nan"), 1.0]])) is None
    assert groups_mod.row_groups(s[:0]) is None
    first = groups_mod.shared_row_groups(s, 3)
    assert groups_mod.shared_row_groups(s, 16) is first  # the next layer's call, another limit
    s.data[2] = torch.tensor([7.0, 8.0])  # through .data: the version stays, the rows are checked again
    assert groups_mod.shared_row_groups(s, 3) is None  # four groups now
    s[2], s[4] = s[0], s[0]  # in place: found again
    again = groups_mod.shared_row_groups(s, 3)
    assert again is not first and again.size == 2


def test_training_mode_and_many_species_run_the_outer_product(monkeypatch):
    seen = _calls(monkeypatch)
    tp, ours = _swapped("nequip-layer2")
    x, s = _inputs(tp, 40, 2)
    assert rel_max(ours.train()(x, s), tp(x, s)) <= 1e-12
    x, s = _inputs(tp, 40, 17)  # more species than the grouped form is worth
    assert rel_max(ours.eval()(x, s), tp(x, s)) <= 1e-12
    assert seen == []


def test_inference_mode_tensors_are_grouped_without_the_cache(monkeypatch):
    seen = _calls(monkeypatch)
    tp, ours = _swapped("nequip-layer1")
    x, s = _inputs(tp, 12, 2)
    with torch.inference_mode():  # no version counter: nothing is kept about these tensors
        xi, si = x.detach().clone(), s.detach().clone()
        assert rel_max(ours(xi, si), tp(xi, si)) <= 1e-12 and rel_max(ours(xi, si), tp(xi, si)) <= 1e-12
    assert seen == [2, 2]


def test_one_hot_species_gather_only_their_weights(monkeypatch):
    """MACE's self-connection: node features times a one-hot of the 20 elements (89 in MACE-MP-0),
    3 of them present. The groups' matrices are built from the weights of those 3 elements only
    (no gather of the whole weight), with e3nn's values and the gradients of the features and the
    weights; a dense set of scalars takes every weight."""
    seen = _calls(monkeypatch)
    gathered = []
    real = groups_mod.WeightMap.matrix
    monkeypatch.setattr(groups_mod.WeightMap, "matrix", lambda self, w: gathered.append(w.shape) or real(self, w))
    torch.manual_seed(4)
    tp = o3.FullyConnectedTensorProduct("8x0e+8x1o", "20x0e", "8x0e+8x1o").double()
    with torch.no_grad():
        tp.weight.normal_()
    ours = copy.deepcopy(tp)
    SWAP.swap(ours, "numba")
    ours.eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, tp.irreps_in1.dim, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.nn.functional.one_hot(torch.tensor([3, 11, 17])[torch.arange(30) % 3], 20).double()
    v = torch.randn(30, tp.irreps_out.dim, generator=g, dtype=torch.float64)
    for m in (tp, ours):
        y = m(x, s)
        m.result = [y, *torch.autograd.grad((y * v).sum(), [x, m.weight])]
    assert seen == [3] and gathered == []
    for i, (a, b) in enumerate(zip(ours.result, tp.result)):
        assert rel_max(a, b) <= 1e-12, i
    dense = torch.randn(3, 20, generator=g, dtype=torch.float64)[torch.arange(30) % 3]
    assert rel_max(ours(x, dense), tp(x, dense)) <= 1e-12 and gathered


def test_a_product_without_paths_gives_zeros():
    """No instruction connects the inputs to the output (1o x 0e never gives 0e): zeros, as e3nn."""
    tp = o3.FullyConnectedTensorProduct("2x1o", "3x0e", "2x0e").double()
    assert len(tp.instructions) == 0
    ours = copy.deepcopy(tp)
    SWAP.swap(ours, "numba")
    x = torch.randn(5, 6, dtype=torch.float64)
    s = torch.nn.functional.one_hot(torch.tensor([0, 1, 0, 2, 1]), 3).double()
    assert torch.equal(ours.eval()(x, s), tp(x, s)) and not tp(x, s).any()
