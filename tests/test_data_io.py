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
    return [
        labelled(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2), 1),
        labelled(bulk("Ni", "fcc", a=3.52).repeat((2, 2, 1)), 2),
        labelled(molecule("CO2"), 3),
    ]


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


@pytest.mark.parametrize("format", [None, "xyz"])
def test_unknown_element_symbol_is_named(tmp_path, format):
    """ASE's bare KeyError('Xx') becomes the frame and the symbol, in our extxyz reader and
    through ASE's other readers (``format="xyz"``)."""
    p = tmp_path / "symbol.xyz"
    frame = "2\nProperties=species:S:1:pos:R:3 energy=1.0\nH 0 0 0\nXx 0 0 0.74\n"
    p.write_text(frame + frame.replace("Xx", "H"))
    with pytest.raises(StructureError, match=r"symbol\.xyz, frame 0: unknown chemical symbol 'Xx'"):
        read_structures(p, format=format, validate=False)


def test_other_key_errors_are_not_called_symbols():
    from workbench.data.formats.extxyz import parse_failure

    try:
        {}["pos"]
    except KeyError as exc:
        assert parse_failure(exc) == "cannot parse (KeyError: 'pos')"


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
    entries = lambda: sorted((tmp_path / "cache" / "structures").glob("*"))  # noqa: E731
    path = write_structures(tmp_path / "a.extxyz", frames)
    first = read_structures(path)
    assert [p.suffix for p in entries()] == [".npz"]  # plain arrays, never a pickle
    again = read_structures(path)  # from the cache
    assert [a.positions.tolist() for a in again] == [a.positions.tolist() for a in first]
    assert [a.info["REF_energy"] for a in again] == [a.info["REF_energy"] for a in first]
    np.testing.assert_array_equal(again[1].arrays["REF_forces"], first[1].arrays["REF_forces"])
    # Other options or other content: another entry; a broken frame is never cached.
    read_structures(path, energy_key="REF_energy", validate=False)
    assert len(entries()) == 2
    text = path.read_text().replace("Properties=", "Properties=broken:", 1)
    path.write_text(text)
    with pytest.raises(StructureError, match="a.extxyz"):
        read_structures(path)
    assert len(entries()) == 2


def test_cache_is_keyed_by_suffix_and_never_trusted(tmp_path, frames, monkeypatch):
    from workbench.data import cache

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    good = write_structures(tmp_path / "a.extxyz", frames)
    read_structures(good)
    fake = tmp_path / "b.extxyz.gz"  # the same bytes, named as gzip
    fake.write_bytes(good.read_bytes())
    with pytest.raises(StructureError, match=r"b\.extxyz\.gz: not a gzip file"):
        read_structures(fake)
    # A file planted at the entry's key: a pickle is not loaded (the file is parsed instead) ...
    entry = cache.cache_path(
        good.read_bytes(), good, (":", None, True, True, "REF_energy", "REF_forces", "REF_stress", "REF_virials")
    )
    assert entry.exists()
    import pickle

    entry.write_bytes(pickle.dumps(frames))
    assert len(read_structures(good)) == len(frames)
    # ... and arrays with NaN coordinates are caught by the checks run on every cache hit.
    bad = [a.copy() for a in frames]
    bad[2].positions[0, 0] = np.nan
    assert cache.save(entry, bad)
    with pytest.raises(StructureError, match=r"a\.extxyz, frame 2: non-finite"):
        read_structures(good)


# -- adversarial inputs: each names the file and the right frame ------------------------------


def _many(frames, n=6):
    out = []
    for k in range(n):
        a = frames[k % len(frames)].copy()
        a.info, a.arrays = dict(a.info), {key: v.copy() for key, v in a.arrays.items()}
        out.append(a)
    return out


def _lines(path):
    return path.read_text().splitlines(keepends=True)


def _frame_starts(lines):
    starts = [0]
    while starts[-1] < len(lines):
        starts.append(starts[-1] + int(lines[starts[-1]]) + 2)
    return starts[:-1]


@pytest.mark.parametrize("delta, why", [(5, "starts the next frame"), (-2, "more atom lines follow")])
def test_wrong_atom_count_names_its_frame(tmp_path, frames, delta, why):
    path = write_structures(tmp_path / "n.extxyz", _many(frames))
    lines = _lines(path)
    s = _frame_starts(lines)
    lines[s[3]] = str(int(lines[s[3]]) + delta) + "\n"  # frame 3's count is off by delta
    path.write_text("".join(lines))
    with pytest.raises(StructureError, match=rf"n\.extxyz, frame 3: the atom count says .*{why}"):
        read_structures(path)


