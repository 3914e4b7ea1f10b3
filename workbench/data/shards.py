r"""The shards of a prepared dataset: flat arrays in HDF5 files, read through memory maps.

Each shard holds contiguous, uncompressed datasets, concatenated over its ``n`` graphs
(``A`` atoms in all)::

    atom_ptr  int64   [n + 1]     graph g owns atoms atom_ptr[g] : atom_ptr[g + 1]
    numbers   uint8   [A]         atomic numbers
    positions float64 [A, 3]      Å
    forces    float64 [A, 3]      eV/Å (NaN for unlabelled frames)
    cell      float64 [n, 3, 3]   Å
    pbc       bool    [n, 3]
    energy    float64 [n]         eV (NaN for unlabelled frames)
    stress    float64 [n, 3, 3]   eV/Å³ (NaN where a graph has no stress label)
    virials   float64 [n, 3, 3]   eV (NaN where it has none)
    weights   float64 [n, 5]      mace's loss weights: config, energy, forces, stress, virials

Stores of format version 2 have no ``stress`` and ``virials`` and three weights; they read as
graphs without stress (NaN, weight 0). Each shard carries its digest (``attrs["digest"]``,
BLAKE2b over its arrays); opening one checks the digest attribute and the array lengths, so a
truncated, missing or foreign shard is named before any graph of it is read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: the datasets of a shard, by the store's format version
SHARD_ARRAYS = ("atom_ptr", "numbers", "positions", "forces", "cell", "pbc", "energy", "stress", "virials", "weights")
SHARD_ARRAYS_V2 = ("atom_ptr", "numbers", "positions", "forces", "cell", "pbc", "energy", "weights")
SHARDS = "shards"


class StoreError(ValueError):
    """A prepared dataset that is damaged or foreign: ``"{where}: {problem}; {fix}"``, each part
    kept as an attribute (prepare reports ``problem`` as it repairs)."""

    def __init__(self, where: str | os.PathLike, problem: str, fix: str | None = None) -> None:
        self.where, self.problem, self.fix = str(where), problem, fix
        super().__init__(f"{where}: {problem}" + (f"; {fix}" if fix else ""))

    def __reduce__(self):  # crosses process boundaries intact
        return (StoreError, (self.where, self.problem, self.fix))


def repair_hint(path: str | os.PathLike) -> str:
    return f"run the same 'workbench data prepare ... --out {path}' command again to repair it"


def shard_digest(arrays: dict[str, np.ndarray], names: Sequence[str] = SHARD_ARRAYS) -> str:
    """BLAKE2b (128 bit) over a shard's arrays ``names`` (their names, shapes and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name in names:
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def shard_name(source: int, chunk: int) -> str:
    return f"s{source:04d}-c{chunk:06d}.h5"


def _no_tensor() -> np.ndarray:
    return np.full((3, 3), np.nan)


@dataclass
class Graph:
    """One stored structure, as arrays."""

    numbers: np.ndarray  # [n] int
    positions: np.ndarray  # [n, 3]
    forces: np.ndarray  # [n, 3]
    cell: np.ndarray  # [3, 3]
    pbc: np.ndarray  # [3] bool
    energy: float
    weights: np.ndarray  # [5]: config, energy, forces, stress, virials
    family: str
    stress: np.ndarray = field(default_factory=_no_tensor)  # [3, 3] eV/Å³, NaN: no label
    virials: np.ndarray = field(default_factory=_no_tensor)  # [3, 3] eV, NaN: no label


