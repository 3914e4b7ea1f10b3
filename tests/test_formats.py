"""The format registry: every format round-trips, prepares into the extxyz route's store bit for bit,
names its bad rows by file, frame and row id, and stress labels arrive in each shape ASE writes."""

from __future__ import annotations

import io
import json
import zlib

import ase.io
import numpy as np
import pytest
from ase.build import bulk

from workbench.data import formats
from workbench.data.embedded import EMBEDDED_PATH
from workbench.data.io import StructureError, read_structures, write_structures
from workbench.data.keys import as_matrix
from workbench.data.prepare import prepare
from workbench.data.store import GraphStore

DB_NAMES = {"ase-db": "s.db", "aselmdb": "s.aselmdb", "mace-lmdb": "s_lmdb"}


def _emt(atoms, rng, stress=True):
    from ase.calculators.emt import EMT

    atoms.calc = EMT()
    atoms.info["REF_energy"] = float(atoms.get_potential_energy())
    atoms.arrays["REF_forces"] = atoms.get_forces().copy()
    if stress:
        atoms.info["REF_stress"] = atoms.get_stress(voigt=True).copy()
    atoms.calc = None
    return atoms


@pytest.fixture(scope="module")
def frames():
    """Strained periodic crystals with EMT stress, a cluster without one, weights, an unlabelled frame."""
    rng = np.random.default_rng(7)
    out = []
    for k, (el, a) in enumerate([("Cu", 3.6), ("Ni", 3.52), ("Al", 4.05), ("Cu", 3.65), ("Ni", 3.5), ("Al", 4.0)]):
        atoms = bulk(el, "fcc", a=a, cubic=True).repeat((1, 1, 2 if k % 2 else 1))
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.normal(0, 0.02, (3, 3))), scale_atoms=True)
        atoms.rattle(0.05, seed=k)
        atoms.info["config_type"] = "bulk"
        out.append(_emt(atoms, rng))
    cluster = bulk("Cu", "fcc", a=3.6, cubic=True)
    cluster.pbc, cluster.cell = False, np.zeros((3, 3))
    cluster.rattle(0.05, seed=11)
    cluster.info["config_type"] = "cluster"
    out.append(_emt(cluster, rng, stress=False))
    out[1].info["config_weight"] = 2.0
    out[2].info["config_stress_weight"] = 0.5
    blank = bulk("Al", "fcc", a=4.05, cubic=True)
    blank.info.update(config_type="unlabelled", labelled=False)
    out.append(blank)
    return out


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.numbers, b.numbers)
    assert a.positions.tobytes() == b.positions.tobytes()
    np.testing.assert_array_equal(a.cell.array, b.cell.array)
    np.testing.assert_array_equal(a.pbc, b.pbc)
    for key in ("config_type", "labelled", "config_weight", "config_stress_weight", "REF_energy"):
        assert a.info.get(key) == b.info.get(key), key
    if "REF_forces" in a.arrays:
        assert a.arrays["REF_forces"].tobytes() == b.arrays["REF_forces"].tobytes()
    assert ("REF_stress" in a.info) == ("REF_stress" in b.info)
    if "REF_stress" in a.info:
        assert as_matrix(a.info["REF_stress"]).tobytes() == as_matrix(b.info["REF_stress"]).tobytes()


@pytest.mark.parametrize("name", ["extxyz", *DB_NAMES])
def test_every_format_round_trips(frames, tmp_path, name):
    path = tmp_path / ("s.extxyz" if name == "extxyz" else DB_NAMES[name])
    write_structures(path, frames)
    assert formats.detect(path).name == name
    back = read_structures(path, require_labels=False)
    assert len(back) == len(frames)
    # extxyz prints positions to 1e-8 Å: compare what it wrote with what it reads
    expect = read_structures(write_structures(tmp_path / "ref.extxyz", frames), require_labels=False)
    for a, b in zip(expect if name == "extxyz" else frames, back):
        _same(a, b)


def _store_bytes(store: GraphStore) -> tuple[bytes, list[str]]:
    return store.records().tobytes(), [r["digest"] for r in store.manifest["shards"]]


