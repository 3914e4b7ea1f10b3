"""The swaps that go with the hot op (:mod:`workbench.kernels.nequip.radial`, :mod:`workbench.kernels.e3nn.silu`,
:mod:`workbench.kernels.nequip.edge_vectors`): nequip's Bessel edge encoding, the MLPs' SiLU and
a batch's edge vectors give nequip's values and derivatives, go onto the workbench with
``accelerate`` and come back with ``backend="e3nn"``."""

from __future__ import annotations

import copy

import pytest
import torch
from nequip_fixtures import build_allegro, build_model
from torch.autograd import gradcheck, gradgradcheck

from workbench.kernels import accelerate
from workbench.kernels.e3nn import gate as e3nn_gate
from workbench.kernels.e3nn import linear as e3nn_linear
from workbench.kernels.e3nn import scalar_tp as e3nn_scalar_tp
from workbench.kernels.e3nn import silu
from workbench.kernels.nequip import edge_vectors, radial


def _encoding(trainable: bool, cutoff: torch.nn.Module | None = None, p: float = 6.0):
    from nequip.nn.embedding import BesselEdgeLengthEncoding, PolynomialCutoff

    m = BesselEdgeLengthEncoding(cutoff=cutoff or PolynomialCutoff(p), num_bessels=7, trainable=trainable)
    m._output_dtype = torch.float64
    if trainable:  # away from 1..N, so that a wrong weight derivative shows
        with torch.no_grad():
            m.bessel_weights.add_(0.1 * torch.randn(m.bessel_weights.shape, dtype=torch.float64))
    return m


def _lengths(seed: int, n: int = 29) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.05 + 1.1 * torch.rand(n, 1, generator=g, dtype=torch.float64)).requires_grad_()  # some beyond the cutoff


