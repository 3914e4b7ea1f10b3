"""Count-only neighbour statistics against vesin's full neighbour list."""

import ase
import numpy as np
import pytest
from vesin import NeighborList

from workbench.data.embedded import EMBEDDED_PATH
from workbench.data.neighbours import neighbour_stats


def _vesin(positions, cell, pbc, cutoff, min_distance):
    pbc = np.asarray(pbc, dtype=bool)
    nl = NeighborList(cutoff=max(cutoff, min_distance), full_list=True)
    i, j, d = nl.compute(
        points=positions,
        box=cell if pbc.any() else np.zeros((3, 3)),
        periodic=[bool(p) for p in pbc] if pbc.any() else False,
        quantities="ijd",
    )
    keep = d < cutoff
    close = d < min_distance
    closest = None
    if close.any():
        # Ties are common (every atom's self-image sits one lattice vector away), so keep all
        # pairs within rounding of the shortest distance; any of them is a right answer.
        shortest = float(d[close].min())
        tied = close & (d <= shortest + 1e-9)
        closest = ({frozenset((int(a), int(b))) for a, b in zip(i[tied], j[tied])}, shortest)
    return (
        int(keep.sum()),
        int(np.count_nonzero(np.bincount(i[keep], minlength=len(positions)))),
        int(close.sum()) // 2,
        closest,
    )


def _plane_spacing(vectors: np.ndarray) -> np.ndarray:
    """Distance between the lattice planes that each of the (periodic) ``vectors`` crosses."""
    duals = np.linalg.solve(vectors @ vectors.T, vectors)
    return 1.0 / np.linalg.norm(duals, axis=1)


def _same(ours, ref):
    assert (ours.edges, ours.connected, ours.close_pairs) == ref[:3]
    if ref[3] is None:
        assert ours.closest is None
    else:
        pairs, shortest = ref[3]
        assert ours.closest[2] == pytest.approx(shortest, abs=1e-12)
        assert frozenset(ours.closest[:2]) in pairs


@pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")
def test_every_embedded_structure_matches_vesin():
    from workbench.data.embedded import load_embedded

    structures = load_embedded()
    for cutoff in (4.5, 6.0):
        for a in structures[:: 1 if cutoff == 4.5 else 10]:
            _same(
                neighbour_stats(a.positions, a.cell.array, a.pbc, cutoff, 1.0),
                _vesin(a.positions, a.cell.array, a.pbc, cutoff, 1.0),
            )


def test_random_cells_skewed_small_and_mixed_periodic():
    rng = np.random.default_rng()
    checked = 0
    while checked < 300:
        n = int(rng.integers(1, 40))
        cell = rng.normal(size=(3, 3)) * rng.uniform(0.5, 6) + np.eye(3) * rng.uniform(1.5, 10)
        if abs(np.linalg.det(cell)) < 2:
            continue
        pbc = rng.random(3) < 0.7
        if pbc.any() and _plane_spacing(cell[pbc]).min() < 0.5:
            continue  # thousands of image shells: vesin takes minutes (thin cells have their own test)
        # Coordinates inside and well outside the cell (wrapping), some atoms on top of each other.
        pos = rng.uniform(-15, 25, size=(n, 3))
        if n > 3:
            pos[1] = pos[0] + rng.normal(scale=0.05, size=3)
        cutoff = float(rng.uniform(2.0, 7.0))
        _same(neighbour_stats(pos, cell, pbc, cutoff, 0.8), _vesin(pos, cell, pbc, cutoff, 0.8))
        checked += 1


