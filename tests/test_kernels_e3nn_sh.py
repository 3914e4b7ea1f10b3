"""e3nn's ``SphericalHarmonics`` as numba passes (:mod:`workbench.kernels.e3nn.spherical_harmonics`):
e3nn's values and first derivatives in float64 for every normalisation, degree lists with gaps
and repeats, unnormalised inputs, zero and tiny vectors; second derivatives (through e3nn's ops),
gradcheck and gradgradcheck; float32 against float64; batch shapes; pickling and the swap back."""

import copy
import pickle

import pytest
import torch
from e3nn import o3
from kernel_fixtures import rel_max
from torch.autograd import gradcheck, gradgradcheck

import workbench  # noqa: F401
from workbench.kernels.e3nn import spherical_harmonics as sh_kernels
from workbench.kernels.e3nn.spherical_harmonics import SWAP, sh_table

CASES = {
    "mace-l3-component": ("0e+1o+2e+3o", True, "component"),
    "gaps-and-repeats-integral": ([1, 3, 2, 2], True, "integral"),
    "l6-unnormalised-norm": ("0e+1o+2e+3o+4e+5o+6e", False, "norm"),
    "l0-only": ("0e", True, "component"),
    "l11-component": (list(range(12)), True, "component"),
}


def _pair(case: str):
    irreps, normalize, normalization = CASES[case]
    sh = o3.SphericalHarmonics(irreps, normalize=normalize, normalization=normalization)
    ours = copy.deepcopy(sh)
    SWAP.swap(ours, "numba")
    return sh, ours.eval()  # in training mode it is e3nn's forward


