"""``workbench bench data``: the data path at scale, in one run (table + JSON).

Three parts, each against an anchor measured in the same run:

* **prepare** — ``workbench data prepare`` on an extxyz of ``frames`` frames (the embedded
  mixture repeated), at 1 and 2 workers, against ``ase.io.iread`` parsing the same file
  alone in one process, and on the same frames as fairchem's ``.aselmdb`` (what OMat24 ships).
  Targets: per worker, at least 0.7x the parse-only rate; from ``.aselmdb`` at least the
  extxyz route's graphs/s at the same workers.
* **layout** — the same graphs stored as mace's ``preprocess_data`` HDF5 (a group per
  structure, read by mace's own ``HDF5Dataset``), as flat arrays read through h5py, and as
  flat arrays read through memory maps (:class:`~workbench.data.store.GraphStore`): write
  time, file size and random-read time per graph.
* **train** — 2 ranks under torchrun with a small model and 2 DataLoader workers per rank, on
  the embedded prepared set and on 100k, 300k and 1M graphs tiled from it
  (:func:`~workbench.data.tiling.tile_prepared`; throughput data, not physics): per-rank peak
  RSS, time from launch to the first step, and the data-wait share of step time in steady
  state. Targets: RSS grows at most 10% from 100k to 1M and stays within 1.5 GB of the
  embedded run; first step within 30 s at 1M; data wait at most 10%.
"""

from __future__ import annotations

import gzip
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.bench.table import Column, render, verdict, write_json

if TYPE_CHECKING:
    from workbench.train.config import TrainConfig

__all__ = ["PARTS", "SIZES", "bench_data", "bench_layout", "bench_prepare", "bench_training", "format_table"]

PARTS = ("prepare", "layout", "train")
SIZES = (100_000, 300_000, 1_000_000)
STEADY_AFTER = 5  # steps before the steady state (workers warming up, first-touch page faults)


