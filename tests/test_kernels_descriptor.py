"""The sparse-polynomial descriptor: canonical form, derivatives, MACE sparsity."""

import numpy as np
import pytest
import torch
from e3nn import o3

import workbench  # noqa: F401
from workbench.kernels import Operand, SparsePolynomial, symmetric_contraction_polynomial


def _random_poly(rng, n_x=4, n_w=3, n_terms=30):
    x = Operand.channel_major("x", n_x, 1)
    w = Operand.component_major("w", n_w, 1, batch="species")
    out = Operand.channel_major("y", 3, 1)
    terms = []
    for _ in range(n_terms):
        deg = rng.integers(1, 4)
        fac = [(0, int(rng.integers(n_x))) for _ in range(deg)] + [(1, int(rng.integers(n_w)))]
        terms.append((int(rng.integers(3)), fac, float(rng.normal())))
    return SparsePolynomial.from_terms((x, w), out, terms)


def test_canonical_form_merges_permuted_monomials():
    x = Operand.channel_major("x", 3, 1)
    y = Operand.channel_major("y", 1, 1)
    p = SparsePolynomial.from_terms(
        (x,), y, [(0, [(0, 2), (0, 1)], 1.5), (0, [(0, 1), (0, 2)], 0.5), (0, [(0, 0)], 1.0), (0, [(0, 0)], -1.0)]
    )
    assert p.num_terms == 1  # x1 x2 merged, x0 - x0 cancelled
    assert p.terms[(0, ((0, 1), (0, 2)))] == pytest.approx(2.0)


def test_vjp_matches_torch_autograd():
    rng = np.random.default_rng(0)
    p = _random_poly(rng)
    xv = torch.tensor(rng.normal(size=4), requires_grad=True)
    wv = torch.tensor(rng.normal(size=3), requires_grad=True)
    g = rng.normal(size=3)

    def f(xv, wv):
        out = [0.0] * 3
        for (o, fs), c in p.terms.items():
            term = torch.tensor(c, dtype=torch.float64)
            for a, i in fs:
                term = term * (xv[i] if a == 0 else wv[i])
            out[o] = out[o] + term
        return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out])

    y = f(xv, wv)
    gx, gw = torch.autograd.grad(y, (xv, wv), torch.tensor(g))
    vals = [xv.detach().numpy(), wv.detach().numpy(), g]
    np.testing.assert_allclose(p.vjp("x").evaluate_numpy(vals), gx.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p.vjp("w").evaluate_numpy(vals), gw.numpy(), rtol=1e-12, atol=1e-12)
    # second order: d/dx <h, vjp_x> equals the Hessian-vector product from torch
    h = rng.normal(size=4)
    gx2 = torch.autograd.grad(f(xv, wv), xv, torch.tensor(g), create_graph=True)[0]
    hx = torch.autograd.grad(gx2, xv, torch.tensor(h))[0]
    p2 = p.vjp("x").vjp("x")
    np.testing.assert_allclose(p2.evaluate_numpy(vals + [h]), hx.numpy(), rtol=1e-12, atol=1e-12)


def _mace_U(ell: int, correlation: int, out: str):
    from mace.tools.cg import U_matrix_real

    irreps_in = o3.Irreps("+".join(f"{l}{'e' if l % 2 == 0 else 'o'}" for l in range(ell + 1)))
    U_list, dims = [], []
    for _, ir in o3.Irreps(out):
        U_list.append(
            [
                U_matrix_real(irreps_in, o3.Irreps(str(ir)), nu, dtype=torch.float64, use_cueq_cg=False)[-1].numpy()
                for nu in range(1, correlation + 1)
            ]
        )
        dims.append(ir.dim)
    return U_list, dims


@pytest.mark.parametrize("ell,correlation,out", [(1, 2, "0e+1o"), (2, 3, "0e+1o"), (3, 3, "0e+1o"), (3, 3, "0e")])
def test_mace_sparsity_under_20_percent(ell, correlation, out):
    U_list, dims = _mace_U(ell, correlation, out)
    poly, stats, k_slices = symmetric_contraction_polynomial(U_list, dims, channels=4)
    assert stats.nonzero == sum(int(np.count_nonzero(U)) for Us in U_list for U in Us)
    assert stats.nonzero_fraction < 0.20  # the paper: "less than 20%"
    assert stats.terms <= stats.nonzero  # merging symmetric index tuples only removes work
    # the polynomial reproduces the dense contraction for one channel
    rng = np.random.default_rng(1)
    I = U_list[0][0].shape[-2]
    K = k_slices[-1][-1][1]
    x, w = rng.normal(size=I), rng.normal(size=K)
    ref = []
    for j, (Us, d) in enumerate(zip(U_list, dims)):
        acc = np.zeros(d)
        for nu, U in enumerate(Us, start=1):
            U = U.reshape((d,) + U.shape[-nu - 1 :])
            T = U
            for _ in range(nu):
                T = np.einsum("mi...,i->m...", T, x)
            a, b = k_slices[j][nu - 1]
            acc += T @ w[a:b]
        ref.append(acc)
    np.testing.assert_allclose(poly.evaluate_numpy([x, w]), np.concatenate(ref), rtol=1e-12, atol=1e-12)
