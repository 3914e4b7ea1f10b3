"""A molecule far from the origin (issue 47, PH10): its graph is built centred, so energies and
forces are those at the origin, memory stays that of the molecule, and the user's coordinates
(an MD trajectory's) are kept."""

import ase.build
import ase.io
import numpy as np
import pytest
import torch
from kernel_fixtures import save_md_model

import workbench  # noqa: F401
from workbench.data.neighbour_frame import CENTRE_BEYOND_A, centred_atoms, neighbour_shift

SHIFTS = [1e2, 1e4, 1e6]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A random float64 H/O mace model, saved as mace saves models."""
    return save_md_model(tmp_path_factory.mktemp("far") / "tiny.model", (1, 8))


def _water(offset: float = 0.0):
    atoms = ase.build.molecule("H2O")
    atoms.positions += offset
    return atoms


@pytest.fixture
def neighbour_list_extent(monkeypatch):
    """The largest |coordinate| mace's neighbour list is given: its bins grow with the cube of it."""
    import mace.data.atomic_data as mace_atomic_data

    seen = []
    original = mace_atomic_data.get_neighborhood

    def spy(positions, *args, **kwargs):
        seen.append(float(np.abs(positions).max()))
        return original(positions, *args, **kwargs)

    monkeypatch.setattr(mace_atomic_data, "get_neighborhood", spy)
    return seen


def test_the_shift_applies_only_away_from_the_origin_and_not_to_full_cells():
    assert neighbour_shift(_water(CENTRE_BEYOND_A - 2.0).positions, False) is None  # near: mace's graph, bit for bit
    assert neighbour_shift(_water(1e6).positions, [True, True, True]) is None  # periodic: no cell grows
    slab = _water(1e3)
    np.testing.assert_allclose(neighbour_shift(slab.positions, [True, True, False]) + 1e3, 0.0, atol=1.0)
    far = _water(1e6)
    moved = centred_atoms(far)
    assert moved is not far and np.abs(moved.positions).max() < 1.0
    assert far.positions.min() > 1e6 - 1.0  # the caller's atoms are not touched


@pytest.mark.parametrize("offset", SHIFTS)
def test_eval_of_a_far_molecule_equals_the_origin(model_file, tmp_path, offset, neighbour_list_extent):
    from workbench.train.evaluation import evaluate_file

    results = {}
    for name, at in (("near", 0.0), ("far", offset)):
        atoms = _water(at)
        atoms.info["REF_energy"] = -10.0
        atoms.arrays["REF_forces"] = np.full((3, 3), 0.5)
        ase.io.write(tmp_path / f"{name}.xyz", atoms)
        results[name] = evaluate_file(model_file, tmp_path / f"{name}.xyz")
    for key in ("e_mae_mev_atom", "f_mae_mev_a", "f_rmse_mev_a"):
        # the far copy's relative coordinates are rounded to ~1e-10 Å at 1e6 Å, not its energy
        assert results["far"][key] == pytest.approx(results["near"][key], rel=1e-7, abs=1e-6)
    assert max(neighbour_list_extent) < 12.0  # Å: the bins are the molecule's, wherever it is


def test_md_of_a_far_molecule_keeps_the_users_coordinates(model_file, tmp_path, neighbour_list_extent):
    from workbench.train.md import run_md

    runs, frames = {}, {}
    for name, at in (("near", 0.0), ("far", 1e6)):
        traj = tmp_path / f"{name}.xyz"
        runs[name] = run_md(
            model_file,
            _water(at),
            steps=4,
            timestep_fs=0.25,
            backend="e3nn",
            trajectory=traj,
            write_every=2,
            progress=False,
        )
        frames[name] = ase.io.read(traj, index=":")
    np.testing.assert_allclose(runs["far"].potential_energy, runs["near"].potential_energy, rtol=1e-8, atol=1e-7)
    assert len(frames["far"]) == 3
    for a, b in zip(frames["far"], frames["near"]):
        np.testing.assert_allclose(a.positions - 1e6, b.positions, atol=1e-6)  # written where the user put it
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=1e-6)
    assert max(neighbour_list_extent) < 12.0  # Å: the bins are the molecule's, wherever it is


def test_graphs_of_a_far_molecule_are_centred_in_bounded_memory(neighbour_list_extent):
    """The graph builder every path shares (training, prepared stores, eval); before the fix this
    graph's neighbour list alone took ~7 GB."""
    import resource

    from mace.tools import AtomicNumberTable

    from workbench.data.atomic_data import to_atomic_data

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; a peak, so it can only grow
    near, far = to_atomic_data([_water(0.0), _water(1e6)], cutoff=4.0, z_table=AtomicNumberTable([1, 8]))
    assert torch.equal(near.edge_index, far.edge_index)
    assert float(far.positions.abs().max()) < 1.0
    assert max(neighbour_list_extent) < 12.0  # Å: the bins are the molecule's, wherever it is
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000