def _tiled_extxyz(workdir: Path, frames: int) -> tuple[Path, int]:
    from workbench.data.embedded import EMBEDDED_PATH

    text = gzip.decompress(EMBEDDED_PATH.read_bytes())  # 2000 frames
    copies = -(-frames // 2000)
    path = workdir / f"mixture_x{copies}.extxyz"
    if not path.exists() or path.stat().st_size != len(text) * copies:
        with open(path, "wb") as fh:
            for _ in range(copies):
                fh.write(text)
    return path, 2000 * copies


def _iread_count(path: str) -> tuple[int, int]:
    import ase.io

    graphs = atoms = 0
    for a in ase.io.iread(path, index=":", format="extxyz"):
        graphs += 1
        atoms += len(a)
    return graphs, atoms


def _import_ase(_: int) -> int:
    import ase.io  # noqa: F401

    return 0


def _parallel_iread(path: Path, frames: int, parts: int) -> float:
    """Seconds for ``parts`` processes to ``iread`` one contiguous part of ``path`` (``frames``
    frames) each, at once."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from workbench.data.formats.extxyz import iter_frames

    files = [str(path.with_name(f"{path.stem}.part{k}of{parts}.extxyz")) for k in range(parts)]
    handles = [open(f, "wb") for f in files]
    try:
        for frame, text, _ in iter_frames(path):
            handles[frame * parts // frames].write(text)
    finally:
        for fh in handles:
            fh.close()
    with ProcessPoolExecutor(parts, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_import_ase, range(parts)))  # processes started and ase imported before the clock
        t0 = time.perf_counter()
        list(pool.map(_iread_count, files))
        seconds = time.perf_counter() - t0
    for f in files:
        Path(f).unlink()
    return seconds


def bench_prepare(workdir: Path, frames: int = 20_000, workers: Sequence[int] = (1, 2)) -> dict:
    """Prepare throughput against ``ase.io.iread`` alone on the same file: per worker against one
    ``iread`` (``per_worker_vs_parse``), and against as many ``iread`` processes running at once
    on parts of the file as there are workers (``vs_parallel_parse``: the same cores busy)."""

    path, n = _tiled_extxyz(workdir, frames)
    t0 = time.perf_counter()
    graphs, atoms = _iread_count(str(path))
    parse_s = time.perf_counter() - t0
    rows = {
        "ase.io.iread (parse only)": {
            "workers": 1,
            "seconds": parse_s,
            "graphs_per_s": graphs / parse_s,
            "atoms_per_s": atoms / parse_s,
        }
    }
    for w in workers:
        parallel_s = parse_s if w == 1 else _parallel_iread(path, graphs, w)
        if w > 1:
            rows[f"ase.io.iread x{w} processes"] = {
                "workers": w,
                "seconds": parallel_s,
                "graphs_per_s": graphs / parallel_s,
                "atoms_per_s": atoms / parallel_s,
            }
        row = _timed_prepare(path, workdir / f"prepared_w{w}", w)
        row["per_worker_vs_parse"] = row["graphs_per_s"] / w / (graphs / parse_s)
        row["vs_parallel_parse"] = parallel_s / row["seconds"]
        rows[f"prepare --workers {w}"] = row
    rows.update(_prepare_aselmdb(workdir, path, n, workers, rows))
    return {"file": str(path), "frames": n, "atoms": atoms, "bytes": path.stat().st_size, "rows": rows}


def _aselmdb_copy(workdir: Path, path: Path, n: int) -> Path:
    """The frames of ``path`` as one ``.aselmdb`` (written through ASE; kept for a later run)."""
    from workbench.data.formats.aselmdb import AseLmdbFormat
    from workbench.data.io import read_structures, write_structures

    db = workdir / f"{path.stem}.aselmdb"
    if db.exists():
        try:
            if len(AseLmdbFormat().listing(db)) == n:
                return db
        except ValueError:
            pass
        db.unlink()
    return write_structures(db, read_structures(path, require_labels=False))


def _prepare_aselmdb(workdir: Path, path: Path, n: int, workers: Sequence[int], rows: dict) -> dict:
    """``data prepare`` from the same frames as ``.aselmdb``, at each worker count, against the
    extxyz route's rate in ``rows`` (``vs_extxyz``)."""

    db = _aselmdb_copy(workdir, path, n)
    out_rows = {}
    for w in workers:
        row = _timed_prepare(db, workdir / f"prepared_lmdb_w{w}", w)
        row["vs_extxyz"] = row["graphs_per_s"] / rows[f"prepare --workers {w}"]["graphs_per_s"]
        out_rows[f"prepare .aselmdb --workers {w}"] = row
    return out_rows


def _timed_prepare(source: Path, out: Path, workers: int) -> dict:
    """One ``data prepare`` of ``source`` into a fresh ``out`` (removed after): its time and rates."""
    from workbench.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    store = prepare([source], out, workers=workers, progress=False)
    s = time.perf_counter() - t0
    row = {
        "workers": workers,
        "seconds": s,
        "graphs_per_s": len(store) / s,
        "atoms_per_s": int(store.column("atoms").sum()) / s,
    }
    shutil.rmtree(out, ignore_errors=True)
    return row


class _ConfigOnly:
    """Stands in for mace's AtomicData in ``HDF5Dataset``: returns the configuration it read."""

    @staticmethod
    def from_config(config, **_):
        return config


def _mace_hdf5(workdir: Path, graphs: list, picks: np.ndarray) -> dict:
    """mace's ``preprocess_data`` layout (a group per structure), read by mace's ``HDF5Dataset``."""
    import h5py
    from mace.data import HDF5Dataset
    from mace.data.utils import Configuration, save_configurations_as_HDF5

    path = workdir / "layout_mace.h5"
    configs = [
        Configuration(
            atomic_numbers=g.numbers,
            positions=g.positions,
            properties={"energy": g.energy, "forces": g.forces},
            property_weights={"energy": 1.0, "forces": 1.0},
            cell=g.cell,
            pbc=tuple(g.pbc),
            config_type=g.family,
        )
        for g in graphs
    ]
    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:
        save_configurations_as_HDF5(configs, 0, f)
    write_s = time.perf_counter() - t0
    ds = HDF5Dataset(str(path), r_max=4.5, z_table=None, atomic_dataclass=_ConfigOnly)
    t0 = time.perf_counter()
    for i in picks:
        ds[int(i)]
    read_us = 1e6 * (time.perf_counter() - t0) / len(picks)
    row = {"write_s": write_s, "mb": path.stat().st_size / 1e6, "read_us": read_us}
    path.unlink()
    return row


def _flat_h5py(flat: Path, graphs: list, picks: np.ndarray) -> dict:
    """The workbench's flat arrays (:func:`~workbench.data.shards.write_shard`), read through h5py slices."""
    import h5py

    from workbench.data.shards import write_shard

    t0 = time.perf_counter()
    write_shard(flat, graphs)
    write_s = time.perf_counter() - t0
    with h5py.File(flat, "r") as f:
        arr = {k: f[k] for k in ("atom_ptr", "numbers", "positions", "forces", "cell", "pbc", "energy")}
        ptr = arr["atom_ptr"][()]
        t0 = time.perf_counter()
        for i in picks:
            a0, a1 = ptr[i], ptr[i + 1]
            (
                arr["numbers"][a0:a1],
                arr["positions"][a0:a1],
                arr["forces"][a0:a1],
                arr["cell"][i],
                arr["pbc"][i],
                arr["energy"][i],
            )
        read_us = 1e6 * (time.perf_counter() - t0) / len(picks)
    return {"write_s": write_s, "mb": flat.stat().st_size / 1e6, "read_us": read_us}


def _flat_memmap(flat: Path, picks: np.ndarray) -> float:
    """Microseconds per graph read from the flat file through memory maps, as ``GraphStore`` reads."""
    from workbench.data.shards import ShardMaps

    shard = ShardMaps(flat)
    t0 = time.perf_counter()
    for i in picks:
        a0, a1 = shard.atom_ptr[i], shard.atom_ptr[i + 1]
        a = shard.arrays
        (
            np.array(a["numbers"][a0:a1]),
            np.array(a["positions"][a0:a1]),
            np.array(a["forces"][a0:a1]),
            np.array(a["cell"][i]),
            np.array(a["pbc"][i]),
            float(a["energy"][i]),
        )
    read_us = 1e6 * (time.perf_counter() - t0) / len(picks)
    del shard
    return read_us


def bench_layout(workdir: Path, source, n: int = 20_000, reads: int = 2000, seed: int = 0) -> dict:
    """Write ``n`` graphs in three layouts and time random reads of ``reads`` graphs."""
    src = [source.graph(i) for i in range(len(source))]
    graphs = [src[i % len(src)] for i in range(n)]
    picks = np.random.default_rng(seed).integers(0, n, size=reads)
    flat = workdir / "layout_flat.h5"
    out = {"group per structure (mace HDF5Dataset)": _mace_hdf5(workdir, graphs, picks)}
    out["flat arrays, h5py slices"] = h5 = _flat_h5py(flat, graphs, picks)
    out["flat arrays, memmap (workbench)"] = {**h5, "read_us": _flat_memmap(flat, picks)}
    flat.unlink()
    return {"graphs": n, "reads": reads, "rows": out}


def _train_config(dataset: Path, out: Path, name: str, n: int, steps: int) -> TrainConfig:
    from workbench.train.presets import tiny_config

    return tiny_config(
        out,
        name,
        dataset=str(dataset),
        capacity=1024,
        max_steps=steps,
        epochs=1,
        checkpoint_every=0,
        valid_fraction=max(20 / n, 1e-6),
        num_workers=2,
        export=False,
        dist_timeout_s=300,
    )


def _one_training(cfg: TrainConfig, workdir: Path) -> dict:
    from workbench.launch.local import train_cli_command
    from workbench.train.rundir import read_steps

    path = workdir / f"{cfg.name}.yaml"
    cfg.to_yaml(path)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    cmd = train_cli_command(path, 2)
    launch = time.time()
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"training on {cfg.dataset} failed:\n{res.stderr[-3000:]}")
    ranks = [read_steps(cfg.run_dir, r) for r in (0, 1)]
    first = min(s[0]["time"] for s in ranks)
    steady = [s[STEADY_AFTER:] for s in ranks]
    data_s = sum(x["data_s"] for s in steady for x in s)
    step_s = sum(x["step_s"] for s in steady for x in s)
    return {
        "steps": len(ranks[0]),
        "launch_to_first_step_s": first - launch,
        "peak_rss_mb": [max(x["peak_rss_mb"] for x in s) for s in ranks],
        "data_wait_share": data_s / step_s,
        "step_ms_median": 1000 * float(np.median([x["step_s"] for s in steady for x in s])),
    }


