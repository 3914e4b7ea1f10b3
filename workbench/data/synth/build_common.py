"""Shared pieces of the structure builders: lattice constants, the decision grid, strain, vacancies, tilings.

Every geometric decision of a builder is taken on values snapped to a 1e-9 grid (:func:`snap`),
so that the same seed builds the same structure on every CPU (see :mod:`workbench.data.synth.generators`).
"""

from __future__ import annotations

import itertools

import numpy as np
from ase import Atoms

# Cubic fcc lattice constants (Å), close to EMT's equilibrium; alloys use Vegard's law.
FCC_A = {"Al": 4.05, "Cu": 3.61, "Ag": 4.09, "Au": 4.08, "Ni": 3.52, "Pd": 3.89, "Pt": 3.92}
METALS = tuple(FCC_A)

SNAP_DECIMALS = 9  # decisions see values rounded to 1e-9 (Å, or a ratio): far above last-bit noise


def snap(x):
    """``x`` rounded to the decision grid, so values equal up to last-bit noise compare equal."""
    return np.round(x, SNAP_DECIMALS)


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """Uniform random rotation matrix (3, 3) from a unit quaternion."""
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


def strain(atoms: Atoms, rng: np.random.Generator, shear: float = 0.02, vol: tuple = (0.98, 1.03)) -> None:
    """Random symmetric strain (std ``shear``) and isotropic scale; makes cells triclinic."""
    e = rng.normal(scale=shear, size=(3, 3))
    e = 0.5 * (e + e.T)
    scale = rng.uniform(*vol) ** (1.0 / 3.0)
    atoms.set_cell(atoms.cell[:] @ (np.eye(3) + e) * scale, scale_atoms=True)


def remove_random(atoms: Atoms, count: int, rng: np.random.Generator, candidates=None) -> Atoms:
    """Delete ``count`` random atoms (vacancies), optionally only among ``candidates``."""
    if count <= 0:
        return atoms
    pool = np.arange(len(atoms)) if candidates is None else np.asarray(candidates)
    del atoms[np.sort(rng.choice(pool, size=count, replace=False))]
    return atoms


def tilings(n: int, basis: int, lengths: np.ndarray, max_aspect: float = 3.0, max_rep: int = 12):
    """Supercell repeats (n1, n2, n3) with basis*n1*n2*n3 >= n, fewest extra atoms first."""
    out = []
    for rep in itertools.product(range(1, max_rep + 1), repeat=3):
        total = basis * rep[0] * rep[1] * rep[2]
        if total < n or total > n + max(basis, n // 4) + basis:
            continue
        size = np.asarray(rep) * lengths
        aspect = float(snap(size.max() / size.min()))  # permuted repeats of equal lengths tie exactly
        if aspect <= max_aspect:
            out.append((total - n, aspect, rep))
    return sorted(out)  # ties in (extra, aspect) fall to the integer repeats


def vegard(symbols) -> float:
    """Vegard's law: the mean of the fcc lattice constants of ``symbols`` (Å)."""
    return float(np.mean([FCC_A[s] for s in symbols]))
