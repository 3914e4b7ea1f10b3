"""read_structures / validate_structure: good files round-trip, every bad input names file and frame."""

import gzip

import ase
import numpy as np
import pytest
from ase.build import bulk, molecule
from ase.calculators.emt import EMT

from workbench.data import StructureError, read_structures, write_structures
from workbench.data.io import structures_to_text


def labelled(atoms: ase.Atoms, seed: int) -> ase.Atoms:
    """EMT labels on a rattled copy: real physics, never zeros."""
    atoms = atoms.copy()
    atoms.rattle(0.05, seed=seed)
    atoms.calc = EMT()
    atoms.info["REF_energy"] = atoms.get_potential_energy()
    atoms.arrays["REF_forces"] = atoms.get_forces()
    atoms.info["config_type"] = "cuni"
    atoms.calc = None
    return atoms


@pytest.fixture
def frames():
    return [labelled(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2), 1),
            labelled(bulk("Ni", "fcc", a=3.52).repeat((2, 2, 1)), 2),
            labelled(molecule("CO2"), 3)]


def test_roundtrip_gz_and_plain(tmp_path, frames):
    for name in ("a.extxyz", "a.extxyz.gz"):
        path = write_structures(tmp_path / name, frames)
        back = read_structures(path)
        assert len(back) == 3
        for a, b in zip(frames, back):
            assert a.get_chemical_formula() == b.get_chemical_formula()
            np.testing.assert_allclose(b.positions, a.positions, atol=1e-7)
            np.testing.assert_allclose(b.arrays["REF_forces"], a.arrays["REF_forces"], atol=1e-7)
            assert b.info["REF_energy"] == pytest.approx(a.info["REF_energy"], abs=1e-7)
            assert b.info["config_type"] == "cuni"


def test_gzip_is_reproducible(tmp_path, frames):
    a = write_structures(tmp_path / "x.extxyz.gz", frames).read_bytes()
    b = write_structures(tmp_path / "y.extxyz.gz", frames).read_bytes()
    assert a == b
    assert gzip.decompress(a).decode() == structures_to_text(frames)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.extxyz"):
        read_structures(tmp_path / "nope.extxyz")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.extxyz"
    p.write_text("")
    with pytest.raises(StructureError, match=r"empty\.extxyz.*(no structures|cannot parse)"):
        read_structures(p)


def test_malformed_frame_is_named(tmp_path, frames):
    p = write_structures(tmp_path / "bad.extxyz", frames)
    lines = p.read_text().splitlines()
    # Corrupt a coordinate line of the third frame (index 2).
    n0, n1 = len(frames[0]), len(frames[1])
    line = 2 + n0 + 2 + n1 + 2
    lines[line] = "C  not-a-number 0.0 0.0"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(StructureError, match=r"bad\.extxyz, frame 2: cannot parse") as err:
        read_structures(p)
    assert err.value.frame == 2


def test_garbage_file(tmp_path):
    p = tmp_path / "garbage.extxyz"
    p.write_text("this is not\nan xyz file\n")
    with pytest.raises(StructureError, match=r"garbage\.extxyz, frame 0"):
        read_structures(p)


@pytest.mark.parametrize("key", ["REF_energy", "REF_forces"])
def test_missing_labels(tmp_path, frames, key):
    if key == "REF_energy":
        del frames[1].info[key]
    else:
        del frames[1].arrays[key]
    p = write_structures(tmp_path / "nolabel.extxyz", frames)
    with pytest.raises(StructureError, match=rf"nolabel\.extxyz, frame 1: missing .*{key}"):
        read_structures(p)
    # Reading without label checks keeps every frame.
    assert len(read_structures(p, require_labels=False)) == 3


def test_declared_unlabelled_frames_pass(tmp_path, frames):
    del frames[0].info["REF_energy"], frames[0].arrays["REF_forces"]
    frames[0].info["labelled"] = False
    assert len(read_structures(write_structures(tmp_path / "u.extxyz", frames))) == 3


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_coordinates(tmp_path, frames, bad):
    frames[2].positions[1, 0] = bad
    p = write_structures(tmp_path / "nan.extxyz", frames)
    with pytest.raises(StructureError, match=r"nan\.extxyz, frame 2: non-finite .* atom 1"):
        read_structures(p)


def test_non_finite_forces(tmp_path, frames):
    frames[0].arrays["REF_forces"][3, 2] = np.nan
    p = write_structures(tmp_path / "f.extxyz", frames)
    with pytest.raises(StructureError, match=r"frame 0: non-finite forces .* atom 3"):
        read_structures(p)


def test_close_atoms(tmp_path, frames):
    frames[2].positions[2] = frames[2].positions[0] + [0.3, 0.0, 0.0]
    p = write_structures(tmp_path / "close.extxyz", frames)
    with pytest.raises(StructureError, match=r"frame 2: atoms 0 and 2 are 0\.300 Å apart"):
        read_structures(p)


def test_close_periodic_image(tmp_path, frames):
    # Two atoms 0.2 Å apart only through the periodic boundary.
    a = ase.Atoms("Cu2", positions=[[0.1, 1, 1], [4.9, 1, 1]], cell=[5, 5, 5], pbc=True)
    a = labelled(a, 4)
    a.positions = [[0.1, 1, 1], [4.9, 1, 1]]
    p = write_structures(tmp_path / "pbc.extxyz", [frames[0], a])
    with pytest.raises(StructureError, match=r"frame 1: atoms 0 and 1 are 0\.200 Å apart"):
        read_structures(p)


def test_parsed_frames_are_cached_by_content(tmp_path, frames, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    path = write_structures(tmp_path / "a.extxyz", frames)
    first = read_structures(path)
    cached = list((tmp_path / "cache" / "structures").glob("*.pkl"))
    assert len(cached) == 1
    again = read_structures(path)  # from the cache
    assert [a.positions.tolist() for a in again] == [a.positions.tolist() for a in first]
    assert [a.info["REF_energy"] for a in again] == [a.info["REF_energy"] for a in first]
    # Other options or other content: another entry; a broken frame is never cached.
    read_structures(path, energy_key="REF_energy", validate=False)
    assert len(list((tmp_path / "cache" / "structures").glob("*.pkl"))) == 2
    text = path.read_text().replace("Properties=", "Properties=broken:", 1)
    path.write_text(text)
    with pytest.raises(StructureError, match="a.extxyz"):
        read_structures(path)
    assert len(list((tmp_path / "cache" / "structures").glob("*.pkl"))) == 2
