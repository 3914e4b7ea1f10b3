r"""Neighbour counts at a cutoff without a neighbour list: edges, connected atoms, the closest pair.

A prepared dataset's index needs, per structure, only the number of directed edges
``E = #{(i, j, S): 0 < |r_j + S·A - r_i| < r_c}`` (``S`` the integer image shifts along the
periodic lattice vectors ``A``), how many atoms have a neighbour, and whether any pair is
closer than ``d_min``. A neighbour list (vesin) allocates and returns every pair to get
there; this module counts them in one pass (numba) and keeps only the closest pair::

    stats = neighbour_stats(positions, cell, pbc, cutoff=4.5, min_distance=0.5)
    stats.edges, stats.connected, stats.close_pairs, stats.closest  # (i, j, d)

How: periodic coordinates are wrapped into the cell; image copies within ``r`` of the
structure's bounding box (``r = max(r_c, d_min)``) are added as ghosts, with as many shells of
images as the plane spacing ``h_k`` needs (``ceil(r / h_k)``); central atoms and ghosts are binned
in a Cartesian grid of cells at least ``r`` wide, and each central atom scans the 27 cells
around its own. The counts equal vesin's full list at the same cutoff (tested on the embedded
mixture and on small, skewed and mixed-periodic cells).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

MAX_CELLS_PER_POINT = 8  # grid cells per binned point; bins widen beyond this (sparse structures)


@dataclass(frozen=True)
class NeighbourStats:
    edges: int  # directed edges at the cutoff (each pair twice, self-images included)
    connected: int  # atoms with at least one neighbour
    close_pairs: int  # pairs (counted once) closer than min_distance
    closest: tuple[int, int, float] | None  # (i, j, d), i <= j, of the closest close pair; None when there is none


@njit(cache=True)
def _lattice(cell, pbc):
    """Periodic vectors ``A`` (k, 3), their duals ``B = (A A^T)^-1 A`` (``A B^T = 1``, within the
    span of ``A``) and the plane spacings ``h = 1/|b|``; ``k <= 3``, by Gauss-Jordan on ``A A^T``."""
    k = 0
    for d in range(3):
        k += 1 if pbc[d] else 0
    vectors = np.empty((k, 3))
    r = 0
    for d in range(3):
        if pbc[d]:
            vectors[r] = cell[d]
            r += 1
    aug = np.zeros((k, 2 * k))
    for i in range(k):
        for j in range(k):
            aug[i, j] = vectors[i, 0] * vectors[j, 0] + vectors[i, 1] * vectors[j, 1] + vectors[i, 2] * vectors[j, 2]
        aug[i, k + i] = 1.0
    for c in range(k):
        piv = c
        for i in range(c + 1, k):
            if abs(aug[i, c]) > abs(aug[piv, c]):
                piv = i
        if piv != c:
            for j in range(2 * k):
                aug[c, j], aug[piv, j] = aug[piv, j], aug[c, j]
        f = aug[c, c]
        for j in range(2 * k):
            aug[c, j] /= f
        for i in range(k):
            if i != c:
                g = aug[i, c]
                for j in range(2 * k):
                    aug[i, j] -= g * aug[c, j]
    duals = np.zeros((k, 3))
    spacing = np.empty(k)
    for i in range(k):
        for j in range(k):
            for d in range(3):
                duals[i, d] += aug[i, k + j] * vectors[j, d]
        spacing[i] = 1.0 / np.sqrt(duals[i, 0] ** 2 + duals[i, 1] ** 2 + duals[i, 2] ** 2)
    return vectors, duals, spacing


@njit(cache=True)
def _images(pos, vectors, shells, lo, hi, points, owner, write):
    """The image copies of ``pos`` (shifted by the lattice, the zero shift left out) inside the box
    ``lo``..``hi``: the number of central atoms plus copies, and, with ``write``, the copies
    appended to ``points`` and ``owner`` after the central atoms."""
    n, k = pos.shape[0], vectors.shape[0]
    n_shifts = 1
    for a in range(k):
        n_shifts *= 2 * shells[a] + 1
    m = n
    shift = np.zeros(3, dtype=np.int64)
    for s in range(n_shifts):
        rest, zero = s, True
        for a in range(k):
            shift[a] = rest % (2 * shells[a] + 1) - shells[a]
            rest //= 2 * shells[a] + 1
            zero = zero and shift[a] == 0
        if zero:
            continue
        sx, sy, sz = 0.0, 0.0, 0.0
        for a in range(k):
            sx += shift[a] * vectors[a, 0]
            sy += shift[a] * vectors[a, 1]
            sz += shift[a] * vectors[a, 2]
        for p in range(n):
            x, y, z = pos[p, 0] + sx, pos[p, 1] + sy, pos[p, 2] + sz
            if lo[0] <= x <= hi[0] and lo[1] <= y <= hi[1] and lo[2] <= z <= hi[2]:
                if write:
                    points[m, 0], points[m, 1], points[m, 2] = x, y, z
                    owner[m] = p
                m += 1
    return m


@njit(cache=True)
def _with_ghosts(positions, vectors, duals, shells, reach):
    """Central atoms wrapped into the cell, then the image copies within ``reach`` of their bounding
    box; ``owner`` maps every point to its atom. The copies are counted before they are stored: a
    thin cell can have millions of candidate shifts of which few land in the box."""
    n, k = positions.shape[0], vectors.shape[0]
    pos = positions.copy()
    for p in range(n):
        for a in range(k):
            c = np.floor(pos[p, 0] * duals[a, 0] + pos[p, 1] * duals[a, 1] + pos[p, 2] * duals[a, 2])
            for d in range(3):
                pos[p, d] -= c * vectors[a, d]
    lo = np.empty(3)
    hi = np.empty(3)
    for d in range(3):
        lo[d] = pos[:, d].min() - reach
        hi[d] = pos[:, d].max() + reach
    m = _images(pos, vectors, shells, lo, hi, np.empty((0, 3)), np.empty(0, dtype=np.int64), False)
    points = np.empty((m, 3))
    owner = np.empty(m, dtype=np.int64)
    points[:n] = pos
    for p in range(n):
        owner[p] = p
    stored = _images(pos, vectors, shells, lo, hi, points, owner, True)
    assert stored == m  # the same shifts and tests both times
    return points, owner


@njit(cache=True)
def _count(points, owner, n_central, cutoff, min_distance, width):
    """Edges per central atom, close pairs (directed) and the closest one, by a cell grid of ``width``."""
    m = points.shape[0]
    lo = np.empty(3)
    dims = np.empty(3, dtype=np.int64)
    for k in range(3):
        lo[k] = points[:, k].min()
        dims[k] = int((points[:, k].max() - lo[k]) / width) + 1
    cell_of = np.empty(m, dtype=np.int64)
    for p in range(m):
        bx = int((points[p, 0] - lo[0]) / width)
        by = int((points[p, 1] - lo[1]) / width)
        bz = int((points[p, 2] - lo[2]) / width)
        cell_of[p] = (bx * dims[1] + by) * dims[2] + bz
    n_cells = dims[0] * dims[1] * dims[2]
    start = np.zeros(n_cells + 1, dtype=np.int64)
    for p in range(m):
        start[cell_of[p] + 1] += 1
    for c in range(n_cells):
        start[c + 1] += start[c]
    fill = start[:-1].copy()
    members = np.empty(m, dtype=np.int64)
    for p in range(m):
        members[fill[cell_of[p]]] = p
        fill[cell_of[p]] += 1
    c2, d2min = cutoff * cutoff, min_distance * min_distance
    degree = np.zeros(n_central, dtype=np.int64)
    close = 0
    best_i, best_j, best_d2 = -1, -1, np.inf
    for i in range(n_central):
        bx = int((points[i, 0] - lo[0]) / width)
        by = int((points[i, 1] - lo[1]) / width)
        bz = int((points[i, 2] - lo[2]) / width)
        for x in range(max(bx - 1, 0), min(bx + 2, dims[0])):
            for y in range(max(by - 1, 0), min(by + 2, dims[1])):
                for z in range(max(bz - 1, 0), min(bz + 2, dims[2])):
                    c = (x * dims[1] + y) * dims[2] + z
                    for k in range(start[c], start[c + 1]):
                        q = members[k]
                        # A pair of central atoms is seen from both ends: count it once, from the lower.
                        if q < n_central and q <= i:
                            continue
                        dx = points[q, 0] - points[i, 0]
                        dy = points[q, 1] - points[i, 1]
                        dz = points[q, 2] - points[i, 2]
                        d2 = dx * dx + dy * dy + dz * dz
                        both = 2 if q < n_central else 1  # a ghost's own atom sees i's ghost
                        if d2 < c2:
                            degree[i] += 1
                            if q < n_central:
                                degree[q] += 1
                        if d2 < d2min:
                            close += both
                            if d2 < best_d2:
                                best_i, best_j, best_d2 = i, owner[q], d2
    return degree, close, best_i, best_j, best_d2


@njit(cache=True)
def _stats(positions, cell, pbc, cutoff, min_distance):
    reach = max(cutoff, min_distance)
    vectors, duals, spacing = _lattice(cell, pbc)
    shells = np.empty(spacing.shape[0], dtype=np.int64)
    for a in range(spacing.shape[0]):
        shells[a] = int(np.ceil(reach / spacing[a]))
    points, owner = _with_ghosts(positions, vectors, duals, shells, reach)
    width = reach
    m = points.shape[0]
    # A sparse structure (a few atoms far apart) would need a huge grid: widen the cells instead.
    while True:
        cells = 1.0
        for d in range(3):
            cells *= np.floor((points[:, d].max() - points[:, d].min()) / width) + 1
        if cells <= MAX_CELLS_PER_POINT * max(m, 64):
            break
        width *= 2.0
    return _count(points, owner, positions.shape[0], cutoff, min_distance, width)


def neighbour_stats(
    positions: np.ndarray, cell: np.ndarray, pbc, cutoff: float, min_distance: float = 0.0
) -> NeighbourStats:
    """Counts of the full neighbour list at ``cutoff`` Å and the pairs closer than ``min_distance`` Å.

    ``positions``: (N, 3) Å; ``cell``: (3, 3) rows are lattice vectors (only the periodic ones
    are used); ``pbc``: three booleans. Coordinates must be finite (see
    :func:`workbench.data.io.check_geometry`).
    """
    pbc = np.asarray(pbc, dtype=bool).reshape(3) if np.ndim(pbc) else np.full(3, bool(pbc))
    positions = np.ascontiguousarray(positions, dtype=np.float64)
    cell = np.ascontiguousarray(cell, dtype=np.float64)
    degree, close, i, j, d2 = _stats(positions, cell, pbc, float(cutoff), float(min_distance))
    closest = (min(int(i), int(j)), max(int(i), int(j)), float(np.sqrt(d2))) if close else None
    return NeighbourStats(
        edges=int(degree.sum()), connected=int(np.count_nonzero(degree)), close_pairs=int(close) // 2, closest=closest
    )
