"""``workbench md``: NVE/NVT with a mace model on the workbench kernels, drift and speed reported."""

import json

import ase.io
import numpy as np
import pytest
import torch
from cli_fixtures import run_workbench
from kernel_fixtures import save_md_model
from md_fixtures import tiny_model  # noqa: F401

import workbench  # noqa: F401
from workbench.train.md import energy_drift, run_md


def test_energy_drift_is_the_least_squares_slope_per_atom():
    t = np.linspace(0.0, 2.0, 21)
    e = 10.0 * (0.5 + 0.03 * t) + 0.001 * np.sin(40 * t)  # 10 atoms: 0.03 eV/atom/ps plus a wiggle
    slope, excursion = energy_drift(t, e, atoms=10)
    assert slope == pytest.approx(0.03, abs=2e-4)
    assert excursion == pytest.approx(np.max(np.abs(e / 10 - e[0] / 10)))


def test_nve_20_steps_numba_matches_e3nn(tiny_model):  # noqa: F811
    model, structure = tiny_model
    runs = {
        b: run_md(model, structure, steps=20, backend=b, timestep_fs=0.25, progress=False) for b in ("numba", "e3nn")
    }
    a, b = runs["numba"], runs["e3nn"]
    assert a.steps == 20 and len(a.total_energy) == 21 and a.atoms == 48
    # float64 model, same velocities: the two trajectories agree to rounding
    np.testing.assert_allclose(a.total_energy, b.total_energy, rtol=1e-10)
    assert np.isfinite(a.drift_ev_atom_ps) and a.ns_per_day > 0 and a.ms_per_step > 0
    # velocity Verlet at 0.25 fs: the total energy moves far less than the potential energy does
    assert a.max_excursion_ev_atom < 0.1 * np.ptp(np.asarray(a.potential_energy) / a.atoms)


def test_cli_writes_trajectory_and_reports_drift(tiny_model, tmp_path):  # noqa: F811
    model, structure = tiny_model
    traj, out = tmp_path / "md.xyz", tmp_path / "md.json"
    options = ("--steps", 20, "--ensemble", "nvt", "--trajectory", traj, "--write-every", 5, "--json", out)
    res = run_workbench("md", model, "--structure", structure, *options, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "NVT 20 steps" in res.stdout and "eV/atom/ps" in res.stdout and "ns/day" in res.stdout
    assert len(ase.io.read(traj, index=":")) == 5  # steps 0, 5, 10, 15, 20
    data = json.loads(out.read_text())
    assert data["ensemble"] == "nvt" and len(data["temperature_k"]) == 21


@pytest.mark.parametrize(
    "args, message",
    [
        (["--structure", "missing.xyz"], "missing.xyz: no such structure file"),
        (["--structure", "{structure}", "--ensemble", "npt"], "invalid choice: 'npt'"),
    ],
)
def test_cli_errors_name_the_problem(tiny_model, args, message):  # noqa: F811
    model, structure = tiny_model
    args = [a.format(structure=structure) for a in args]
    res = run_workbench("md", model, *args, timeout=300)
    assert res.returncode == 2 and message in res.stderr


def _count_forwards(monkeypatch, cls) -> list:
    calls: list = []
    original = cls.forward

    def spy(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", spy)
    return calls


def test_backend_e3nn_on_an_accelerated_file_runs_e3nn(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    """A model file saved after accelerate() runs mace's e3nn modules under --backend e3nn, as the
    summary says, and the workbench kernels under numba (issue 47, AC27b)."""
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceContraction

    from workbench.kernels import SymmetricContraction, accelerate

    model, structure = tiny_model
    fast = accelerate(torch.load(model, weights_only=False), backend="numba")
    torch.save(fast, tmp_path / "accelerated.model")
    runs = {"ours": _count_forwards(monkeypatch, SymmetricContraction)}
    runs["mace"] = _count_forwards(monkeypatch, MaceContraction)
    for backend, runs_it, idle in (("e3nn", "mace", "ours"), ("numba", "ours", "mace")):
        result = run_md(tmp_path / "accelerated.model", structure, steps=2, backend=backend, progress=False)
        assert f"backend {backend}:" in result.summary()
        assert runs[runs_it] and not runs[idle], (backend, {k: len(v) for k, v in runs.items()})
        for calls in runs.values():
            calls.clear()


def test_calculator_of_many_elements_matches_e3nn(tmp_path, monkeypatch):
    """A model of 8 elements on methanol in a periodic box (3 present): the MD calculator's paths
    that work on the species present (the contraction's folded weights, the self-connection's
    per-species matrices) give e3nn's energy, forces and stress in float64."""
    from ase.build import molecule

    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction
    from workbench.train.md_calculator import load_calculator

    monkeypatch.delenv("WORKBENCH_FOLD_SPECIES", raising=False)
    path = save_md_model(tmp_path / "many.model", (1, 6, 7, 8, 9, 14, 26, 29))
    atoms = molecule("CH3OH", vacuum=2.0, pbc=True)
    atoms.positions += np.random.default_rng(3).normal(0, 0.05, atoms.positions.shape)
    out = {}
    for backend in ("numba", "e3nn"):
        calc = load_calculator(path, backend=backend)
        a = atoms.copy()
        a.calc = calc
        out[backend] = (a.get_potential_energy(), a.get_forces(), a.get_stress())
        names = {type(m).__name__ for m in calc.models[0].modules()}
        assert ("WorkbenchScalarTP" in names) == (backend == "numba")
    model = load_calculator(path).models[0]
    x = torch.zeros(1, dtype=torch.float64)
    contractions = [m for m in model.modules() if isinstance(m, SymmetricContraction)]
    assert len(contractions) == 2 and all(m.fold(x) for m in contractions)
    (e1, f1, s1), (e0, f0, s0) = out["numba"], out["e3nn"]
    assert abs(e1 - e0) <= 1e-10 * abs(e0)
    assert np.abs(f1 - f0).max() <= 1e-10 * np.abs(f0).max()
    assert np.abs(s1 - s0).max() <= 1e-10 * np.abs(s0).max()
