"""Reference labels (energy in eV, forces in eV/Å) for each family of Table 3.

Every labelled structure gets ``info["REF_energy"]`` (float, eV),
``arrays["REF_forces"]`` (shape ``(n_atoms, 3)``, eV/Å) and
``info["labelled"] = True``; a periodic one whose calculator gives a stress (EMT, xTB; not
TIP3P) also gets ``info["REF_stress"]`` (Voigt 6, eV/Å³, ASE's sign). No calculator is left attached. Families with no
affordable physical calculator get ``info["labelled"] = False`` and no REF_ keys.

Calculators (all conserve momentum, so forces sum to ~0):

* ``emt`` — ASE's effective-medium theory (Al, Cu, Ag, Au, Ni, Pd, Pt; H, C, N, O
  only as a rough add-on). Fast, pure Python/numpy.
* ``tip3p`` — ASE's TIP3P rigid water (Coulomb + O–O Lennard-Jones), atoms in O,H,H order.
* ``gfn1-xtb`` — GFN1 tight-binding DFT (tblite), Γ-point only, used for al_hcl; TMD and
  zeolite can opt in (``calculator="gfn1-xtb"``) but cost ~10 s and > 100 s per structure.
"""

from __future__ import annotations

import numpy as np
from ase import Atoms

# Which calculator labels which family (None: shipped without labels, see data/README.md).
CALCULATOR: dict[str, str | None] = {
    "mptrj": "emt",
    "water_clusters": "tip3p",
    "tmd": None,  # GFN1-xTB works but averages ~10 s/structure here: opt in, see label()
    "liquid_water": "tip3p",
    "zeolite": None,
    "cuni": "emt",
    "hea": "emt",
    "al_hcl": "gfn1-xtb",
}

# TIP3P cutoff on O–O distances: clusters take every pair; boxes need rc < L/2.
TIP3P_CLUSTER_RC = 1.0e4
TIP3P_BOX_RC = 9.0


def _calculator(kind: str, atoms: Atoms):
    if kind == "emt":
        from ase.calculators.emt import EMT

        return EMT()
    if kind == "tip3p":
        from ase.calculators.tip3p import TIP3P

        rc = TIP3P_BOX_RC if atoms.pbc.any() else TIP3P_CLUSTER_RC
        return TIP3P(rc=rc)
    if kind in ("gfn1-xtb", "gfn2-xtb"):
        # Imported lazily: tblite's OpenMP runtime reads OMP_NUM_THREADS at load.
        from tblite.ase import TBLite

        method = "GFN1-xTB" if kind == "gfn1-xtb" else "GFN2-xTB"
        # accuracy=10 loosens SCC thresholds ~1e-5 Eh: forces change < 1e-4 eV/Å, 30% faster.
        return TBLite(method=method, accuracy=10.0, verbosity=0, charge=0.0)
    raise ValueError(f"unknown calculator {kind!r}")


KINDS = ("emt", "tip3p", "gfn1-xtb", "gfn2-xtb")
#: the calculators that compute a stress (ASE's TIP3P gives energy and forces only)
STRESS_KINDS = ("emt", "gfn1-xtb", "gfn2-xtb")


def gives_stress(kind: str | None, atoms: Atoms) -> bool:
    """Whether ``atoms`` labelled by ``kind`` get a stress: a periodic cell in every direction and
    a calculator that computes one."""
    return kind in STRESS_KINDS and bool(atoms.pbc.all())


def label(atoms: Atoms, family: str, calculator: str | None = "default") -> Atoms:
    """Compute and store the reference labels of ``atoms`` (in place, also returned).

    Args:
        atoms: a structure of ``family`` (n atoms).
        family: one of the Table-3 names; picks the calculator from :data:`CALCULATOR`.
        calculator: ``"default"`` (that table), one of :data:`KINDS` to override it, or
            None to leave the structure unlabelled.

    Returns:
        ``atoms`` with ``info["REF_energy"]`` (eV), ``arrays["REF_forces"]`` ((n, 3) eV/Å)
        and ``info["labelled"]``, and no calculator attached.
    """
    if family not in CALCULATOR:
        raise KeyError(f"unknown family {family!r}; choose from {', '.join(CALCULATOR)}")
    kind = CALCULATOR[family] if calculator == "default" else calculator
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown calculator {kind!r}; choose from {', '.join(KINDS)}")
    atoms.info["labelled"] = kind is not None
    if kind is None:
        return atoms
    work = atoms.copy()
    work.calc = _calculator(kind, work)
    stress = None
    try:
        energy = float(work.get_potential_energy())
        forces = np.array(work.get_forces(), dtype=np.float64)
        if gives_stress(kind, work):
            stress = np.array(work.get_stress(voigt=True), dtype=np.float64)
    except Exception as exc:  # name the structure, the calculator's own message says why
        where = f"{family} #{atoms.info.get('family_index')} (seed {atoms.info.get('seed')})"
        raise RuntimeError(f"{kind} failed to label {where}: {exc}") from exc
    finite = np.isfinite(energy) and np.isfinite(forces).all() and (stress is None or np.isfinite(stress).all())
    if not finite:
        raise RuntimeError(f"{kind} gave non-finite labels for {family} #{atoms.info.get('family_index')}")
    atoms.info["REF_energy"] = energy
    atoms.arrays["REF_forces"] = forces
    if stress is not None:
        atoms.info["REF_stress"] = stress
    atoms.info["calculator"] = kind
    return atoms
