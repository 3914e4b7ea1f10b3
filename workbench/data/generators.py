"""Builders for the eight families of Table 3: one deterministic structure per (family, index, seed).

``generate(family, index, seed)`` seeds its RNG from
``np.random.SeedSequence([seed, family_id, index])``, draws the atom count with
:func:`workbench.data.families.sample_natoms` (so it matches ``synthetic_sizes``),
builds a physically sensible, lightly strained/rattled structure with exactly that
many atoms, and labels it with :func:`workbench.data.labels.label`.
Lengths are in Å, energies in eV.

**The same structure on every CPU.** Sums, matrix products and numpy's SIMD
transcendentals differ in their last bits between CPUs (and between numpy's SIMD paths
on one CPU). A random draw never lands within those bits of a threshold, but exact
ties do: equal cell lengths, symmetric lattice sites, equally compact supercells. So
every geometric decision here is taken on values snapped to a 1e-9 grid
(:func:`_snap`), ties are broken by integer keys, and neighbour pairs are put in a
canonical order before they drive the random stream. Species, cell and positions then
agree between CPUs to rounding (~1e-12 Å); labels go through floating-point codes and
are compared with the tolerances of ``workbench.data.embedded``.
"""

from __future__ import annotations

import itertools

import numpy as np
from ase import Atoms
from ase.build import bulk, make_supercell, mx2
from ase.neighborlist import neighbor_list
from ase.spacegroup import crystal

from workbench.data.families import FAMILY_NAMES, family, sample_natoms
from workbench.data.labels import label

# Cubic fcc lattice constants (Å), close to EMT's equilibrium; alloys use Vegard's law.
FCC_A = {"Al": 4.05, "Cu": 3.61, "Ag": 4.09, "Au": 4.08, "Ni": 3.52, "Pd": 3.89, "Pt": 3.92}
METALS = tuple(FCC_A)

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


# ----------------------------------------------------------------------------- helpers
SNAP_DECIMALS = 9  # decisions see values rounded to 1e-9 (Å, or a ratio): far above last-bit noise


def _snap(x):
    """``x`` rounded to the decision grid, so values equal up to last-bit noise compare equal."""
    return np.round(x, SNAP_DECIMALS)


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
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


def _strain(atoms: Atoms, rng: np.random.Generator, shear: float = 0.02, vol: tuple = (0.98, 1.03)) -> None:
    """Random symmetric strain (std ``shear``) and isotropic scale; makes cells triclinic."""
    e = rng.normal(scale=shear, size=(3, 3))
    e = 0.5 * (e + e.T)
    scale = rng.uniform(*vol) ** (1.0 / 3.0)
    atoms.set_cell(atoms.cell[:] @ (np.eye(3) + e) * scale, scale_atoms=True)


def _remove_random(atoms: Atoms, count: int, rng: np.random.Generator, candidates=None) -> Atoms:
    """Delete ``count`` random atoms (vacancies), optionally only among ``candidates``."""
    if count <= 0:
        return atoms
    pool = np.arange(len(atoms)) if candidates is None else np.asarray(candidates)
    del atoms[np.sort(rng.choice(pool, size=count, replace=False))]
    return atoms


def _tilings(n: int, basis: int, lengths: np.ndarray, max_aspect: float = 3.0, max_rep: int = 12):
    """Supercell repeats (n1, n2, n3) with basis*n1*n2*n3 >= n, fewest extra atoms first."""
    out = []
    for rep in itertools.product(range(1, max_rep + 1), repeat=3):
        total = basis * rep[0] * rep[1] * rep[2]
        if total < n or total > n + max(basis, n // 4) + basis:
            continue
        size = np.asarray(rep) * lengths
        aspect = float(_snap(size.max() / size.min()))  # permuted repeats of equal lengths tie exactly
        if aspect <= max_aspect:
            out.append((total - n, aspect, rep))
    return sorted(out)  # ties in (extra, aspect) fall to the integer repeats


def _vegard(symbols) -> float:
    return float(np.mean([FCC_A[s] for s in symbols]))


# ----------------------------------------------------------------------------- mptrj
def _prototypes(rng: np.random.Generator) -> tuple[list[tuple[str, Atoms]], list[str]]:
    """A handful of inorganic prototypes with EMT elements, fresh random chemistry each call."""
    m = list(rng.choice(METALS, size=3, replace=False))
    a = FCC_A[m[0]]
    ab = _vegard(m[:2])
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
        ("random-fcc", bulk(m[0], "fcc", a=_vegard(m), cubic=True)),
        ("random-bcc", bulk(m[0], "bcc", a=_vegard(m) * 0.5 ** (1 / 3), cubic=True)),
    ], m