def test_database_formats_prepare_into_the_extxyz_routes_store(frames, tmp_path):
    src = write_structures(tmp_path / "s.extxyz", frames)
    parsed = read_structures(src, require_labels=False)  # what the extxyz route stores, 1e-8 Å positions
    ref = prepare([src], tmp_path / "ref", workers=1, shard_size=3, progress=False)
    assert ref.has_stress and int(ref.column("stress").sum()) == 6
    for name, file in DB_NAMES.items():
        path = write_structures(tmp_path / file, parsed)
        store = prepare([path], tmp_path / f"from-{name}", workers=2, shard_size=3, progress=False)
        assert _store_bytes(store) == _store_bytes(ref), name
    g = ref.graph(2)
    assert g.weights.tolist() == [1.0, 1.0, 1.0, 0.5, 0.0]
    assert np.isnan(ref.graph(6).stress).all() and ref.graph(6).weights[3] == 0  # the cluster: masked


def test_lmdb_written_by_mace_and_read_by_mace(frames, tmp_path):
    """Files of mace's own LMDB writer prepare like ours, and mace's reader reads ours."""
    from ase.calculators.singlepoint import SinglePointCalculator
    from mace.tools.fairchem_dataset import AseDBDataset
    from mace.tools.fairchem_dataset.lmdb_dataset_tools import LMDBDatabase

    src = write_structures(tmp_path / "s.extxyz", frames[:7])
    parsed = read_structures(src)
    folder = tmp_path / "mace_lmdb"
    folder.mkdir()
    db = LMDBDatabase(folder / "part0.lmdb", readonly=False)
    for a in parsed:
        b = a.copy()
        info = {k: v for k, v in b.info.items() if not k.startswith("REF_")}
        b.info, b.arrays = info, {k: v for k, v in b.arrays.items() if k in ("numbers", "positions")}
        results = {"energy": a.info["REF_energy"], "forces": a.arrays["REF_forces"]}
        if "REF_stress" in a.info:
            results["stress"] = a.info["REF_stress"]
        b.calc = SinglePointCalculator(b, **results)
        db.write(b)
    db.close()
    assert formats.detect(folder).name == "mace-lmdb"
    theirs = prepare([folder], tmp_path / "theirs", workers=1, progress=False)
    ours = prepare([src], tmp_path / "ours", workers=1, progress=False)
    assert _store_bytes(theirs)[0] == _store_bytes(ours)[0]
    mine = write_structures(tmp_path / "ours.aselmdb", parsed)
    seen = AseDBDataset(config={"src": str(mine)})
    for k, a in enumerate(parsed):
        b = seen.get_atoms(seen.ids[k])
        np.testing.assert_array_equal(b.positions, a.positions)
        assert b.calc.results["energy"] == a.info["REF_energy"]  # mace's reader: results, then arrays added
        if "REF_stress" in a.info:
            np.testing.assert_array_equal(b.calc.results["stress"], a.info["REF_stress"])


def _extxyz_with(stress_text: str, periodic: bool = True) -> str:
    lattice = 'Lattice="4 0 0 0 4 0 0 0 4" pbc="T T T"' if periodic else 'pbc="F F F"'
    return (
        f"2\n{lattice} Properties=species:S:1:pos:R:3:REF_forces:R:3 REF_energy=-1.0 {stress_text}\n"
        "Cu 0 0 0 0.1 0 0\nCu 2 2 0 -0.1 0 0\n"
    )


