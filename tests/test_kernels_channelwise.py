"""Kernels II: the fused channelwise tensor product + scatter (message op) against mace/e3nn."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from kernel_fixtures import build_model, energy_force_grads, rel_err

from workbench.kernels import AVAILABLE_OPS, SymmetricContraction, accelerate
from workbench.kernels.e3nn.tp import channelwise_tp_op, channelwise_tp_polynomial
from workbench.kernels.mace.channelwise_tp import SUPPORTED_INTERACTION_BLOCKS, FusedChannelwiseTensorProduct
from workbench.kernels.ops import EdgeGraph, apply_edge_poly_op


# ---------------------------------------------------------------------------------------- helpers
def graph_batch(structures, n_elements: int, r_max: float = 4.0, dtype=torch.float64, seed: int = 0) -> dict:
    """Batch ``[(positions [n, 3], cell [3, 3] or None), ...]`` with mace's own neighbour list
    (periodic where a cell is given: a small cell gives periodic self-images i -> i)."""
    from mace.data.neighborhood import get_neighborhood

    rng = np.random.default_rng(seed)
    pos, attrs, batch, eis, shifts, unit, cells, ptr = [], [], [], [], [], [], [], [0]
    start = 0
    for gi, (p, cell) in enumerate(structures):
        p = np.asarray(p, dtype=np.float64)
        pbc = (cell is not None,) * 3
        c = np.array(cell, dtype=np.float64) if cell is not None else np.zeros((3, 3))
        ei, sh, us, _ = get_neighborhood(p, cutoff=r_max, pbc=pbc, cell=c.copy() if cell is not None else None)
        eis.append(torch.as_tensor(ei, dtype=torch.int64) + start)
        shifts.append(torch.as_tensor(sh))
        unit.append(torch.as_tensor(us))
        cells.append(torch.as_tensor(c))
        z = rng.integers(0, n_elements, len(p))
        attrs.append(torch.nn.functional.one_hot(torch.as_tensor(z), n_elements).double())
        pos.append(torch.as_tensor(p))
        batch.append(torch.full((len(p),), gi, dtype=torch.int64))
        start += len(p)
        ptr.append(start)
    return {
        "positions": torch.cat(pos).to(dtype),
        "node_attrs": torch.cat(attrs).to(dtype),
        "edge_index": torch.cat(eis, dim=1).contiguous(),
        "shifts": torch.cat(shifts).to(dtype),
        "unit_shifts": torch.cat(unit).to(dtype),
        "cell": torch.cat(cells).to(dtype),
        "batch": torch.cat(batch),
        "ptr": torch.tensor(ptr, dtype=torch.int64),
    }


def mixed_graphs(n_elements: int) -> dict:
    """A molecule with an isolated atom, a second molecule, and a periodic cell smaller than the
    cutoff (every atom sees its own images)."""
    rng = np.random.default_rng(3)
    mol = rng.random((5, 3)) * 3.0
    mol_iso = np.concatenate([mol, [[20.0, 20.0, 20.0]]])  # last atom: no neighbours
    mol2 = rng.random((4, 3)) * 2.5
    cell = np.diag([2.7, 2.9, 3.1]) + 0.2 * rng.random((3, 3))
    crystal = rng.random((2, 3)) @ cell
    data = graph_batch([(mol_iso, None), (mol2, None), (crystal, cell)], n_elements)
    ei = data["edge_index"]
    assert bool((ei[0] == ei[1]).any()), "expected periodic self-images"
    assert not bool((ei == 5).any()), "atom 5 must be isolated"
    return data


def empty_graphs(n_elements: int) -> dict:
    """Two single atoms: zero edges overall."""
    data = graph_batch([(np.zeros((1, 3)), None), (np.ones((1, 3)), None)], n_elements)
    assert data["edge_index"].shape[1] == 0
    return data


def compare(ref, acc, tol: float, flat: bool = False) -> dict:
    (E0, F0, G0), (E1, F1, G1) = ref, acc
    errs = {"energy": rel_err(E1, E0), "forces": rel_err(F1, F0) if F0.abs().max() > 0 else float(F1.abs().max())}
    if flat:  # float32 vs float64: relative to the largest parameter gradient
        errs["param_grads"] = rel_err(torch.cat([g.flatten() for g in G1]), torch.cat([g.flatten() for g in G0]))
    else:
        errs["param_grads"] = max((rel_err(a, b) for a, b in zip(G1, G0) if b.abs().max() > 0), default=0.0)
    for k, v in errs.items():
        assert v <= tol, (k, v, errs)
    return errs


def e3nn_message(tp, x, Y, W, edge_index):
    """mace's unfused path: TP on gathered sender features, then scatter-sum to receivers."""
    from mace.tools.scatter import scatter_sum

    mji = tp(x[edge_index[0]], Y, W)
    return scatter_sum(src=mji, index=edge_index[1], dim=0, dim_size=x.shape[0])