class ShardMaps:
    """Read-only maps of one shard's datasets (``arrays[name]`` for each of :attr:`names`).

    ``expect`` (the manifest's record of the shard: ``graphs``, ``digest``) is checked on open."""

    def __init__(self, path: Path, expect: dict | None = None) -> None:
        import h5py

        self.path = path
        self.arrays: dict[str, np.ndarray] = {}
        try:
            with h5py.File(path, "r", locking=False) as f:
                self.digest = str(f.attrs.get("digest", ""))
                self.names = SHARD_ARRAYS if "stress" in f else SHARD_ARRAYS_V2
                for name in self.names:
                    self.arrays[name] = _mapped(path, f[name])
        except (OSError, KeyError, ValueError) as exc:
            raise StoreError(path, f"unreadable shard ({exc})", repair_hint(path.parent.parent)) from None
        self.atom_ptr = np.asarray(self.arrays["atom_ptr"])
        self.has_tensors = "stress" in self.arrays
        self._check(expect)

    def _check(self, expect: dict | None) -> None:
        graphs = self.atom_ptr.shape[0] - 1
        atoms = int(self.atom_ptr[-1]) if graphs >= 0 else -1
        per_graph = [n for n in self.names if n not in ("atom_ptr", "numbers", "positions", "forces")]
        short = [n for n in ("numbers", "positions", "forces") if self.arrays[n].shape[0] != atoms]
        short += [n for n in per_graph if self.arrays[n].shape[0] != graphs]
        problem = f"arrays {short} do not match atom_ptr" if short else None
        if expect is not None and problem is None:
            if graphs != expect["graphs"]:
                problem = f"{graphs} graphs, the manifest says {expect['graphs']}"
            elif self.digest != expect["digest"]:
                problem = "a shard of another dataset (its digest differs from the manifest's)"
        if problem:
            raise StoreError(self.path, problem, repair_hint(self.path.parent.parent))

    def graph(self, row: int, family: str) -> Graph:
        """The graph in ``row``, as arrays it owns (copies, not views of the map)."""
        a0, a1 = int(self.atom_ptr[row]), int(self.atom_ptr[row + 1])
        arr = self.arrays
        weights = np.array(arr["weights"][row])
        tensors = {}
        if self.has_tensors:
            tensors = {"stress": np.array(arr["stress"][row]), "virials": np.array(arr["virials"][row])}
        else:  # a version-2 store: no stress or virials, weight 0
            weights = np.concatenate([weights, [0.0, 0.0]])
        return Graph(
            numbers=np.asarray(arr["numbers"][a0:a1], dtype=np.int64),
            positions=np.array(arr["positions"][a0:a1]),
            forces=np.array(arr["forces"][a0:a1]),
            cell=np.array(arr["cell"][row]),
            pbc=np.array(arr["pbc"][row], dtype=bool),
            energy=float(arr["energy"][row]),
            weights=weights,
            family=family,
            **tensors,
        )


def _mapped(path: Path, ds) -> np.ndarray:
    offset = ds.id.get_offset()
    if offset is None or ds.size == 0:  # empty or not contiguous: read it whole
        return ds[()]
    return np.memmap(path, dtype=ds.dtype, mode="r", offset=offset, shape=ds.shape)


class ShardReader:
    """Reads graphs from a prepared dataset's shards by ``(shard, row)``; holds no index.

    Pickles without its open maps, so DataLoader workers and spawned processes reopen shards
    lazily in their own process.
    """

    def __init__(self, path: Path, shards: Sequence[dict], families: Sequence[str]) -> None:
        self.path = Path(path)
        self.shards = tuple(shards)  # the manifest's shard records
        self.families = tuple(families)
        self._open: dict[int, ShardMaps] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    def _shard(self, code: int) -> ShardMaps:
        if self._pid != os.getpid():  # forked: maps are per process
            self._open, self._pid = {}, os.getpid()
        shard = self._open.get(code)
        if shard is None:
            if len(self._open) >= 256:  # bound open maps on datasets with thousands of shards
                self._open.pop(next(iter(self._open)))
            rec = self.shards[code]
            shard = self._open[code] = ShardMaps(self.path / SHARDS / rec["name"], rec)
        return shard

    def read(self, shard: int, row: int, family: int) -> Graph:
        """The graph in row ``row`` of shard ``shard``, of family code ``family``."""
        return self._shard(int(shard)).graph(int(row), self.families[int(family)])


def write_shard(path: Path, graphs: list[Graph]) -> dict:
    """Write ``graphs`` as one shard (contiguous datasets), atomically: a temporary file renamed.
    Returns the shard's manifest record: ``name``, ``bytes``, ``graphs`` and ``digest``."""
    import h5py

    n = len(graphs)
    natoms = np.array([g.numbers.shape[0] for g in graphs], dtype=np.int64)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(natoms, out=ptr[1:])

    def cat(key: str, shape: tuple, dtype) -> np.ndarray:
        return np.concatenate([getattr(g, key) for g in graphs]).astype(dtype) if n else np.zeros(shape, dtype)

    def stack(key: str, shape: tuple, dtype) -> np.ndarray:
        return np.array([getattr(g, key) for g in graphs], dtype=dtype).reshape(n, *shape)

    arrays = {
        "atom_ptr": ptr,
        "numbers": cat("numbers", (0,), np.uint8),
        "positions": cat("positions", (0, 3), np.float64).reshape(-1, 3),
        "forces": cat("forces", (0, 3), np.float64).reshape(-1, 3),
        "cell": stack("cell", (3, 3), np.float64),
        "pbc": stack("pbc", (3,), bool),
        "energy": np.array([g.energy for g in graphs], dtype=np.float64),
        "stress": stack("stress", (3, 3), np.float64),
        "virials": stack("virials", (3, 3), np.float64),
        "weights": stack("weights", (5,), np.float64),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = shard_digest(arrays)
    # Built in memory, written with plain file I/O: a full disk is one OSError, not HDF5's noise.
    with h5py.File(path.name, "w", driver="core", backing_store=False) as f:
        for name in SHARD_ARRAYS:
            f.create_dataset(name, data=arrays[name])  # contiguous, uncompressed: memmap-able
        f.attrs["digest"] = digest
        f.flush()
        image = f.id.get_file_image()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(image)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return {"name": path.name, "bytes": path.stat().st_size, "graphs": n, "digest": digest}
