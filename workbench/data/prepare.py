r"""``workbench data prepare``: structures in any preparable format into a prepared dataset.

The sources are files or folders of extxyz (``.gz`` too), mace HDF5, ASE ``.db``, fairchem
``.aselmdb`` or mace LMDB (:mod:`workbench.data.formats`); energies, forces, stresses and virials
are kept per graph.

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

import errno
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from workbench.data.io import StructureError
from workbench.data.keys import ENERGY_KEY, FORCES_KEY, STRESS_KEY, VIRIALS_KEY
from workbench.data.prepare_sources import Chunk, fingerprint, iter_chunks, resolve_sources
from workbench.data.prepare_worker import (
    DEFAULT_SHARD_SIZE,
    ON_ERROR,
    PART_FIELDS,
    Settings,
    measure,
    part_path,
    run_chunk,
    worker_init,
)
from workbench.data.store import (
    COUNTS,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    MAX_Z,
    ORIGIN,
    SHARDS,
    SKIPPED,
    GraphStore,
    ShardMaps,
    StoreError,
    damaged_shards,
    new_index_arrays,
)
from workbench.limits import MAX_CUTOFF

#: the public names; sources, chunks and the per-chunk work live in prepare_sources / prepare_worker
__all__ = [
    "DEFAULT_SHARD_SIZE",
    "ON_ERROR",
    "Chunk",
    "Settings",
    "iter_chunks",
    "measure",
    "prepare",
    "resolve_sources",
    "run_chunk",
]

# -- the whole prepare ---------------------------------------------------------------------------


def _check_resume(out: Path, settings: Settings, paths: list[Path]) -> dict | None:
    """The finished manifest when there is nothing to do; raise on settings that differ."""
    manifest = out / MANIFEST
    data = _read_json(manifest)
    if data is None:  # none, or unreadable: the parts (each with its source's fingerprint) say what is done
        if out.exists() and any(out.iterdir()) and not (out / SHARDS).is_dir():
            raise ValueError(f"{out}: directory is not empty and holds no prepared dataset; choose a new --out")
        return None
    if data.get("format") != FORMAT:
        raise ValueError(f"{manifest}: not a {FORMAT} manifest; choose a new --out")
    old = data.get("settings", {})
    older = data.get("version") != FORMAT_VERSION
    # an older format knew fewer settings: those it lacks had today's defaults
    changed = sorted(k for k, v in asdict(settings).items() if old.get(k, getattr(Settings(), k)) != v)
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
    if older:  # the same sources and settings: nothing else is lost by writing it again
        print(f"{out}: prepared by format version {data.get('version')}; preparing it again", file=sys.stderr)
        _clear_old_format(out)
        return None
    if data.get("complete") and data["sources"] == [fingerprint(p) for p in paths]:
        return data if _intact(out, data) else None
    return None


def _clear_old_format(out: Path) -> None:
    """Remove what a prepare of an older format left in ``out``: its shards, parts and manifest."""
    for pattern in ("*.h5", "*.part.npz", ".*.tmp"):
        for f in (out / SHARDS).glob(pattern):
            f.unlink()
    (out / MANIFEST).unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError):
        print(f"{path}: unreadable; preparing again from the finished chunks", file=sys.stderr)
        return None
    return data if isinstance(data, dict) else None


def _intact(out: Path, manifest: dict) -> bool:
    """True when a finished prepare is whole; else drop its damaged shards (and their parts) so
    that the run redoes just those chunks and merges again."""
    damaged = dict(damaged_shards(out, manifest["shards"]))
    for rec in manifest["shards"]:
        if rec["name"] not in damaged:
            try:
                ShardMaps(out / SHARDS / rec["name"], rec)  # digest attribute and lengths, not the data
            except StoreError as exc:
                damaged[rec["name"]] = exc.problem
    for name, why in damaged.items():
        print(f"{out / SHARDS / name}: {why}; preparing it again", file=sys.stderr)
        (out / SHARDS / name).unlink(missing_ok=True)
        part_path(out, int(name[1:5]), int(name[7:13])).unlink(missing_ok=True)
    if damaged:
        return False
    try:
        GraphStore(out)
    except StoreError as exc:  # the index: the merge writes it again from the parts
        print(f"{exc.where}: {exc.problem}; merging again", file=sys.stderr)
        return False
    return True


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
                shard = json.loads(str(z["shard"]))
                if not set(PART_FIELDS) <= set(z.files):  # a part of an older format: done again
                    fp = None
        except Exception:
            fp = shard = None
        if source < len(fingerprints) and fp == fingerprints[source] and not damaged_shards(out, [shard]):
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
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
) -> GraphStore:
    """Prepare ``sources`` into the directory ``out`` and return the :class:`GraphStore`.

    ``workers``: processes that parse and measure (default: all cores). The label keys say where
    each format puts its labels (:mod:`workbench.data.formats`); a stress or virial label is
    optional per graph. Running the same call again resumes a killed prepare, or returns at once
    when it finished.
    """
    settings = _settings(cutoff, workers, energy_key, forces_key, on_error, shard_size)
    settings = replace(settings, stress_key=stress_key, virials_key=virials_key)
    out = Path(out)
    paths = resolve_sources(sources)
    try:
        return _prepare(paths, out, settings, workers, progress)
    except OSError as exc:
        if exc.errno not in DISK_ERRORS:
            raise
        where = Path(exc.filename).parent if exc.filename else out
        raise StoreError(
            where,
            f"cannot write ({exc.strerror})",
            "free space or make it writable, then run the same command again: finished chunks are kept",
        ) from None


#: errno values that mean "the output folder cannot take the data": one line, and a resumable prepare
DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM, errno.EFBIG)


def _settings(
    cutoff: float, workers: int | None, energy_key: str, forces_key: str, on_error: str, shard_size: int
) -> Settings:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error: {on_error!r} is not one of {', '.join(ON_ERROR)}")
    if not 0 < cutoff <= MAX_CUTOFF:  # also refuses NaN
        raise ValueError(f"cutoff: must be > 0 and <= {MAX_CUTOFF} Å (MACE uses 4-6 Å), got {cutoff}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers: must be >= 1, or 0 for all cores, got {workers}")
    if shard_size < 1:
        raise ValueError(f"shard_size: must be >= 1, got {shard_size}")
    return Settings(float(cutoff), energy_key, forces_key, int(shard_size), on_error)


def _prepare(paths: list[Path], out: Path, settings: Settings, workers: int | None, progress: bool) -> GraphStore:
    if _check_resume(out, settings, paths) is not None:
        return GraphStore(out)
    fingerprints = [fingerprint(p) for p in paths]
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
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=worker_init) as pool:
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


def _scan_parts(out: Path, chunk_ids: list[tuple[int, int]]) -> tuple[list[str], np.ndarray, list[dict]]:
    """First pass over the parts: sorted family names, the elements present, the shards' records."""
    families: set[str] = set()
    present = np.zeros(MAX_Z + 1, dtype=bool)
    shards = []
    for source, chunk in chunk_ids:
        with np.load(part_path(out, source, chunk)) as z:
            families.update(str(f) for f in z["families"])
            present |= z["counts"].any(axis=0)
            shards.append(json.loads(str(z["shard"])))
    return sorted(families), np.flatnonzero(present), shards


