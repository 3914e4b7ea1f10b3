"""Builders of the water families: gas-phase clusters, liquid boxes and the Al3+/HCl solution.

Waters are rigid TIP3P molecules; :func:`place_waters` orients them so that no H comes too close
to what is already placed (also used for the pore water of :mod:`workbench.data.synth.build_zeolite`).
"""

from __future__ import annotations

import numpy as np
from ase import Atoms

from workbench.data.synth.build_common import random_rotation, snap

# Rigid TIP3P water: O–H 0.9572 Å, H–O–H 104.52 degrees, in the molecule frame.
_R_OH, _THETA = 0.9572, np.deg2rad(104.52)
_WATER = np.array(
    [
        [0.0, 0.0, 0.0],
        [_R_OH * np.sin(_THETA / 2), 0.0, _R_OH * np.cos(_THETA / 2)],
        [-_R_OH * np.sin(_THETA / 2), 0.0, _R_OH * np.cos(_THETA / 2)],
    ]
)
_MASS_H2O = 18.015  # g/mol
_AVOGADRO = 6.02214076e23


def place_waters(
    centres: np.ndarray,
    rng: np.random.Generator,
    others: np.ndarray,
    cell=None,
    min_dist: float = 1.6,
    donate_to=None,
    tries: int = 60,
) -> np.ndarray:
    """Orient rigid waters at O positions ``centres`` (m, 3) -> (3m, 3) O,H,H positions.

    Each orientation is redrawn until H atoms keep ``min_dist`` from every other atom
    placed so far (``others`` plus earlier waters), with minimum image if ``cell`` (3x3
    orthorhombic). ``donate_to`` (m, 3) optional acceptor positions: one O–H points at it
    (an H bond), giving realistic cluster geometries.
    """
    placed = [others.reshape(-1, 3)]
    out = np.empty((3 * len(centres), 3))
    L = None if cell is None else np.diag(cell)
    for i, o in enumerate(centres):
        prev = np.concatenate(placed) if placed else np.empty((0, 3))
        prev = prev[
            snap(np.linalg.norm(prev - o if L is None else (prev - o) - L * np.round((prev - o) / L), axis=1)) < 4.0
        ]
        best, best_d = None, -1.0
        for t in range(tries):
            rot = random_rotation(rng)
            if donate_to is not None and donate_to[i] is not None and t < tries // 2:
                # rotate so that the first O–H points along the O···acceptor direction
                target = donate_to[i] - o
                target /= np.linalg.norm(target)
                oh = rot @ _WATER[1]
                oh /= np.linalg.norm(oh)
                v = np.cross(oh, target)
                c, s = float(oh @ target), np.linalg.norm(v)
                if snap(s) > 1e-8:
                    k = v / s
                    K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
                    rot = (np.eye(3) + s * K + (1 - c) * K @ K) @ rot
            mol = o + _WATER @ rot.T
            if len(prev) == 0:
                best = mol
                break
            d = mol[1:, None, :] - prev[None, :, :]
            if L is not None:
                d -= L * np.round(d / L)
            dmin = float(snap(np.sqrt((d**2).sum(-1)).min()))
            if dmin > best_d:
                best, best_d = mol, dmin
            if dmin >= min_dist:
                break
        out[3 * i : 3 * i + 3] = best
        placed.append(best)
    return out


def build_water_cluster(n: int, rng: np.random.Generator) -> Atoms:
    """(H2O)_{n/3} cluster, non-periodic, O–O nearest neighbours 2.7–2.95 Å, H-bond donors."""
    m = n // 3
    oxy = [np.zeros(3)]
    partner = [None]
    while len(oxy) < m:
        j = int(rng.integers(len(oxy)))
        d = rng.normal(size=3)
        p = oxy[j] + rng.uniform(2.7, 2.95) * d / np.linalg.norm(d)
        if snap(np.linalg.norm(np.asarray(oxy) - p, axis=1).min()) >= 2.6:
            oxy.append(p)
            partner.append(oxy[j])
    oxy = np.asarray(oxy)
    pos = place_waters(oxy, rng, np.empty((0, 3)), donate_to=partner, min_dist=1.6)
    atoms = Atoms("OH2" * m, positions=pos - pos.mean(0), pbc=False)
    return atoms


def _water_box_sites(
    n_sites_side: int, length: float, count: int, rng: np.random.Generator, jitter: float = 0.15
) -> np.ndarray:
    """``count`` distinct sites of a cubic grid filling a box, jittered: liquid-like packing."""
    g = (np.arange(n_sites_side) + 0.5) * length / n_sites_side
    grid = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    sites = grid[np.sort(rng.choice(len(grid), size=count, replace=False))]
    return sites + rng.uniform(-jitter, jitter, size=sites.shape)


