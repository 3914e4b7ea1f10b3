r"""``workbench data prepare``: extxyz (``.gz`` too) or mace HDF5 shards into a prepared dataset.

The inputs are cut into chunks of ``shard_size`` consecutive frames of one source. Worker
processes parse a chunk, validate every frame (the checks of
:func:`~workbench.data.io.validate_structure`, with the neighbour list computed once at the
cutoff), count atoms, edges, connected atoms and elements, and write the chunk as one shard
plus its part of the index (:mod:`workbench.data.store` owns the format). The main process
only frames the input (reads it once, line by line, in C) and merges the parts in input
order, so the same inputs always give the same index.

The checks are those of :func:`~workbench.data.io.validate_structure` (geometry, close pairs,
labels), with one half neighbour list at the cutoff serving the close-pair check and the counts.

* **Resumable.** A shard and its part are each written to a temporary file and renamed; the
  part is written last and marks the chunk done. A killed prepare, run again with the same
  command, skips finished chunks and gives the same index as an uninterrupted one. Sources
  whose size or modification time changed are redone; changed settings are refused.
* **Nothing lost silently.** ``on_error="fail"`` stops at the first bad frame with its file
  and frame; ``on_error="skip"`` leaves bad frames out and lists each one with its reason in
  ``skipped.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from workbench.data.extxyz import iter_frames, parse_frames
from workbench.data.io import ENERGY_KEY, FORCES_KEY, MIN_DISTANCE, StructureError
from workbench.data.store import (
    COUNTS,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    INDEX_DTYPE,
    MANIFEST,
    MAX_Z,
    ORIGIN,
    ORIGIN_DTYPE,
    SHARDS,
    SKIPPED,
    Graph,
    GraphStore,
    shard_name,
    write_shard,
)

ON_ERROR = ("fail", "skip")
H5_SUFFIXES = (".h5", ".hdf5")
DEFAULT_SHARD_SIZE = 2048


@dataclass(frozen=True)
class Settings:
    """What decides the prepared content: a resume must use the same."""

    cutoff: float = 4.5
    energy_key: str = ENERGY_KEY
    forces_key: str = FORCES_KEY
    shard_size: int = DEFAULT_SHARD_SIZE
    on_error: str = "fail"
    min_distance: float = MIN_DISTANCE


# -- sources -----------------------------------------------------------------------------------


def resolve_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """Files as given; a directory stands for its ``*.h5`` / ``*.hdf5`` files (mace shards), sorted."""
    out: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in H5_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: directory holds no .h5/.hdf5 files (mace preprocess_data shards)")
            out.extend(found)
        elif p.is_file():
            if p.stat().st_size == 0:
                raise StructureError(p, None, "file is empty: it contains no structures")
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such structure file or directory")
    if not out:
        raise ValueError("data prepare: no sources given")
    return out


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_h5(path: Path) -> bool:
    return path.suffix in H5_SUFFIXES


@dataclass
class Chunk:
    source: int
    chunk: int
    first_frame: int
    n_frames: int
    payload: object  # extxyz: the frames' text; mace HDF5: list of (batch, config) keys
    done_bytes: int  # input bytes consumed up to the end of this chunk (progress)


def _extxyz_chunks(source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
    """Consecutive frames of an extxyz file (framed by :func:`workbench.data.extxyz.iter_frames`)."""
    texts: list[bytes] = []
    first = chunk_no = 0
    for frame, text, done in iter_frames(path):
        if not texts:
            first = frame
        texts.append(text)
        if len(texts) == shard_size:
            yield Chunk(source, chunk_no, first, len(texts), texts, done)
            chunk_no, texts = chunk_no + 1, []
    if texts:
        yield Chunk(source, chunk_no, first, len(texts), texts, path.stat().st_size)


def _mace_h5_keys(path: Path) -> list[tuple[str, str]]:
    import h5py

    def num(name: str) -> int:
        return int(name.rsplit("_", 1)[-1]) if name.rsplit("_", 1)[-1].isdigit() else -1

    try:
        with h5py.File(path, "r", locking=False) as f:
            keys = []
            for b in sorted(f.keys(), key=num):
                if not b.startswith("config_batch_"):
                    raise StructureError(
                        path, None, f"not a mace preprocess_data file: top-level group {b!r} (expected config_batch_N)"
                    )
                keys.extend((b, c) for c in sorted(f[b].keys(), key=num))
    except OSError as exc:
        raise StructureError(path, None, f"cannot open as HDF5 ({exc})") from None
    return keys


def _h5_chunks(source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
    keys = _mace_h5_keys(path)
    size = path.stat().st_size
    for chunk_no, k in enumerate(range(0, len(keys), shard_size)):
        part = keys[k : k + shard_size]
        yield Chunk(source, chunk_no, k, len(part), part, int(size * (k + len(part)) / max(len(keys), 1)))


def iter_chunks(paths: Sequence[Path], shard_size: int) -> Iterator[Chunk]:
    for source, path in enumerate(paths):
        yield from (_h5_chunks if _is_h5(path) else _extxyz_chunks)(source, path, shard_size)


# -- one chunk, in a worker ---------------------------------------------------------------------


def _read_mace_h5(path: Path, first: int, keys: list[tuple[str, str]]) -> list[tuple[int, object]]:
    """mace ``preprocess_data`` configurations as ``ase.Atoms`` with REF-style labels."""
    import ase
    import h5py

    def value(x):
        x = x[()]
        x = x.decode() if isinstance(x, bytes) else x
        return None if isinstance(x, str) and x == "None" else x

    out: list[tuple[int, object]] = []
    with h5py.File(path, "r", locking=False) as f:
        for k, (b, c) in enumerate(keys):
            frame = first + k
            try:
                g = f[b][c]
                props = {name: value(g["properties"][name]) for name in g["properties"]}
                weights = {name: value(g["property_weights"][name]) for name in g.get("property_weights", {})}
                cell, pbc = value(g["cell"]), value(g["pbc"])
                atoms = ase.Atoms(
                    numbers=np.asarray(value(g["atomic_numbers"]), dtype=int),
                    positions=np.asarray(value(g["positions"]), dtype=float),
                    cell=np.zeros((3, 3)) if cell is None else np.asarray(cell, dtype=float),
                    pbc=False if pbc is None else np.asarray(pbc, dtype=bool),
                )
                if props.get("energy") is not None:
                    atoms.info[ENERGY_KEY] = float(props["energy"])
                if props.get("forces") is not None:
                    atoms.arrays[FORCES_KEY] = np.asarray(props["forces"], dtype=float)
                atoms.info["config_type"] = value(g["config_type"]) or "Default"
                weight = value(g["weight"]) if "weight" in g else None
                atoms.info["config_weight"] = 1.0 if weight is None else float(weight)
                for name in ("energy", "forces"):
                    if weights.get(name) is not None:
                        atoms.info[f"config_{name}_weight"] = float(weights[name])
                out.append((frame, atoms))
            except Exception as exc:
                out.append(
                    (
                        frame,
                        StructureError(
                            path, frame, f"malformed mace configuration {b}/{c} ({type(exc).__name__}: {exc})"
                        ),
                    )
                )
    return out


def _labels_from_calc(atoms, settings: Settings) -> None:
    # ASE moves extxyz keys named like calculator results (energy, forces) onto a calculator.
    calc = getattr(atoms, "calc", None)
    if calc is None:
        return
    results = getattr(calc, "results", {})
    if settings.energy_key not in atoms.info and settings.energy_key in results:
        atoms.info[settings.energy_key] = results[settings.energy_key]
    if settings.forces_key not in atoms.arrays and settings.forces_key in results:
        atoms.arrays[settings.forces_key] = np.asarray(results[settings.forces_key])


def measure(atoms, settings: Settings, path: Path | None = None, frame: int | None = None) -> tuple[Graph, dict]:
    """Validate one structure and return its stored arrays and index fields.

    One count-only pass at the cutoff (:func:`~workbench.data.neighbours.neighbour_stats`) gives
    the edge count, the connected atoms and the close-pair check; the geometry is checked once,
    before it.
    """
    from workbench.data.io import check_geometry, check_labels, close_pair_error
    from workbench.data.neighbours import neighbour_stats

    _labels_from_calc(atoms, settings)
    check_geometry(atoms, path=path, frame=frame)
    n = len(atoms)
    positions, cell, pbc = atoms.positions, atoms.cell.array, atoms.pbc
    nb = neighbour_stats(positions, cell, pbc, settings.cutoff, settings.min_distance)
    if nb.closest is not None:
        raise close_pair_error(*nb.closest, nb.close_pairs, settings.min_distance, path=path, frame=frame)
    info = atoms.info
    labelled = bool(info.get("labelled", True))
    if labelled:
        check_labels(atoms, path=path, frame=frame, energy_key=settings.energy_key, forces_key=settings.forces_key)
        energy = float(info[settings.energy_key])
        forces = np.asarray(atoms.arrays[settings.forces_key], dtype=np.float64)
    else:
        energy, forces = float("nan"), np.full((n, 3), np.nan)
    weights = np.array(
        [
            float(info.get("config_weight", 1.0)),
            float(info.get("config_energy_weight", 1.0)) if labelled else 0.0,
            float(info.get("config_forces_weight", 1.0)) if labelled else 0.0,
        ]
    )
    graph = Graph(
        numbers=atoms.numbers.astype(np.int64),
        positions=positions.copy(),
        forces=forces,
        cell=cell.copy(),
        pbc=pbc.copy(),
        energy=energy,
        weights=weights,
        family=str(info.get("config_type", "Default")),
    )
    fields = {
        "atoms": n,
        "edges": nb.edges,
        "connected": nb.connected,
        "labelled": labelled,
        "energy": energy,
        "fsq": float(np.sum(forces * forces)) if labelled else float("nan"),
    }
    return graph, fields


def _worker_init() -> None:
    # Nothing here needs torch (2-3 s to import per process); keep it out should a library reach for it.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def _part_path(out: Path, source: int, chunk: int) -> Path:
    return out / SHARDS / shard_name(source, chunk).replace(".h5", ".part.npz")


def run_chunk(job: tuple) -> dict:
    """Worker: parse, validate and measure one chunk; write its shard and index part."""
    out, path, chunk, settings, fingerprint = job
    out, path = Path(out), Path(path)
    reader = _read_mace_h5 if _is_h5(path) else parse_frames
    graphs: list[Graph] = []
    records: list[dict] = []
    frames: list[int] = []
    skipped: list[dict] = []
    for frame, item in reader(path, chunk.first_frame, chunk.payload):
        try:
            if isinstance(item, StructureError):
                raise item
            graph, fields = measure(item, settings, path, frame)
        except StructureError as exc:
            if settings.on_error == "fail":
                raise
            skipped.append({"source": str(path), "frame": frame, "reason": exc.reason})
            continue
        graphs.append(graph)
        records.append(fields)
        frames.append(frame)
    write_shard(out / SHARDS / shard_name(chunk.source, chunk.chunk), graphs)
    families = sorted({g.family for g in graphs})
    code = {f: k for k, f in enumerate(families)}
    counts = np.zeros((len(graphs), MAX_Z + 1), dtype=np.uint32)
    for k, g in enumerate(graphs):
        counts[k] = np.bincount(g.numbers, minlength=MAX_Z + 1)
    part = _part_path(out, chunk.source, chunk.chunk)
    tmp = part.with_name(f".{part.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez_compressed(
            fh,
            **{
                k: np.array([r[k] for r in records], dtype=INDEX_DTYPE[k])
                for k in ("atoms", "edges", "connected", "labelled", "energy", "fsq")
            },
            family=np.array([code[g.family] for g in graphs], dtype=np.int64),
            families=np.array(families, dtype=str),
            counts=counts,
            frame=np.array(frames, dtype=np.int64),
            skipped=np.array(json.dumps(skipped)),
            fingerprint=np.array(json.dumps(fingerprint)),
        )
    os.replace(tmp, part)  # last: marks the chunk done
    return {"graphs": len(graphs), "skipped": len(skipped)}


# -- the whole prepare ---------------------------------------------------------------------------


def _check_resume(out: Path, settings: Settings, paths: list[Path]) -> dict | None:
    """The finished manifest when there is nothing to do; raise on settings that differ."""
    manifest = out / MANIFEST
    if not manifest.exists():
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out}: directory is not empty and holds no prepared dataset; choose a new --out")
        return None
    data = json.loads(manifest.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{manifest}: not a {FORMAT} manifest; choose a new --out")
    old = data.get("settings", {})
    changed = sorted(k for k, v in asdict(settings).items() if old.get(k) != v)
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {getattr(settings, k)!r}" for k in changed)
        raise ValueError(
            f"{out}: was prepared with other settings ({detail}); use a new --out, or the same settings to resume"
        )
    old_paths = [s["path"] for s in data.get("sources", [])]
    new_paths = [str(p.resolve()) for p in paths]
    if old_paths != new_paths:
        raise ValueError(
            f"{out}: was prepared from other sources ({len(old_paths)} file(s): {old_paths[:3]}...); "
            "use a new --out, or the same sources to resume"
        )
    if data.get("complete") and data["sources"] == [_fingerprint(p) for p in paths]:
        return data
    return None


def _done_chunks(out: Path, fingerprints: list[dict]) -> set[tuple[int, int]]:
    """Chunks whose part exists and was made from the source as it is now; stale files removed."""
    done = set()
    shards = out / SHARDS
    if not shards.exists():
        return done
    for tmp in shards.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)  # left by a killed worker
    for part in sorted(shards.glob("*.part.npz")):
        source, chunk = int(part.name[1:5]), int(part.name[7:13])
        try:
            with np.load(part) as z:
                fp = json.loads(str(z["fingerprint"]))
        except Exception:
            fp = None
        if source < len(fingerprints) and fp == fingerprints[source]:
            done.add((source, chunk))
        else:
            part.unlink(missing_ok=True)
    return done


def prepare(
    sources: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    cutoff: float = 4.5,
    workers: int | None = None,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
    on_error: str = "fail",
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
) -> GraphStore:
    """Prepare ``sources`` into the directory ``out`` and return the :class:`GraphStore`.

    ``workers``: processes that parse and measure (default: all cores). Running the same call
    again resumes a killed prepare, or returns at once when it finished.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error: {on_error!r} is not one of {', '.join(ON_ERROR)}")
    if not cutoff > 0 or not np.isfinite(cutoff):
        raise ValueError(f"cutoff: must be a finite number > 0 Å, got {cutoff}")
    if shard_size < 1:
        raise ValueError(f"shard_size: must be >= 1, got {shard_size}")
    settings = Settings(float(cutoff), energy_key, forces_key, int(shard_size), on_error)
    out = Path(out)
    paths = resolve_sources(sources)
    if _check_resume(out, settings, paths) is not None:
        return GraphStore(out)
    fingerprints = [_fingerprint(p) for p in paths]
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    _write_manifest(
        out,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "complete": False,
            "settings": asdict(settings),
            "sources": fingerprints,
        },
    )
    done = _done_chunks(out, fingerprints)
    workers = max(1, int(workers or os.cpu_count() or 1))
    total_bytes = sum(fp["size"] for fp in fingerprints)
    bar = _bar(total_bytes, progress)
    t0 = time.perf_counter()
    chunk_ids = _run_pool(out, paths, settings, fingerprints, done, workers, bar)
    bar.close()
    store = _merge(out, settings, paths, fingerprints, chunk_ids, time.perf_counter() - t0)
    return store