def _embed(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from nequip.data import AtomicDataDict

    out = m({AtomicDataDict.NORM_LENGTH_KEY: x})
    return out[AtomicDataDict.EDGE_EMBEDDING_KEY], out[AtomicDataDict.EDGE_CUTOFF_KEY]


def _derivatives(m: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Embedding, cutoff, d/dx and the gradients of a force-like loss to x and the weights."""
    e, c = _embed(m, x)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(e.shape, generator=g, dtype=e.dtype)
    (dx,) = torch.autograd.grad((e * v).sum() + c.sum(), x, create_graph=True)
    wrt = [x] + list(m.parameters())
    return [e, c, dx, *torch.autograd.grad((dx**2).sum(), wrt)]


class _SquareCutoff(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 - x).clamp(min=0.0) ** 2


def _cutoff(kind: str) -> torch.nn.Module | None:
    from nequip.nn.embedding import PolynomialCutoff

    class Subclass(PolynomialCutoff):  # its own forward: must be called, not read as a polynomial
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * (1.0 + 0.1 * x)

    made = {"another module": _SquareCutoff(), "a subclass": Subclass(6.0)}
    made["scripted-5"] = torch.jit.script(PolynomialCutoff(5.0))
    return made.get(kind)


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("cutoff", ["polynomial-6", "polynomial-3", "scripted-5", "a subclass", "another module"])
def test_bessel_encoding_matches_nequips_to_the_second_derivative(trainable, cutoff):
    made = _cutoff(cutoff)
    native = _encoding(trainable, made, p=float(cutoff.rpartition("-")[2]) if made is None else 6.0)
    ours = copy.deepcopy(native)
    radial.SWAP.swap(ours, "numba")
    assert isinstance(ours, radial.WorkbenchBesselEdgeLengthEncoding)
    horner = cutoff.startswith(("polynomial", "scripted"))
    assert (radial._power(ours.cutoff) is not None) == horner  # Horner's rule for exactly nequip's own
    x = _lengths(1)
    assert bool((x > 1).any()) and bool((x < 1).any())
    ref, got = _derivatives(native, x), _derivatives(ours, x)
    assert len(got) == (5 if trainable else 4)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), i


def test_gradcheck_and_gradgradcheck_in_length_and_weights():
    m = _encoding(trainable=True)
    radial.SWAP.swap(m, "numba")
    x = _lengths(2, 6)
    w = m.bessel_weights.detach().clone().requires_grad_()
    del m._parameters["bessel_weights"]  # a plain attribute from here on: g sets it

    def g(x, w):
        m.bessel_weights = w
        return _embed(m, x)[0]

    assert gradcheck(g, (x, w)) and gradgradcheck(g, (x, w))


def test_float32_output_from_float64_lengths():
    native = _encoding(False)  # float64 output: the reference
    ours = copy.deepcopy(native)
    radial.SWAP.swap(ours, "numba")
    ours._output_dtype = torch.float32
    x = _lengths(4)
    (e32, c32), (e64, c64) = _embed(ours, x), _embed(native, x)
    assert e32.dtype == c32.dtype == torch.float32 and e64.dtype == torch.float64
    assert (e32.double() - e64).abs().max() <= 1e-6 * e64.abs().max()
    assert (c32.double() - c64).abs().max() <= 1e-6


def test_coincident_atoms_give_nequips_limit():
    native = _encoding(True)
    ours = copy.deepcopy(native)
    radial.SWAP.swap(ours, "numba")
    x = torch.tensor([[0.0], [0.3]], dtype=torch.float64)
    (a, _), (b, _) = _embed(ours, x), _embed(native, x)
    assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-12 * b.abs().max()


class MySiLU(torch.nn.SiLU):
    """Someone else's subclass: accelerate must leave it as it is."""


def test_subclasses_are_left_alone_and_a_swapped_model_pickles():
    import pickle

    model = build_model(l_max=1)
    model.extra = torch.nn.Sequential(MySiLU())  # someone else's subclass
    accelerate(model, backend="numba")
    assert type(model.extra[0]) is MySiLU
    again = pickle.loads(pickle.dumps(model))
    assert sum(radial.SWAP.is_ours(m) for m in again.modules()) == 1
    assert sum(silu.SWAP.is_ours(m) for m in again.modules()) == sum(silu.SWAP.is_ours(m) for m in model.modules())


@pytest.mark.parametrize("family", ["nequip", "allegro"])
def test_accelerate_brings_the_companions_and_e3nn_takes_them_back(family):
    model = build_model(l_max=1) if family == "nequip" else build_allegro()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sites = {"bessel": radial.SWAP, "silu": silu.SWAP, "linear": e3nn_linear.SWAP, "gate": e3nn_gate.SWAP}
    sites.update({"self-connection": e3nn_scalar_tp.SWAP, "edge vectors": edge_vectors.SWAP})
    natives = {k: sum(s.is_native(m) for m in model.modules()) for k, s in sites.items()}
    assert (
        natives["edge vectors"] == (1 if family == "nequip" else 0)
        and natives["bessel"] == 1
        and natives["silu"] >= 2
        and natives["linear"] >= (4 if family == "nequip" else 0)
    )
    assert natives["gate"] == (2 if family == "nequip" else 0)
    assert natives["self-connection"] == (1 if family == "nequip" else 0)
    accelerate(model, backend="torch")
    ours = [m for s in sites.values() for m in model.modules() if s.is_ours(m)]
    assert len(ours) == sum(natives.values()) and {m.kernel_backend for m in ours} == {"torch"}
    accelerate(model, backend="e3nn")
    assert {k: sum(s.is_native(m) for m in model.modules()) for k, s in sites.items()} == natives
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def _vector_data(seed: int = 4) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A mixed batch (two periodic cells, one of them small enough for self-images, a molecule),
    positions and cells as leaves."""
    from nequip_fixtures import batch, mixed_frames

    data = batch(mixed_frames(seed, 2), build_model(l_max=1))
    pos = data["pos"].detach().clone().requires_grad_()
    cell = data["cell"].detach().clone().requires_grad_()
    return {**data, "pos": pos, "cell": cell}, pos, cell


def test_edge_vectors_frame_by_frame_match_nequips_with_gradients():
    from nequip.nn.utils import with_edge_vectors_

    data, pos, cell = _vector_data()
    ours = edge_vectors.edge_vectors(data)
    ref = with_edge_vectors_(dict(data), with_lengths=False)["edge_vectors"]
    assert ours is not None and ours.shape == ref.shape and data["cell"].shape[0] == 3
    v = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=ref.dtype)
    got = [ours, *torch.autograd.grad((ours * v).sum(), [pos, cell])]
    want = [ref, *torch.autograd.grad((ref * v).sum(), [pos, cell])]
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), i


def test_edge_vectors_leave_other_data_to_nequip():
    data, _, _ = _vector_data()
    shuffled = dict(data)  # edges no longer frame after frame
    perm = torch.randperm(data["edge_index"].shape[1], generator=torch.Generator().manual_seed(0))
    shuffled["edge_index"], shuffled["edge_cell_shift"] = data["edge_index"][:, perm], data["edge_cell_shift"][perm]
    assert edge_vectors.edge_vectors(shuffled) is None
    assert edge_vectors.edge_vectors({k: v for k, v in data.items() if k != "batch"}) is None
    assert edge_vectors.edge_vectors({**data, "edge_vectors": torch.zeros(1, 3)}) is None
    model = build_model(l_max=1)
    fast = accelerate(copy.deepcopy(model), backend="numba")
    assert sum(edge_vectors.SWAP.is_ours(m) for m in fast.modules()) == 1
    for d in (shuffled, data):  # the same energies either way
        assert torch.allclose(fast(dict(d))["total_energy"], model(dict(d))["total_energy"], rtol=1e-10, atol=0)
