"""Allegro on the workbench kernels: its ``Contracter`` as one sparse polynomial, parity with
Allegro's own einsum path (float64 within 1e-10 on energy, forces, stress and every parameter
gradient; float32 within 1e-5 of float64), gradcheck and gradgradcheck, the state dict kept."""

from __future__ import annotations

import copy

import pytest
import torch
from nequip_fixtures import batch, build_allegro, mixed_frames, outputs, parity_kernels, rel

from workbench.kernels import accelerate
from workbench.kernels.allegro import contracter
from workbench.kernels.e3nn import silu
from workbench.kernels.nequip import radial

CONFIGS = {
    "lmax2-coupled": {},
    "lmax2-uncoupled-paths": {"tp_path_channel_coupling": False},
    "lmax1-noparity-3types": {"l_max": 1, "parity": False, "num_types": 3},
    "lmax3-trainable-scales": {"l_max": 3, "per_type_energy_scales_trainable": True},
    "spline-embedding-edge-cutoffs": {
        "radial_chemical_embed": {
            "_target_": "allegro.nn.TwoBodySplineScalarEmbed",
            "num_splines": 8,
            "spline_span": 4,
        },
        "per_edge_type_cutoff": {"H": 2.6, "C": {"H": 3.0, "C": 3.5}},
    },
}


#: run on the default CPU kernels (fused passes), the others on the interpreter
ON_DEFAULT_KERNELS = ("lmax2-coupled",)


@pytest.mark.parametrize("name", CONFIGS)
def test_float64_parity_with_allegros_own_path(name, monkeypatch):
    fused = parity_kernels(monkeypatch, name in ON_DEFAULT_KERNELS)
    kw = dict(CONFIGS[name])
    model = build_allegro(**kw)
    data = batch(mixed_frames(5, kw.get("num_types", 2)), model, shuffle_edges=1)
    ref = outputs(model, data)
    fast = copy.deepcopy(model)
    accelerate(fast, backend="numba")
    sites = [m for m in fast.modules() if contracter.is_workbench(m)]
    assert len(sites) == 2 and any(m.w3j_is_ij_diagonal for m in sites)  # the last layer's diagonal w3j
    assert any(silu.SWAP.is_ours(m) for m in fast.modules())  # the MLPs' SiLU goes along, and the
    assert sum(radial.SWAP.is_ours(m) for m in fast.modules()) == ("Spline" not in str(kw))  # Bessel embedding
    got = outputs(fast, data)
    assert got.keys() == ref.keys() and any(k.endswith("weights") for k in ref)
    worst = {k: rel(got[k], ref[k]) for k in ref}
    assert max(worst.values()) <= 1e-10, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert (
        fused is None or len(fused) >= 4
    )  # at least forward and backward of both layers (longer programs: interpreter)


def test_float32_against_float64():
    f64, f32 = build_allegro("float64"), build_allegro("float32")
    f32.load_state_dict(f64.state_dict())
    data = batch(mixed_frames(9, 2), f64)
    for m in (f32, f64):
        accelerate(m, backend="numba")
    a, b = f32(dict(data)), f64(dict(data))
    assert {m.weights.dtype for m in f32.modules() if contracter.is_workbench(m)} == {torch.float32}
    for key in ("total_energy", "forces"):
        assert rel(a[key].detach(), b[key].detach()) <= 1e-5, key


def test_state_dict_kept_and_back_to_allegro():
    model = build_allegro()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    accelerate(model, backend="numba")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    accelerate(model, backend="e3nn")
    assert not any(contracter.is_workbench(m) for m in model.modules())


def test_modifier_from_a_config():
    from nequip.model import modify

    model = modify({"_target_": "nequip_fixtures.build_allegro", "l_max": 1}, [{"modifier": "enable_WorkbenchKernels"}])
    assert sum(contracter.is_workbench(m) for m in model.modules()) == 2


@pytest.mark.parametrize("coupled", [True, False])
def test_gradcheck_and_gradgradcheck_on_the_contraction(coupled):
    model = build_allegro(l_max=1, num_tensor_features=2, tp_path_channel_coupling=coupled)
    accelerate(model, backend="numba")
    gen = torch.Generator().manual_seed(2)
    for m in (m for m in model.modules() if contracter.is_workbench(m)):
        e, n = 4, 3

        def rand(*shape):
            return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()

        x1, x2, w = rand(e, m.mul * m.base_dim1), rand(n, m.mul * m.base_dim2), rand(*m.weights.shape)
        idx = torch.randint(0, n, (e,), generator=gen)

        def f(x1, x2, w, m=m, idx=idx):
            return torch.func.functional_call(m, {"weights": w}, (x1, x2, idx))

        assert torch.autograd.gradcheck(f, (x1, x2, w))
        assert torch.autograd.gradgradcheck(f, (x1, x2, w))
