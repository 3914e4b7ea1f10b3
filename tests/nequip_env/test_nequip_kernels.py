"""NequIP on the workbench kernels: parity with nequip's own e3nn path, in nequip's venv.

float64: energy, forces, stress and every parameter gradient of a force-and-stress loss within
1e-10 (relative to the largest entry) of the e3nn model with the same weights; float32 within
1e-5 of float64. Inputs: random triclinic cells with atoms outside the home cell, a cell small
enough that atoms see their own images, a molecule whose last atom has no neighbour, several
frames in one batch, edges in random order.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
from nequip_fixtures import batch, build_model, mixed_frames, outputs, parity_kernels, rel

from workbench.kernels import accelerate
from workbench.kernels.e3nn import gate as e3nn_gate
from workbench.kernels.e3nn import linear as e3nn_linear
from workbench.kernels.e3nn import scalar_tp as e3nn_scalar_tp
from workbench.kernels.e3nn import silu
from workbench.kernels.nequip import radial, tp_scatter

CONFIGS = {
    "lmax1-parity-2types": {"l_max": 1, "parity": True},
    "lmax2-noparity-3types-trainable-scales": {
        "l_max": 2,
        "parity": False,
        "num_types": 3,
        "per_type_energy_scales_trainable": True,
        "per_type_energy_shifts_trainable": True,
    },
    "lmax3-parity-deep-radial": {
        "l_max": 3,
        "parity": True,
        "radial_mlp_depth": 2,
        "num_bessels": 6,
        "bessel_trainable": True,
    },
    # nequip's minimal_toy_emt.yaml model (l_max 1, 3 layers, 16 features, float64), one species
    "toy-emt-config": {"l_max": 1, "num_layers": 3, "num_features": 16, "radial_mlp_width": 8, "num_types": 1},
    "per-edge-type-cutoffs": {"l_max": 2, "per_edge_type_cutoff": {"H": 2.6, "C": {"H": 3.0, "C": 3.5}}},
}
#: run on the default CPU kernels (fused passes at 16 channels), the others on the interpreter
ON_DEFAULT_KERNELS = ("toy-emt-config",)


@pytest.mark.parametrize("name", CONFIGS)
def test_float64_parity_with_nequips_e3nn_path(name, monkeypatch):
    fused = parity_kernels(monkeypatch, name in ON_DEFAULT_KERNELS)
    kw = dict(CONFIGS[name])
    types = kw.get("num_types", 2)
    model = build_model(**kw)
    data = batch(mixed_frames(7, types), model, shuffle_edges=3)
    ref = outputs(model, data)
    fast = copy.deepcopy(model)
    assert accelerate(fast, backend="numba") is fast
    assert sum(tp_scatter.is_workbench(m) for m in fast.modules()) == kw.get("num_layers", 2)
    assert sum(radial.SWAP.is_ours(m) for m in fast.modules()) == 1  # the Bessel encoding and the
    assert sum(silu.SWAP.is_ours(m) for m in fast.modules()) >= kw.get("num_layers", 2)  # MLPs' SiLU and
    assert sum(e3nn_linear.SWAP.is_ours(m) for m in fast.modules()) >= 2 * kw.get("num_layers", 2)  # linears
    assert sum(e3nn_gate.SWAP.is_ours(m) for m in fast.modules()) == kw.get("num_layers", 2)  # gates and
    self_connections = sum(e3nn_scalar_tp.SWAP.is_native(m) for m in model.modules())
    assert sum(e3nn_scalar_tp.SWAP.is_ours(m) for m in fast.modules()) == self_connections >= 1  # self-connections
    got = outputs(fast, data)
    assert got.keys() == ref.keys() and len([k for k in ref if k.startswith("grad:")]) >= 10
    worst = {k: rel(got[k], ref[k]) for k in ref}
    assert max(worst.values()) <= 1e-10, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert fused is None or len(fused) >= 3 * kw.get("num_layers", 2)  # forward, backward, double backward


@pytest.mark.parametrize("name", ["lmax2-noparity-3types-trainable-scales", "toy-emt-config"])
def test_eval_mode_parity_runs_the_self_connection_by_species(name, monkeypatch):
    """An MD model (``eval()``: forces without a graph) takes the self-connections by species
    groups; energy, forces and stress stay nequip's."""
    from workbench.kernels.e3nn import scalar_tp_groups as e3nn_scalar_tp_groups

    groups: list[int] = []
    real = e3nn_scalar_tp_groups.GroupedScalarTP.forward
    spy = lambda ctx, plan, g, *rest: groups.append(g.size) or real(ctx, plan, g, *rest)  # noqa: E731
    monkeypatch.setattr(e3nn_scalar_tp_groups.GroupedScalarTP, "forward", staticmethod(spy))
    kw = dict(CONFIGS[name])
    model = build_model(**kw).eval()
    data = batch(mixed_frames(5, kw.get("num_types", 2)), model, shuffle_edges=2)
    fast = accelerate(copy.deepcopy(model), backend="numba").eval()
    ref, got = model(dict(data)), fast(dict(data))
    assert groups and set(groups) == {kw.get("num_types", 2)}
    periodic = ~torch.isnan(ref["stress"].reshape(ref["stress"].shape[0], -1)).any(dim=1)  # molecules: NaN
    assert periodic.any() and not periodic.all()
    for key in ("total_energy", "forces", "stress"):
        a, b = got[key].detach(), ref[key].detach()
        a, b = (a[periodic], b[periodic]) if key == "stress" else (a, b)
        assert rel(a, b) <= 1e-10, key