def test_extxyz_stress_in_every_shape_ase_writes(tmp_path):
    """3x3 (ASE writes it as _JSON), Voigt 6 and 9 numbers give the same matrix, through the C
    parser and through ASE; the 9 numbers read in the order written (ASE keeps them flat)."""
    from workbench.data.formats.extxyz import parse_frames

    m = np.array([[1.0, 6.0, 5.0], [6.0, 2.0, 4.0], [5.0, 4.0, 3.0]]) * 1e-3
    voigt = " ".join(str(x) for x in (m[0, 0], m[1, 1], m[2, 2], m[1, 2], m[0, 2], m[0, 1]))
    nine = np.arange(9.0) * 1e-3
    texts = [
        _extxyz_with(f'REF_stress="_JSON {json.dumps(m.tolist())}"'),
        _extxyz_with(f'REF_stress="{voigt}"'),
        _extxyz_with(f'REF_stress="{" ".join(map(str, nine))}"'),
    ]
    parsed = [a for _, a in parse_frames(tmp_path / "x.extxyz", 0, [t.encode() for t in texts])]
    for got, text in zip(parsed, texts):
        ase_reads = ase.io.read(io.StringIO(text), format="extxyz")
        np.testing.assert_array_equal(as_matrix(got.info["REF_stress"]), as_matrix(ase_reads.info["REF_stress"]))
    np.testing.assert_array_equal(as_matrix(parsed[0].info["REF_stress"]), m)
    np.testing.assert_array_equal(as_matrix(parsed[1].info["REF_stress"]), m)
    np.testing.assert_array_equal(as_matrix(parsed[2].info["REF_stress"]), nine.reshape(3, 3))
    path = tmp_path / "shapes.extxyz"
    path.write_text("".join(texts))
    store = prepare([path], tmp_path / "store", workers=1, progress=False)
    np.testing.assert_array_equal(store.graph(1).stress, m)


@pytest.mark.parametrize(
    ("stress", "periodic", "reason"),
    [
        ('REF_stress="1 2 3 4 5"', True, r"stress label 'REF_stress' has shape \(5,\)"),
        ('REF_stress="nan 0 0 0 0 0"', True, "stress label 'REF_stress' is not numeric: 'nan 0 0 0 0 0'"),
        ('REF_stress="1e5 0 0 0 0 0"', True, "beyond 1000 eV/Å³"),
        ('REF_stress="0.1 0 0 0 0 0"', False, "on a structure with no periodic direction"),
        ('REF_virials="1 2"', True, r"virials label 'REF_virials' has shape \(2,\)"),
    ],
)
def test_bad_stress_labels_are_named(tmp_path, stress, periodic, reason):
    path = tmp_path / "bad.extxyz"
    path.write_text(_extxyz_with("", True) + _extxyz_with(stress, periodic))
    with pytest.raises(StructureError, match=rf"bad\.extxyz, frame 1: .*{reason}"):
        read_structures(path)
    with pytest.raises(StructureError, match=rf"bad\.extxyz, frame 1: .*{reason}"):
        prepare([path], tmp_path / "out", workers=1, progress=False)
    store = prepare([path], tmp_path / "skip", workers=1, on_error="skip", progress=False)
    assert len(store) == 1 and store.manifest["n_skipped"] == 1


def test_a_nan_stress_in_a_database_is_named(frames, tmp_path):
    bad = [a.copy() for a in frames[:3]]
    bad[1].info["REF_stress"] = np.array([np.nan, 0, 0, 0, 0, 0])
    path = write_structures(tmp_path / "nan.db", bad)
    with pytest.raises(StructureError, match=r"nan\.db, frame 1: row id 2: stress label 'REF_stress' is not finite"):
        read_structures(path)


def _raw_lmdb(path, rows: dict) -> None:
    import lmdb

    env = lmdb.open(str(path), subdir=False, map_size=2**26)
    with env.begin(write=True) as txn:
        for key, value in rows.items():
            txn.put(str(key).encode(), value)
    env.close()
    (path.parent / f"{path.name}-lock").unlink(missing_ok=True)


def _row(**fields) -> bytes:
    base = {
        "numbers": [29, 29],
        "positions": [[0, 0, 0], [1.8, 1.8, 0]],
        "cell": [[3.6, 0, 0], [0, 3.6, 0], [0, 0, 3.6]],
        "pbc": [True, True, True],
        "energy": -1.0,
        "forces": [[0.1, 0, 0], [-0.1, 0, 0]],
        "key_value_pairs": {"config_type": "x"},
    }
    base.update(fields)
    return zlib.compress(json.dumps({k: v for k, v in base.items() if v is not None}).encode())