def _fill_arrays(
    out: Path, chunk_ids: list[tuple[int, int]], family_names: list[str], elements: np.ndarray, n_total: int
) -> list[str]:
    """Second pass: write index, counts and origin (memory-mapped, to temporary names, then renamed
    into place); returns the skipped frames' JSON lines in input order."""
    index, counts, origin = new_index_arrays(out, n_total, elements.size, temporary=True)
    skipped_lines: list[str] = []
    at = 0
    for code, (source, chunk) in enumerate(chunk_ids):
        with np.load(part_path(out, source, chunk)) as z:
            n = int(z["atoms"].shape[0])
            sl = slice(at, at + n)
            for key in PART_FIELDS:
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
    return skipped_lines


def _merge(
    out: Path,
    settings: Settings,
    paths: list[Path],
    fingerprints: list[dict],
    chunk_ids: list[tuple[int, int]],
    seconds: float,
) -> GraphStore:
    """Concatenate the parts in input order into index, counts and origin (bounded memory)."""
    family_names, elements, shards = _scan_parts(out, chunk_ids)
    n_total = sum(r["graphs"] for r in shards)
    skipped_lines = _fill_arrays(out, chunk_ids, family_names, elements, n_total)
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
            "shards": shards,
            "n_graphs": n_total,
            "n_skipped": len(skipped_lines),
            "seconds": round(seconds, 3),
        },
    )
    return GraphStore(out)