@pytest.mark.parametrize("where", [1e5, 1e30])
def test_far_away_atom_is_an_error_not_a_crash(tmp_path, frames, where):
    mol, box = frames[2].copy(), frames[0].copy()
    mol.positions[1, 0] = where
    box.positions[3, 2] = where
    for k, a in enumerate((mol, box)):
        path = write_structures(tmp_path / f"far{k}.extxyz", [frames[1], a])
        with pytest.raises(StructureError, match=rf"far{k}\.extxyz, frame 1: .*(spans|outside the periodic cell)"):
            read_structures(path)


def test_gzip_damage_names_the_file(tmp_path, frames):
    path = write_structures(tmp_path / "t.extxyz.gz", _many(frames, 30))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(StructureError, match=r"t\.extxyz\.gz, frame \d+: compressed stream is corrupt or truncated"):
        read_structures(path)
    text = structures_to_text(_many(frames)).encode()
    at = text.index(b"\n", text.index(b"Properties", text.index(b"Properties") + 1)) + 3  # inside frame 1
    (tmp_path / "latin.extxyz.gz").write_bytes(gzip.compress(text[:at] + b"\xe9" + text[at:]))
    with pytest.raises(StructureError, match=r"latin\.extxyz\.gz, frame 1: not UTF-8"):
        read_structures(tmp_path / "latin.extxyz.gz")


def test_zero_volume_cell_unknown_species_duplicate_key(tmp_path, frames):
    flat = frames[0].copy()
    flat.cell[2] = [0, 0, 0]
    path = write_structures(tmp_path / "flat.extxyz", [frames[2], flat])
    with pytest.raises(StructureError, match=r"flat\.extxyz, frame 1: periodic structure with a degenerate"):
        read_structures(path)
    x = frames[2].copy()
    x.numbers[0] = 0  # species X
    path = write_structures(tmp_path / "x.extxyz", [frames[1], x])
    with pytest.raises(StructureError, match=r"x\.extxyz, frame 1: atom 0 has atomic number 0 \(symbol 'X'\)"):
        read_structures(path)
    path = write_structures(tmp_path / "dup.extxyz", _many(frames, 3))
    lines = _lines(path)
    s = _frame_starts(lines)
    lines[s[2] + 1] = lines[s[2] + 1].rstrip("\n") + " REF_energy=1.0\n"
    path.write_text("".join(lines))
    with pytest.raises(StructureError, match=r"dup\.extxyz, frame 2: key 'REF_energy' appears more than once"):
        read_structures(path)


PARITY_FRAMES = [
    '2\nLattice="4.0 0.0 0.0 0.0 4.0 0.0 0.0 0.0 4.0" Properties=species:S:1:pos:R:3 REF_energy=-1.5 note="a b" flag=T\n'
    "Cu 0.0 0.0 0.0\nNi 2.0 2.0 2.0\n",
    '3\nProperties=species:S:1:pos:R:3:tag:I:1:REF_forces:R:3 REF_energy=2 vec="1.0 2.0 3.0" pbc="F F F"\n'
    "O 0.0 0.0 0.0 1 0.1 0.2 0.3\nH 0.96 0.0 0.0 2 -0.1 0.0 0.0\nh 0.0 0.96 0.0 3 0.0 -0.2 -0.3\n",
    '1\nLattice="3.0 0.1 0.0 0.0 3.0 0.0 0.2 0.0 3.0" pbc="T T F" Properties=species:S:1:pos:R:3:mask:L:1 count=7\n'
    "Au 0.5 0.5 0.5 T\n",
    "2\nenergy=-3.0 Properties=species:S:1:pos:R:3:forces:R:3\nH 0 0 0 0 0 1\nH 0 0 0.74 0 0 -1\n",  # ASE: a calculator
]


def _same(x, y) -> bool:
    ok = np.array_equal(x.numbers, y.numbers) and np.array_equal(x.positions, y.positions)
    ok &= np.array_equal(x.cell.array, y.cell.array) and np.array_equal(x.pbc, y.pbc)
    ok &= set(x.arrays) == set(y.arrays) and all(
        np.array_equal(x.arrays[k], y.arrays[k]) and x.arrays[k].dtype == y.arrays[k].dtype for k in x.arrays
    )
    ok &= x.info.keys() == y.info.keys() and all(np.all(x.info[k] == y.info[k]) for k in x.info)
    return bool(ok and (x.calc is None) == (y.calc is None))


def test_fast_parser_gives_what_ase_gives():
    import io

    import ase.io

    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.data.formats.extxyz import iter_frames, parse_frames

    pytest.importorskip("extxyz")
    frames = [t for _, t, _ in iter_frames(EMBEDDED_PATH)] + [t.encode() for t in PARITY_FRAMES]
    got = [a for _, a in parse_frames("x", 0, frames)]
    want = [ase.io.read(io.StringIO(t.decode()), format="extxyz") for t in frames]
    assert [k for k, (a, b) in enumerate(zip(got, want)) if not _same(a, b)] == []
