"""Structure generators of the Table-3 families: sizes, geometry, real labels, determinism."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from ase.io import write
from ase.neighborlist import neighbor_list

from workbench.data.chemical_families import BY_NAME, FAMILY_NAMES, family_counts, sample_natoms
from workbench.data.synth.generators import generate, structure_rng
from workbench.data.synth.labels import CALCULATOR, label
from workbench.data.synth.mixture import make_mixture, mixture_tasks

CHEAP = [f for f in FAMILY_NAMES if CALCULATOR[f] in ("emt", "tip3p", None)]
XTB = [f for f in FAMILY_NAMES if CALCULATOR[f] not in ("emt", "tip3p", None)]


def _expected_natoms(name: str, index: int, seed: int) -> int:
    return int(sample_natoms(name, 1, structure_rng(name, index, seed))[0])


def _min_distance(atoms) -> float:
    d = neighbor_list("d", atoms, 1.5)  # includes periodic images of the atom itself
    return float(d.min()) if len(d) else np.inf


def _check_geometry(atoms, name: str, index: int, seed: int) -> None:
    fam = BY_NAME[name]
    assert atoms.info["config_type"] == name
    assert atoms.info["family_index"] == index and atoms.info["seed"] == seed
    assert len(atoms) == _expected_natoms(name, index, seed)
    assert fam.atoms_min <= len(atoms) <= fam.atoms_max
    assert _min_distance(atoms) >= 0.7
    assert bool(atoms.pbc.any()) == fam.periodic
    if not fam.periodic:
        assert np.allclose(atoms.cell[:], 0.0)
    assert atoms.calc is None


def _check_labels(atoms) -> None:
    assert atoms.info["labelled"] is True
    e, f = atoms.info["REF_energy"], atoms.arrays["REF_forces"]
    assert isinstance(e, float) and np.isfinite(e)
    assert f.shape == (len(atoms), 3) and np.isfinite(f).all()
    fnorm = np.linalg.norm(f, axis=1)
    assert fnorm.max() > 1e-3, "structures are rattled: forces must not vanish"
    # every calculator used conserves momentum: the net force is round-off only
    assert np.linalg.norm(f.sum(0)) <= 1e-6 * max(1.0, fnorm.sum())


@pytest.mark.parametrize("name", CHEAP)
def test_cheap_families(name):
    for index in range(3):
        atoms = generate(name, index, seed=7)
        _check_geometry(atoms, name, index, 7)
        if CALCULATOR[name] is None:
            assert atoms.info["labelled"] is False and "REF_energy" not in atoms.info
            assert "REF_forces" not in atoms.arrays
        else:
            _check_labels(atoms)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_geometry_many_indices(name):
    """Geometry only (no labels): many sizes of each family, including the extremes."""
    count = 5 if name in ("zeolite", "liquid_water", "cuni") else 12  # big ones: fewer
    for index in range(count):
        _check_geometry(generate(name, index, seed=3, labelled=False), name, index, 3)


def test_mptrj_every_size_reachable():
    from workbench.data.synth.generators import build_mptrj

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 13, 97, 211, 443, 444):
        atoms = build_mptrj(n, rng)
        assert len(atoms) == n and _min_distance(atoms) >= 0.7


def test_water_cluster_oxygen_spacing():
    atoms = generate("water_clusters", 0, seed=1, labelled=False)
    o = atoms.positions[atoms.numbers == 8]
    d = np.linalg.norm(o[:, None] - o[None], axis=-1) + 1e3 * np.eye(len(o))
    nearest = d.min(1)
    assert nearest.min() >= 2.5 and nearest.max() <= 3.1
    assert list(atoms.get_chemical_symbols()[:3]) == ["O", "H", "H"]  # TIP3P order


def test_liquid_water_density():
    atoms = generate("liquid_water", 0, seed=0, labelled=False)
    rho = atoms.get_masses().sum() / 6.02214076e23 / (atoms.get_volume() * 1e-24)
    assert 0.97 <= rho <= 1.03


def test_tmd_gfn1_xtb_one_structure():
    """tblite GFN1-xTB (opt-in for tmd) labels one small slab: ~1 s."""
    index = next(i for i in range(50) if _expected_natoms("tmd", i, 0) <= 24)
    atoms = generate("tmd", index, seed=0, calculator="gfn1-xtb")
    _check_geometry(atoms, "tmd", index, 0)
    _check_labels(atoms)
    assert atoms.info["calculator"] == "gfn1-xtb"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("WORKBENCH_XTB_SLOW"), reason="281-atom GFN1-xTB takes 2-3 min; set WORKBENCH_XTB_SLOW=1"
)
def test_al_hcl_labels():
    assert "al_hcl" in XTB
    atoms = generate("al_hcl", 0, seed=0)
    _check_geometry(atoms, "al_hcl", 0, 0)
    _check_labels(atoms)


def test_al_hcl_composition():
    atoms = generate("al_hcl", 0, seed=0, labelled=False)
    sym = atoms.get_chemical_symbols()
    n_o, n_h, n_cl = sym.count("O"), sym.count("H"), sym.count("Cl")
    assert sym.count("Al") == 1 and len(atoms) == 281
    n_h3o = n_h - 2 * n_o  # each O carries 2 H, hydronium one more
    assert 3 + n_h3o - n_cl == 0  # neutral: Al3+ + H3O+ = Cl-
    d = atoms.get_distances(0, np.flatnonzero(atoms.numbers == 8), mic=True)
    assert np.sum(d < 2.2) == 6  # octahedral [Al(H2O)6]3+


def _text(atoms) -> str:
    buf = io.StringIO()
    write(buf, atoms, format="extxyz")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["mptrj", "water_clusters", "cuni", "zeolite"])
def test_generate_reproducible(name):
    assert _text(generate(name, 5, seed=11)) == _text(generate(name, 5, seed=11))
    assert _text(generate(name, 5, seed=11)) != _text(generate(name, 6, seed=11))


def test_mixture_counts_and_order():
    fams = ["mptrj", "water_clusters", "hea"]
    a = make_mixture(n=30, seed=2, families=fams)
    got = {f: sum(x.info["config_type"] == f for x in a) for f in fams}
    assert got == family_counts(30, fams)
    b = make_mixture(n=30, seed=2, families=fams)
    assert "".join(map(_text, a)) == "".join(map(_text, b))
    # interleaved, not grouped by family
    kinds = [x.info["config_type"] for x in a]
    assert kinds != sorted(kinds, key=fams.index)


def test_mixture_dict_counts():
    a = make_mixture(seed=0, families={"hea": 3, "water_clusters": 2, "cuni": 0})
    assert sorted(x.info["config_type"] for x in a) == ["hea"] * 3 + ["water_clusters"] * 2


def test_mixture_all_families_plan():
    tasks = mixture_tasks(n=2000, seed=0)
    counts = family_counts(2000)
    assert len(tasks) == 2000
    assert {f: sum(t[0] == f for t in tasks) for f in FAMILY_NAMES} == counts
    assert tasks == mixture_tasks(n=2000, seed=0)


def test_mixture_workers_same_result():
    fams = {"hea": 3, "water_clusters": 3}
    one = make_mixture(seed=4, families=fams, workers=1)
    two = make_mixture(seed=4, families=fams, workers=2)
    assert "".join(map(_text, one)) == "".join(map(_text, two))


@pytest.mark.parametrize("bad", [["mptrj", "graphene"], {"nope": 3}])
def test_bad_family_names(bad):
    with pytest.raises(KeyError, match="mptrj"):
        make_mixture(n=5, families=bad)
    with pytest.raises(KeyError, match="choose from"):
        generate("graphene", 0, 0)


def test_label_unknown_family():
    with pytest.raises(KeyError):
        label(generate("hea", 0, 0, labelled=False), "graphene")
