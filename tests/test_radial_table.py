"""Radial networks as tables for MD (:mod:`workbench.kernels.radial_table`,
:mod:`workbench.kernels.mace.radial`): the table meets its measured tolerance, a tabulated mace
model gives the network's energies, forces and stress (1e-10 in float64, 1e-5 in float32 against
float64) for every interaction block and radial basis mace builds, and it runs the network
wherever the table would be wrong or stale."""

import copy
import io
import math

import numpy as np
import pytest
import torch
from kernel_fixtures import build_model, periodic_batch, rel_err, save_md_model

from workbench.kernels.mace import radial
from workbench.kernels.mace.radial import tabulate_radial, untabulate_radial
from workbench.kernels.numba.cpu.radial import table_slope_dot, table_values
from workbench.kernels.radial_table import TOLERANCE, TableRefused, build

WAVES = torch.tensor([0.7, 1.9, 3.1, 5.3], dtype=torch.float64)


def _waves(r: torch.Tensor) -> torch.Tensor:
    """``[K, 4]``: sin(k r) / r, a Bessel-like basis."""
    return torch.sin(r[:, None] * WAVES) / r[:, None]


def _waves_slope(r: torch.Tensor) -> torch.Tensor:
    x = r[:, None] * WAVES
    return (WAVES * torch.cos(x) * r[:, None] - torch.sin(x)) / r[:, None] ** 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernels_meet_the_measured_tolerance(dtype):
    table = build(_waves, lo=0.3, hi=5.0, dtype=dtype)
    tol_v, tol_s = TOLERANCE[dtype]
    assert table.value_error <= tol_v and table.slope_error <= tol_s
    assert table.coeffs.dtype == (np.float64 if dtype == torch.float64 else np.float32)
    r64 = torch.from_numpy(np.random.default_rng(3).uniform(0.3, 5.0, 2000))
    r = r64.to(dtype).numpy()
    values, plan = table_values(r, table.lo, table.h, table.coeffs)
    truth = _waves(torch.from_numpy(r).double())
    assert rel_err(torch.from_numpy(values).double(), truth) <= (1e-12 if dtype == torch.float64 else 2e-6)
    grad = np.random.default_rng(4).normal(size=values.shape).astype(r.dtype)
    dot = table_slope_dot(r, plan, table.lo, table.h, table.coeffs, grad)
    want = (torch.from_numpy(grad).double() * _waves_slope(torch.from_numpy(r).double())).sum(1)
    assert rel_err(torch.from_numpy(dot).double(), want) <= (1e-9 if dtype == torch.float64 else 1e-5)


def test_kernels_on_runs_of_every_length_match_the_polynomials():
    """Intervals holding 1 to 9 edges, shuffled, across chunk boundaries: the blocked and the
    single-edge evaluations both equal the polynomials written out in numpy (float64)."""
    rng = np.random.default_rng(7)
    n, lo, h = 40, 0.2, 0.1
    coeffs = rng.normal(size=(n, 8, 37))
    counts = [q % 9 + 1 for q in range(n)]
    q = np.repeat(np.arange(n), counts)
    s = rng.uniform(-1.0, 1.0, q.size)
    shuffle = rng.permutation(q.size)
    q, s = q[shuffle], s[shuffle]
    r = lo + (q + (s + 1.0) / 2.0) * h
    s = 2.0 * ((r - lo) / h - q) - 1.0  # as the kernels compute it from r
    powers = s[:, None] ** np.arange(8)
    want = np.einsum("ep,epj->ej", powers, coeffs[q])
    slopes = np.einsum("ep,epj->ej", np.arange(1, 8) * powers[:, :7], coeffs[q][:, 1:]) * (2.0 / h)
    values, plan = table_values(r, lo, h, coeffs)
    grad = rng.normal(size=values.shape)
    dot = table_slope_dot(r, plan, lo, h, coeffs, grad)
    assert np.array_equal(plan[1], q)
    assert np.abs(values - want).max() <= 1e-13 * np.abs(want).max()
    assert np.abs(dot - (grad * slopes).sum(1)).max() <= 1e-12 * np.abs(dot).max()


def test_the_edges_of_the_domain_are_covered_and_nothing_past_them():
    table = build(_waves, lo=0.5, hi=4.0, dtype=torch.float64)
    assert math.isclose(table.hi, 4.0)
    assert table.covers(torch.tensor([0.5, 4.0], dtype=torch.float64))
    assert not table.covers(torch.tensor([0.49, 1.0], dtype=torch.float64))
    assert not table.covers(torch.tensor([1.0, 4.0001], dtype=torch.float64))
    values, _ = table_values(np.array([0.5, 4.0]), table.lo, table.h, table.coeffs)
    assert rel_err(torch.from_numpy(values), _waves(torch.tensor([0.5, 4.0], dtype=torch.float64))) <= 1e-12


