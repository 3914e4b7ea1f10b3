"""``workbench data prepare`` and training from a prepared dataset: index, statistics, resume, errors."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fault_injection import fault_env
from train_fixtures import run_cli

from workbench.data.embedded import EMBEDDED_PATH
from workbench.data.io import StructureError, read_structures, write_structures
from workbench.data.prepare import prepare
from workbench.data.sizes import graph_sizes
from workbench.data.store import GraphStore
from workbench.train import TrainConfig
from workbench.train.presets import tiny_config

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

BIN = Path(sys.executable).parent
# E0s come from a streamed QR instead of one lstsq, the means from other summation orders.
STATS_RTOL = 1e-9


@pytest.fixture(scope="module")
def embedded_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "mixture"
    return prepare([EMBEDDED_PATH], out, workers=2, shard_size=100, progress=False)


@pytest.fixture(scope="module")
def embedded_frames():
    return read_structures(EMBEDDED_PATH, require_labels=False)


def test_index_matches_structures(embedded_store, embedded_frames):
    store = embedded_store
    assert len(store) == len(embedded_frames) == 2000
    assert len(store.shards) == 20  # 2000 frames in shards of 100
    sizes = graph_sizes(embedded_frames, cutoff=4.5)
    idx = store.records()
    np.testing.assert_array_equal(idx["atoms"], sizes["atoms"])
    np.testing.assert_array_equal(idx["edges"], sizes["edges"])
    np.testing.assert_array_equal(store.sizes()["family"], sizes["family"])
    labelled = np.array([a.info.get("labelled", True) for a in embedded_frames])
    np.testing.assert_array_equal(idx["labelled"], labelled)
    for k in (0, 17, 999, 1999):  # graphs read back exactly as parsed
        a, g = embedded_frames[k], store.graph(k)
        np.testing.assert_array_equal(g.numbers, a.numbers)
        np.testing.assert_array_equal(g.positions, a.positions)
        np.testing.assert_array_equal(g.cell, a.cell.array)
        np.testing.assert_array_equal(g.pbc, a.pbc)
        if labelled[k]:
            assert g.energy == a.info["REF_energy"] == idx["energy"][k]
            np.testing.assert_array_equal(g.forces, a.arrays["REF_forces"])
            assert idx["fsq"][k] == pytest.approx(float(np.sum(a.arrays["REF_forces"] ** 2)), rel=1e-14)
        assert store.origin(k) == [(str(EMBEDDED_PATH.resolve()), k)]
    counts = np.concatenate([c for _, c in store.element_counts(chunk=333)])
    z = np.array(store.elements)
    for k in (3, 1500):
        np.testing.assert_array_equal(counts[k], [(embedded_frames[k].numbers == e).sum() for e in z])


def test_same_inputs_same_index_and_no_work_twice(embedded_store, tmp_path):
    again = prepare([EMBEDDED_PATH], tmp_path / "again", workers=1, shard_size=100, progress=False)
    for name in ("index.npy", "counts.npy", "origin.npy"):
        assert (again.path / name).read_bytes() == (embedded_store.path / name).read_bytes(), name
    before = (again.path / "manifest.json").stat().st_mtime_ns
    prepare([EMBEDDED_PATH], tmp_path / "again", workers=1, shard_size=100, progress=False)  # finished: no-op
    assert (again.path / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match=r"other settings \(cutoff: 4.5 -> 5.0"):
        prepare([EMBEDDED_PATH], tmp_path / "again", cutoff=5.0, shard_size=100, progress=False)


def test_statistics_from_index_match_mace(embedded_store):
    from workbench.train.data import prepare_data
    from workbench.train.stats import compute_stats

    base = dict(valid_fraction=0.1, dtype="float64", seed=5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as train() does: mace's functions average in the default dtype
    try:
        mem = prepare_data(TrainConfig(**base))
        lazy = prepare_data(TrainConfig(dataset=str(embedded_store.path), **base))
        ref = compute_stats(mem.train_configs, mem.train, mem.z_table)
    finally:
        torch.set_default_dtype(previous)
    got = lazy.stats
    assert got.zs == ref.zs == [int(z) for z in mem.z_table.zs]
    np.testing.assert_allclose(got.e0s, ref.e0s, rtol=STATS_RTOL, atol=1e-12)
    assert got.avg_num_neighbors == pytest.approx(ref.avg_num_neighbors, rel=1e-15)
    assert got.shift == pytest.approx(ref.shift, rel=STATS_RTOL)
    assert got.scale == pytest.approx(ref.scale, rel=STATS_RTOL)
    # The same split, the same sizes, and identical graphs, built lazily.
    np.testing.assert_array_equal(lazy.train_atoms, mem.train_atoms)
    np.testing.assert_array_equal(lazy.train_edges, mem.train_edges)
    assert len(lazy.valid) == len(mem.valid)
    for k in (0, 100, len(mem.train) - 1):
        a, b = mem.train[k], lazy.train[k]
        assert b.positions.dtype == torch.float64
        for key in ("positions", "edge_index", "shifts", "node_attrs", "forces", "energy", "cell", "weight"):
            x, y = getattr(a, key), getattr(b, key)
            assert x.dtype == y.dtype and torch.equal(x, y), (k, key)


def _bad_file(tmp_path: Path, frames: list) -> Path:
    """Ten labelled water clusters; frame 3 with a NaN coordinate, frame 7 without its energy."""
    out = []
    for k, a in enumerate(frames[:10]):
        a = a.copy()
        a.info = dict(a.info)
        a.arrays = {key: v.copy() for key, v in a.arrays.items()}
        if k == 3:
            a.positions[2, 1] = np.nan
        if k == 7:
            del a.info["REF_energy"]
        out.append(a)
    return write_structures(tmp_path / "bad.extxyz", out)


def _water(frames):
    return [a for a in frames if a.info.get("config_type") == "water_clusters"]


def test_on_error_fail_names_file_and_frame_skip_lists_every_frame(embedded_frames, tmp_path):
    bad = _bad_file(tmp_path, _water(embedded_frames))
    with pytest.raises(StructureError, match=r"bad\.extxyz, frame 3: non-finite \(NaN/inf\) coordinates at atom 2"):
        prepare([bad], tmp_path / "fail", workers=1, shard_size=4, progress=False)
    store = prepare([bad], tmp_path / "skip", workers=1, shard_size=4, on_error="skip", progress=False)
    assert len(store) == 8
    assert [f for _, f in store.origin(np.arange(8))] == [0, 1, 2, 4, 5, 6, 8, 9]
    skipped = [json.loads(x) for x in (store.path / "skipped.jsonl").read_text().splitlines()]
    assert [(s["frame"], s["source"]) for s in skipped] == [(3, str(bad)), (7, str(bad))]
    assert "non-finite" in skipped[0]["reason"] and "missing energy label info['REF_energy']" in skipped[1]["reason"]
    # the CLI: one line naming file and frame, exit 1
    res = subprocess.run(
        [str(BIN / "workbench"), "data", "prepare", str(bad), "--out", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "bad.extxyz, frame 3" in res.stderr and "Traceback" not in res.stderr


def test_fail_names_the_first_bad_chunk_whichever_worker_finishes_first():
    """Chunks finish out of order; the error raised is still the earliest one in file order."""
    import threading
    from concurrent.futures import Future

    from workbench.data.prepare import _collect

    class Bar:
        def update(self, n):
            pass

        def set_postfix(self, **kw):
            pass

    def failed(msg):
        f = Future()
        f.set_exception(StructureError(Path("a.extxyz"), None, msg))
        return f

    # both failed: the later chunk may come first out of wait()'s set
    for _ in range(20):
        with pytest.raises(StructureError, match="chunk 0"):
            _collect({failed("chunk 0"): 1, failed("chunk 1"): 2}, Bar(), 0, 0, 0, block=True)
    # the later chunk failed while the earlier one still runs: wait for it, raise its error
    early, late = Future(), failed("chunk 1")
    threading.Timer(0.2, lambda: early.set_exception(StructureError(Path("a.extxyz"), None, "chunk 0"))).start()
    with pytest.raises(StructureError, match="chunk 0"):
        _collect({early: 1, late: 2}, Bar(), 0, 0, 0, block=True)
    # the earlier one succeeds: the later chunk's error stands
    early, late = Future(), failed("chunk 1")
    threading.Timer(0.2, lambda: early.set_result({"graphs": 4, "skipped": 0})).start()
    with pytest.raises(StructureError, match="chunk 1"):
        _collect({early: 1, late: 2}, Bar(), 0, 0, 0, block=True)


def test_malformed_inputs_name_the_frame(embedded_frames, tmp_path):
    good = write_structures(tmp_path / "w.extxyz", _water(embedded_frames)[:6])
    lines = good.read_text().splitlines(keepends=True)
    starts = [0]
    while len(starts) < 6:
        starts.append(starts[-1] + int(lines[starts[-1]]) + 2)
    wrong = list(lines)
    wrong[starts[4]] = "x7\n"
    (tmp_path / "count.extxyz").write_text("".join(wrong))
    with pytest.raises(StructureError, match=r"count\.extxyz, frame 4: first line of a frame should be the atom count"):
        prepare([tmp_path / "count.extxyz"], tmp_path / "o1", workers=1, progress=False)
    (tmp_path / "cut.extxyz").write_text("".join(lines[: starts[5] + 4]))  # count, comment, 2 atoms
    with pytest.raises(StructureError, match=r"cut\.extxyz, frame 5: file ends inside the frame: 2 of"):
        prepare([tmp_path / "cut.extxyz"], tmp_path / "o2", workers=1, progress=False)
    gz = gzip.compress(good.read_bytes())
    (tmp_path / "trunc.extxyz.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(StructureError, match=r"trunc\.extxyz\.gz, frame \d: compressed stream is corrupt or truncated"):
        prepare([tmp_path / "trunc.extxyz.gz"], tmp_path / "o3", workers=1, progress=False)
    (tmp_path / "plain.extxyz.gz").write_bytes(good.read_bytes())
    with pytest.raises(StructureError, match=r"plain\.extxyz\.gz: not a gzip file"):
        prepare([tmp_path / "plain.extxyz.gz"], tmp_path / "o4", workers=1, progress=False)


def test_killed_prepare_resumes_to_the_same_index(embedded_store, tmp_path):
    ref = embedded_store  # the same settings, uninterrupted (2 workers; the index does not depend on them)
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from workbench.data.prepare import prepare; "
        f"prepare([{str(EMBEDDED_PATH)!r}], {str(out)!r}, workers=1, shard_size=100, progress=False)",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "shards").glob("*.part.npz"))) < 4:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    parts = len(list((out / "shards").glob("*.part.npz")))
    assert 4 <= parts < 20 and not (out / "index.npy").exists()
    with pytest.raises(ValueError, match="prepare did not finish"):
        GraphStore(out)
    resumed = prepare([EMBEDDED_PATH], out, workers=1, shard_size=100, progress=False)
    for name in ("index.npy", "counts.npy", "origin.npy"):
        assert (resumed.path / name).read_bytes() == (ref.path / name).read_bytes(), name
    assert not list((out / "shards").glob(".*.tmp"))


def test_mace_hdf5_shards_are_accepted(embedded_store, embedded_frames, tmp_path):
    import h5py
    from mace.data.utils import config_from_atoms, save_configurations_as_HDF5

    from workbench.data.atomic_data import key_specification

    chosen = [k for k, a in enumerate(embedded_frames) if a.info.get("labelled", True)][:60]
    configs = [config_from_atoms(embedded_frames[k], key_specification=key_specification()) for k in chosen]
    folder = tmp_path / "mace_h5"
    folder.mkdir()
    for part, block in enumerate((configs[:25], configs[25:])):  # two shards, as preprocess_data writes them
        with h5py.File(folder / f"train_{part}.h5", "w") as f:
            save_configurations_as_HDF5(block, part, f)
    store = prepare([folder], tmp_path / "from_mace", workers=2, shard_size=16, progress=False)
    assert len(store) == 60
    ref = embedded_store.records(chosen)
    for key in ("atoms", "edges", "connected", "energy", "fsq", "labelled"):
        np.testing.assert_array_equal(store.records()[key], ref[key], err_msg=key)
    assert store.sizes()["family"].tolist() == embedded_store.sizes()["family"][chosen].tolist()
    g, h = store.graph(30), embedded_store.graph(chosen[30])
    np.testing.assert_array_equal(g.positions, h.positions)
    np.testing.assert_array_equal(g.forces, h.forces)


def test_prepare_train_resume_under_torchrun(embedded_store, tmp_path):
    from workbench.train.rundir import RunDir, read_steps

    # Checkpoints at steps 3, 6 and 9: a failure after step 5 resumes from step 3.
    schedule = dict(capacity=250, epochs=5, max_steps=9, checkpoint_every=3)
    base = dict(
        dataset=str(embedded_store.path),
        families=["water_clusters", "hea", "mptrj"],
        max_structures=200,
        num_workers=2,
        dtype="float64",
        **schedule,
    )
    ref = tiny_config(tmp_path, "ref", **base)
    out = run_cli(ref, tmp_path, 2)
    assert out.returncode == 0, out.stderr[-4000:]
    # Rank 1 dies after step 5; torchrun restarts the group, which resumes from the step-3 checkpoint.
    cut = tiny_config(tmp_path, "cut", **base)
    resumed = run_cli(cut, tmp_path, 2, fault_env(5, rank=1), restarts=1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resume: from step 3" in resumed.stderr
    for rank in (0, 1):
        a, b = read_steps(ref.run_dir, rank), read_steps(cut.run_dir, rank)
        assert len(a) == ref.max_steps
        assert [s["batch_hash"] for s in a] == [s["batch_hash"] for s in b]
        assert [s["loss"] for s in a] == [s["loss"] for s in b]
        assert all(s["peak_rss_mb"] > 100 for s in a)
    wa = torch.load(RunDir(ref.run_dir).checkpoint, weights_only=False)["model"]
    wb = torch.load(RunDir(cut.run_dir).checkpoint, weights_only=False)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    epochs = [json.loads(x) for x in RunDir(ref.run_dir).epoch_log.read_text().splitlines()]
    assert np.isfinite(epochs[-1]["valid_f_mae_mev_a"])  # validation read from the same store
    assert set(epochs[-1]["valid_families"]) <= {"water_clusters", "hea", "mptrj"}


def test_prepared_dataset_errors(embedded_store, tmp_path):
    from workbench.train.data import prepare_data

    with pytest.raises(ValueError, match=r"prepared at cutoff 4.5 Å, but TrainConfig.cutoff is 5.0"):
        prepare_data(TrainConfig(dataset=str(embedded_store.path), cutoff=5.0))
    with pytest.raises(ValueError, match=r"families \['nope'\] are not in the dataset"):
        prepare_data(TrainConfig(dataset=str(embedded_store.path), families=["nope"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a finished prepared dataset"):
        prepare_data(TrainConfig(dataset=str(tmp_path / "empty")))


def test_data_source_is_resolved_once_and_the_store_reads_by_name(embedded_store, tmp_path):
    from workbench.data.source import DataSource, data_source

    assert data_source(None) == DataSource("embedded", EMBEDDED_PATH)
    assert data_source(None).label() == "embedded mixture"
    assert data_source(str(EMBEDDED_PATH)).kind == "structures"
    prepared = data_source(str(embedded_store.path))
    assert (prepared.kind, prepared.in_memory, prepared.label()) == ("prepared", False, str(embedded_store.path))
    with pytest.raises(ValueError, match="dataset: an empty path"):
        data_source("  ")
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="half: a directory, but not a finished prepared dataset"):
        data_source(tmp_path / "half")
    with pytest.raises(ValueError, match="choose one of embedded, structures, prepared"):
        DataSource("lmdb", tmp_path)
    # the reading API: columns by name, labelled rows by family, family names per row
    records = embedded_store.records()
    rows = embedded_store.select(["liquid_water"])
    assert rows.size > 0 and records["labelled"][rows].all()
    assert set(embedded_store.family_names(rows)) == {"liquid_water"}
    np.testing.assert_array_equal(embedded_store.column("atoms", rows), records["atoms"][rows])
    assert embedded_store.select().size == int(records["labelled"].sum())
    with pytest.raises(KeyError, match="no column 'natoms'; columns: atoms, edges"):
        embedded_store.column("natoms")


def test_large_structure_file_points_to_prepare(monkeypatch):
    import workbench.train.data as data

    monkeypatch.setattr(data, "LARGE_FILE_BYTES", 1000)
    with pytest.warns(UserWarning, match=r"workbench data prepare .*mixture\.extxyz\.gz --out DIR"):
        structures = data.load_structures(TrainConfig(dataset=str(EMBEDDED_PATH), families=["hea"]))
    assert len(structures) == 19


def test_bench_prepare_rows_and_anchors(tmp_path):
    from workbench.bench.data import _targets, bench_prepare, format_table

    res = bench_prepare(tmp_path, frames=2000, workers=(1, 2))
    rows = res["rows"]
    assert res["frames"] == 2000 and set(rows) == {
        "ase.io.iread (parse only)",
        "prepare --workers 1",
        "ase.io.iread x2 processes",
        "prepare --workers 2",
        "prepare .aselmdb --workers 1",
        "prepare .aselmdb --workers 2",
    }
    for w in (1, 2):  # the same frames from fairchem's format, against the extxyz route
        lmdb = rows[f"prepare .aselmdb --workers {w}"]
        assert lmdb["vs_extxyz"] == pytest.approx(lmdb["graphs_per_s"] / rows[f"prepare --workers {w}"]["graphs_per_s"])
    one, two = rows["prepare --workers 1"], rows["prepare --workers 2"]
    parse, parallel = rows["ase.io.iread (parse only)"], rows["ase.io.iread x2 processes"]
    assert one["vs_parallel_parse"] == pytest.approx(parse["seconds"] / one["seconds"])
    assert two["vs_parallel_parse"] == pytest.approx(parallel["seconds"] / two["seconds"])
    assert two["per_worker_vs_parse"] == pytest.approx(two["graphs_per_s"] / 2 / parse["graphs_per_s"])
    assert one["graphs_per_s"] * one["seconds"] == pytest.approx(2000)
    target = _targets({"prepare": res})
    lmdb_ok = min(rows[f"prepare .aselmdb --workers {w}"]["vs_extxyz"] for w in (1, 2)) >= 1.0
    assert list(target.values()) == [min(one["vs_parallel_parse"], two["vs_parallel_parse"]) >= 0.7, lmdb_ok]
    assert "vs as many ireads" in format_table({"prepare": res, "targets": target})
    assert not list(tmp_path.glob("*.part*of2.extxyz"))  # the anchor's part files are removed
