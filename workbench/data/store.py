r"""The prepared dataset: sharded HDF5 files of flat arrays, and one small index for all graphs.

This module owns the on-disk format that ``workbench data prepare`` writes
(:mod:`workbench.data.prepare`) and training reads. A prepared directory::

    manifest.json                 format version, cutoff, label keys, sources, families, elements, totals
    index.npy                     one INDEX_DTYPE record per graph, in input order
    counts.npy                    [graphs, elements] uint32 element counts (E0s; read in chunks)
    origin.npy                    [graphs] (source, frame): the input file and frame of each graph
    skipped.jsonl                 every frame ``--on-error skip`` left out, with its reason
    shards/s0000-c000000.h5       flat arrays for up to ``shard_size`` graphs of one source

Each shard holds contiguous, uncompressed datasets, concatenated over its graphs::

    atom_ptr  int64   [n + 1]     graph g owns atoms atom_ptr[g] : atom_ptr[g + 1]
    numbers   uint8   [A]         atomic numbers
    positions float64 [A, 3]      Å
    forces    float64 [A, 3]      eV/Å (NaN for unlabelled frames)
    cell      float64 [n, 3, 3]   Å
    pbc       bool    [n, 3]
    energy    float64 [n]         eV (NaN for unlabelled frames)
    weights   float64 [n, 3]      config weight, energy weight, forces weight (mace's loss weights)

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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "cfm-workbench-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.npy"
COUNTS = "counts.npy"
ORIGIN = "origin.npy"
SKIPPED = "skipped.jsonl"
SHARDS = "shards"

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
    ]
)
ORIGIN_DTYPE = np.dtype([("source", "<u4"), ("frame", "<i8")])
SHARD_ARRAYS = ("atom_ptr", "numbers", "positions", "forces", "cell", "pbc", "energy", "weights")
MAX_Z = 118


def shard_name(source: int, chunk: int) -> str:
    return f"s{source:04d}-c{chunk:06d}.h5"


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


@dataclass
class Graph:
    """One stored structure, as arrays."""

    numbers: np.ndarray  # [n] int
    positions: np.ndarray  # [n, 3]
    forces: np.ndarray  # [n, 3]
    cell: np.ndarray  # [3, 3]
    pbc: np.ndarray  # [3] bool
    energy: float
    weights: np.ndarray  # [3]: config, energy, forces
    family: str


class _Shard:
    """Read-only maps of one shard's datasets."""

    def __init__(self, path: Path) -> None:
        import h5py

        self.path = path
        self.arrays: dict[str, np.ndarray] = {}
        with h5py.File(path, "r", locking=False) as f:
            for name in SHARD_ARRAYS:
                ds = f[name]
                offset = ds.id.get_offset()
                if offset is None or ds.size == 0:  # empty or not contiguous: read it whole
                    self.arrays[name] = ds[()]
                else:
                    self.arrays[name] = np.memmap(path, dtype=ds.dtype, mode="r", offset=offset, shape=ds.shape)
        self.atom_ptr = np.asarray(self.arrays["atom_ptr"])


class ShardReader:
    """Reads graphs from a prepared dataset's shards by ``(shard, row)``; holds no index.

    Pickles without its open maps, so DataLoader workers and spawned processes reopen shards
    lazily in their own process.
    """

    def __init__(self, path: Path, shards: Sequence[str], families: Sequence[str]) -> None:
        self.path = Path(path)
        self.shards = tuple(shards)
        self.families = tuple(families)
        self._open: dict[int, _Shard] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    def _shard(self, code: int) -> _Shard:
        if self._pid != os.getpid():  # forked: maps are per process
            self._open, self._pid = {}, os.getpid()
        shard = self._open.get(code)
        if shard is None:
            if len(self._open) >= 256:  # bound open maps on datasets with thousands of shards
                self._open.pop(next(iter(self._open)))
            shard = self._open[code] = _Shard(self.path / SHARDS / self.shards[code])
        return shard

    def read(self, shard: int, row: int, family: int) -> Graph:
        """The graph in row ``row`` of shard ``shard``, of family code ``family``."""
        sh = self._shard(int(shard))
        row = int(row)
        a0, a1 = int(sh.atom_ptr[row]), int(sh.atom_ptr[row + 1])
        arr = sh.arrays
        return Graph(
            numbers=np.asarray(arr["numbers"][a0:a1], dtype=np.int64),
            positions=np.array(arr["positions"][a0:a1]),
            forces=np.array(arr["forces"][a0:a1]),
            cell=np.array(arr["cell"][row]),
            pbc=np.array(arr["pbc"][row], dtype=bool),
            energy=float(arr["energy"][row]),
            weights=np.array(arr["weights"][row]),
            family=self.families[int(family)],
        )