def _vectors(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    v = 2.5 * torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    v[0] = 0.0  # normalize's floor: zeros for l >= 1
    v[1] = torch.tensor([3e-13, -1e-13, 2e-13])  # under the floor, not zero
    return v.to(dtype).requires_grad_()


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_e3nn_in_float64(case):
    sh, ours = _pair(case)
    assert type(ours).__name__ == "WorkbenchSphericalHarmonics"
    v = _vectors(300, seed=len(case))
    g = torch.randn(300, sh.irreps_out.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, mine = sh(v), ours(v)
    (g_mine,) = torch.autograd.grad(mine, v, g)
    (g_ref,) = torch.autograd.grad(ref, v, g) if ref.requires_grad else (torch.zeros_like(v),)  # l = 0: constant
    assert mine.shape == ref.shape == (300, sh.irreps_out.dim)
    assert rel_max(mine, ref) <= 1e-11
    if not ref.requires_grad:
        assert torch.equal(g_mine, g_ref)
        return
    # rows 0-1 sit under normalize's floor (gradients ~1e12): checked apart from the others
    assert rel_max(g_mine[2:], g_ref[2:]) <= 1e-11 and rel_max(g_mine[:2], g_ref[:2]) <= 1e-11
    assert torch.equal(mine[0, 1:], torch.zeros_like(mine[0, 1:]))  # zero vector: only l = 0 is nonzero


def test_the_table_holds_only_nonzero_terms():
    table = sh_table((0, 1, 2, 3), "component")
    degree = {0: 0, **dict.fromkeys(range(1, 4), 1), **dict.fromkeys(range(4, 9), 2), **dict.fromkeys(range(9, 16), 3)}
    assert table.dim == 16 and table.lmax == 3 and (table.coef != 0).all()
    assert [int(p.sum()) for p in table.powers] == [degree[int(c)] for c in table.comp]
    assert sorted(set(table.comp.tolist())) == list(range(16))
    assert len(table.coef) < 40  # of the 1 + 9 + 30 + 70 (component, monomial) pairs of each degree


def test_second_derivatives_through_e3nns_ops():
    sh, ours = _pair("mace-l3-component")
    v = _vectors(40, seed=3)[2:].detach().requires_grad_()  # e3nn's second derivative at zero is NaN
    results = []
    for m in (sh, ours):
        y = m(v)
        (dv,) = torch.autograd.grad((y * torch.sin(y)).sum(), v, create_graph=True)
        results.append([dv, *torch.autograd.grad(dv.pow(2).sum(), v)])
    for a, b in zip(*results):
        assert rel_max(a, b) <= 1e-11


def test_batched_hessians_as_mace_computes_them():
    """mace's Hessians batch the second backward over cotangents with ``torch.vmap`` (falling back
    to a loop on an error): it runs through the harmonics' pass, and equals e3nn's."""
    sh, ours = _pair("mace-l3-component")
    v = _vectors(12, seed=6)[2:].detach()
    hessians = []
    for m in (sh, ours):
        x = v.clone().requires_grad_()
        y = m(x)
        (dv,) = torch.autograd.grad((y * torch.sin(y)).sum(), x, create_graph=True)
        flat = dv.reshape(-1)

        def row(t, flat=flat, x=x):
            return torch.autograd.grad(flat, x, t, retain_graph=True)[0]

        hessians.append(torch.vmap(row, chunk_size=7)(torch.eye(flat.numel(), dtype=torch.float64)))
    assert rel_max(hessians[1], hessians[0]) <= 1e-11


def test_a_constant_harmonic_differentiates_twice_to_zero():
    _, ours = _pair("l0-only")
    v = _vectors(5, seed=8)
    (dv,) = torch.autograd.grad(ours(v).sum(), v, create_graph=True)
    assert torch.equal(dv.detach(), torch.zeros_like(v))  # e3nn's output is a constant: no graph to follow


def test_gradcheck_and_gradgradcheck():
    _, ours = _pair("gaps-and-repeats-integral")
    v = _vectors(6, seed=4)[2:].detach().requires_grad_()  # away from the floor, where it is smooth
    assert gradcheck(ours, (v,)) and gradgradcheck(ours, (v,))


def test_float32_against_float64():
    sh, ours = _pair("mace-l3-component")
    v = _vectors(500, seed=5)[2:].detach()
    v32 = v.float().requires_grad_()
    y32 = ours(v32)
    (g32,) = torch.autograd.grad(y32.sum(), v32)
    v64 = v.clone().requires_grad_()
    y64 = sh(v64)
    (g64,) = torch.autograd.grad(y64.sum(), v64)
    assert y32.dtype == torch.float32 and rel_max(y32, y64) <= 1e-5 and rel_max(g32, g64) <= 1e-5


def test_the_numba_passes_run_in_eval_only(monkeypatch):
    sh, ours = _pair("mace-l3-component")
    calls = []
    real = sh_kernels._values
    monkeypatch.setattr(sh_kernels, "_values", lambda *a: calls.append(a[0].shape) or real(*a))
    v = _vectors(10, seed=7)
    assert rel_max(ours(v), sh(v)) <= 1e-11 and calls == [(10, 3)]
    ours.train()
    assert rel_max(ours(v), sh(v)) == 0 and calls == [(10, 3)]
    monkeypatch.setenv("WORKBENCH_CPU_HARMONICS", "0")
    assert rel_max(ours.eval()(v), sh(v)) == 0 and calls == [(10, 3)]


def test_batch_shapes_pickling_and_the_swap_back(monkeypatch):
    sh, ours = _pair("mace-l3-component")
    v = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert ours(v).shape == (2, 5, 16) and rel_max(ours(v), sh(v)) <= 1e-11
    again = pickle.loads(pickle.dumps(ours))
    assert type(again) is type(ours) and rel_max(again(v), sh(v)) <= 1e-11
    calls = []
    monkeypatch.setattr(sh_kernels, "_values", lambda *a: calls.append(a))
    SWAP.unswap(ours)
    assert type(ours) is o3.SphericalHarmonics and rel_max(ours(v), sh(v)) == 0 and calls == []
