"""Builders for the eight families of Table 3: one deterministic structure per (family, index, seed).

``generate(family, index, seed)`` seeds its RNG from
``np.random.SeedSequence([seed, family_id, index])``, draws the atom count with
:func:`workbench.data.chemical_families.sample_natoms` (so it matches ``synthetic_sizes``),
builds a physically sensible, lightly strained/rattled structure with exactly that
many atoms, and labels it with :func:`workbench.data.synth.labels.label`.
Lengths are in Å, energies in eV. The water and zeolite builders live in
:mod:`workbench.data.synth.build_water` and :mod:`workbench.data.synth.build_zeolite`, the pieces they share
in :mod:`workbench.data.synth.build_common`.

**The same structure on every CPU.** Sums, matrix products and numpy's SIMD
transcendentals differ in their last bits between CPUs (and between numpy's SIMD paths
on one CPU). A random draw never lands within those bits of a threshold, but exact
ties do: equal cell lengths, symmetric lattice sites, equally compact supercells. So
every geometric decision here is taken on values snapped to a 1e-9 grid
(:func:`workbench.data.synth.build_common.snap`), ties are broken by integer keys, and neighbour
pairs are put in a canonical order before they drive the random stream. Species, cell and
positions then agree between CPUs to rounding (~1e-12 Å); labels go through floating-point
codes and are compared with the tolerances of ``workbench.data.embedded``.
"""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.build import bulk, make_supercell, mx2

from workbench.data.chemical_families import FAMILY_NAMES, family, sample_natoms
from workbench.data.synth.build_common import FCC_A, METALS, remove_random, snap, strain, tilings, vegard
from workbench.data.synth.build_water import build_al_hcl, build_liquid_water, build_water_cluster
from workbench.data.synth.build_zeolite import build_zeolite
from workbench.data.synth.labels import label


# ----------------------------------------------------------------------------- mptrj
def _prototypes(rng: np.random.Generator) -> tuple[list[tuple[str, Atoms]], list[str]]:
    """A handful of inorganic prototypes with EMT elements, fresh random chemistry each call."""
    m = list(rng.choice(METALS, size=3, replace=False))
    a = FCC_A[m[0]]
    ab = vegard(m[:2])
    x = str(rng.choice(["H", "H", "N", "C", "O"]))  # interstitials, sparingly
    anti = Atoms(  # anti-perovskite A3BX (e.g. Ni3AlC, Cu3PdN): perovskite-like, X in the octahedron
        [m[1], m[0], m[0], m[0], x],
        scaled_positions=[(0, 0, 0), (0.5, 0.5, 0), (0.5, 0, 0.5), (0, 0.5, 0.5), (0.5, 0.5, 0.5)],
        cell=np.eye(3) * 1.04 * ab,
        pbc=True,
    )
    l10 = Atoms(  # CuAu-type tetragonal AB layers
        [m[0], m[1]],
        scaled_positions=[(0, 0, 0), (0.5, 0.5, 0.5)],
        cell=np.diag([ab / np.sqrt(2), ab / np.sqrt(2), 0.96 * ab]),
        pbc=True,
    )
    return [
        ("fcc", bulk(m[0], "fcc", a=a)),
        ("fcc-cubic", bulk(m[0], "fcc", a=a, cubic=True)),
        ("bcc", bulk(m[0], "bcc", a=a * 0.5 ** (1 / 3))),
        ("hcp", bulk(m[0], "hcp", a=a / np.sqrt(2), c=a / np.sqrt(2) * 1.633)),
        ("b2", bulk(f"{m[0]}{m[1]}", "cesiumchloride", a=ab * 0.5 ** (1 / 3))),
        ("l12", bulk(m[0], "fcc", a=ab, cubic=True)),  # species set below
        ("l10", l10),
        ("rocksalt", bulk(f"{m[0]}{x}", "rocksalt", a=a * (1.04 if x == "H" else 1.18))),
        ("antiperovskite", anti),
        ("random-fcc", bulk(m[0], "fcc", a=vegard(m), cubic=True)),
        ("random-bcc", bulk(m[0], "bcc", a=vegard(m) * 0.5 ** (1 / 3), cubic=True)),
    ], m