def test_self_images_sparse_and_far_structures():
    # One atom in a 2 Å cube at a 4.5 Å cutoff: only its own images are neighbours (and edges).
    one = ase.Atoms("Cu", positions=[[0.3, 0.2, 0.1]], cell=np.eye(3) * 2.0, pbc=True)
    got = neighbour_stats(one.positions, one.cell.array, one.pbc, 4.5, 0.5)
    _same(got, _vesin(one.positions, one.cell.array, one.pbc, 4.5, 0.5))
    grid = np.stack(np.meshgrid(*[np.arange(-3, 4)] * 3), -1).reshape(-1, 3)
    lattice_points = int(np.count_nonzero((np.linalg.norm(2.0 * grid, axis=1) < 4.5) & grid.any(axis=1)))
    assert (got.edges, got.connected, got.closest) == (lattice_points, 1, None)
    # Two atoms 9 km apart stay cheap (the grid widens) and have no neighbour.
    far = np.array([[0.0, 0.0, 0.0], [9000.0, 10.0, -3.0], [1.0, 0.0, 0.0]])
    got = neighbour_stats(far, np.zeros((3, 3)), [False] * 3, 4.5, 0.5)
    assert (got.edges, got.connected, got.close_pairs) == (2, 2, 0)
    # A slab periodic in two directions, with a zero third cell vector.
    rng = np.random.default_rng()
    slab = rng.uniform(0, 6, size=(20, 3))
    cell = np.array([[6.0, 0, 0], [1.5, 5.5, 0], [0, 0, 0]])
    _same(neighbour_stats(slab, cell, [True, True, False], 4.5, 0.5), _vesin(slab, cell, [True, True, False], 4.5, 0.5))


def test_tied_closest_pairs_accept_any_of_them():
    # Every atom sits 0.7 Å from its own image along a: all those self pairs tie for closest,
    # and no two different atoms come that close. (CI once drew such a cell and the test
    # compared which tied pair each side reported first.)
    rng = np.random.default_rng()
    cell = np.diag([0.7, 9.0, 9.0])
    pos = np.column_stack([rng.uniform(0, 0.7, 3), [1.0, 4.0, 7.0], rng.uniform(0, 9, 3)])
    got = neighbour_stats(pos, cell, [True] * 3, 3.0, 0.8)
    pairs, shortest = _vesin(pos, cell, [True] * 3, 3.0, 0.8)[3]
    assert pairs == {frozenset((k,)) for k in range(3)} and shortest == pytest.approx(0.7, abs=1e-12)
    assert got.closest[0] == got.closest[1] and got.closest[2] == pytest.approx(0.7, abs=1e-12)
    _same(got, _vesin(pos, cell, [True] * 3, 3.0, 0.8))


THIN = """
import resource, sys
import numpy as np
from workbench.data.neighbours import neighbour_stats
cell = np.array([[100.0, 0, 0], [100.0, 0.02, 0], [0, 0, 1.0]])
pos = np.array([[0.3, 0.01, 0.2], [50.0, 0.005, 0.7]])
neighbour_stats(pos[:1], np.eye(3) * 3, [True] * 3, 2.0, 0.5)  # compile before the limit
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 100 * 2**20, resource.RLIM_INFINITY))
s = neighbour_stats(pos, cell, [True] * 3, 6.0, 0.8)
print(s.edges, s.connected, s.close_pairs, s.closest[0], s.closest[1], repr(s.closest[2]))
"""


def test_a_thin_cell_does_not_store_every_candidate_image(tmp_path):
    # Plane spacing 0.02 A: 601 x 601 x 13 shifts per atom, of which a few thousand land within
    # reach. Storing every candidate took 300 MB for these two atoms (and tens of GB for 40).
    import subprocess
    import sys

    cell = np.array([[100.0, 0, 0], [100.0, 0.02, 0], [0, 0, 1.0]])
    pos = np.array([[0.3, 0.01, 0.2], [50.0, 0.005, 0.7]])
    assert _plane_spacing(cell).min() == pytest.approx(0.02)
    out = subprocess.run([sys.executable, "-c", THIN], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    edges, connected, close_pairs, i, j, d = out.stdout.split()
    ref = _vesin(pos, cell, [True] * 3, 6.0, 0.8)
    assert (int(edges), int(connected), int(close_pairs)) == ref[:3]
    assert frozenset((int(i), int(j))) in ref[3][0] and float(d) == pytest.approx(ref[3][1], abs=1e-12)