def make_conv_tp(hidden: str, max_ell: int, dtype=torch.float64):
    """``conv_tp`` exactly as mace's interaction blocks build it."""
    from e3nn import o3
    from mace.modules.irreps_tools import tp_out_irreps_with_instructions
    from mace.modules.wrapper_ops import TensorProduct

    node = o3.Irreps(hidden)
    sh = o3.Irreps.spherical_harmonics(max_ell)
    C = node[0].mul
    target = (sh * C).sort()[0].simplify()
    mid, ins = tp_out_irreps_with_instructions(node, sh, target)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return TensorProduct(node, sh, mid, instructions=ins, shared_weights=False, internal_weights=False)
    finally:
        torch.set_default_dtype(old)


def random_graph(n_nodes: int, n_edges: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n_nodes - 1, (2, n_edges), generator=g)  # node n_nodes-1 isolated
    ei[:, 0] = torch.tensor([1, 1])  # a self-loop (periodic self-image)
    return ei


def away_from_zero(shape, g, dtype=torch.float64):
    x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (x * sign).to(dtype)


# ---------------------------------------------------------------------------------------- descriptor
@pytest.mark.parametrize("hidden,max_ell", [("3x0e", 3), ("3x0e+3x1o", 3), ("2x0e+2x1o+2x2e", 2), ("4x0e+4x1o", 1)])
def test_descriptor_matches_e3nn_message(hidden, max_ell):
    tp = make_conv_tp(hidden, max_ell)
    N, E = 7, 23
    ei = random_graph(N, E, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, tp.irreps_in1.dim, generator=g, dtype=torch.float64)
    Y = torch.randn(E, tp.irreps_in2.dim, generator=g, dtype=torch.float64)
    W = torch.randn(E, tp.weight_numel, generator=g, dtype=torch.float64)
    ref = e3nn_message(tp, x, Y, W, ei)
    op, stats = channelwise_tp_op(tp)
    (out,) = apply_edge_poly_op(op, EdgeGraph(ei, N), x, Y, W)
    assert rel_err(out, ref) < 1e-13
    assert out[N - 1].abs().max() == 0  # isolated node gets no message
    # the descriptor holds only non-zero CG entries; terms per (edge, channel) = non-zero count
    assert stats.terms == stats.nonzero < stats.dense
    assert all(nz > 0 for *_, nz in stats.per_instruction)


def test_sparsity_paper_config():
    """Paper config interactions[1]: 128x0e+128x1o features, max_ell 3 spherical harmonics."""
    from e3nn import o3
    from mace.modules.irreps_tools import tp_out_irreps_with_instructions

    node, sh = o3.Irreps("128x0e+128x1o"), o3.Irreps.spherical_harmonics(3)
    target = o3.Irreps("128x0e+128x1o+128x2e+128x3o")
    mid, _ = tp_out_irreps_with_instructions(node, sh, target)
    tp = make_conv_tp("128x0e+128x1o", 3)
    assert tp.irreps_out == mid
    poly, stats = channelwise_tp_polynomial(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, tp.instructions)
    print("paper interactions[1]:", stats.dense, stats.nonzero, f"{stats.nonzero_fraction:.2%}", len(tp.instructions))
    # e3nn's real-basis CG tensors: 86 of 402 entries are non-zero (21.4%), close to the
    # paper's "typically < 20%"; the first layer (128x0e input) has 16 of 84 (19.0%)
    assert (stats.dense, stats.nonzero, len(tp.instructions)) == (402, 86, 10)
    first = make_conv_tp("128x0e", 3)
    _, st0 = channelwise_tp_polynomial(first.irreps_in1, first.irreps_in2, first.irreps_out, first.instructions)
    assert (st0.dense, st0.nonzero) == (84, 16)
    assert poly.output.size == mid.dim // 128


