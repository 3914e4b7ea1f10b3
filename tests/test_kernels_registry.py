"""The kernel seam: the backend and model registries, and the plain-torch reference backend that
every other backend is checked against."""

import copy

import pytest
import torch
from kernel_fixtures import build_model, energy_force_grads, random_batch, rel_err

from workbench.kernels import accelerate, registry
from workbench.kernels.acceleration import model_ops
from workbench.kernels.ops import EdgeGraph, SpeciesIndex, apply_edge_poly_op, apply_poly_op
from workbench.kernels.registry import Backend, get_backend

CONFIG = ("MACE", "4x0e+4x1o", 2, 2, 3)  # (class, hidden irreps, max_ell, correlation, elements)


def _sites():
    model = accelerate(build_model(*CONFIG, dtype=torch.float64), backend="numba")
    return {site.label: site for site in model_ops(model)}


def _inputs(op, channels: int, gen: torch.Generator, num_species: int = 3, atoms: int = 9, nodes: int = 7):
    """Fresh random operands for ``op`` and a row index: species per atom, or a random edge list."""
    if op.edge:
        edges = 23
        index = EdgeGraph(torch.randint(0, nodes, (2, edges), generator=gen), nodes)
    else:
        index = SpeciesIndex(torch.randint(0, num_species, (atoms,), generator=gen), num_species)
    tensors = [torch.randn(index.num_rows(o.rows), o.width, generator=gen, dtype=torch.float64) for o in op.operands]
    return tensors, index


def _passes(op):
    """The forward op, its backward and double backward (every operand differentiated)."""
    d1 = op.derivative((True,) * len(op.operands))
    d2 = d1.derivative((True,) * len(d1.operands))
    return {"forward": op, "backward": d1, "double backward": d2}


@pytest.mark.parametrize("label", ["products.0.symmetric_contractions", "interactions.1.conv_tp"])
def test_torch_reference_matches_numba_on_every_pass(label):
    site = _sites()[label]
    gen = torch.Generator().manual_seed(7)
    for name, op in _passes(site.op).items():
        if len(op.operands) > 8 and op.edge:
            continue  # beyond what the edge kernels take: the reference alone goes there
        tensors, index = _inputs(op, site.channels, gen)
        ref = op.evaluate_rows(tensors, index, backend="torch")
        fast = op.evaluate_rows(tensors, index, backend="numba")
        assert len(ref) == len(fast) == len(op.outputs)
        for r, f in zip(ref, fast):
            assert r.shape == f.shape and r.abs().max() > 0, name
            assert rel_err(f, r) <= 1e-12, (label, name, rel_err(f, r))


def test_torch_backend_gradcheck_and_gradgradcheck():
    gen = torch.Generator().manual_seed(3)
    sites = _sites()
    sc = sites["products.0.symmetric_contractions"]
    tensors, index = _inputs(sc.op, sc.channels, gen, atoms=4)
    args = [t.requires_grad_() for t in tensors]

    def f_sc(*xs):
        return apply_poly_op(sc.op, index.species, index.num_species, *xs, backend="torch")

    assert torch.autograd.gradcheck(f_sc, args)
    assert torch.autograd.gradgradcheck(f_sc, args)
    tp = sites["interactions.1.conv_tp"]
    tensors, graph = _inputs(tp.op, tp.channels, gen, nodes=4)
    args = [t.requires_grad_() for t in tensors]

    def f_tp(*xs):
        return apply_edge_poly_op(tp.op, graph, *xs, backend="torch")

    assert torch.autograd.gradcheck(f_tp, args)
    assert torch.autograd.gradgradcheck(f_tp, args)


def test_model_on_torch_backend_matches_e3nn_and_numba_float64():
    model = build_model(*CONFIG, dtype=torch.float64)
    data = random_batch(CONFIG[4], dtype=torch.float64)
    E0, F0, G0 = energy_force_grads(model, data)
    for backend in ("torch", "numba"):
        E, F, G = energy_force_grads(accelerate(copy.deepcopy(model), backend=backend), data)
        assert rel_err(E, E0) <= 1e-10 and rel_err(F, F0) <= 1e-10, backend
        assert max(rel_err(a, b) for a, b in zip(G, G0) if b.abs().max() > 0) <= 1e-10, backend
    # switching an accelerated model between descriptor backends changes no parameter
    fast = accelerate(copy.deepcopy(model), backend="numba")
    params = {id(p) for p in fast.parameters()}
    accelerate(fast, backend="torch")
    assert {id(p) for p in fast.parameters()} == params
    assert {m.kernel_backend for m in fast.modules() if hasattr(m, "kernel_backend")} == {"torch"}


def test_registry_lists_and_refuses_with_the_choices():
    names = registry.backend_names()
    assert {"numba", "torch", "e3nn", "cueq"} <= set(names)
    assert registry.backend_names("descriptor")[:2] == ("numba", "torch")
    with pytest.raises(ValueError, match="unknown backend .triton.; choose one of numba, torch, e3nn, cueq, oeq$"):
        get_backend("triton")
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        accelerate(build_model(*CONFIG), backend="triton")
    cueq = get_backend("cueq")
    assert cueq.devices == ("cuda",) and registry.DEFAULT_BACKEND == "numba"
    assert get_backend("numba").evaluator() is not None  # numba is a descriptor backend like torch
    assert get_backend("numba").available and get_backend("torch").available
    if not torch.cuda.is_available():
        reason = cueq.unavailable()
        assert reason and ("GPU" in reason or "import" in reason), reason
    with pytest.raises(ValueError, match="registered already"):
        registry.register_backend(Backend("numba", "descriptor", "again"))
    with pytest.raises(ValueError, match="kind 'gpu'; choose one of"):
        Backend("x", "gpu", "bad kind")
    with pytest.raises(TypeError, match="no registered model family holds it"):
        accelerate(torch.nn.Linear(3, 3))


def test_a_new_backend_is_one_registration(monkeypatch):
    """A toy backend (the reference evaluator, counting its calls) plugs in with one registration."""
    from workbench.kernels import reference

    calls = []

    def counting(op, tensors, index, channels):
        calls.append(len(op.outputs))
        return reference.evaluate(op, tensors, index, channels)

    monkeypatch.setitem(registry.BACKENDS, "counting", Backend("counting", "descriptor", "toy", evaluate=counting))
    model = build_model(*CONFIG, dtype=torch.float64)
    data = random_batch(CONFIG[4], dtype=torch.float64)
    E0, F0, _ = energy_force_grads(model, data)
    E, F, _ = energy_force_grads(accelerate(model, backend="counting"), data)
    assert rel_err(E, E0) <= 1e-10 and rel_err(F, F0) <= 1e-10
    assert len(calls) >= 3 * 4  # 2 contractions + 2 message ops, each forward, backward, double backward