def build_mptrj(n: int, rng: np.random.Generator) -> Atoms:
    """MPtrj-like crystal with exactly ``n`` atoms: prototype supercell minus vacancies."""
    protos, m = _prototypes(rng)
    options = []
    for name, cell in protos:
        lengths = cell.cell.lengths()
        tl = _tilings(n, len(cell), lengths)
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
    _remove_random(atoms, vac, rng)
    _strain(atoms, rng, shear=0.02)
    atoms.rattle(stdev=rng.uniform(0.02, 0.08), seed=int(rng.integers(2**31)))
    atoms.info["prototype"] = name
    return atoms


# ----------------------------------------------------------------------------- metals
def build_cuni(n: int, rng: np.random.Generator) -> Atoms:
    """fcc Cu(1-x)Ni(x), 5x5x5 conventional cells (500 sites) minus ``500 - n`` vacancies."""
    x = rng.uniform(0.0, 1.0)
    sym = np.where(rng.random(500) < x, "Ni", "Cu")
    atoms = bulk("Cu", "fcc", a=_vegard(["Cu"]) * (1 - x) + FCC_A["Ni"] * x, cubic=True).repeat((5, 5, 5))
    atoms.set_chemical_symbols(list(sym))
    _remove_random(atoms, 500 - n, rng)
    _strain(atoms, rng, shear=0.01)
    atoms.rattle(stdev=rng.uniform(0.02, 0.06), seed=int(rng.integers(2**31)))
    return atoms


def build_hea(n: int, rng: np.random.Generator) -> Atoms:
    """High-entropy fcc alloy of 4–5 EMT metals, near-equiatomic, exactly ``n`` sites filled."""
    elems = list(rng.choice(METALS, size=int(rng.integers(4, 6)), replace=False))
    sym = np.resize(elems, n)  # near-equiatomic, then shuffled
    rng.shuffle(sym)
    a = _vegard(sym)
    cell = bulk("Cu", "fcc", a=a, cubic=True)
    tl = _tilings(n, 4, cell.cell.lengths())
    if not tl or tl[0][0] > 4 or rng.random() < 0.5:  # else the rhombohedral 1-atom cell
        cell = bulk("Cu", "fcc", a=a)
        tl = _tilings(n, 1, cell.cell.lengths())
    vac, _aspect, rep = tl[0]
    atoms = cell.repeat(rep)
    _remove_random(atoms, vac, rng)
    atoms.set_chemical_symbols(list(sym))
    _strain(atoms, rng, shear=0.015)
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
    cosang = _snap(np.abs((vec[:, 0] * vec[:, 1]).sum(1)) / lens.prod(1))
    score = _snap(lens.max(1) * np.where(cosang > 0.55, 10.0, 1.0))  # avoid needle-like cells
    ok = np.flatnonzero(score <= _snap(score.min() * 1.05))  # symmetric shapes tie exactly
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
    _remove_random(atoms, vac, rng, candidates=chalc)
    atoms.pbc = True
    e = np.eye(3)
    e[:2, :2] += 0.5 * (lambda s: s + s.T)(rng.normal(scale=0.01, size=(2, 2)))  # in-plane strain only
    atoms.set_cell(atoms.cell[:] @ e, scale_atoms=True)
    atoms.rattle(stdev=rng.uniform(0.02, 0.05), seed=int(rng.integers(2**31)))
    return atoms