class GraphStore:
    """A prepared dataset directory: the index in memory, graphs read on demand.

    >>> store = GraphStore("data/prepared")
    >>> store.index["atoms"]          # sizes for the packer, no structure touched
    >>> g = store.graph(123)          # one structure's arrays, O(1)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise FileNotFoundError(
                f"{self.path}: not a prepared dataset (no {MANIFEST}); "
                f"create one with 'workbench data prepare SRC... --out {self.path}'"
            )
        self.manifest = json.loads((self.path / MANIFEST).read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path / MANIFEST}: not a {FORMAT} manifest")
        if self.manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{self.path}: prepared with format version {self.manifest.get('version')}, this "
                f"workbench reads version {FORMAT_VERSION}; prepare it again"
            )
        if not self.manifest.get("complete"):
            raise ValueError(
                f"{self.path}: prepare did not finish; run the same 'workbench data prepare' command again to resume it"
            )
        self.index = np.load(self.path / INDEX)
        self.families: tuple[str, ...] = tuple(self.manifest["families"])
        self.elements: tuple[int, ...] = tuple(int(z) for z in self.manifest["elements"])
        self.shards: tuple[str, ...] = tuple(self.manifest["shards"])
        self.cutoff = float(self.manifest["cutoff"])
        self.reader = ShardReader(self.path, self.shards, self.families)

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def __repr__(self) -> str:
        return f"GraphStore({str(self.path)!r}: {len(self)} graphs, {len(self.shards)} shards, cutoff {self.cutoff} Å)"

    def graph(self, i: int) -> Graph:
        """Graph ``i`` (a row of :attr:`index`) as arrays."""
        rec = self.index[int(i)]
        return self.reader.read(rec["shard"], rec["row"], rec["family"])

    def locations(self, rows: np.ndarray) -> np.ndarray:
        """``(shard, row, family)`` of ``rows``: all a :class:`ShardReader` needs, 10 bytes a graph."""
        return np.asarray(self.index[["shard", "row", "family"]][np.asarray(rows, dtype=np.int64)]).copy()

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

    # -- summaries
    def summary(self) -> list[dict[str, Any]]:
        """Per-family rows (graphs, share, atoms, edges per atom, labelled) and a total, from the index."""
        from workbench.data.summary import summarize

        return summarize(self.sizes(), np.asarray(self.index["labelled"]))

    def sizes(self) -> np.ndarray:
        """Sizes in :data:`workbench.data.sizes.SIZES_DTYPE` (atoms, edges, family name)."""
        from workbench.data.sizes import SIZES_DTYPE

        out = np.zeros(len(self), dtype=SIZES_DTYPE)
        out["atoms"] = self.index["atoms"]
        out["edges"] = self.index["edges"]
        out["family"] = np.asarray(self.families, dtype=SIZES_DTYPE["family"])[self.index["family"]]
        return out


def write_shard(path: Path, graphs: list[Graph]) -> None:
    """Write ``graphs`` as one shard (contiguous datasets), atomically: a temporary file renamed."""
    import h5py

    n = len(graphs)
    natoms = np.array([g.numbers.shape[0] for g in graphs], dtype=np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(natoms, out=ptr[1:])

    def cat(key: str, shape: tuple, dtype) -> np.ndarray:
        return np.concatenate([getattr(g, key) for g in graphs]).astype(dtype) if n else np.zeros(shape, dtype)

    arrays = {
        "atom_ptr": ptr,
        "numbers": cat("numbers", (0,), np.uint8),
        "positions": cat("positions", (0, 3), np.float64).reshape(-1, 3),
        "forces": cat("forces", (0, 3), np.float64).reshape(-1, 3),
        "cell": np.array([g.cell for g in graphs], dtype=np.float64).reshape(n, 3, 3),
        "pbc": np.array([g.pbc for g in graphs], dtype=bool).reshape(n, 3),
        "energy": np.array([g.energy for g in graphs], dtype=np.float64),
        "weights": np.array([g.weights for g in graphs], dtype=np.float64).reshape(n, 3),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w", locking=False) as f:
        for name in SHARD_ARRAYS:
            f.create_dataset(name, data=arrays[name])  # contiguous, uncompressed: memmap-able
    os.replace(tmp, path)
