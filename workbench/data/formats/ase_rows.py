"""ASE database rows (SQLite ``.db``, fairchem's ``.aselmdb``, mace's LMDB) as ``ase.Atoms``.

An ASE row keeps its structure (``numbers``, ``positions``, ``cell``, ``pbc``), the calculator's
results (``energy``, ``forces``, ``stress``), scalar ``key_value_pairs`` and a free ``data``
dictionary; fairchem's writer files non-scalar ``info`` under ``data["__info__"]`` and extra
per-atom arrays under ``data["__arrays__"]``. The labels are taken, in this order:

=========  ===============================================================================
label      from
=========  ===============================================================================
energy     ``key_value_pairs[energy_key]``, else the calculator's ``energy``
forces     ``data["__arrays__"][forces_key]`` or ``data[forces_key]``, else its ``forces``
stress     ``data[stress_key]`` or ``data["__info__"][stress_key]``, else its ``stress``
virials    ``data[virials_key]`` or ``data["__info__"][virials_key]``
=========  ===============================================================================

``config_type``, ``config_weight`` and the ``config_*_weight`` keys come from
``key_value_pairs`` (or ``data["__info__"]``), as mace's readers take them. Arrays may be
stored as plain lists (fairchem's orjson writer) or in ASE's JSON form
``{"__ndarray__": [shape, dtype, values]}`` (``ase.db`` and ``ase-db-backends``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from workbench.data.keys import LabelKeys, as_matrix
from workbench.limits import MAX_Z

#: dtypes an encoded array may declare (anything else is refused, never evaluated)
_DTYPES = {"int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "float64", "float32", "bool"}


def decode_arrays(obj: object) -> object:
    """``obj`` with every ``{"__ndarray__": [shape, dtype, flat]}`` turned into a numpy array."""
    if isinstance(obj, dict):
        if "__ndarray__" in obj and len(obj) == 1:
            shape, dtype, flat = obj["__ndarray__"]
            if dtype not in _DTYPES:
                raise ValueError(f"an array of dtype {str(dtype)[:20]!r}, which no structure field has")
            return np.asarray(flat, dtype=dtype).reshape(shape)
        return {k: decode_arrays(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_arrays(v) for v in obj]
    return obj


def _field(row: Mapping, name: str, dtype, shape: tuple | None, default=None) -> np.ndarray:
    value = row.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"no {name}")
        return default
    try:
        out = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):
        raise ValueError(f"{name} is not an array of {np.dtype(dtype).name}") from None
    if shape is not None and out.shape != shape:
        raise ValueError(f"{name} has shape {out.shape}, expected {shape}")
    return out


def _numbers(row: Mapping) -> np.ndarray:
    z = _field(row, "numbers", np.int64, None)
    if z.ndim != 1 or z.size == 0:
        raise ValueError(f"numbers has shape {z.shape}: a structure needs at least one atom")
    bad = np.flatnonzero((z < 1) | (z > MAX_Z))
    if bad.size:
        raise ValueError(f"atom {int(bad[0])} has atomic number {int(z[bad[0]])}, outside 1-{MAX_Z}")
    return z


def row_atoms(row: Mapping, keys: LabelKeys):
    """One decoded row (:func:`decode_arrays` applied) as ``ase.Atoms`` with the labels under
    ``keys``; ``ValueError`` names the field that is missing or malformed."""
    import ase

    z = _numbers(row)
    n = z.size
    atoms = ase.Atoms(
        numbers=z,
        positions=_field(row, "positions", np.float64, (n, 3)),
        cell=_field(row, "cell", np.float64, (3, 3), np.zeros((3, 3))),
        pbc=_field(row, "pbc", bool, (3,), np.zeros(3, dtype=bool)),
    )
    kvp, data = row.get("key_value_pairs") or {}, row.get("data") or {}
    if not isinstance(kvp, dict) or not isinstance(data, dict):
        raise ValueError("key_value_pairs and data must be mappings")
    extra_info, extra_arrays = data.get("__info__") or {}, data.get("__arrays__") or {}
    for name, value in (*extra_info.items(), *kvp.items()):
        atoms.info[str(name)] = value
    for name, value in extra_arrays.items():
        if np.shape(value)[:1] == (n,):
            atoms.arrays[str(name)] = np.asarray(value)
    _labels(atoms, row, data, keys)
    return atoms


def _labels(atoms, row: Mapping, data: dict, keys: LabelKeys) -> None:
    info, arrays = atoms.info, atoms.arrays
    if keys.energy not in info and row.get("energy") is not None:
        info[keys.energy] = row["energy"]
    if keys.forces not in arrays:
        forces = data.get(keys.forces, row.get("forces"))
        if forces is not None:
            arrays[keys.forces] = _field({"forces": forces}, "forces", np.float64, (len(atoms), 3))
    for key, result in ((keys.stress, "stress"), (keys.virials, None)):
        value = data.get(key, info.get(key))
        if value is None and result is not None:
            value = row.get(result)
        if value is not None:
            try:
                info[key] = as_matrix(value)
            except ValueError as exc:
                raise ValueError(f"{key} {exc}") from None