def test_energy_only_under_inference_mode():
    """The model without its force output (``model.model.func``: energies only) under
    ``torch.inference_mode()``, whose tensors keep no version counter for the kernels' caches."""
    model = build_model(l_max=2, num_types=3).eval()
    fast = accelerate(copy.deepcopy(model), backend="numba").eval()
    data = batch(mixed_frames(9, 3), model)
    with torch.inference_mode():
        ref = model.model.func(dict(data))["total_energy"]
        got = [fast.model.func(dict(data))["total_energy"] for _ in range(2)]
    assert all(rel(g, ref) <= 1e-10 for g in got)


def test_float32_against_float64():
    f64 = build_model("float64", l_max=2)
    f32 = build_model("float32", l_max=2)
    f32.load_state_dict(f64.state_dict())
    data = batch(mixed_frames(11, 2), f64)
    accelerate(f64, backend="numba")
    accelerate(f32, backend="numba")
    a, b = f32(dict(data)), f64(dict(data))
    # nequip keeps positions and outputs in float64; the message passing runs in the model dtype
    assert {m.model_dtype for m in f32.modules() if tp_scatter.is_workbench(m)} == {torch.float32}
    assert a["node_features"].dtype == torch.float32
    for key in ("total_energy", "forces"):
        assert rel(a[key].detach(), b[key].detach()) <= 1e-5, key


def test_accelerate_in_place_and_back_keeps_the_state_dict():
    model = build_model(l_max=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    accelerate(model, backend="numba")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: id(p) for n, p in model.named_parameters()} == ids  # optimizers keep their parameters
    accelerate(model, backend="e3nn")
    assert not any(tp_scatter.is_workbench(m) for m in model.modules())
    assert sum(tp_scatter.is_native(m) for m in model.modules()) == 2


def test_user_hooks_survive_acceleration_and_never_fire_on_probes():
    """A lambda hook on every module (a user's logging): the companions' probes copy modules that
    e3nn pickles, and a lambda does not pickle. The first step must run, and each hook fire once
    per module call of the user's own step, never on a probe."""
    model = build_model(l_max=2, num_types=3)
    accelerate(model, backend="numba")
    fired: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.jit.ScriptModule):
            m.register_forward_hook(lambda m, i, o, name=name: fired.append(name))
    data = batch(mixed_frames(seed=3, types=3), model)
    outputs(model, data)  # the companions build their plans here
    first, fired[:] = list(fired), []
    outputs(model, data)
    assert first == fired and fired.count("") == 1


def test_modifier_from_a_nequip_config():
    from nequip.model import modify

    config = {"_target_": "nequip_fixtures.build_model", "l_max": 1}
    model = modify(config, [{"modifier": "enable_WorkbenchKernels", "backend": "torch"}])
    sites = [m for m in model.modules() if tp_scatter.is_workbench(m)]
    assert len(sites) == 2 and {m.kernel_backend for m in sites} == {"torch"}
    modify(model, [{"modifier": "enable_WorkbenchKernels", "backend": "e3nn"}])
    assert not any(tp_scatter.is_workbench(m) for m in model.modules())


def test_gradcheck_and_gradgradcheck_on_nequips_polynomials():
    model = build_model(l_max=3, parity=True, num_features=2, radial_mlp_width=4)
    accelerate(model, backend="numba")
    gen = torch.Generator().manual_seed(5)
    for m in (m for m in model.modules() if tp_scatter.is_workbench(m)):
        n, e = 4, 9
        x = torch.randn(n, m.tp.irreps_in1.dim, dtype=torch.float64, generator=gen, requires_grad=True)
        y = torch.randn(e, m.tp.irreps_in2.dim, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(e, m.tp.weight_numel, dtype=torch.float64, generator=gen, requires_grad=True)
        src, dst = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)

        def f(x, y, w, m=m, src=src, dst=dst):
            return m(x, y, w, dst, src)

        assert torch.autograd.gradcheck(f, (x, y, w))
        assert torch.autograd.gradgradcheck(f, (x, y, w))


def test_unequal_multiplicities_are_refused_naming_the_module():
    model = build_model(l_max=2, parity=False, num_features=[4, 2, 4])
    with pytest.raises(TypeError, match=r"tp_scatter \(TensorProductScatter\): .*channels"):
        accelerate(model, backend="numba")
    assert not any(tp_scatter.is_workbench(m) for m in model.modules())  # all or nothing


def test_the_workbench_imports_without_mace():
    assert importlib.util.find_spec("mace") is None  # this venv has nequip, not mace-torch
    import workbench.kernels
    import workbench.packing

    assert "nequip" in workbench.kernels.registry.MODELS and "mace" not in sys.modules