def bench_training(workdir: Path, embedded, sizes: Sequence[int] = SIZES, steps: int = 40) -> dict:
    """2 ranks under torchrun on the embedded set and on tiled sets of ``sizes`` graphs."""
    from workbench.data.tiling import tile_prepared

    rows = {}
    runs = workdir / "runs"
    for n in (0, *sizes):
        if n:
            t0 = time.perf_counter()
            store = tile_prepared(embedded, workdir / f"tiled_{n}", n)
            tile_s = time.perf_counter() - t0
        else:
            store, tile_s = embedded, 0.0
        label = f"embedded ({len(store)})" if not n else f"tiled {n:,}"
        row = _one_training(_train_config(store.path, runs, f"n{len(store)}", len(store), steps), workdir)
        row.update(graphs=len(store), tile_s=tile_s)
        rows[label] = row
    return {"rows": rows, "model": "8x0e+8x1o, max_ell 1, correlation 2, capacity 1024 atoms, 2 ranks x 2 workers"}


def _targets(res: dict) -> dict:
    t = {}
    if "prepare" in res:
        per = [r["vs_parallel_parse"] for r in res["prepare"]["rows"].values() if "vs_parallel_parse" in r]
        t["prepare >= 0.7x parse per worker (as many iread processes as workers)"] = min(per) >= 0.7
        lmdb = [r["vs_extxyz"] for r in res["prepare"]["rows"].values() if "vs_extxyz" in r]
        if lmdb:
            t["prepare from .aselmdb >= the extxyz route's graphs/s"] = min(lmdb) >= 1.0
    rows = res.get("train", {}).get("rows", {})
    by_n = {r["graphs"]: r for r in rows.values()}
    if 100_000 in by_n and 1_000_000 in by_n:
        small, big = max(by_n[100_000]["peak_rss_mb"]), max(by_n[1_000_000]["peak_rss_mb"])
        t["RSS growth 100k -> 1M <= 10%"] = big <= 1.10 * small
        t["first step at 1M <= 30 s"] = by_n[1_000_000]["launch_to_first_step_s"] <= 30
        emb = [r for k, r in rows.items() if k.startswith("embedded")]
        if emb:
            t["RSS at 1M <= embedded + 1.5 GB"] = big <= max(emb[0]["peak_rss_mb"]) + 1536
    if rows:
        t["data wait <= 10% of step"] = max(r["data_wait_share"] for r in rows.values()) <= 0.10
    return t