BAD_ROWS = {
    2: (b"not zlib at all", "not zlib-compressed"),
    3: (zlib.compress(b"{not json"), "not JSON"),
    4: (zlib.compress(b"[1, 2]"), "a JSON list, not a row"),
    5: (_row(numbers=None), "no numbers"),
    6: (_row(positions=[[0, 0, 0]]), r"positions has shape \(1, 3\), expected \(2, 3\)"),
    7: (_row(stress=[1, 2, 3, 4, 5]), r"stress has shape \(5,\)"),
    8: (_row(energy=float("nan")), "energy label 'REF_energy' is nan"),
    9: (_row(numbers=[29, 200]), "atomic number 200, outside 1-118"),
    10: (_row(forces=[[1, 2]]), r"forces has shape \(1, 2\)"),
    11: (zlib.compress(b" " * (300 * 2**20)), "decompresses to more than 256 MiB"),
}


def test_bad_lmdb_rows_are_named_by_file_frame_and_id(tmp_path):
    path = tmp_path / "bad.aselmdb"
    _raw_lmdb(path, {1: _row(), 12: _row(), **{k: v for k, (v, _) in BAD_ROWS.items()}, "nextid": b"x"})
    with pytest.raises(StructureError, match=r"bad\.aselmdb, frame 1: row id 2: not zlib-compressed"):
        read_structures(path)
    store = prepare([path], tmp_path / "skip", workers=1, on_error="skip", progress=False)
    assert len(store) == 2  # ids 1 and 12
    skipped = [json.loads(line) for line in (store.path / "skipped.jsonl").read_text().splitlines()]
    assert [s["frame"] for s in skipped] == list(range(1, 11))
    for s, (row_id, (_, reason)) in zip(skipped, BAD_ROWS.items()):
        assert s["source"] == str(path)
        assert s["reason"].startswith(f"row id {row_id}: ")
        assert __import__("re").search(reason, s["reason"]), (s, reason)


def test_files_that_are_not_what_their_name_says(tmp_path):
    lmdb_as_db = tmp_path / "x.db"
    _raw_lmdb(lmdb_as_db, {1: _row()})
    with pytest.raises(StructureError, match=r"x\.db: is an LMDB file, not SQLite: rename it to \.aselmdb"):
        read_structures(lmdb_as_db)
    text = tmp_path / "y.aselmdb"
    text.write_text("hello")
    with pytest.raises(StructureError, match=r"y\.aselmdb: is not an LMDB file"):
        prepare([text], tmp_path / "out", progress=False)
    empty = tmp_path / "z.aselmdb"
    _raw_lmdb(empty, {"nextid": b"1"})
    with pytest.raises(StructureError, match=r"z\.aselmdb: holds no rows"):
        read_structures(empty)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("x")
    with pytest.raises(StructureError, match="holds no structure files this workbench reads: mace-h5"):
        formats.detect(tmp_path / "folder")
    with pytest.raises(ValueError, match="format 'parquet': choose one of extxyz, mace-h5, ase-db, aselmdb"):
        formats.detect(text, "parquet")
    traj = tmp_path / "t.traj"
    ase.io.write(traj, bulk("Cu"))
    with pytest.raises(StructureError, match=r"t\.traj: data prepare reads extended XYZ"):
        prepare([traj], tmp_path / "traj-out", progress=False)


def test_a_folder_of_aselmdb_files_reads_in_sorted_order(frames, tmp_path):
    folder = tmp_path / "omat"
    folder.mkdir()
    labelled = [a for a in frames if a.info.get("labelled", True)]
    write_structures(folder / "b.aselmdb", labelled[3:])
    write_structures(folder / "a.aselmdb", labelled[:3])
    (folder / "README").write_text("not a database")
    assert formats.detect(folder).name == "aselmdb"
    back = read_structures(folder)
    assert [a.info["REF_energy"] for a in back] == [a.info["REF_energy"] for a in labelled]
    store = prepare([folder], tmp_path / "store", workers=1, progress=False)
    assert [p for p, _ in store.origin(np.arange(len(store)))][2:4] == [
        str(folder / "a.aselmdb"),
        str(folder / "b.aselmdb"),
    ]


