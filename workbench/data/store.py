r"""The prepared dataset: sharded HDF5 files of flat arrays, and one small index for all graphs.

This module owns the on-disk format that ``workbench data prepare`` writes
(:mod:`workbench.data.prepare`) and training reads. A prepared directory::

    manifest.json                 format version, cutoff, label keys, sources, families, elements, totals,
                                  and each shard's name, bytes, graphs and digest
    index.npy                     one INDEX_DTYPE record per graph, in input order
    counts.npy                    [graphs, elements] uint32 element counts (E0s; read in chunks)
    origin.npy                    [graphs] (source, frame): the input file and frame of each graph
    skipped.jsonl                 every frame ``--on-error skip`` left out, with its reason
    shards/s0000-c000000.h5       flat arrays for up to ``shard_size`` graphs of one source

The shards' arrays (positions, labels, loss weights) are :mod:`workbench.data.shards`'.
Each shard carries its digest (``attrs["digest"]``, BLAKE2b over its arrays). Opening a
store checks every shard's size and graph count against the manifest and the index (a ``stat``
per shard); opening a shard checks its digest attribute and array lengths, so a truncated,
missing or foreign shard is named before any graph of it is read. ``workbench data verify
STORE`` recomputes every digest from the data (:func:`verify_shards`).

Reads (:class:`ShardReader`) go through ``numpy.memmap`` at each dataset's byte offset in the file (HDF5 contiguous
layout), so fetching graph ``i`` is two index look-ups and a few slices of mapped pages: O(1),
no HDF5 call per read, safe for any number of ranks and DataLoader workers reading at once
(read-only maps; each process opens its own after a fork).

Why this layout. ``workbench bench data --parts layout`` writes 20,000 embedded graphs (114
atoms on average) three ways and reads 2,000 at random (2-core machine, 2026-11-25):

=========================================  =======  ======  =====================
layout                                     write s  MB      random read, µs/graph
=========================================  =======  ======  =====================
group per structure (mace ``HDF5Dataset``)    53.3   250.7                 4311.1
flat arrays, h5py slices                       0.5   113.7                  178.9
flat arrays, memmap (this module)              0.5   113.7                   14.7
=========================================  =======  ======  =====================

A group per structure pays an HDF5 object lookup per dataset per read and grows the file's
B-tree and metadata with every structure (2.2x the bytes here); flat arrays keep eight datasets
per shard whatever the number of graphs, and a mapped read skips HDF5 altogether: 290x faster
than mace's reader, so graph building, not reading, is what DataLoader workers spend time on.
LMDB would also give O(1) reads, but stores one pickled record per key (the group-per-structure
problem again, serialised); HDF5 keeps the arrays typed, readable by h5py and mace users' tools.

Format versions: 3 adds stress and virials (shards) and which graphs carry them (index). A
version-2 store still opens: its index gains ``stress`` and ``virials`` columns of False, its
graphs read without stress (:attr:`GraphStore.has_stress` is False).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workbench.data.shards import SHARDS, Graph, ShardMaps, ShardReader, StoreError, repair_hint, shard_digest
from workbench.limits import MAX_Z

__all__ = ["FORMAT", "FORMAT_VERSION", "INDEX_DTYPE", "MAX_Z", "GraphStore", "StoreError", "repair_hint"]

FORMAT = "cfm-workbench-prepared"
#: 2: the manifest lists each shard's bytes, graphs and digest; 3: stress and virials
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
INDEX = "index.npy"
COUNTS = "counts.npy"
ORIGIN = "origin.npy"
SKIPPED = "skipped.jsonl"

#: One record per graph. Everything the packer, the split and mace's statistics need.
INDEX_DTYPE = np.dtype(
    [
        ("atoms", "<i4"),  # vertices
        ("edges", "<i4"),  # directed edges at the cutoff (periodic images included)
        ("connected", "<i4"),  # atoms with at least one neighbour (mace's avg_num_neighbors counts these)
        ("family", "<u2"),  # code into manifest["families"] (the extxyz config_type)
        ("shard", "<u4"),  # code into manifest["shards"]
        ("row", "<i4"),  # graph row inside the shard
        ("labelled", "?"),  # energy and forces present
        ("energy", "<f8"),  # eV (NaN when unlabelled)
        ("fsq", "<f8"),  # sum over atoms and components of F^2, (eV/Å)^2
        ("stress", "?"),  # a stress label is present
        ("virials", "?"),  # a virial label is present
    ]
)
#: the index of a version-2 store: no stress or virials columns
INDEX_DTYPE_V2 = np.dtype([(name, INDEX_DTYPE[name]) for name in INDEX_DTYPE.names[:-2]])
ORIGIN_DTYPE = np.dtype([("source", "<u4"), ("frame", "<i8")])


def new_index_arrays(out: Path, n: int, n_elements: int, temporary: bool = False) -> tuple[np.ndarray, ...]:
    """Index, element counts and origin for ``n`` graphs, memory-mapped in ``out`` for the writer
    to fill (``temporary``: as ``.<name>.tmp``, which the writer renames into place when done)."""

    def new(name: str, dtype, shape: tuple) -> np.ndarray:
        path = out / (f".{name}.tmp" if temporary else name)
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    return new(INDEX, INDEX_DTYPE, (n,)), new(COUNTS, np.uint32, (n, n_elements)), new(ORIGIN, ORIGIN_DTYPE, (n,))


def is_prepared(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory with a finished prepare (its manifest says so)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return data.get("format") == FORMAT and bool(data.get("complete"))


def read_manifest(path: Path) -> dict:
    """The manifest of a finished prepare in ``path``; errors name the file and the fix."""
    file = path / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(
            f"{path}: not a prepared dataset (no {MANIFEST}); create one with 'workbench data prepare SRC... --out {path}'"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreError(file, f"unreadable manifest ({exc})", repair_hint(path)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(file, f"not a {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise StoreError(
            path,
            f"prepared with format version {manifest.get('version')}, this workbench reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            "prepare it again",
        )
    if not manifest.get("complete"):
        raise StoreError(
            path, "prepare did not finish", "run the same 'workbench data prepare' command again to resume it"
        )
    return manifest


def _read_index(path: Path, manifest: dict) -> np.ndarray:
    try:
        index = np.load(path / INDEX, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise StoreError(path / INDEX, f"unreadable index ({exc})", repair_hint(path)) from None
    expected = INDEX_DTYPE if manifest.get("version") == FORMAT_VERSION else INDEX_DTYPE_V2
    if index.dtype != expected or index.ndim != 1 or index.shape[0] != manifest.get("n_graphs"):
        raise StoreError(
            path / INDEX,
            f"{index.shape} records of {index.dtype}, the manifest says {manifest.get('n_graphs')} graphs",
            repair_hint(path),
        )
    if expected is INDEX_DTYPE_V2:  # before stress: no graph has one
        full = np.zeros(index.shape, dtype=INDEX_DTYPE)
        for name in INDEX_DTYPE_V2.names:
            full[name] = index[name]
        index = full
    return index


def damaged_shards(path: Path, records: Sequence[dict]) -> list[tuple[str, str]]:
    """``(name, problem)`` of each shard that is missing or whose size is not the manifest's
    (one ``stat`` per shard; :func:`verify_shards` reads the data)."""
    out = []
    for rec in records:
        file = Path(path) / SHARDS / rec["name"]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            out.append((rec["name"], "missing"))
            continue
        if size != rec["bytes"]:
            out.append((rec["name"], f"{size} bytes, the manifest says {rec['bytes']}"))
    return out


def verify_shards(store: GraphStore, progress: bool = True) -> list[tuple[str, str]]:
    """Recompute every shard's digest from its data; ``(name, problem)`` of each that differs."""
    from workbench.progress import bar

    problems = []
    records = store.manifest["shards"]
    with bar(total=len(records), desc="verify", unit="shard", disable=not progress) as shown:
        for rec in records:
            try:
                maps = ShardMaps(store.path / SHARDS / rec["name"])
            except StoreError as exc:
                problems.append((rec["name"], str(exc)))
            else:
                if shard_digest(maps.arrays, maps.names) != rec["digest"]:
                    problems.append((rec["name"], "its data differs from the digest written at prepare"))
            shown.update(1)
    return problems