# ---------------------------------------------------------------------------------------- autograd
def test_gradcheck_and_gradgradcheck():
    tp = make_conv_tp("2x0e+2x1o", 2)
    N, E = 4, 5
    ei = random_graph(N, E, seed=4)
    g = torch.Generator().manual_seed(5)
    x = away_from_zero((N, tp.irreps_in1.dim), g).requires_grad_()
    Y = away_from_zero((E, tp.irreps_in2.dim), g).requires_grad_()
    W = away_from_zero((E, tp.weight_numel), g).requires_grad_()
    op, _ = channelwise_tp_op(tp)
    graph = EdgeGraph(ei, N)
    fn = lambda x, Y, W: apply_edge_poly_op(op, graph, x, Y, W)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, Y, W))
    # gradgradcheck differentiates the backward numerically: fewer edges keep it quick
    graph2 = EdgeGraph(ei[:, :3], N)
    fn2 = lambda x, Y, W: apply_edge_poly_op(op, graph2, x, Y, W)[0]  # noqa: E731
    Y2, W2 = (t[:3].detach().clone().requires_grad_() for t in (Y, W))
    assert torch.autograd.gradgradcheck(fn2, (x, Y2, W2))
    # and the derivatives equal e3nn's (first and second order, through mace's unfused path)
    ct = away_from_zero((N, tp.irreps_out.dim), g)
    outs = []
    for f in (fn, lambda x, Y, W: e3nn_message(tp, x, Y, W, ei)):
        gx, gY, gW = torch.autograd.grad((f(x, Y, W) * ct).sum(), (x, Y, W), create_graph=True)
        dd = torch.autograd.grad((gx**2).sum() + (gY**3).sum() + (gW * ct.sum()).sum(), (x, Y, W))
        outs.append((gx, gY, gW) + dd)
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-12


# ---------------------------------------------------------------------------------------- full models
MODEL_CFGS = [
    # (class, hidden irreps, max_ell, correlation, elements, interaction class)
    ("ScaleShiftMACE", "4x0e+4x1o", 3, 2, 3, "RealAgnosticResidualInteractionBlock"),
    ("MACE", "3x0e+3x1o+3x2e", 2, 2, 2, "RealAgnosticInteractionBlock"),
]


def build(cfg, dtype=torch.float64, seed=0):
    cls, hidden, max_ell, corr, nel, icls = cfg
    m = build_model(cls, hidden, max_ell, corr, nel, dtype=dtype, seed=seed, interaction=icls)
    assert all(type(b).__name__ == icls for b in m.interactions)
    return m


@pytest.mark.parametrize("cfg", MODEL_CFGS, ids=lambda c: f"{c[0]}-{c[5]}")
def test_full_model_both_ops_float64(cfg):
    model = build(cfg)
    fast = accelerate(copy.deepcopy(model), backend="numba")  # ops=None: both
    assert sum(isinstance(m, FusedChannelwiseTensorProduct) for m in fast.modules()) == 2
    assert sum(isinstance(m, SymmetricContraction) for m in fast.modules()) == 2
    for name, data in (("mixed", mixed_graphs(cfg[4])), ("empty", empty_graphs(cfg[4]))):
        ref = energy_force_grads(model, data)
        errs = compare(ref, energy_force_grads(fast, data), tol=1e-10)
        print(cfg[0], cfg[5], name, errs)


def test_full_model_float32_vs_float64():
    cfg = MODEL_CFGS[0]
    model = build(cfg)
    data = mixed_graphs(cfg[4])
    ref = energy_force_grads(model, data)
    fast32 = accelerate(copy.deepcopy(model).float(), backend="numba")
    data32 = {k: (v.float() if v.is_floating_point() else v) for k, v in data.items()}
    errs = compare(ref, energy_force_grads(fast32, data32), tol=1e-5, flat=True)
    print("float32 vs float64", errs)


def test_ops_alone_restore_and_state_dict():
    from e3nn import o3
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    cfg = MODEL_CFGS[0]
    model = build(cfg)
    data = mixed_graphs(cfg[4])
    ref = energy_force_grads(model, data)
    params = [id(p) for p in model.parameters()]
    sd = model.state_dict()
    tps = [b.conv_tp for b in model.interactions]
    assert "channelwise_tp" in AVAILABLE_OPS

    accelerate(model, ops=("channelwise_tp",))
    assert all(type(b.conv_tp) is FusedChannelwiseTensorProduct and b.conv_fusion for b in model.interactions)
    assert [b.conv_tp for b in model.interactions] == tps  # same objects
    assert sum(isinstance(m, MaceSC) for m in model.modules()) == 2  # contraction untouched
    compare(ref, energy_force_grads(model, data), tol=1e-10)

    accelerate(model, backend="e3nn", ops=("channelwise_tp",))
    assert all(type(b.conv_tp) is o3.TensorProduct and not hasattr(b, "conv_fusion") for b in model.interactions)
    accelerate(model, ops=("symmetric_contraction",))
    assert not any(isinstance(m, FusedChannelwiseTensorProduct) for m in model.modules())
    assert sum(isinstance(m, SymmetricContraction) for m in model.modules()) == 2

    accelerate(model)  # both
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == list(sd)
    accelerate(model, backend="e3nn")
    assert all(type(b.conv_tp) is o3.TensorProduct and not hasattr(b, "conv_fusion") for b in model.interactions)
    assert not any(isinstance(m, SymmetricContraction) for m in model.modules())
    assert [id(p) for p in model.parameters()] == params
    sd2 = model.state_dict()
    assert list(sd2) == list(sd) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert energy_force_grads(model, data)[0].equal(ref[0])  # e3nn again, bit for bit


