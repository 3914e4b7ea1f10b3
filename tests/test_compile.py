"""torch.compile and torch.export (workbench.kernels.library, workbench.kernels.compiling):
the custom op ``workbench::sparse_poly`` passes torch's own op checks and differentiates to
second order as the eager autograd function does; a ``compile_ready`` MACE model traces as one
graph with zero breaks, and its compiled energy, forces and parameter gradients (double
backward) and its exported energy equal eager's in float64."""

import copy

import pytest
import torch
from kernel_fixtures import build_model, periodic_batch, rel_err
from test_kernels_channelwise import away_from_zero, make_conv_tp, random_graph

from workbench.kernels import SymmetricContraction, channelwise_tp_op, compile_ready, energy_program
from workbench.kernels.library import op_key, sparse_poly
from workbench.kernels.ops import EdgeGraph, apply_edge_poly_op, apply_poly_op


def _edge_case(seed: int = 4):
    tp = make_conv_tp("2x0e+2x1o", 2)
    N, E = 5, 7
    ei = random_graph(N, E, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tensors = [
        away_from_zero(shape, g).requires_grad_()
        for shape in ((N, tp.irreps_in1.dim), (E, tp.irreps_in2.dim), (E, tp.weight_numel))
    ]
    return channelwise_tp_op(tp)[0], ei, N, tensors


def _atom_case(seed: int = 0):
    from kernel_fixtures import mace_contraction

    fast = SymmetricContraction.from_mace(mace_contraction(3, max_ell=1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    W = fast.concatenated_weights().detach().reshape(2, -1).clone().requires_grad_()
    return fast.op, torch.tensor([0, 1, 1, 0, 1, 1]), [x, W]


def test_the_custom_op_passes_torchs_op_checks():
    """Schema, fake tensor, autograd registration and AOT dispatch (``torch.library.opcheck``)."""
    op, ei, N, tensors = _edge_case()
    torch.library.opcheck(sparse_poly, (op_key(op), "numba", ei[0], ei[1], N, tensors))
    op, species, tensors = _atom_case()
    torch.library.opcheck(sparse_poly, (op_key(op), "numba", species, None, 2, tensors))


def test_the_custom_op_differentiates_as_the_eager_function():
    op, ei, N, tensors = _edge_case()
    key = op_key(op)

    def custom(*ts):
        return sparse_poly(key, "numba", ei[0], ei[1], N, list(ts))[0]

    def eager(*ts):
        return apply_edge_poly_op(op, EdgeGraph(ei, N), *ts)[0]

    g = torch.Generator().manual_seed(9)
    ct = torch.randn(custom(*tensors).shape, generator=g, dtype=torch.float64)
    outs = []
    for f in (custom, eager):
        first = torch.autograd.grad((f(*tensors) * ct).sum(), tensors, create_graph=True)
        second = torch.autograd.grad(sum((d**2).sum() for d in first), tensors)
        outs.append(first + second)
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-13
    assert torch.autograd.gradcheck(custom, tuple(tensors))
    assert torch.autograd.gradgradcheck(custom, tuple(tensors))


def test_an_atom_op_through_the_custom_op_under_compile():
    op, species, (x, W) = _atom_case()

    def f(x, W):
        (out,) = apply_poly_op(op, species, 2, x, W)
        (gx,) = torch.autograd.grad((out**2).sum(), x, create_graph=True)
        return out, gx

    torch._dynamo.config.trace_autograd_ops = True
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(f(x, W), compiled(x, W)):
        assert rel_err(a, b) < 1e-12


def test_a_pickled_op_gets_a_key_of_its_own():
    import pickle

    op, *_ = _edge_case()
    again = pickle.loads(pickle.dumps(op))
    assert op_key(again) != op_key(op)
    with pytest.raises(KeyError, match="no op 'nope' in this process"):
        sparse_poly("nope", "numba", torch.zeros(1, dtype=torch.int64), None, 1, [torch.zeros(1, 1)])


def _ready_model():
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=2)
    eager = copy.deepcopy(model)
    changes = compile_ready(model)
    return eager, model, changes


def _inputs(data: dict) -> dict:
    d = {k: v.detach().clone() for k, v in data.items()}
    d["positions"].requires_grad_(True)
    return d


def _step(model, data: dict):
    """Energy, forces and the parameter gradients of an energy + force loss (double backward)."""
    out = model(data, training=True, compute_force=True)
    loss = (out["energy"] ** 2).sum() + (out["forces"] ** 2).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [out["energy"].detach(), out["forces"].detach(), *(g for g in grads if g is not None)]


def test_a_ready_mace_model_compiles_as_one_graph_and_matches_eager():
    eager, model, changes = _ready_model()
    assert any(c.startswith("accelerate:") for c in changes) and any("Activation" in c for c in changes)
    data = periodic_batch(2)

    def energy_forces(d):
        out = model(d, training=True, compute_force=True)
        return out["energy"], out["forces"]

    explained = torch._dynamo.explain(energy_forces)(_inputs(data))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    want = _step(eager, _inputs(data))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = _step(compiled, _inputs(data))
    assert len(got) == len(want) > 2
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-10


def test_a_ready_mace_model_exports_its_energy():
    eager, model, _ = _ready_model()
    data = periodic_batch(2, seed=3)
    program = energy_program(model, data)
    want = eager(dict(data), compute_force=False)["energy"]
    assert rel_err(program.module()(dict(data)), want) <= 1e-12
    assert any(isinstance(m, torch.jit.ScriptModule) for m in model.modules()), "set-aside modules are back"
    with pytest.raises(TypeError, match="no registered model family holds it"):
        compile_ready(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_compiled_model_on_a_padded_batch_matches_eager_unpadded():
    """Fixed shapes and the compiled step together: the ghost graph's all-zero one-hot rows
    take the traced contraction's mask, with no host sync."""
    from test_losses import _batch

    from workbench.packing.shapes import FixedShape
    from workbench.train.padding import pad_batch

    ref, _ = _batch(stress_everywhere=True)
    shape = FixedShape(ref.num_nodes + 5, int(ref.edge_index.shape[1]) + 40, ref.num_graphs + 2)
    padded = pad_batch(copy.deepcopy(ref), shape, r_max=4.0)
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=1)
    eager = copy.deepcopy(model)
    compile_ready(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want = eager(_inputs(ref.to_dict()), training=True, compute_force=True)
    got = compiled(_inputs(padded.to_dict()), training=True, compute_force=True)
    G, A = ref.num_graphs, ref.num_nodes
    assert rel_err(got["energy"][:G], want["energy"]) <= 1e-10
    assert rel_err(got["forces"][:A], want["forces"]) <= 1e-10
    assert float(got["forces"][A:].abs().max()) == 0.0