class GraphStore:
    """A prepared dataset directory: the index in memory, graphs read on demand.

    >>> store = GraphStore("data/prepared")
    >>> store.column("atoms")         # sizes for the packer, no structure touched
    >>> rows = store.select(["water"])  # labelled graphs of some families
    >>> g = store.graph(123)          # one structure's arrays, O(1)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        records = self.manifest["shards"]
        self._index = _read_index(self.path, self.manifest)
        damaged = damaged_shards(self.path, records)
        if damaged:
            listed = "; ".join(f"{name}: {why}" for name, why in damaged[:3])
            more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
            raise StoreError(self.path, f"{len(damaged)} damaged shard(s) ({listed}{more})", repair_hint(self.path))
        per_shard = np.bincount(self._index["shard"], minlength=len(records))
        if per_shard.shape[0] != len(records) or any(int(c) != r["graphs"] for c, r in zip(per_shard, records)):
            raise StoreError(self.path / INDEX, "does not match the shards' graph counts", repair_hint(self.path))
        self.families: tuple[str, ...] = tuple(self.manifest["families"])
        self.elements: tuple[int, ...] = tuple(int(z) for z in self.manifest["elements"])
        self.shards: tuple[str, ...] = tuple(r["name"] for r in records)
        self.cutoff = float(self.manifest["cutoff"])
        self.reader = ShardReader(self.path, records, self.families)

    def __len__(self) -> int:
        return int(self._index.shape[0])

    def __repr__(self) -> str:
        return f"GraphStore({str(self.path)!r}: {len(self)} graphs, {len(self.shards)} shards, cutoff {self.cutoff} Å)"

    def column(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """One per-graph quantity of the index (a name of :data:`INDEX_DTYPE`: atoms, edges,
        connected, family, labelled, energy, fsq, ...), for every graph or for ``rows``."""
        if name not in INDEX_DTYPE.names:
            raise KeyError(f"{self.path / INDEX}: no column {name!r}; columns: {', '.join(INDEX_DTYPE.names)}")
        col = self._index[name]
        return col if rows is None else col[np.asarray(rows, dtype=np.int64)]

    def records(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Whole index records (:data:`INDEX_DTYPE`), for writers of a derived dataset and for tests."""
        return self._index if rows is None else self._index[np.asarray(rows, dtype=np.int64)]

    def select(self, families: Sequence[str] | None = None) -> np.ndarray:
        """Rows of the labelled graphs, of ``families`` only when given (unknown names are refused)."""
        keep = self._index["labelled"].copy()
        if families:
            unknown = sorted(set(families) - set(self.families))
            if unknown:
                raise ValueError(
                    f"{self.path}: families {unknown} are not in the dataset; it has {list(self.families)}"
                )
            keep &= np.isin(self._index["family"], [self.families.index(f) for f in families])
        return np.flatnonzero(keep)

    def family_names(self, rows: np.ndarray) -> list[str]:
        """The family (extxyz ``config_type``) of each of ``rows``."""
        return list(np.asarray(self.families, dtype=str)[self.column("family", rows)])

    def graph(self, i: int) -> Graph:
        """Graph ``i`` (a row of :attr:`index`) as arrays."""
        rec = self._index[int(i)]
        return self.reader.read(rec["shard"], rec["row"], rec["family"])

    def locations(self, rows: np.ndarray) -> np.ndarray:
        """``(shard, row, family)`` of ``rows``: all a :class:`ShardReader` needs, 10 bytes a graph."""
        return np.asarray(self._index[["shard", "row", "family"]][np.asarray(rows, dtype=np.int64)]).copy()

    def origin(self, rows: np.ndarray | int) -> list[tuple[str, int]]:
        """``(source file, frame)`` of each row: where a graph came from, for error messages."""
        org = np.load(self.path / ORIGIN, mmap_mode="r")
        rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        sources = self.manifest["sources"]
        return [(sources[int(org[r]["source"])]["path"], int(org[r]["frame"])) for r in rows]

    # -- element counts (E0s), streamed
    def element_counts(
        self, rows: np.ndarray | None = None, chunk: int = 65536
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(rows, counts)`` blocks: counts ``[len(rows), len(elements)]`` for the given
        (sorted or not) rows, at most ``chunk`` rows at a time, so memory stays bounded."""
        if rows is None:
            rows = np.arange(len(self))
        rows = np.asarray(rows, dtype=np.int64)
        for k in range(0, rows.size, chunk):
            block = rows[k : k + chunk]
            counts = np.load(self.path / COUNTS, mmap_mode="r")  # mapped per block: pages it touched go with it
            yield block, np.asarray(counts[block])
            del counts

    def present_elements(self, rows: np.ndarray | None = None) -> list[int]:
        """Atomic numbers occurring in ``rows`` (default: every graph), sorted."""
        present = np.zeros(len(self.elements), dtype=bool)
        for _, counts in self.element_counts(None if rows is None else np.sort(np.asarray(rows))):
            present |= counts.any(axis=0)
        return [int(z) for z, p in zip(self.elements, present) if p]

    @property
    def has_stress(self) -> bool:
        """Whether any graph carries a stress label (never, in a store prepared before version 3)."""
        return bool(self._index["stress"].any())

    @property
    def has_virials(self) -> bool:
        return bool(self._index["virials"].any())

    # -- summaries
    def summary(self) -> list[dict[str, Any]]:
        """Per-family rows (graphs, share, atoms, edges per atom, labelled, stress) and a total, from the index."""
        from workbench.data.summary import summarize

        return summarize(self.sizes(), np.asarray(self._index["labelled"]), np.asarray(self._index["stress"]))

    def sizes(self) -> np.ndarray:
        """Sizes in :data:`workbench.data.sizes.SIZES_DTYPE` (atoms, edges, family name)."""
        from workbench.data.sizes import SIZES_DTYPE

        out = np.zeros(len(self), dtype=SIZES_DTYPE)
        out["atoms"] = self._index["atoms"]
        out["edges"] = self._index["edges"]
        out["family"] = np.asarray(self.families, dtype=SIZES_DTYPE["family"])[self._index["family"]]
        return out