def build_liquid_water(n: int, rng: np.random.Generator) -> Atoms:
    """256 rigid waters in a cubic box at 1.00 g/cm^3 (L ≈ 19.7 Å), periodic."""
    m = n // 3
    density = rng.uniform(0.98, 1.02)  # g/cm^3
    L = (m * _MASS_H2O / _AVOGADRO / density * 1e24) ** (1 / 3)
    cell = np.eye(3) * L
    oxy = _water_box_sites(7, L, m, rng)  # 343 sites, spacing ~2.8 Å = first O–O shell
    pos = place_waters(oxy, rng, np.empty((0, 3)), cell=cell, min_dist=1.6)
    return Atoms("OH2" * m, positions=pos, cell=cell, pbc=True)


def build_al_hcl(n: int, rng: np.random.Generator) -> Atoms:
    """[Al(H2O)6]3+ with Cl-, H3O+ and water at ~1.1 g/cm^3, neutral, periodic.

    Atom count 1 + k + 4h + 3w = n with k = 3 + h Cl- (neutrality); h in {2, 5}.
    """
    h = int(rng.choice([2, 5]))
    k, w = 3 + h, (n - 1 - (3 + h) - 4 * h) // 3
    assert 1 + k + 4 * h + 3 * w == n, (n, h)
    mass = 26.98 + 35.45 * k + 19.02 * h + _MASS_H2O * w
    L = (mass / _AVOGADRO / rng.uniform(1.08, 1.14) * 1e24) ** (1 / 3)
    cell = np.eye(3) * L
    side = 5  # 125 sites for 1 + k + h + w molecules
    g = (np.arange(side) + 0.5) * L / side
    grid = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    centre = grid[len(grid) // 2]
    axes = np.concatenate([np.eye(3), -np.eye(3)])
    shell_idx = [int(np.argmin(snap(np.linalg.norm(grid - (centre + ax * L / side), axis=1)))) for ax in axes]
    free = np.setdiff1d(np.arange(len(grid)), shell_idx + [len(grid) // 2])
    chosen = grid[rng.choice(free, size=k + h + (w - 6), replace=False)]
    chosen += rng.uniform(-0.15, 0.15, size=chosen.shape)
    cl, h3o, bulkw = chosen[:k], chosen[k : k + h], chosen[k + h :]
    # first shell: O at 1.90 Å from Al, H pointing away (lone pairs towards the cation)
    shell = []
    for ax in axes:
        o = centre + 1.90 * ax
        rot = random_rotation(rng)
        mol = _WATER @ rot.T
        bis = (mol[1] + mol[2]) / 2
        # rotate the molecule so its H–H bisector points along +ax (away from Al)
        v = np.cross(bis / np.linalg.norm(bis), ax)
        s, c = np.linalg.norm(v), bis @ ax / np.linalg.norm(bis)
        if snap(s) > 1e-8:
            kk = v / s
            K = np.array([[0, -kk[2], kk[1]], [kk[2], 0, -kk[0]], [-kk[1], kk[0], 0]])
            mol = mol @ (np.eye(3) + s * K + (1 - c) * K @ K).T
        shell.append(o + mol)
    shell = np.concatenate(shell)
    heavy = np.concatenate([[centre], shell, cl])
    hyd = []
    for o in h3o:  # trigonal-pyramidal H3O+: three O–H of 0.98 Å at 112 degrees
        rot = random_rotation(rng)
        phi = np.arange(3) * 2 * np.pi / 3
        sin_t = np.sin(np.deg2rad(68.0))
        hs = 0.98 * np.stack([sin_t * np.cos(phi), sin_t * np.sin(phi), np.full(3, np.cos(np.deg2rad(68.0)))], 1)
        hyd.append(np.concatenate([[o], o + hs @ rot.T]))
    hyd = np.concatenate(hyd)
    waters = place_waters(bulkw, rng, np.concatenate([heavy, hyd]), cell=cell, min_dist=1.5)
    symbols = ["Al"] + ["O", "H", "H"] * 6 + ["Cl"] * k + ["O", "H", "H", "H"] * h + ["O", "H", "H"] * (w - 6)
    pos = np.concatenate([heavy[:1], shell, cl, hyd, waters])
    return Atoms(symbols, positions=pos, cell=cell, pbc=True)