def test_a_function_that_cannot_be_tabulated_is_refused():
    with pytest.raises(TableRefused, match=r"not finite on \[0, 4\]"):
        build(_waves, lo=0.0, hi=4.0, dtype=torch.float64)  # sin(0) / 0
    with pytest.raises(
        TableRefused, match=r"over the tolerance 1e-20 / 1e-20, and a finer table would pass 0.0625 MiB"
    ):
        build(_waves, lo=0.5, hi=4.0, dtype=torch.float64, tolerance=(1e-20, 1e-20), max_bytes=2**16)


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _outputs(model: torch.nn.Module, data: dict) -> tuple[torch.Tensor, ...]:
    out = model({k: v.clone() for k, v in data.items()}, training=False, compute_force=True, compute_stress=True)
    return tuple(out[k].detach() for k in ("energy", "forces", "stress"))


class _Calls:
    """Counts the tables' answers (weights read in place by the message passes, or values)."""

    def __init__(self, monkeypatch):
        self.n = 0
        weights, values = radial.TabulatedWeights, radial.TableValues

        def counted(*args):
            self.n += 1
            return weights(*args)

        class Values:
            @staticmethod
            def apply(*args):
                self.n += 1
                return values.apply(*args)

        monkeypatch.setattr(radial, "TabulatedWeights", counted)
        monkeypatch.setattr(radial, "TableValues", Values)


CONFIGS = [
    ("RealAgnosticResidualInteractionBlock", 1, 1, {}),
    ("RealAgnosticResidualInteractionBlock", 3, 3, {"radial_type": "gaussian"}),
    ("RealAgnosticInteractionBlock", 2, 2, {"apply_cutoff": False}),
    ("RealAgnosticDensityInteractionBlock", 2, 2, {"num_polynomial_cutoff": 6}),
    ("RealAgnosticDensityResidualInteractionBlock", 1, 3, {}),
]


@pytest.mark.parametrize("interaction, max_ell, correlation, extra", CONFIGS)
def test_tabulated_model_gives_the_networks_energy_forces_and_stress(
    monkeypatch, interaction, max_ell, correlation, extra
):
    data = periodic_batch(3, dtype=torch.float64)
    model = _frozen(
        build_model("ScaleShiftMACE", "8x0e+8x1o", max_ell, correlation, 3, interaction=interaction, **extra)
    )
    want = _outputs(model, data)
    model32 = copy.deepcopy(model).float()
    report = tabulate_radial(model)
    assert sorted(report) == ["interactions.0", "interactions.1"]
    assert all(v.startswith("table of ") for v in report.values()), report
    calls = _Calls(monkeypatch)
    got = _outputs(model, data)
    assert calls.n == 2
    for name, a, b in zip(("energy", "forces", "stress"), got, want):
        assert rel_err(a, b) <= 1e-10, name
    # float32 tables against the float64 network
    tabulate_radial(model32)
    got32 = _outputs(model32, periodic_batch(3, dtype=torch.float32))
    assert calls.n == 4
    for name, a, b in zip(("energy", "forces", "stress"), got32, want):
        assert rel_err(a.double(), b) <= 1e-5, name


KEPT = {
    "distance_transform": (
        "Agnesi",
        "network kept: its radial embedding applies a AgnesiTransform (depends on species)",
    ),
    # torch.special.chebyshev_polynomial_t has no derivative: mace's forces leave the basis out
    "radial_type": ("chebyshev", "network kept: the slope errors do not fall as the intervals double"),
}


@pytest.mark.parametrize("keyword", sorted(KEPT))
def test_an_embedding_the_table_cannot_follow_keeps_its_networks(monkeypatch, keyword):
    value, reason = KEPT[keyword]
    data = periodic_batch(3, dtype=torch.float64)
    model = _frozen(build_model("MACE", "8x0e+8x1o", 2, 2, 3, **{keyword: value}))
    want = _outputs(model, data)
    report = tabulate_radial(model)
    assert sorted(report) == ["interactions.0", "interactions.1"]
    assert all(v.startswith(reason) for v in report.values()), report
    assert type(model.radial_embedding).__name__ == "RadialEmbeddingBlock"  # no table reads it: untapped
    calls = _Calls(monkeypatch)
    got = _outputs(model, data)
    assert calls.n == 0 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_network_runs_when_the_table_would_be_wrong(monkeypatch):
    data = periodic_batch(3, dtype=torch.float64)
    model = _frozen(build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 3))
    tabulate_radial(model)
    calls = _Calls(monkeypatch)
    model.train()  # training mode
    _outputs(model, data)
    model.eval()
    for p in model.parameters():  # parameters that take gradients
        p.requires_grad_(True)
    _outputs(model, data)
    assert calls.n == 0
    _frozen(model)
    mlp = model.interactions[1].conv_tp_weights
    for change in ("in place", "through .data"):  # .data bumps no version counter (EMA helpers write so)
        with torch.no_grad():
            (mlp.layer0.weight if change == "in place" else mlp.layer0.weight.data).mul_(1.5)
        got = _outputs(model, data)
        assert calls.n == 2 * (1 + (change != "in place")), change
        untabulate_radial(model)
        for a, b in zip(got, _outputs(model, data)):
            assert rel_err(a, b) <= 1e-10, change
        tabulate_radial(model)