def _bar(total_bytes: int, progress: bool):
    from workbench.progress import bar

    return bar(total=total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress)


def _run_pool(
    out: Path,
    paths: list[Path],
    settings: Settings,
    fingerprints: list[dict],
    done: set[tuple[int, int]],
    workers: int,
    bar,
) -> list[tuple[int, int]]:
    """Run every chunk not yet done; at most ``2 * workers`` in flight. Returns all chunk ids in order."""
    import multiprocessing as mp

    chunk_ids: list[tuple[int, int]] = []
    graphs = skipped = 0
    base = [0] * len(paths)  # bytes of earlier sources, for one progress scale
    for k in range(1, len(paths)):
        base[k] = base[k - 1] + fingerprints[k - 1]["size"]
    position = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=_worker_init) as pool:
        pending: dict = {}
        try:
            for chunk in iter_chunks(paths, settings.shard_size):
                chunk_ids.append((chunk.source, chunk.chunk))
                now = base[chunk.source] + chunk.done_bytes
                if (chunk.source, chunk.chunk) in done:
                    bar.update(now - position)
                    position = now
                    continue
                while len(pending) >= 2 * workers:
                    graphs, skipped, position = _collect(pending, bar, graphs, skipped, position, block=True)
                pending[
                    pool.submit(
                        run_chunk, (str(out), str(paths[chunk.source]), chunk, settings, fingerprints[chunk.source])
                    )
                ] = now
            while pending:
                graphs, skipped, position = _collect(pending, bar, graphs, skipped, position, block=True)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return chunk_ids


