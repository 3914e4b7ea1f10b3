"""Builder of the zeolite family: a sodalite SiO2 framework with Brønsted acid sites and pore water."""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.neighborlist import neighbor_list
from ase.spacegroup import crystal

from workbench.data.synth.build_common import snap, strain
from workbench.data.synth.build_water import place_waters


def _sod_framework(rep: tuple[int, int, int], rng: np.random.Generator) -> Atoms:
    """Sodalite (SOD) SiO2 framework: Si on 12d of Im-3m, bridging O off the Si–Si line.

    Si–Si 3.07 Å and Si–O 1.61 Å give Si–O–Si ≈ 145 degrees and 1.8 g/cm^3.
    """
    a = 3.07 / (np.sqrt(2) / 4)  # Si–Si = a*sqrt(2)/4 on the SOD net
    si = crystal(["Si"], [(0.25, 0.0, 0.5)], spacegroup=229, cellpar=[a, a, a, 90, 90, 90]).repeat(rep)
    i, j, D = neighbor_list("ijD", si, 3.3)
    keep = i < j
    # ASE's pair order follows its cell binning, which moves with last-bit differences
    # (atoms sit on bin edges): sort, so the bonds consume the random stream in one order.
    order = np.lexsort((j[keep], i[keep]))
    i, j, D = i[keep][order], j[keep][order], D[keep][order]
    if len(np.unique(i * len(si) + j)) != len(i):
        raise RuntimeError("SOD framework: a Si pair is bonded through two periodic images")
    h = np.sqrt(1.61**2 - (np.linalg.norm(D, axis=1) / 2) ** 2)
    oxy = np.empty((len(i), 3))
    for b, (a_i, d) in enumerate(zip(i, D)):
        mid = si.positions[a_i] + d / 2
        u = d / np.linalg.norm(d)
        # only O atoms of bonds sharing a Si can come close: check those (placed earlier)
        near = np.flatnonzero((i[:b] == i[b]) | (i[:b] == j[b]) | (j[:b] == i[b]) | (j[:b] == j[b]))
        for _ in range(50):  # random bend direction, kept if O–O stays > 2.4 Å
            p = rng.normal(size=3)
            p -= (p @ u) * u
            cand = mid + h[b] * p / np.linalg.norm(p)
            if len(near) == 0 or snap(_mic_min(oxy[near], cand, si.cell)) > 2.4:
                break
        oxy[b] = cand
    fw = si + Atoms(["O"] * len(oxy), positions=oxy)
    fw.pbc = True
    fw.info["bonds"] = np.stack([i, j], 1)
    return fw


def _mic_min(points: np.ndarray, p: np.ndarray, cell) -> float:
    """Minimum-image distance (orthorhombic ``cell``) from ``p`` to ``points``."""
    L = np.diag(cell[:])
    d = points - p
    d -= L * np.round(d / L)
    return float(np.sqrt((d**2).sum(1)).min())


def build_zeolite(n: int, rng: np.random.Generator) -> Atoms:
    """Hydrated SOD-type zeolite: framework + acid sites (Al, bridging OH) + pore water.

    Framework sizes 144/216/288/324 atoms (36 per cubic cell); ``n % 3`` Brønsted acid
    sites (Si->Al with H on a bridging O) make any atom count reachable; waters fill the rest.
    """
    reps = {144: (2, 2, 1), 216: (3, 2, 1), 288: (2, 2, 2), 324: (3, 3, 1)}
    nfw = max(f for f in reps if f <= n)
    n_acid = (n - nfw) % 3
    n_water = (n - nfw - n_acid) // 3
    fw = _sod_framework(reps[nfw], rng)
    nsi = int((fw.numbers == 14).sum())
    bonds = fw.info.pop("bonds")
    extra = []
    # acid sites: Si -> Al (not adjacent: Loewenstein's rule), H on one of its O, pointing into the pore
    al_sites = []
    for si_idx in rng.permutation(nsi):
        if len(al_sites) == n_acid:
            break
        nbrs = set(bonds[bonds[:, 0] == si_idx, 1]) | set(bonds[bonds[:, 1] == si_idx, 0])
        if not nbrs & set(al_sites):
            al_sites.append(int(si_idx))
    for s in al_sites:
        fw[s].symbol = "Al"
        bond_ids = np.flatnonzero((bonds == s).any(1))
        b = int(rng.choice(bond_ids))
        o = fw.positions[nsi + b]
        i, j = bonds[b]
        mid = fw.positions[i] + fw.get_distance(i, j, mic=True, vector=True) / 2
        u = fw.get_distance(i, nsi + b, mic=True, vector=True) - (mid - fw.positions[i])
        extra.append(o + 0.97 * u / np.linalg.norm(u))
    fw += Atoms(["H"] * len(extra), positions=np.reshape(extra, (-1, 3)))
    # pore water: O at least 2.6 Å from framework atoms and 2.6 Å from other water O
    cell = fw.cell[:]
    oxy: list[np.ndarray] = []
    L = np.diag(cell)
    for _ in range(100):  # batches of random trial points, filtered against the framework at once
        if len(oxy) == n_water:
            break
        trial = rng.random((512, 3)) * L
        d = trial[:, None, :] - fw.positions[None, :, :]
        d -= L * np.round(d / L)
        trial = trial[snap(np.sqrt((d**2).sum(-1).min(1))) >= 2.6]
        for p in trial:
            if len(oxy) == n_water:
                break
            if not oxy or snap(_mic_min(np.asarray(oxy), p, cell)) >= 2.6:
                oxy.append(p)
    if len(oxy) < n_water:
        raise RuntimeError(f"zeolite: could fit only {len(oxy)} of {n_water} waters in a {nfw}-atom framework")
    waters = place_waters(np.asarray(oxy).reshape(-1, 3), rng, fw.positions, cell=cell, min_dist=1.6)
    atoms = fw + Atoms("OH2" * n_water, positions=waters.reshape(-1, 3))
    strain(atoms, rng, shear=0.01, vol=(0.99, 1.02))
    atoms.rattle(stdev=0.03, seed=int(rng.integers(2**31)))
    return atoms