def test_unsupported_block_raises():
    from mace.modules.blocks import RealAgnosticResidualInteractionBlock

    class MyInteractionBlock(RealAgnosticResidualInteractionBlock):
        pass

    model = build(MODEL_CFGS[0])
    model.interactions[1].__class__ = MyInteractionBlock
    with pytest.raises(TypeError, match="MyInteractionBlock"):
        accelerate(model, ops=("channelwise_tp",))
    assert not any(isinstance(m, FusedChannelwiseTensorProduct) for m in model.modules())  # all or nothing
    assert "RealAgnosticInteractionBlock" in SUPPORTED_INTERACTION_BLOCKS


def test_saved_accelerated_model_loads_without_cuda(tmp_path):
    """torch.save of a model with both ops; a fresh interpreter with no GPU loads and runs it."""
    cfg = MODEL_CFGS[0]
    model = accelerate(build(cfg), backend="numba")
    data = mixed_graphs(cfg[4])
    ref = energy_force_grads(model, data)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    compare(ref, energy_force_grads(torch.load(buf, weights_only=False), data), tol=1e-12)
    path, dpath = tmp_path / "model.pt", tmp_path / "data.pt"
    torch.save(model, path)
    torch.save(data, dpath)
    code = (
        f"import sys, torch; sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
        "import workbench\n"
        f"m = torch.load({str(path)!r}, weights_only=False); d = torch.load({str(dpath)!r}, weights_only=False)\n"
        "out = m(d, training=False, compute_force=True)\n"
        "print('ok', type(m.interactions[1].conv_tp).__name__, float(out['energy'].sum()))\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("ok ")][-1]
    assert line.split()[1] == "FusedChannelwiseTensorProduct"
    assert abs(float(line.split()[2]) - float(ref[0].sum())) <= 1e-10 * abs(float(ref[0].sum()))


@pytest.mark.parametrize(
    "icls",
    [
        c
        for c in SUPPORTED_INTERACTION_BLOCKS
        if c not in ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock")
    ],
)
def test_other_supported_blocks_match_e3nn_float64(icls):
    """Every block class on the supported list is checked, not only the two the paper's model uses."""
    cfg = ("MACE", "3x0e+3x1o", 2, 2, 2, icls)
    model = build(cfg)
    fast = accelerate(copy.deepcopy(model), backend="numba", ops=("channelwise_tp",))
    assert sum(isinstance(m, FusedChannelwiseTensorProduct) for m in fast.modules()) == 2
    data = mixed_graphs(cfg[4])
    compare(energy_force_grads(model, data), energy_force_grads(fast, data), tol=1e-10)


def test_edge_graph_is_shared_by_layers_until_the_edges_change():
    """``EdgeGraph.of`` hands the layers of one forward the same graph (one CSR sort), and a new one
    when the edge tensor is another object, was changed in place, or the node count differs."""
    g = torch.Generator().manual_seed(11)
    edge_index = torch.randint(0, 9, (2, 40), generator=g)
    first = EdgeGraph.of(edge_index[0], edge_index[1], 9)
    assert EdgeGraph.of(edge_index[0], edge_index[1], 9) is first  # new views of the same tensor
    ptr, perm = first.csr("receiver")
    assert torch.equal(torch.sort(edge_index[1], stable=True).indices, perm)
    assert torch.equal(ptr, torch.searchsorted(torch.sort(edge_index[1]).values, torch.arange(10)))
    assert EdgeGraph.of(edge_index[0], edge_index[1], 10) is not first
    second = EdgeGraph.of(edge_index[0], edge_index[1], 9)
    assert EdgeGraph.of(edge_index[1], edge_index[0], 9) is not second  # sender and receiver swapped
    copy_ = edge_index.clone()
    third = EdgeGraph.of(copy_[0], copy_[1], 9)
    assert third is not second and torch.equal(third.receiver, edge_index[1])
    copy_[1, 0] = (copy_[1, 0] + 1) % 9  # in place: the version counter moves
    fourth = EdgeGraph.of(copy_[0], copy_[1], 9)
    assert fourth is not third and int(fourth.receiver[0]) == int(copy_[1, 0])