def build_mptrj(n: int, rng: np.random.Generator) -> Atoms:
    """MPtrj-like crystal with exactly ``n`` atoms: prototype supercell minus vacancies."""
    protos, m = _prototypes(rng)
    options = []
    for name, cell in protos:
        lengths = cell.cell.lengths()
        tl = tilings(n, len(cell), lengths)
        if tl:
            vac, _aspect, rep = tl[0]
            options.append((name, cell, rep, vac))
    # EMT's H/C/N/O parameters are rough (E up to ~5 eV/atom, forces ~10 eV/Å in these
    # lattices), so interstitial compounds are only ~4 % of mptrj
    inter = ("rocksalt", "antiperovskite")
    fits = [o for o in options if o[3] <= max(1, 0.1 * n)]  # few vacancies (<= 10 %, 1 if tiny)
    pool = [o for o in fits if o[0] in inter]
    if not pool or rng.random() >= 0.04:
        pool = [o for o in fits if o[0] not in inter]
    if pool:
        name, cell, rep, vac = pool[rng.integers(len(pool))]
    else:  # tiny awkward n (e.g. 13): the metal prototype with the fewest vacancies
        name, cell, rep, vac = min((o for o in options if o[0] not in inter), key=lambda o: o[3])
    atoms = cell.repeat(rep)
    if name == "l12":  # A3B ordered: corner site B
        sym = np.array(atoms.get_chemical_symbols())
        frac = (atoms.get_scaled_positions(wrap=False) * np.array(rep)) % 1.0
        sym[(np.minimum(frac, 1.0 - frac) < 1e-6).all(1)] = m[1]
        atoms.set_chemical_symbols(sym)
    if name.startswith("random"):
        k = rng.integers(2, 4)
        atoms.set_chemical_symbols(list(rng.choice(m[:k], size=len(atoms))))
    remove_random(atoms, vac, rng)
    strain(atoms, rng, shear=0.02)
    atoms.rattle(stdev=rng.uniform(0.02, 0.08), seed=int(rng.integers(2**31)))
    atoms.info["prototype"] = name
    return atoms


# ----------------------------------------------------------------------------- metals
def build_cuni(n: int, rng: np.random.Generator) -> Atoms:
    """fcc Cu(1-x)Ni(x), 5x5x5 conventional cells (500 sites) minus ``500 - n`` vacancies."""
    x = rng.uniform(0.0, 1.0)
    sym = np.where(rng.random(500) < x, "Ni", "Cu")
    atoms = bulk("Cu", "fcc", a=vegard(["Cu"]) * (1 - x) + FCC_A["Ni"] * x, cubic=True).repeat((5, 5, 5))
    atoms.set_chemical_symbols(list(sym))
    remove_random(atoms, 500 - n, rng)
    strain(atoms, rng, shear=0.01)
    atoms.rattle(stdev=rng.uniform(0.02, 0.06), seed=int(rng.integers(2**31)))
    return atoms


def build_hea(n: int, rng: np.random.Generator) -> Atoms:
    """High-entropy fcc alloy of 4–5 EMT metals, near-equiatomic, exactly ``n`` sites filled."""
    elems = list(rng.choice(METALS, size=int(rng.integers(4, 6)), replace=False))
    sym = np.resize(elems, n)  # near-equiatomic, then shuffled
    rng.shuffle(sym)
    a = vegard(sym)
    cell = bulk("Cu", "fcc", a=a, cubic=True)
    tl = tilings(n, 4, cell.cell.lengths())
    if not tl or tl[0][0] > 4 or rng.random() < 0.5:  # else the rhombohedral 1-atom cell
        cell = bulk("Cu", "fcc", a=a)
        tl = tilings(n, 1, cell.cell.lengths())
    vac, _aspect, rep = tl[0]
    atoms = cell.repeat(rep)
    remove_random(atoms, vac, rng)
    atoms.set_chemical_symbols(list(sym))
    strain(atoms, rng, shear=0.015)
    atoms.rattle(stdev=rng.uniform(0.03, 0.08), seed=int(rng.integers(2**31)))
    return atoms


