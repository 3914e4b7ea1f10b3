"""The parsed-structure cache: frames of a structure file as plain arrays (``.npz``), never a pickle.

Parsing and validating the embedded mixture takes ~10 s and every rank of every run reads it;
the cache brings that under a second. An entry is keyed by the file's content (sha256), its
suffix and the read options, so a renamed copy hits and a ``.gz``-named text file does not.
Entries hold only numbers, strings and JSON (loaded with ``allow_pickle=False``): a file planted
in a shared cache directory can at worst give wrong coordinates, which the cheap checks on load
(finite, sane extent, labels) and the content key guard against, never run code.
``WORKBENCH_DATA_CACHE=0`` turns it off; ``WORKBENCH_CACHE_DIR`` moves it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import ase
import numpy as np

from workbench.cache_dir import cache_dir
from workbench.switches import switch

DATA_CACHE_ENV = "WORKBENCH_DATA_CACHE"
CACHE_VERSION = 4  # bump when the stored form or what the readers accept changes


def cache_path(raw: bytes, path: Path, options: tuple) -> Path | None:
    """Where the frames of this content, read with ``options``, are cached; None when disabled."""
    if switch(DATA_CACHE_ENV) == "0":
        return None
    root = cache_dir("structures")
    digest = hashlib.sha256(raw)
    digest.update(repr(("".join(Path(path).suffixes), options, ase.__version__, CACHE_VERSION)).encode())
    return root / f"{digest.hexdigest()}.npz"


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise TypeError(type(value).__name__)


def _from_json(value):
    if isinstance(value, dict) and "__ndarray__" in value:
        return np.array(value["__ndarray__"], dtype=value["dtype"])
    return value


def save(cache: Path, frames: list) -> bool:
    """Write ``frames``; False (nothing written) when a frame holds something arrays cannot."""
    try:
        if any(a.calc is not None for a in frames):
            return False
        info = json.dumps([{k: _jsonable(v) for k, v in a.info.items()} for a in frames])
        keys = sorted({k for a in frames for k in a.arrays} - {"numbers", "positions"})
        arrays = {
            "natoms": np.array([len(a) for a in frames], dtype=np.int64),
            "numbers": np.concatenate([a.numbers for a in frames]).astype(np.int64),
            "positions": np.concatenate([a.positions for a in frames]),
            "cell": np.array([a.cell.array for a in frames]),
            "pbc": np.array([a.pbc for a in frames]),
            "info": np.array(info),
            "keys": np.array(keys, dtype=str),
        }
        for k, key in enumerate(keys):
            has = np.array([key in a.arrays for a in frames])
            values = np.concatenate([a.arrays[key] for a in frames if key in a.arrays])
            if values.dtype == object:
                return False
            arrays[f"has{k}"], arrays[f"arr{k}"] = has, values
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, cache)  # atomic: ranks reading the same file at once never see half a file
        return True
    except (TypeError, ValueError, OSError):
        return False  # unusual info values or a read-only home: no cache, no harm


def load(cache: Path) -> list | None:
    """The cached frames, or None when the entry is missing or unreadable."""
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as z:
            natoms = z["natoms"]
            ptr = np.concatenate([[0], np.cumsum(natoms)])
            numbers, positions, cell, pbc = z["numbers"], z["positions"], z["cell"], z["pbc"]
            infos = json.loads(str(z["info"]))
            keys = [str(k) for k in z["keys"]]
            extra = [(key, z[f"has{k}"], z[f"arr{k}"]) for k, key in enumerate(keys)]
    except Exception:
        return None
    if len(infos) != natoms.size or ptr[-1] != numbers.size:
        return None
    frames = []
    offsets = {key: 0 for key, _, _ in extra}
    for g in range(natoms.size):
        a = ase.Atoms(
            numbers=numbers[ptr[g] : ptr[g + 1]], positions=positions[ptr[g] : ptr[g + 1]], cell=cell[g], pbc=pbc[g]
        )
        a.info.update({k: _from_json(v) for k, v in infos[g].items()})
        for key, has, values in extra:
            if has[g]:
                a.arrays[key] = values[offsets[key] : offsets[key] + natoms[g]].copy()
                offsets[key] += natoms[g]
        frames.append(a)
    return frames
