"""Radial weights read from their table inside the message passes
(:mod:`workbench.kernels.tabulated_edge`, :mod:`workbench.kernels.numba.cpu.tabulated`): the same
messages and gradients (to node features, harmonics and edge lengths) as the table's values
written out, in float64 and float32, merged and separate backward passes; any other use of the
weights gets their values; what the passes cannot read falls back; no second derivative."""

import numpy as np
import pytest
import torch
from kernel_fixtures import rel_err
from test_kernels_channelwise import make_conv_tp, random_graph

from workbench.kernels.e3nn.tp import channelwise_tp_op
from workbench.kernels.numba.cpu import radial as radial_kernels
from workbench.kernels.numba.dispatch import cpu_plan
from workbench.kernels.ops import edge_poly_op
from workbench.kernels.options import overridden
from workbench.kernels.radial_table import build
from workbench.kernels.tabulated_edge import TableValues, TabulatedWeights, tabulated_edge_op

LO, HI = 0.4, 4.5


@pytest.fixture(autouse=True)
def _fused_kernels():
    """The suite runs on the interpreter (conftest); the table is read by fused passes only."""
    with overridden(cpu_kernels="auto"):
        yield


def _table(width: int, dtype: torch.dtype, seed: int = 0):
    """A table of ``width`` smooth functions of r (random frequencies and phases)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.rand(width, generator=g, dtype=torch.float64) * 2.0 + 0.3
    phase = torch.rand(width, generator=g, dtype=torch.float64) * 6.0
    return build(lambda r: torch.cos(r[:, None] * k + phase) / (1.0 + r[:, None]), lo=LO, hi=HI, dtype=dtype)


def _problem(dtype: torch.dtype, hidden: str = "8x0e+8x1o", max_ell: int = 2, n_nodes: int = 9, n_edges: int = 70):
    """A message op (the second interaction's of test_radial_table's models: their kernels are
    compiled once for both files), a graph, features, harmonics, lengths and a table."""
    tp = make_conv_tp(hidden, max_ell)
    op, _ = channelwise_tp_op(tp)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_nodes, tp.irreps_in1.dim, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(n_edges, tp.irreps_in2.dim, generator=g, dtype=torch.float64).to(dtype)
    lengths = (LO + (HI - LO) * torch.rand(n_edges, generator=g, dtype=torch.float64)).to(dtype)
    lengths[:3] = torch.tensor([LO, HI, HI], dtype=dtype)  # both ends of the domain
    return op, random_graph(n_nodes, n_edges, seed=5), x, y, lengths, _table(tp.weight_numel, dtype)


def _run(op, ei, x, y, lengths, table, cotangent, tabulated: bool):
    """Messages, and the gradients of <messages, cotangent> to x, y and the lengths."""
    x, y, lengths = (t.clone().requires_grad_(True) for t in (x, y, lengths))
    if tabulated:
        outs = tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(lengths, table))
        assert outs is not None, "the passes did not read the table"
        (out,) = outs
    else:
        (out,) = edge_poly_op(op, ei[0], ei[1], x.shape[0], x, y, TableValues.apply(lengths, table))
    grads = torch.autograd.grad((out * cotangent).sum(), (x, y, lengths))
    return (out.detach(), *grads)


@pytest.mark.parametrize("merge", [False, True])
def test_messages_and_gradients_equal_the_written_out_weights_in_float64(merge):
    op, ei, x, y, lengths, table = _problem(torch.float64)
    cot = torch.randn(x.shape[0], op.outputs[0].output.width, dtype=torch.float64)
    with overridden(cpu_merge_edges=merge):
        want = _run(op, ei, x, y, lengths, table, cot, tabulated=False)
        got = _run(op, ei, x, y, lengths, table, cot, tabulated=True)
        derivative = op.derivative((True, True, True))
        assert any(rp.merged for _, rp in cpu_plan(derivative, op.channels).passes) == merge
    for name, a, b in zip(("messages", "d x", "d y", "d lengths"), got, want):
        assert rel_err(a, b) <= 1e-12, name


@pytest.mark.parametrize("hidden, max_ell", [("4x0e+4x1o", 3)])
def test_other_irreps_and_harmonics(hidden, max_ell):
    op, ei, x, y, lengths, table = _problem(torch.float64, hidden=hidden, max_ell=max_ell)
    cot = torch.randn(x.shape[0], op.outputs[0].output.width, dtype=torch.float64)
    want = _run(op, ei, x, y, lengths, table, cot, tabulated=False)
    got = _run(op, ei, x, y, lengths, table, cot, tabulated=True)
    for name, a, b in zip(("messages", "d x", "d y", "d lengths"), got, want):
        assert rel_err(a, b) <= 1e-12, name


def test_float32_is_within_1e_5_of_float64():
    op, ei, x, y, lengths, table = _problem(torch.float64)
    cot = torch.randn(x.shape[0], op.outputs[0].output.width, dtype=torch.float64)
    want = _run(op, ei, x, y, lengths, table, cot, tabulated=False)
    table32 = _table(table.outputs, torch.float32)
    got = _run(op, ei, x.float(), y.float(), lengths.float(), table32, cot.float(), tabulated=True)
    for name, a, b in zip(("messages", "d x", "d y", "d lengths"), got, want):
        assert rel_err(a.double(), b) <= 1e-5, name


COMBINATIONS = [(x, y, r) for x in (False, True) for y in (False, True) for r in (False, True) if x or y or r]


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("wanted", COMBINATIONS, ids=lambda w: "".join("xyr"[i] for i in range(3) if w[i]))
def test_every_combination_of_wanted_gradients(merge, wanted):
    """The first interaction wants no node-feature gradient, forces want no harmonics' gradient
    when ``l = 0``, a pass may compute the weights' cotangent without reading them: each
    combination matches the written-out weights, and only what is asked is computed."""
    op, ei, x, y, lengths, table = _problem(torch.float64)
    cot = torch.randn(x.shape[0], op.outputs[0].output.width, dtype=torch.float64)
    want = _run(op, ei, x, y, lengths, table, cot, tabulated=False)[1:]
    inputs = [t.clone().requires_grad_(w) for t, w in zip((x, y, lengths), wanted)]
    asked = []
    derivative = op.derivative
    with overridden(cpu_merge_edges=merge):
        op.derivative = lambda needed, present=None: asked.append(needed) or derivative(needed, present)
        try:
            (out,) = tabulated_edge_op(
                op, ei[0], ei[1], x.shape[0], inputs[0], inputs[1], TabulatedWeights(inputs[2], table)
            )
            got = torch.autograd.grad((out * cot).sum(), [t for t in inputs if t.requires_grad])
        finally:
            del op.derivative
    assert asked == [wanted]
    for g, b in zip(got, [b for b, w in zip(want, wanted) if w]):
        assert rel_err(g, b) <= 1e-12


def test_gradients_only_where_the_caller_asks():
    """``autograd.grad`` to the harmonics alone: the node features and lengths require grad, but
    their gradients are not computed (``engine_uses``)."""
    op, ei, x, y, lengths, table = _problem(torch.float64)
    x, y, r = (t.clone().requires_grad_(True) for t in (x, y, lengths))
    asked, derivative = [], op.derivative
    op.derivative = lambda needed, present=None: asked.append(needed) or derivative(needed, present)
    try:
        (out,) = tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(r, table))
        torch.autograd.grad(out.sum(), y)
    finally:
        del op.derivative
    assert asked == [(False, True, False)]


def test_weights_of_the_wrong_shape_are_refused():
    op, ei, x, y, lengths, table = _problem(torch.float64)
    with pytest.raises(ValueError, match=r"expected \[70, \d+\], got \(69, \d+\)"):
        tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(lengths[:69], table))
    narrow = _table(table.outputs - 8, torch.float64)
    with pytest.raises(ValueError, match=r"expected \[70, \d+\]"):
        tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(lengths, narrow))
    with pytest.raises(ValueError, match=r"\[edges\] lengths"):
        TabulatedWeights(lengths[:, None], table)


def test_lengths_changed_between_forward_and_backward_are_refused():
    op, ei, x, y, lengths, table = _problem(torch.float64)
    r = lengths.clone().requires_grad_(True)
    r2 = r * 1.0
    (out,) = tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(r2, table))
    with torch.no_grad():
        r2.mul_(1.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.sum(), r)


def test_weights_give_their_values_to_any_other_function(monkeypatch):
    table = _table(12, torch.float64)
    r = torch.linspace(LO, HI, 17, dtype=torch.float64, requires_grad=True)
    w = TabulatedWeights(r, table)
    assert w.shape == (17, 12) and w.dtype == torch.float64 and w.dim() == 2 and w.size(1) == 12
    assert w._values is None  # shape, dtype and size do not compute the values
    cutoff = torch.rand(17, 1, dtype=torch.float64)
    got = w * cutoff  # as mace's blocks do when the cutoff is applied after the network
    assert type(got) is torch.Tensor and w._values is not None
    values = TableValues.apply(r, table)
    assert torch.equal(got, values * cutoff)
    (dr,) = torch.autograd.grad(got.sum(), r)
    (want,) = torch.autograd.grad((values * cutoff).sum(), r)
    assert rel_err(dr, want) <= 1e-14


def test_weights_cannot_be_read_as_numbers_past_their_values_or_changed():
    table = _table(12, torch.float64)
    r = torch.linspace(LO, HI, 17, dtype=torch.float64, requires_grad=True)
    w = TabulatedWeights(r, table)
    assert w.requires_grad and not w.is_leaf and len(w) == 17 and w._values is None

    # a script reads the storage itself: NaN, never numbers that pass for weights
    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * 1.0

    assert torch.isnan(torch.jit.script(scaled)(w)).all()

    class Reader(torch.autograd.Function):  # a custom Function sees the tensor, not the values
        @staticmethod
        def forward(ctx, t):
            return t.sum(1)

        @staticmethod
        def backward(ctx, g):
            return g[:, None].expand(-1, 12)

    out = Reader.apply(w)
    assert torch.isfinite(out).all()  # its forward's torch calls got the values
    with pytest.raises(RuntimeError, match="reached a gradient without their values"):
        torch.autograd.grad(out.sum(), r)  # but no gradient can leave out the lengths'
    for change in (lambda: w.mul_(2.0), lambda: w.__imul__(2.0), lambda: torch.mul(w, 2.0, out=w)):
        with pytest.raises(RuntimeError, match="read-only"):
            change()
    fresh = TabulatedWeights(r, table)
    with torch.no_grad():
        fresh.sum()  # values without a graph are not kept for later readers
    (dr,) = torch.autograd.grad(fresh.sum(), r)
    assert torch.isfinite(dr).all() and dr.abs().max() > 0


def test_passes_that_cannot_read_the_table_fall_back(monkeypatch):
    op, ei, x, y, lengths, table = _problem(torch.float64)
    w = TabulatedWeights(lengths, table)
    with overridden(cpu_kernels="interpreter"):
        assert tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, w) is None
    assert tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, w, backend="e3nn") is None
    assert tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x.float(), y, w) is None  # mixed dtypes
    assert (
        tabulated_edge_op(op, ei[:, :0][0], ei[:, :0][1], x.shape[0], x, y[:0], TabulatedWeights(lengths[:0], table))
        is None
    )
    # a forward the passes read, a backward they cannot: the values are written out for it
    cot = torch.randn(x.shape[0], op.outputs[0].output.width, dtype=torch.float64)
    forward = max(rp.program.num_instructions for _, rp in cpu_plan(op, op.channels).passes)
    with overridden(cpu_unroll_max=forward, cpu_merge_edges=False):
        backward = [rp.fused() for _, rp in cpu_plan(op.derivative((True, True, True)), op.channels).passes]
        assert not all(backward)
        calls, values = [], radial_kernels.table_values
        monkeypatch.setattr(radial_kernels, "table_values", lambda *a: calls.append(1) or values(*a))
        got = _run(op, ei, x, y, lengths, table, cot, tabulated=True)
        assert len(calls) == 1  # for the backward only
    want = _run(op, ei, x, y, lengths, table, cot, tabulated=False)
    for name, a, b in zip(("messages", "d x", "d y", "d lengths"), got, want):
        assert rel_err(a, b) <= 1e-12, name


def test_a_second_derivative_is_refused():
    op, ei, x, y, lengths, table = _problem(torch.float64)
    r = lengths.clone().requires_grad_(True)
    (out,) = tabulated_edge_op(op, ei[0], ei[1], x.shape[0], x, y, TabulatedWeights(r, table))
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(out.square().sum(), r, create_graph=True)


def test_table_rows_are_the_table_kernels_intervals_and_coordinates():
    from workbench.kernels.numba.cpu.radial import table_rows, table_values

    table = _table(5, torch.float64)
    r = np.random.default_rng(2).uniform(LO, HI, 300)
    r[:2] = LO, HI
    k, s = table_rows(r, table.lo, table.h, table.num_intervals, np.float64)
    _, plan = table_values(r, table.lo, table.h, table.coeffs)
    assert np.array_equal(k, plan[1]) and k.max() == table.num_intervals - 1
    assert np.abs(s).max() <= 1.0 and s[1] == 1.0 and s[0] == -1.0