# ----------------------------------------------------------------------------- tmd
def _compact_2d_supercell(p: int, cell2: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """3x3 supercell matrix, in-plane block of determinant ``p``, as compact as possible.

    Any ``p`` is reachable with a non-diagonal matrix, so no more than two vacancies are
    ever needed; among the most compact shapes (longest vector within 5 %) one is drawn.
    """
    r = np.arange(-7, 8)
    m = np.stack(np.meshgrid(r, r, r, r, indexing="ij"), -1).reshape(-1, 2, 2)
    m = m[np.rint(np.linalg.det(m)).astype(int) == p]
    vec = m @ cell2  # (k, 2, 2): rows are the new in-plane vectors
    lens = np.linalg.norm(vec, axis=2)
    cosang = snap(np.abs((vec[:, 0] * vec[:, 1]).sum(1)) / lens.prod(1))
    score = snap(lens.max(1) * np.where(cosang > 0.55, 10.0, 1.0))  # avoid needle-like cells
    ok = np.flatnonzero(score <= snap(score.min() * 1.05))  # symmetric shapes tie exactly
    out = np.eye(3, dtype=int)
    out[:2, :2] = m[ok[rng.integers(len(ok))]]
    return out


def build_tmd(n: int, rng: np.random.Generator) -> Atoms:
    """2H MX2 monolayer (M = Mo/W, X = S/Se) supercell, chalcogen vacancies to reach ``n``.

    Periodic in-plane; 10 Å of vacuum along z (pbc True so every code treats it alike).
    """
    x_w = rng.choice([0.0, 0.0, rng.uniform(0, 1), 1.0])
    x_se = rng.choice([0.0, 0.0, rng.uniform(0, 1), 1.0])
    a = 3.18 + 0.14 * x_se
    layer = mx2("MoS2", kind="2H", a=a, thickness=3.13 + 0.2 * x_se, vacuum=5.0)
    p = -(-n // 3)  # formula units; 3p - n <= 2 chalcogen vacancies
    atoms = make_supercell(layer, _compact_2d_supercell(p, layer.cell[:2, :2], rng))
    vac = 3 * p - n
    z = atoms.numbers
    metal, chalc = np.flatnonzero(z == 42), np.flatnonzero(z == 16)
    sym = np.array(atoms.get_chemical_symbols(), dtype=object)
    sym[metal[rng.random(len(metal)) < x_w]] = "W"
    sym[chalc[rng.random(len(chalc)) < x_se]] = "Se"
    atoms.set_chemical_symbols(list(sym))
    remove_random(atoms, vac, rng, candidates=chalc)
    atoms.pbc = True
    e = np.eye(3)
    e[:2, :2] += 0.5 * (lambda s: s + s.T)(rng.normal(scale=0.01, size=(2, 2)))  # in-plane strain only
    atoms.set_cell(atoms.cell[:] @ e, scale_atoms=True)
    atoms.rattle(stdev=rng.uniform(0.02, 0.05), seed=int(rng.integers(2**31)))
    return atoms


BUILDERS = {
    "mptrj": build_mptrj,
    "water_clusters": build_water_cluster,
    "tmd": build_tmd,
    "liquid_water": build_liquid_water,
    "zeolite": build_zeolite,
    "cuni": build_cuni,
    "hea": build_hea,
    "al_hcl": build_al_hcl,
}


def structure_rng(family_name: str, index: int, seed: int) -> np.random.Generator:
    """The RNG of structure ``index`` of a family: SeedSequence([seed, family_id, index])."""
    family(family_name)
    return np.random.default_rng(np.random.SeedSequence([int(seed), FAMILY_NAMES.index(family_name), int(index)]))


def generate(
    family_name: str, index: int, seed: int, labelled: bool = True, calculator: str | None = "default"
) -> Atoms:
    """Build (and label) structure number ``index`` of a Table-3 family.

    Args:
        family_name: one of ``FAMILY_NAMES``.
        index: structure number (>= 0) within the family.
        seed: dataset seed.
        labelled: compute REF_ labels (False: geometry only, for size studies/tests).
        calculator: ``"default"`` (the family's entry in ``labels.CALCULATOR``) or a
            calculator name to override it, e.g. ``"gfn1-xtb"`` for tmd.

    Returns:
        ``ase.Atoms`` with n atoms (n = ``sample_natoms(family, 1, rng)[0]``), positions in Å,
        cell and pbc set (water_clusters: no cell, pbc False), ``info`` keys ``config_type``,
        ``family_index``, ``seed``, ``labelled`` and, when labelled, ``REF_energy`` (eV) and
        ``arrays["REF_forces"]`` ((n, 3) eV/Å).
    """
    fam = family(family_name)
    if int(index) < 0:
        raise ValueError(f"{family_name}: index must be >= 0, got {index}")
    rng = structure_rng(family_name, index, seed)
    n = int(sample_natoms(family_name, 1, rng)[0])
    try:
        atoms = BUILDERS[family_name](n, rng)
    except Exception as exc:
        raise RuntimeError(f"building {family_name} #{index} (seed {seed}, {n} atoms) failed: {exc}") from exc
    if len(atoms) != n or not fam.atoms_min <= n <= fam.atoms_max:
        raise RuntimeError(f"{family_name} #{index}: built {len(atoms)} atoms, expected {n}")
    atoms.info.update(config_type=family_name, family_index=int(index), seed=int(seed))
    if labelled:
        label(atoms, family_name, calculator)
    else:
        atoms.info["labelled"] = False
    return atoms