def _collect(pending: dict, bar, graphs: int, skipped: int, position: int, block: bool) -> tuple[int, int, int]:
    finished, _ = wait(list(pending), return_when=FIRST_COMPLETED) if block else (set(), None)
    order = list(pending)  # submission order = file order
    for fut in sorted(finished, key=order.index):
        if fut.exception() is not None:
            _raise_first_error(order[: order.index(fut) + 1])
        now = pending.pop(fut)
        result = fut.result()
        graphs += result["graphs"]
        skipped += result["skipped"]
        if now > position:
            bar.update(now - position)
            position = now
        bar.set_postfix(graphs=graphs, skipped=skipped, refresh=False)
    return graphs, skipped, position


def _raise_first_error(futures: list) -> None:
    """Raise the error of the earliest chunk that failed, so ``on_error="fail"`` names the first
    bad frame in file order whichever worker finished first."""
    wait(futures)
    for fut in futures:
        if fut.exception() is not None:
            raise fut.exception()  # a worker's StructureError, with file and frame


def _write_manifest(out: Path, data: dict) -> None:
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


def _merge(
    out: Path,
    settings: Settings,
    paths: list[Path],
    fingerprints: list[dict],
    chunk_ids: list[tuple[int, int]],
    seconds: float,
) -> GraphStore:
    """Concatenate the parts in input order into index, counts and origin (bounded memory)."""
    families: set[str] = set()
    present = np.zeros(MAX_Z + 1, dtype=bool)
    n_total = 0
    for source, chunk in chunk_ids:
        with np.load(_part_path(out, source, chunk)) as z:
            families.update(str(f) for f in z["families"])
            present |= z["counts"].any(axis=0)
            n_total += int(z["atoms"].shape[0])
    skipped_lines: list[str] = []
    family_names = sorted(families)
    elements = np.flatnonzero(present)
    index = np.lib.format.open_memmap(out / f".{INDEX}.tmp", mode="w+", dtype=INDEX_DTYPE, shape=(n_total,))
    counts = np.lib.format.open_memmap(
        out / f".{COUNTS}.tmp", mode="w+", dtype=np.uint32, shape=(n_total, elements.size)
    )
    origin = np.lib.format.open_memmap(out / f".{ORIGIN}.tmp", mode="w+", dtype=ORIGIN_DTYPE, shape=(n_total,))
    at = 0
    for code, (source, chunk) in enumerate(chunk_ids):
        with np.load(_part_path(out, source, chunk)) as z:
            n = int(z["atoms"].shape[0])
            sl = slice(at, at + n)
            for key in ("atoms", "edges", "connected", "labelled", "energy", "fsq"):
                index[key][sl] = z[key]
            local = [family_names.index(str(f)) for f in z["families"]]
            index["family"][sl] = np.asarray(local, dtype=np.int64)[z["family"]] if n else []
            index["shard"][sl] = code
            index["row"][sl] = np.arange(n)
            counts[sl] = z["counts"][:, elements]
            origin["source"][sl] = source
            origin["frame"][sl] = z["frame"]
            skipped_lines += [json.dumps(s) for s in json.loads(str(z["skipped"]))]
            at += n
    for arr in (index, counts, origin):
        arr.flush()
    del index, counts, origin
    for name in (INDEX, COUNTS, ORIGIN):
        os.replace(out / f".{name}.tmp", out / name)
    (out / SKIPPED).write_text("".join(line + "\n" for line in skipped_lines))
    if n_total == 0:
        raise StructureError(
            out, None, f"no graphs prepared: all {len(skipped_lines)} frame(s) were skipped (see {out / SKIPPED})"
        )
    _write_manifest(
        out,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "complete": True,
            "settings": asdict(settings),
            "cutoff": settings.cutoff,
            "sources": fingerprints,
            "families": family_names,
            "elements": [int(z) for z in elements],
            "shards": [shard_name(s, c) for s, c in chunk_ids],
            "n_graphs": n_total,
            "n_skipped": len(skipped_lines),
            "seconds": round(seconds, 3),
        },
    )
    return GraphStore(out)
