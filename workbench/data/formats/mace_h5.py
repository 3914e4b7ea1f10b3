"""mace ``preprocess_data`` HDF5 files, read defensively: every problem is a :class:`StructureError`.

A file holds groups ``config_batch_N/config_M``, each a configuration (``atomic_numbers``,
``positions``, ``cell``, ``pbc``, ``properties/{energy,forces,stress,virials}``,
``property_weights``, ``config_type``, ``weight``; absent values are stored as the string
``"None"``). A damaged
file, a stray group, an empty file or an impossible value names the file, the frame (0-based,
in key order) and the configuration, never a bare h5py or ASE exception.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from workbench.data.errors import StructureError
from workbench.data.formats.base import Format
from workbench.data.keys import LabelKeys, as_matrix
from workbench.limits import MAX_Z

H5_SUFFIXES = (".h5", ".hdf5")


def _num(name: str) -> int:
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def mace_h5_keys(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The ``(batch, config)`` keys of a mace HDF5 file, in batch then config order."""
    import h5py

    path = Path(path)
    keys: list[tuple[str, str]] = []
    try:
        with h5py.File(path, "r", locking=False) as f:
            for b in sorted(f.keys(), key=_num):
                if not b.startswith("config_batch_") or not isinstance(f[b], h5py.Group):
                    raise StructureError(
                        path, None, f"not a mace preprocess_data file: top-level {b!r} is not a config_batch_N group"
                    )
                keys.extend((b, c) for c in sorted(f[b].keys(), key=_num))
    except StructureError:
        raise
    except Exception as exc:  # h5py raises OSError, RuntimeError, KeyError, ... for a damaged file
        raise StructureError(path, None, f"cannot read as HDF5 ({type(exc).__name__}: {exc})") from None
    if not keys:
        raise StructureError(path, None, "mace HDF5 file holds no configurations (no config_batch_N/config_M groups)")
    return keys


def _value(x):
    x = x[()]
    x = x.decode() if isinstance(x, bytes) else x
    return None if isinstance(x, str) and x == "None" else x


def _array(g, name: str, dtype, shape: tuple) -> np.ndarray:
    value = _value(g[name])
    if value is None:
        raise ValueError(f"{name} is missing (stored as None)")
    out = np.asarray(value, dtype=dtype)
    if out.shape != shape:
        raise ValueError(f"{name} has shape {out.shape}, expected {shape}")
    return out


def _numbers(g) -> np.ndarray:
    z = np.asarray(_value(g["atomic_numbers"]))
    if z.ndim != 1 or z.size == 0:
        raise ValueError(f"atomic_numbers has shape {z.shape}: a configuration needs at least one atom")
    if not np.issubdtype(z.dtype, np.integer):
        raise ValueError(f"atomic_numbers are {z.dtype}, not integers")
    bad = np.where((z < 1) | (z > MAX_Z))[0]
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"atom {k} has atomic number {int(z[k])}, outside the valid range 1-{MAX_Z}")
    return z.astype(np.int64)


def _config(g, keys: LabelKeys):
    """One configuration group as ``ase.Atoms`` with labels under ``keys``; ValueError/KeyError if malformed."""
    import ase

    z = _numbers(g)
    n = z.size
    cell, pbc = _value(g["cell"]), _value(g["pbc"])
    atoms = ase.Atoms(
        numbers=z,
        positions=_array(g, "positions", float, (n, 3)),
        cell=np.zeros((3, 3)) if cell is None else _array(g, "cell", float, (3, 3)),
        pbc=False if pbc is None else _array(g, "pbc", bool, (3,)),
    )
    props = g["properties"]
    if "energy" in props and _value(props["energy"]) is not None:
        atoms.info[keys.energy] = float(_array(props, "energy", float, ()))
    if "forces" in props and _value(props["forces"]) is not None:
        atoms.arrays[keys.forces] = _array(props, "forces", float, (n, 3))
    for name, key in (("stress", keys.stress), ("virials", keys.virials)):
        if name in props and _value(props[name]) is not None:
            try:
                atoms.info[key] = as_matrix(_value(props[name]))
            except ValueError as exc:
                raise ValueError(f"{name} {exc}") from None
    config_type = _value(g["config_type"]) if "config_type" in g else None
    atoms.info["config_type"] = str(config_type or "Default")
    weight = _value(g["weight"]) if "weight" in g else None
    atoms.info["config_weight"] = 1.0 if weight is None else float(np.asarray(weight, dtype=float))
    weights = g.get("property_weights", {})
    for name in ("energy", "forces", "stress", "virials"):
        if name in weights and _value(weights[name]) is not None:
            atoms.info[f"config_{name}_weight"] = float(np.asarray(_value(weights[name]), dtype=float))
    return atoms


def read_mace_h5(
    path: str | os.PathLike, first: int, keys: list[tuple[str, str]], labels: LabelKeys | None = None
) -> list[tuple[int, object]]:
    """``[(frame, ase.Atoms or StructureError)]`` for ``keys`` (from :func:`mace_h5_keys`), the
    frames numbered from ``first``, labels under ``labels``; a malformed configuration is a
    StructureError in its place."""
    import h5py

    labels = labels or LabelKeys()
    path = Path(path)
    out: list[tuple[int, object]] = []
    try:
        f = h5py.File(path, "r", locking=False)
    except Exception as exc:
        raise StructureError(path, None, f"cannot read as HDF5 ({type(exc).__name__}: {exc})") from None
    with f:
        for k, (b, c) in enumerate(keys):
            try:
                out.append((first + k, _config(f[b][c], labels)))
            except Exception as exc:  # any failure is this configuration's, named with its key
                reason = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
                reason = reason.replace("\n", " ")[:200]
                out.append((first + k, StructureError(path, first + k, f"mace configuration {b}/{c}: {reason}")))
    return out


class MaceH5Format(Format):
    """mace ``preprocess_data`` HDF5: a file, or a folder of its shards."""

    name = "mace-h5"
    summary = "mace preprocess_data HDF5 (.h5, .hdf5; a folder of shards)"
    suffixes = H5_SUFFIXES
    folder_suffixes = H5_SUFFIXES
    names_handles = True

    def handle_name(self, handle: object) -> str:
        batch, config = handle  # type: ignore[misc]
        return f"mace configuration {batch}/{config}"

    def listing(self, path: Path) -> list[tuple[str, str]]:
        return mace_h5_keys(path)  # an empty or malformed file is named here, not in the output

    def read(self, path: Path, first: int, payload: object, keys: LabelKeys) -> list[tuple[int, object]]:
        return read_mace_h5(path, first, payload, keys)  # type: ignore[arg-type]