def bench_data(
    out: str | os.PathLike = "runs/bench/data.json",
    workdir: str | os.PathLike = "runs/bench/data",
    parts: Sequence[str] = PARTS,
    frames: int = 20_000,
    sizes: Sequence[int] = SIZES,
    steps: int = 40,
) -> dict:
    """Run the chosen ``parts`` and write the JSON to ``out``."""
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.data.prepare import prepare

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"bench data: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    embedded = prepare([EMBEDDED_PATH], workdir / "embedded", progress=False)
    res: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if "prepare" in parts:
        res["prepare"] = bench_prepare(workdir, frames)
    if "layout" in parts:
        res["layout"] = bench_layout(workdir, embedded)
    if "train" in parts:
        res["train"] = bench_training(workdir, embedded, sizes, steps)
    res["targets"] = _targets(res)
    write_json(out, res)
    return res


def _anchor(key: str):
    # the iread rows are the anchors of these ratios; the .aselmdb rows compare with extxyz instead
    return lambda r: f"{r[key]:.2f}" if key in r else ("" if "vs_extxyz" in r else "anchor")


#: part -> its table: the title (from the part's result), the columns, the label column's width
_TABLES: dict[str, tuple[Callable[[dict], str], list[Column], int]] = {
    "prepare": (
        lambda p: f"prepare: {p['frames']} frames, {p['atoms']} atoms, {p['bytes'] / 1e6:.0f} MB extxyz",
        [
            Column("s", "seconds", ".1f", 7),
            Column("graphs/s", "graphs_per_s", ".0f", 9),
            Column("atoms/s", "atoms_per_s", ".0f", 10),
            Column("/worker vs 1 iread", _anchor("per_worker_vs_parse"), width=19),
            Column("vs as many ireads", _anchor("vs_parallel_parse"), width=18),
            Column("vs extxyz", lambda r: f"{r['vs_extxyz']:.2f}" if "vs_extxyz" in r else "", width=10),
        ],
        30,
    ),
    "layout": (
        lambda lay: f"layout: {lay['graphs']} graphs, {lay['reads']} random reads",
        [
            Column("write s", "write_s", ".2f", 8),
            Column("MB", "mb", ".1f", 7),
            Column("read µs/graph", "read_us", ".1f", 14),
        ],
        40,
    ),
    "train": (
        lambda tr: f"train: {tr['model']} (tiled sets are throughput data, not physics)",
        [
            Column("graphs", "graphs", width=9),
            Column("peak RSS MB r0/r1", lambda r: "/".join(f"{x:.0f}" for x in r["peak_rss_mb"]), width=19),
            Column("first step s", "launch_to_first_step_s", ".1f", 13),
            Column("data wait", "data_wait_share", ".1%", 10),
            Column("step ms", "step_ms_median", ".1f", 8),
        ],
        18,
    ),
}


def format_table(res: dict) -> str:
    """The prepare, layout and train tables and the targets' verdicts."""
    lines = []
    for part, (title, columns, label_width) in _TABLES.items():
        if part in res:
            label = Column("", "label", width=label_width - 1, align="<")
            rows = [{"label": k, **r} for k, r in res[part]["rows"].items()]
            lines += [render(rows, [label, *columns], title=title(res[part]), rule=False), ""]
    lines += [f"target {k}: {verdict(ok)}" for k, ok in res.get("targets", {}).items()]
    return "\n".join(lines)