# ----------------------------------------------------------------------------- water
def _place_waters(
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
            _snap(np.linalg.norm(prev - o if L is None else (prev - o) - L * np.round((prev - o) / L), axis=1)) < 4.0
        ]
        best, best_d = None, -1.0
        for t in range(tries):
            rot = _random_rotation(rng)
            if donate_to is not None and donate_to[i] is not None and t < tries // 2:
                # rotate so that the first O–H points along the O···acceptor direction
                target = donate_to[i] - o
                target /= np.linalg.norm(target)
                oh = rot @ _WATER[1]
                oh /= np.linalg.norm(oh)
                v = np.cross(oh, target)
                c, s = float(oh @ target), np.linalg.norm(v)
                if _snap(s) > 1e-8:
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
            dmin = float(_snap(np.sqrt((d**2).sum(-1)).min()))
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
        if _snap(np.linalg.norm(np.asarray(oxy) - p, axis=1).min()) >= 2.6:
            oxy.append(p)
            partner.append(oxy[j])
    oxy = np.asarray(oxy)
    pos = _place_waters(oxy, rng, np.empty((0, 3)), donate_to=partner, min_dist=1.6)
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
    pos = _place_waters(oxy, rng, np.empty((0, 3)), cell=cell, min_dist=1.6)
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
    shell_idx = [int(np.argmin(_snap(np.linalg.norm(grid - (centre + ax * L / side), axis=1)))) for ax in axes]
    free = np.setdiff1d(np.arange(len(grid)), shell_idx + [len(grid) // 2])
    chosen = grid[rng.choice(free, size=k + h + (w - 6), replace=False)]
    chosen += rng.uniform(-0.15, 0.15, size=chosen.shape)
    cl, h3o, bulkw = chosen[:k], chosen[k : k + h], chosen[k + h :]
    # first shell: O at 1.90 Å from Al, H pointing away (lone pairs towards the cation)
    shell = []
    for ax in axes:
        o = centre + 1.90 * ax
        rot = _random_rotation(rng)
        mol = _WATER @ rot.T
        bis = (mol[1] + mol[2]) / 2
        # rotate the molecule so its H–H bisector points along +ax (away from Al)
        v = np.cross(bis / np.linalg.norm(bis), ax)
        s, c = np.linalg.norm(v), bis @ ax / np.linalg.norm(bis)
        if _snap(s) > 1e-8:
            kk = v / s
            K = np.array([[0, -kk[2], kk[1]], [kk[2], 0, -kk[0]], [-kk[1], kk[0], 0]])
            mol = mol @ (np.eye(3) + s * K + (1 - c) * K @ K).T
        shell.append(o + mol)
    shell = np.concatenate(shell)
    heavy = np.concatenate([[centre], shell, cl])
    hyd = []
    for o in h3o:  # trigonal-pyramidal H3O+: three O–H of 0.98 Å at 112 degrees
        rot = _random_rotation(rng)
        phi = np.arange(3) * 2 * np.pi / 3
        sin_t = np.sin(np.deg2rad(68.0))
        hs = 0.98 * np.stack([sin_t * np.cos(phi), sin_t * np.sin(phi), np.full(3, np.cos(np.deg2rad(68.0)))], 1)
        hyd.append(np.concatenate([[o], o + hs @ rot.T]))
    hyd = np.concatenate(hyd)
    waters = _place_waters(bulkw, rng, np.concatenate([heavy, hyd]), cell=cell, min_dist=1.5)
    symbols = ["Al"] + ["O", "H", "H"] * 6 + ["Cl"] * k + ["O", "H", "H", "H"] * h + ["O", "H", "H"] * (w - 6)
    pos = np.concatenate([heavy[:1], shell, cl, hyd, waters])
    return Atoms(symbols, positions=pos, cell=cell, pbc=True)


# ----------------------------------------------------------------------------- zeolite
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
            if len(near) == 0 or _snap(_mic_min(oxy[near], cand, si.cell)) > 2.4:
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
        trial = trial[_snap(np.sqrt((d**2).sum(-1).min(1))) >= 2.6]
        for p in trial:
            if len(oxy) == n_water:
                break
            if not oxy or _snap(_mic_min(np.asarray(oxy), p, cell)) >= 2.6:
                oxy.append(p)
    if len(oxy) < n_water:
        raise RuntimeError(f"zeolite: could fit only {len(oxy)} of {n_water} waters in a {nfw}-atom framework")
    waters = _place_waters(np.asarray(oxy).reshape(-1, 3), rng, fw.positions, cell=cell, min_dist=1.6)
    atoms = fw + Atoms("OH2" * n_water, positions=waters.reshape(-1, 3))
    _strain(atoms, rng, shear=0.01, vol=(0.99, 1.02))
    atoms.rattle(stdev=0.03, seed=int(rng.integers(2**31)))
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
