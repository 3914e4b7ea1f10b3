"""The sparse-polynomial ops under ``torch.vmap`` (:mod:`workbench.kernels.ops`): a batch is one
call on disjoint copies of the rows, and equals the ops called one batch element at a time; a
batched second backward, as mace's Hessians take it, through the message op and the contraction;
the whole MD calculator's Hessian on its batched path, equal to e3nn's."""

import numpy as np
import pytest
import torch
from kernel_fixtures import mace_contraction, rel_err, save_md_model
from test_kernels_channelwise import make_conv_tp, random_graph

from workbench.kernels import SymmetricContraction
from workbench.kernels.e3nn.tp import channelwise_tp_op
from workbench.kernels.ops import edge_poly_op


def _message_problem():
    tp = make_conv_tp("4x0e+4x1o", 2)
    op, _ = channelwise_tp_op(tp)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, tp.irreps_in1.dim, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(30, tp.irreps_in2.dim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, tp.weight_numel, generator=g, dtype=torch.float64, requires_grad=True)
    return op, random_graph(7, 30, seed=2), x, y, w


def test_a_batched_forward_equals_one_call_per_element():
    op, ei, x, y, w = _message_problem()
    xs = torch.randn(5, *x.shape, dtype=torch.float64)
    batched = torch.vmap(lambda xb: edge_poly_op(op, ei[0], ei[1], 7, xb, y, w)[0])(xs)
    one_by_one = torch.stack([edge_poly_op(op, ei[0], ei[1], 7, xb, y, w)[0] for xb in xs])
    assert batched.shape == one_by_one.shape and rel_err(batched, one_by_one) <= 1e-14


def test_a_batched_second_backward_through_the_message_op():
    """Hessian-vector products of ``sum(out * sin(out))`` for a batch of directions, by ``vmap``
    over ``autograd.grad`` (mace's ``compute_hessians_vmap``) and one at a time."""
    op, ei, x, y, w = _message_problem()
    (out,) = edge_poly_op(op, ei[0], ei[1], 7, x, y, w)
    gx, gy, gw = torch.autograd.grad((out * torch.sin(out)).sum(), (x, y, w), create_graph=True)
    flat = torch.cat([gx.reshape(-1), gy.reshape(-1), gw.reshape(-1)])
    directions = torch.randn(6, flat.numel(), dtype=torch.float64)

    def hvp(v):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(flat, (x, y, w), v, retain_graph=True)])

    batched = torch.vmap(hvp, chunk_size=4)(directions)
    assert rel_err(batched, torch.stack([hvp(v) for v in directions])) <= 1e-13


def test_a_batched_second_backward_through_the_contraction():
    fast = SymmetricContraction.from_mace(mace_contraction(3, max_ell=1))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.one_hot(torch.tensor([0, 1, 1, 0, 1, 1]), 2).double()
    (gx,) = torch.autograd.grad(fast(x, y).pow(2).sum(), x, create_graph=True)
    flat = gx.reshape(-1)

    def row(v):
        return torch.autograd.grad(flat, x, v, retain_graph=True)[0]

    eye = torch.eye(flat.numel(), dtype=torch.float64)
    assert rel_err(torch.vmap(row)(eye), torch.stack([row(v) for v in eye])) <= 1e-13


def test_the_md_calculators_hessian_takes_maces_batched_path(tmp_path, monkeypatch):
    """``get_hessian`` with the networks (tables are differentiable once): no fall back to mace's
    loop, and e3nn's Hessian to 1e-10 in float64."""
    import mace.modules.utils as mace_utils
    from ase.build import molecule

    from workbench.train.md_calculator import load_calculator

    path = save_md_model(tmp_path / "cho.model", (1, 6, 8))
    methanol = molecule("CH3OH")
    methanol.positions += np.random.default_rng(1).normal(0, 0.05, methanol.positions.shape)

    def no_loop(*args):
        pytest.fail("mace fell back to its Hessian loop")

    monkeypatch.setattr(mace_utils, "compute_hessians_loop", no_loop)
    ours = load_calculator(str(path), backend="numba", radial="mlp").get_hessian(methanol)
    theirs = load_calculator(str(path), backend="e3nn").get_hessian(methanol)
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() <= 1e-10 * np.abs(np.asarray(theirs)).max()
