"""The prepared dataset protects itself: damaged, missing or foreign shards, a broken index or
manifest, bad settings, a full disk and a killed prepare each end in one line that names the
file, and the same prepare command repairs what can be repaired."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from train_fixtures import file_size_limit

from workbench.data.embedded import EMBEDDED_PATH
from workbench.data.prepare import prepare
from workbench.data.store import MANIFEST, SHARDS, GraphStore, StoreError, verify_shards
from workbench.train.presets import small_dataset

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("src") / "small.xyz", n=24)


def _prepare(source: Path, out: Path, **kw) -> GraphStore:
    return prepare([source], out, workers=2, shard_size=6, progress=False, **kw)


def _same_store(a: GraphStore, b: GraphStore) -> None:
    np.testing.assert_array_equal(a.records(), b.records())
    assert a.manifest["shards"] == b.manifest["shards"]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "workbench"), *args], capture_output=True, text=True, timeout=300, **kw)


def test_manifest_records_each_shard_and_verify_recomputes_it(source, tmp_path):
    store = _prepare(source, tmp_path / "a")
    records = store.manifest["shards"]
    assert len(records) == 4 and sum(r["graphs"] for r in records) == len(store) == 24
    for rec in records:
        file = store.path / SHARDS / rec["name"]
        assert file.stat().st_size == rec["bytes"]
        with h5py.File(file, "r") as f:
            assert f.attrs["digest"] == rec["digest"]
    assert verify_shards(store, progress=False) == []
    from workbench.train.data import prepare_data
    from workbench.train.presets import tiny_config

    data = prepare_data(tiny_config(tmp_path, dataset=str(store.path)))  # errors name the frame and its shard
    assert re.fullmatch(r"\S+small\.xyz, frame \d+ \(shard s0000-c00000\d\.h5\)", data.describe([0]))
    res = _cli("data", "verify", str(store.path))
    assert res.returncode == 0 and "4 shards, 24 graphs: every digest matches" in res.stdout


def test_missing_or_truncated_shard_is_named_and_the_same_prepare_repairs_it(source, tmp_path):
    ref = _prepare(source, tmp_path / "ref")
    out = tmp_path / "a"
    _prepare(source, out)
    first, second = (out / SHARDS / r["name"] for r in ref.manifest["shards"][:2])
    first.unlink()
    with open(second, "r+b") as fh:
        fh.truncate(second.stat().st_size // 2)
    with pytest.raises(
        StoreError, match=r"2 damaged shard\(s\) \(s0000-c000000.h5: missing; s0000-c000001.h5: \d+ bytes"
    ):
        GraphStore(out)
    res = _cli("data", "info", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "damaged shard" in res.stderr and "run the same 'workbench data prepare" in res.stderr
    _same_store(_prepare(source, out), ref)


def test_foreign_shard_is_refused_before_a_graph_is_read(source, tmp_path):
    out = _prepare(source, tmp_path / "a").path
    other_src = small_dataset(tmp_path / "other.xyz", n=24, families=("mptrj", "hea"), scan=600)
    other = prepare([other_src], tmp_path / "b", workers=2, shard_size=6, progress=False)
    name = other.manifest["shards"][1]["name"]
    shutil.copyfile(other.path / SHARDS / name, out / SHARDS / name)
    with pytest.raises(StoreError, match=rf"{name}: (\d+ bytes, the manifest says|a shard of another dataset)"):
        store = GraphStore(out)
        for i in range(len(store)):
            store.graph(i)
    _prepare(source, out)  # repaired: the foreign shard is prepared again
    assert verify_shards(GraphStore(out), progress=False) == []


def test_data_changed_in_place_is_found_by_verify(source, tmp_path):
    store = _prepare(source, tmp_path / "a")
    name = store.manifest["shards"][2]["name"]
    with h5py.File(store.path / SHARDS / name, "r+") as f:
        pos = f["positions"]
        pos[0] = pos[0] + 0.25
    res = _cli("data", "verify", str(store.path))
    assert res.returncode == 1
    assert f"{name}: its data differs from the digest written at prepare" in res.stdout
    assert "1 of 4 shards damaged: delete them" in res.stdout
    (store.path / SHARDS / name).unlink()
    _prepare(source, store.path)
    assert _cli("data", "verify", str(store.path)).returncode == 0


def test_broken_index_or_manifest_names_the_file_and_prepare_repairs(source, tmp_path):
    ref = _prepare(source, tmp_path / "ref")
    out = tmp_path / "a"
    _prepare(source, out)
    index = out / "index.npy"
    with open(index, "r+b") as fh:
        fh.truncate(index.stat().st_size - 40)
    with pytest.raises(StoreError, match=r"index.npy: unreadable index"):
        GraphStore(out)
    _same_store(_prepare(source, out), ref)
    (out / MANIFEST).write_text("{ not json")
    res = _cli("data", "info", str(out))
    assert res.returncode == 2 and "manifest.json: unreadable manifest" in res.stderr
    _same_store(_prepare(source, out), ref)


def test_prepare_refuses_bad_settings_by_name(source, tmp_path):
    for args, message in (
        (["--cutoff", "1000"], "cutoff: must be > 0 and <= 15.0 Å"),
        (["--cutoff", "nan"], "cutoff: must be > 0"),
        (["--workers", "-3"], "workers: must be >= 1, or 0 for all cores, got -3"),
    ):
        res = _cli("data", "prepare", str(source), "--out", str(tmp_path / "x"), *args)
        assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()


def test_full_disk_is_one_line_and_the_run_resumes(source, tmp_path):
    ref = _prepare(source, tmp_path / "ref")
    out = tmp_path / "a"
    args = ("data", "prepare", str(source), "--out", str(out), "--workers", "2", "--shard-size", "6")
    res = _cli(*args, preexec_fn=file_size_limit(4096))
    assert res.returncode == 2, res.stderr
    noise = [line for line in res.stderr.splitlines() if not line.startswith("prepare: ")]  # the progress lines
    assert len(noise) == 1 and "cannot write (File too large)" in noise[0] and "run the same command" in noise[0]
    assert _cli(*args).returncode == 0
    _same_store(GraphStore(out), ref)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def test_killed_prepare_leaves_no_workers(tmp_path):
    out = tmp_path / "a"
    cmd = [str(BIN / "workbench"), "data", "prepare", str(EMBEDDED_PATH), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen([*cmd, "--shard-size", "20"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(_children(proc.pid)) < 3 and time.time() < deadline:  # two workers and the resource tracker
        time.sleep(0.2)
    kids = _children(proc.pid)
    assert len(kids) >= 2, "the workers never started"
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    while any(_alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [k for k in kids if _alive(k)], "processes of the killed prepare are still running"


def test_atomic_number_out_of_range_and_empty_frame_name_the_frame(tmp_path):
    from ase import Atoms

    from workbench.data.errors import StructureError
    from workbench.data.prepare_worker import Settings, measure

    settings = Settings(4.5, "REF_energy", "REF_forces", 6, "fail")
    water = Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])
    water.info["REF_energy"] = -1.0
    water.arrays["REF_forces"] = np.random.default_rng(0).normal(size=(3, 3))
    assert measure(water, settings, Path("w.h5"), 0)[1]["atoms"] == 3
    heavy = water.copy()
    heavy.numbers[0] = 300  # what a mace HDF5 file can hold
    with pytest.raises(StructureError, match=r"w.h5, frame 7: atomic number 300 outside 1..118"):
        measure(heavy, settings, Path("w.h5"), 7)
    with pytest.raises(StructureError, match=r"w.h5, frame 8: no atoms"):
        measure(Atoms(), settings, Path("w.h5"), 8)


def test_empty_mace_hdf5_names_the_source_not_the_output(tmp_path):
    from workbench.data.errors import StructureError

    src = tmp_path / "empty_train.h5"
    h5py.File(src, "w").close()
    with pytest.raises(StructureError, match=r"empty_train\.h5: mace HDF5 file holds no configurations"):
        prepare([src], tmp_path / "out", workers=1, progress=False)


def test_tiled_store_repeats_the_source_graphs_and_verifies(source, tmp_path):
    """``tile_prepared`` writes graph ``i`` as labelled graph ``i mod m`` of the source: the same
    index record, element counts and origin frame, in shards that verify."""
    from workbench.data.tiling import tile_prepared

    src = _prepare(source, tmp_path / "src")
    tiled = tile_prepared(src, tmp_path / "tiled", 60, shard_size=16, progress=False)
    pick = src.select()[np.arange(60) % src.select().size]
    assert len(tiled) == 60 and len(tiled.shards) == 4 and verify_shards(tiled, progress=False) == []
    np.testing.assert_array_equal(tiled.column("atoms"), src.column("atoms", pick))
    np.testing.assert_array_equal(next(tiled.element_counts())[1], next(src.element_counts(pick))[1])
    assert [frame for _, frame in tiled.origin(np.arange(60))] == pick.tolist()
    assert tile_prepared(src, tmp_path / "tiled", 60, shard_size=16, progress=False).path == tiled.path  # reused
