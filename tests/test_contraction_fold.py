"""The symmetric contraction with its per-species weights folded into the coupling coefficients
(:func:`~workbench.kernels.mace.symmetric_contraction.fold_species_weights`): the same numbers as
mace's module and as the unfolded kernels, through every derivative a force loss takes, with
fewer terms."""

import numpy as np
import pytest
import torch
from e3nn import o3
from kernel_fixtures import contraction_derivatives, rel_err

from workbench.dtypes import default_dtype
from workbench.kernels import SymmetricContraction
from workbench.kernels.mace.symmetric_contraction import fold_species_weights
from workbench.kernels.options import overridden


def _mace(correlation: int, max_ell: int, channels: int = 3, elements: int = 4, out: str = "0e+1o"):
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    irreps_in = o3.Irreps([(channels, (ell, (-1) ** ell)) for ell in range(max_ell + 1)])
    irreps_out = o3.Irreps([(channels, ir) for _, ir in o3.Irreps(out)])
    torch.manual_seed(10 * correlation + max_ell)
    with default_dtype(torch.float64):
        sc = MaceSC(irreps_in, irreps_out, correlation=correlation, num_elements=elements)
    with torch.no_grad():
        for p in sc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return sc


@pytest.mark.parametrize("correlation,max_ell", [(1, 1), (2, 2), (3, 3), (4, 1)])
def test_folded_polynomial_is_the_contraction(correlation, max_ell):
    """Per channel, the folded polynomial at ``V = S W`` equals the original at ``W``, for every
    species' weights; its terms are the distinct (output component, monomial) pairs."""
    fast = SymmetricContraction.from_mace(_mace(correlation, max_ell))
    poly = fast.polynomial()[0]
    folded, S = fold_species_weights(poly)
    pairs = {(o, tuple(i for a, i in f if a == 0)) for o, f in poly.terms}
    assert folded.num_terms == len(pairs) == S.shape[0]
    assert S.shape[1] == poly.operands[1].size
    if correlation >= 2:
        assert folded.num_terms < poly.num_terms
    rng = np.random.default_rng(correlation)
    for _ in range(3):
        x, W = rng.normal(size=poly.operands[0].size), rng.normal(size=poly.operands[1].size)
        want = poly.evaluate_numpy([x, W])
        got = folded.evaluate_numpy([x, S @ W])
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_paper_configuration_term_counts():
    """The paper's first product (128x0e..3o -> 0e+1o, correlation 3): 1,909 terms to 410."""
    fast = SymmetricContraction.from_mace(_mace(3, 3, channels=1, elements=1))
    poly = fast.polynomial()[0]
    assert (poly.num_terms, fold_species_weights(poly)[0].num_terms) == (1909, 410)


def _inputs(channels, dim, species, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(species), channels, dim, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.one_hot(torch.tensor(species), 4).double()
    return x, y, g


@pytest.mark.parametrize("correlation,max_ell", [(2, 1), (2, 3), (3, 2), (4, 1)])
def test_folded_module_matches_mace_and_the_unfolded_kernels(correlation, max_ell, monkeypatch):
    """Species 1 and 3 absent (the rows of ``V`` are the species present), an atom of no
    species (all-zero attributes) gives zeros; output, force-like gradient and its derivatives
    by ``x`` and every weight, in float64."""
    ref = _mace(correlation, max_ell)
    fast = SymmetricContraction.from_mace(ref)
    x, y, g = _inputs(3, (max_ell + 1) ** 2, [2, 0, 0, 2, 2, 0, 2])
    y[4] = 0.0
    out_dim = fast.irreps_out.dim
    cot = (
        torch.randn(7, out_dim, generator=g, dtype=torch.float64),
        torch.randn(x.shape, generator=g, dtype=torch.float64),
    )
    params = [p for p in ref.parameters() if p.requires_grad]
    want = contraction_derivatives(ref, x, y, params, *cot)
    monkeypatch.delenv("WORKBENCH_FOLD_SPECIES", raising=False)
    assert fast.fold(x)
    results = {}
    for fold in (True, False):
        with overridden(fold_species=fold):
            assert fast.fold(x) is fold
            results[fold] = contraction_derivatives(fast, x, y, params, *cot)
    for fold, got in results.items():
        errs = [rel_err(a, b) for a, b in zip(got, want)]
        assert max(errs) <= 1e-10, (fold, errs)
    assert results[True][0][4].abs().max() == 0
    # the weights of an absent species get no gradient, as in mace
    assert all(float(gw[1].abs().max()) == 0 for gw in results[True][3:])


def test_folded_module_gradcheck_and_float32():
    """gradcheck and gradgradcheck in ``x`` and every weight (one channel, ``l_max`` 1: the
    numerical Jacobian perturbs each weight alone), and float32 within 1e-5 of float64 at two
    channels and ``l_max`` 2."""
    fast = SymmetricContraction.from_mace(_mace(3, 1, channels=1))
    x, y, _ = _inputs(1, 4, [1, 3, 1, 0])
    W = [p for p in fast.parameters() if p.requires_grad]

    def f(x, *ws):
        return fast(x, y)

    assert torch.autograd.gradcheck(f, (x, *W))
    assert torch.autograd.gradgradcheck(f, (x, *W))
    ref = _mace(3, 2, channels=2)
    x, y, _ = _inputs(2, 9, [1, 3, 1, 0])
    fast32 = SymmetricContraction.from_mace(_mace(3, 2, channels=2).float())
    got = fast32(x.detach().float(), y.float())
    assert rel_err(got.double(), ref(x, y)) <= 1e-5


def test_the_option_chooses_the_op(monkeypatch):
    monkeypatch.delenv("WORKBENCH_FOLD_SPECIES", raising=False)
    fast = SymmetricContraction.from_mace(_mace(2, 1))
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert fast.fold(x)
    with overridden(fold_species=False):
        assert not fast.fold(x)
    assert fast.folded_op[0] is not fast.op
    assert fast.folded_op[0] is SymmetricContraction.from_mace(_mace(2, 1)).folded_op[0]  # shared


def test_a_first_call_under_inference_mode_leaves_later_gradients_working():
    """The fold matrix kept from a call under ``torch.inference_mode`` is a normal tensor: a later
    call with gradients (the MD calculator's forces after an energy-only call) saves it."""
    ref = _mace(2, 1)
    fast = SymmetricContraction.from_mace(ref)
    x, y, _ = _inputs(3, 4, [0, 2, 2])
    with torch.inference_mode():
        fast(x.detach(), y)
    (g,) = torch.autograd.grad(fast(x, y).sum(), x)
    (want,) = torch.autograd.grad(ref(x, y).sum(), x)
    assert rel_err(g, want) <= 1e-10