def test_mace_hdf5_carries_stress_and_virials(frames, tmp_path):
    import h5py
    from mace.data.utils import config_from_atoms, save_configurations_as_HDF5

    from workbench.data.atomic_data import key_specification

    labelled = [a for a in frames if a.info.get("labelled", True)]
    labelled[0].info["REF_virials"] = -as_matrix(labelled[0].info["REF_stress"]) * labelled[0].get_volume()
    configs = [config_from_atoms(a, key_specification=key_specification()) for a in labelled]
    with h5py.File(tmp_path / "train.h5", "w") as f:
        save_configurations_as_HDF5(configs, 0, f)
    store = prepare([tmp_path / "train.h5"], tmp_path / "store", workers=1, progress=False)
    assert store.column("stress").tolist() == [True] * 6 + [False]
    assert store.column("virials").tolist() == [True] + [False] * 6
    for k, a in enumerate(labelled[:6]):
        np.testing.assert_array_equal(store.graph(k).stress, as_matrix(a.info["REF_stress"]))
    np.testing.assert_array_equal(store.graph(0).virials, labelled[0].info["REF_virials"])
    assert store.graph(2).weights[3] == 0.5


def _downgrade_to_version_2(store: GraphStore) -> None:
    """Rewrite a store as version 2 wrote it: no stress or virials anywhere, three weights."""
    import h5py

    from workbench.data.shards import SHARD_ARRAYS_V2, shard_digest
    from workbench.data.store import INDEX_DTYPE_V2

    manifest = store.manifest
    for rec in manifest["shards"]:
        path = store.path / "shards" / rec["name"]
        with h5py.File(path, "r") as f:
            arrays = {n: f[n][()] for n in SHARD_ARRAYS_V2}
        arrays["weights"] = arrays["weights"][:, :3]
        with h5py.File(path, "w") as f:
            for n in SHARD_ARRAYS_V2:
                f.create_dataset(n, data=arrays[n])
            rec["digest"] = f.attrs["digest"] = shard_digest(arrays, SHARD_ARRAYS_V2)
        rec["bytes"] = path.stat().st_size
    old = np.zeros(len(store), dtype=INDEX_DTYPE_V2)
    for name in INDEX_DTYPE_V2.names:
        old[name] = store.records()[name]
    np.save(store.path / "index.npy", old)
    manifest["version"] = 2
    (store.path / "manifest.json").write_text(json.dumps(manifest))


def test_a_store_of_version_2_opens_without_stress_and_prepares_again(frames, tmp_path):
    src = write_structures(tmp_path / "s.extxyz", frames)
    store = prepare([src], tmp_path / "store", workers=1, shard_size=4, progress=False)
    _downgrade_to_version_2(store)
    old = GraphStore(store.path)
    assert not old.has_stress and not old.column("stress").any()
    g = old.graph(0)
    assert np.isnan(g.stress).all() and g.weights.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert old.records()["energy"].tobytes() == store.records()["energy"].tobytes()
    again = prepare([src], store.path, workers=1, shard_size=4, progress=False)
    assert again.has_stress and again.manifest["version"] == 3


def test_a_new_format_is_one_class_and_one_registration(tmp_path, monkeypatch):
    from workbench.data.formats.base import Format

    class Poscars(Format):
        name = "poscar-list"
        summary = "test: one POSCAR file name per line"
        labels = "none"
        suffixes = (".poscars",)

        def listing(self, path):
            return path.read_text().split()

        def read(self, path, first, payload, keys):
            return [(first + k, ase.io.read(path.parent / p, format="vasp")) for k, p in enumerate(payload)]

    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    formats.register(Poscars())
    for k, el in enumerate(("Cu", "Ni")):
        ase.io.write(tmp_path / f"p{k}", bulk(el), format="vasp")
    (tmp_path / "two.poscars").write_text("p0\np1\n")
    got = read_structures(tmp_path / "two.poscars", require_labels=False)
    assert [a.get_chemical_symbols() for a in got] == [["Cu"], ["Ni"]]
    with pytest.raises(ValueError, match="already registered"):
        formats.register(Poscars())


@pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")
def test_the_embedded_mixture_prepares_alike_from_every_format(tmp_path):
    """The target's own case: copies of the embedded mixture (here its first 400 frames: every
    family, unlabelled ones, stress and none) give the extxyz route's index and shards, bit for bit."""
    frames = read_structures(EMBEDDED_PATH, index=":400", require_labels=False)
    assert 0 < sum("REF_stress" in a.info for a in frames) < len(frames)
    src = write_structures(tmp_path / "mix.extxyz", frames)
    ref = prepare([src], tmp_path / "ref", workers=2, shard_size=128, progress=False)
    for name, file in DB_NAMES.items():
        path = write_structures(tmp_path / file, frames)
        store = prepare([path], tmp_path / f"from-{name}", workers=2, shard_size=128, progress=False)
        assert _store_bytes(store) == _store_bytes(ref), name


def test_errors_of_checks_name_the_file_its_frame_and_the_row(frames, tmp_path):
    """A check that fails after reading (here: two atoms on one spot) names the file of a folder,
    the frame in that file and, in a database or mace HDF5, the row or configuration."""
    import h5py
    from mace.data.utils import config_from_atoms, save_configurations_as_HDF5

    bad = [a.copy() for a in frames[:3]]
    bad[2].positions[1] = bad[2].positions[0]
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        save_configurations_as_HDF5([config_from_atoms(a) for a in bad], 0, f)
    with pytest.raises(StructureError, match=r"bad\.h5, frame 2: mace configuration config_batch_0/config_2: atoms"):
        read_structures(tmp_path / "bad.h5", require_labels=False)
    folder = tmp_path / "omat"
    folder.mkdir()
    write_structures(folder / "a.aselmdb", frames[:2])
    write_structures(folder / "b.aselmdb", bad)
    with pytest.raises(StructureError, match=r"omat/b\.aselmdb, frame 2: row id 3: atoms 0 and 1"):
        read_structures(folder, require_labels=False)


def test_a_mixed_lmdb_folder_reads_every_file_as_mace_does(frames, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_structures(folder / "a.aselmdb", frames[:2])
    write_structures(tmp_path / "x_lmdb", frames[2:5])
    (tmp_path / "x_lmdb" / "data.lmdb").rename(folder / "b.lmdb")
    assert formats.detect(folder).name == "mace-lmdb"
    assert len(read_structures(folder)) == 5


def test_writing_refuses_names_of_other_formats_and_keeps_the_keys_asked_for(frames, tmp_path):
    with pytest.raises(StructureError, match=r"x\.traj: a 'traj' file name; workbench writes extxyz"):
        write_structures(tmp_path / "x.traj", frames)
    assert not (tmp_path / "x.traj").exists()
    renamed = [a.copy() for a in frames[:3]]
    for a in renamed:
        a.info["E_dft"] = a.info.pop("REF_energy")
    from workbench.data.keys import LabelKeys

    path = write_structures(tmp_path / "k.db", renamed, keys=LabelKeys(energy="E_dft"))
    assert [a.info["REF_energy"] for a in read_structures(path)] == [a.info["E_dft"] for a in renamed]


def test_a_loss_weight_that_is_not_a_number_is_named(frames, tmp_path):
    bad = [a.copy() for a in frames[:2]]
    bad[1].info["config_stress_weight"] = "heavy"
    path = write_structures(tmp_path / "w.extxyz", bad)
    with pytest.raises(StructureError, match=r"w\.extxyz, frame 1: config_stress_weight is not a number: 'heavy'"):
        prepare([path], tmp_path / "out", workers=1, progress=False)


def test_a_run_on_a_version_2_store_keeps_its_fingerprint(frames, tmp_path):
    """Resume checks the training data's fingerprint: a version-2 store (no stress) hashes to what
    the version-2 code hashed (its index records as stored, then its shards' digests), so runs
    started on it still resume."""
    import hashlib

    from workbench.train.data import store_fingerprint

    plain = [a.copy() for a in frames]
    for a in plain:
        a.info.pop("REF_stress", None)
    store = prepare([write_structures(tmp_path / "p.extxyz", plain)], tmp_path / "st", workers=1, progress=False)
    _downgrade_to_version_2(store)
    old = GraphStore(store.path)
    rows = np.arange(len(old))
    then = hashlib.blake2b(digest_size=16)
    then.update(np.ascontiguousarray(np.load(store.path / "index.npy")[rows]).tobytes())
    then.update("".join(r["digest"] for r in old.manifest["shards"]).encode())
    assert store_fingerprint(old, rows) == then.hexdigest()
