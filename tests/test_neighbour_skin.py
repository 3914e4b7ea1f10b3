"""The MD calculator's neighbour list (:mod:`workbench.data.neighbour_skin`): searched once with a
skin, it answers with exactly mace's edges while atoms move less than half the skin, and searches
again when they move farther, or the cell, the atom count or the cutoff change."""

import numpy as np
import pytest
from ase.build import bulk, molecule
from kernel_fixtures import save_md_model
from mace.data.neighborhood import get_neighborhood

from workbench.data.neighbour_skin import SkinNeighbourList

CUTOFF = 3.0


def _shifts_by_edge(result) -> dict:
    """``{(i, j, S): shift vector}`` of a ``get_neighborhood`` result."""
    edge_index, shifts, unit_shifts, _ = result
    return {(int(i), int(j), *map(int, u)): d for (i, j), u, d in zip(edge_index.T, unit_shifts, shifts)}


def _same_as_mace(neighbours: SkinNeighbourList, atoms) -> None:
    args = (atoms.positions, CUTOFF, tuple(atoms.pbc))
    mine, theirs = neighbours(*args, np.array(atoms.cell)), get_neighborhood(*args, np.array(atoms.cell))
    mine_edges, their_edges = _shifts_by_edge(mine), _shifts_by_edge(theirs)
    assert mine_edges.keys() == their_edges.keys() and len(mine_edges) == mine[0].shape[1] > 0
    for edge, shift in their_edges.items():
        np.testing.assert_allclose(mine_edges[edge], shift, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(mine[3], theirs[3])  # the cell, widened where not periodic


@pytest.mark.parametrize("periodic", [True, False])
def test_the_kept_list_gives_mace_edges_until_an_atom_moves_half_the_skin(periodic):
    rng = np.random.default_rng(7)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 3, 3))
    atoms.positions += rng.normal(0, 0.1, atoms.positions.shape)
    if not periodic:
        atoms.pbc = False
        atoms.cell = np.zeros((3, 3))
        atoms.positions += 15.0  # off the origin: mace widens the cell with the coordinates
    neighbours = SkinNeighbourList(skin=0.4)
    start = atoms.positions.copy()
    _same_as_mace(neighbours, atoms)
    for _ in range(4):  # each atom within 0.2 Å of where the list was built
        step = rng.normal(0, 1, start.shape)
        atoms.positions = start + 0.19 * step / np.linalg.norm(step, axis=1, keepdims=True)
        _same_as_mace(neighbours, atoms)
    assert neighbours.builds == 1
    atoms.positions = start
    atoms.positions[5] += [0.21, 0.0, 0.0]
    _same_as_mace(neighbours, atoms)
    assert neighbours.builds == 2


def test_a_new_cell_atom_count_or_cutoff_searches_again():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    atoms.positions += np.random.default_rng(8).normal(0, 0.05, atoms.positions.shape)
    neighbours = SkinNeighbourList(skin=0.4)
    _same_as_mace(neighbours, atoms)
    atoms.set_cell(atoms.cell.array * 1.01, scale_atoms=False)  # NPT: same positions, new cell
    _same_as_mace(neighbours, atoms)
    assert neighbours.builds == 2
    del atoms[3]
    _same_as_mace(neighbours, atoms)
    assert neighbours.builds == 3
    neighbours(atoms.positions, CUTOFF + 0.1, tuple(atoms.pbc), np.array(atoms.cell))
    assert neighbours.builds == 4
    with pytest.raises(ValueError, match="skin must be positive, got 0"):
        SkinNeighbourList(skin=0)


def test_md_calculator_keeps_its_list_and_its_numbers(tmp_path):
    from workbench.train.md_calculator import load_calculator

    path = save_md_model(tmp_path / "ho.model", (1, 8))
    water = molecule("H2O")
    water.positions += np.random.default_rng(9).normal(0, 0.05, water.positions.shape)
    kept = load_calculator(path)
    for k in range(3):
        atoms = water.copy()
        atoms.positions += 0.01 * k
        atoms.calc = kept
        got = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = load_calculator(path)  # a fresh search
        want = atoms.get_potential_energy(), atoms.get_forces()
        assert abs(got[0] - want[0]) <= 1e-10 * abs(want[0])
        assert np.abs(got[1] - want[1]).max() <= 1e-10 * np.abs(want[1]).max()
    assert kept.neighbour_list.builds == 1


def test_a_kept_list_left_in_mace_never_searches_through_another(tmp_path, monkeypatch):
    """A list another thread's calculator left installed is not taken as the search (it would
    search through itself at ever larger cutoffs), and the search is put back after the call."""
    import mace.data.atomic_data as atomic_data

    from workbench.train.md_calculator import load_calculator

    stray = SkinNeighbourList(search=get_neighborhood)
    monkeypatch.setattr(atomic_data, "get_neighborhood", stray)
    calc = load_calculator(save_md_model(tmp_path / "ho.model", (1, 8)))
    water = molecule("H2O")
    water.calc = calc
    water.get_potential_energy()
    assert calc.neighbour_list.search is get_neighborhood and calc.neighbour_list.builds == 1
    assert atomic_data.get_neighborhood is stray and stray.builds == 0


def test_a_forces_only_call_skips_the_stress_and_a_later_stress_call_computes_it(tmp_path, monkeypatch):
    """mace computes the stress at every call; the calculator does only when ASE asks for it
    (an MD integrator asks for forces), and a stress asked later is the full call's."""
    from workbench.train.md_calculator import load_calculator

    path = save_md_model(tmp_path / "ho.model", (1, 8))
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 1, 1)
    atoms.numbers[::2] = 1  # H and O: the model's elements
    atoms.numbers[1::2] = 8
    atoms.positions += np.random.default_rng(3).normal(0, 0.05, atoms.positions.shape)
    full = load_calculator(path)
    lazy = load_calculator(path)
    asked = []
    for calc in (full, lazy):
        model = calc.models[0]
        monkeypatch.setattr(model, "forward", _recording(model.forward, asked))
    a, b = atoms.copy(), atoms.copy()
    a.calc, b.calc = full, lazy
    full.calculate(a)  # every property, as mace's own calculator computes them
    forces = b.get_forces()
    assert asked == [True, False] and "stress" not in lazy.results
    assert np.abs(forces - full.results["forces"]).max() <= 1e-12 * np.abs(forces).max()
    assert abs(b.get_potential_energy() - full.results["energy"]) <= 1e-12 * abs(full.results["energy"])
    assert asked == [True, False]  # the energy came with the forces
    stress = b.get_stress()  # Voigt, as mace stores it
    assert asked == [True, False, True]
    assert np.abs(stress - full.results["stress"]).max() <= 1e-10 * np.abs(full.results["stress"]).max()


def _recording(forward, asked: list):
    def call(*args, **kwargs):
        asked.append(bool(kwargs.get("compute_stress")))
        return forward(*args, **kwargs)

    return call