def test_forces_from_a_table_are_not_differentiated_again():
    data = periodic_batch(3, dtype=torch.float64)
    model = _frozen(build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 3))
    tabulate_radial(model)
    inputs = {k: v.clone() for k, v in data.items()}
    with pytest.raises(RuntimeError, match="differentiable once"):
        model(inputs, training=True, compute_force=True)  # forces with create_graph


def test_tabulated_model_saves_with_the_same_keys_and_goes_back(monkeypatch):
    model = _frozen(build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 3))
    keys = list(model.state_dict())
    tabulate_radial(model)
    assert list(model.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    data = periodic_batch(3, dtype=torch.float64)
    calls = _Calls(monkeypatch)
    assert all(rel_err(a, b) <= 1e-10 for a, b in zip(_outputs(loaded, data), _outputs(model, data)))
    assert calls.n == 4  # the loaded copy answers from its own (rebuilt) tables too
    untabulate_radial(model)
    assert type(model.radial_embedding).__name__ == "RadialEmbeddingBlock"
    assert type(model.interactions[0].conv_tp_weights).__name__ == "FullyConnectedNet"
    assert list(model.state_dict()) == keys


def test_md_calculator_tabulates_by_default_on_the_numba_backend(tmp_path, monkeypatch):
    from ase.build import molecule

    from workbench.train.md_calculator import load_calculator

    path = save_md_model(tmp_path / "ho.model", (1, 8))
    water = molecule("H2O")
    water.positions += np.random.default_rng(5).normal(0, 0.05, water.positions.shape)
    results, calls = {}, _Calls(monkeypatch)
    for radial_choice in ("table", "mlp"):
        calc = load_calculator(path, radial=radial_choice)
        assert not calc.models[0].training
        atoms = water.copy()
        atoms.calc = calc
        results[radial_choice] = (atoms.get_potential_energy(), atoms.get_forces())
        assert calls.n == 2, radial_choice  # the table's two interactions, then the networks
    assert abs(results["table"][0] - results["mlp"][0]) <= 1e-10 * abs(results["mlp"][0])
    assert np.abs(results["table"][1] - results["mlp"][1]).max() <= 1e-10 * np.abs(results["mlp"][1]).max()
    report = load_calculator(path).radial_report
    assert len(report) == 1 and all(v.startswith("table of ") for v in report[0].values())
    e3nn_calc = load_calculator(path, backend="e3nn")
    assert e3nn_calc.radial_report == [{}]
    # the MD path's linears (mace.adapter.use_companions): ours with numba, e3nn's with e3nn
    ours, theirs = ({type(m).__name__ for m in c.models[0].modules()} for c in (calc, e3nn_calc))
    swapped = {"WorkbenchLinear", "WorkbenchScalarTP", "WorkbenchReshapeIrreps"}
    assert swapped <= ours
    assert not swapped & theirs and "Linear" in theirs
    with pytest.raises(ValueError, match="radial='spline'; the choices are table, mlp"):
        load_calculator(path, radial="spline")


@pytest.mark.parametrize("interaction, extra", [CONFIGS[1][::3], CONFIGS[2][::3]])
def test_message_passes_read_the_table_in_place(monkeypatch, interaction, extra):
    """Accelerated, on the fused CPU kernels: each interaction's message op reads its table (its
    ``[E, J]`` weights never written), unless its block multiplies them by the cutoff first (then
    they are values); the network's energy, forces and stress either way."""
    from workbench.kernels import accelerate, tabulated_edge
    from workbench.kernels.options import overridden

    data = periodic_batch(3, dtype=torch.float64)
    model = _frozen(build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 3, interaction=interaction, **extra))
    want = _outputs(model, data)
    in_place, apply = [], tabulated_edge._TabulatedEdge.apply
    monkeypatch.setattr(tabulated_edge._TabulatedEdge, "apply", lambda *a: in_place.append(1) or apply(*a))
    with overridden(cpu_kernels="auto"):
        for dtype in (torch.float64, torch.float32) if extra.get("apply_cutoff") is not False else (torch.float64,):
            fast = accelerate(copy.deepcopy(model).to(dtype))
            tabulate_radial(fast)
            got = _outputs(fast, periodic_batch(3, dtype=dtype))
            for name, a, b in zip(("energy", "forces", "stress"), got, want):
                assert rel_err(a.double(), b) <= (1e-10 if dtype == torch.float64 else 1e-5), (name, dtype)
    assert len(in_place) == (0 if extra.get("apply_cutoff") is False else 4)  # 2 interactions, 2 dtypes
