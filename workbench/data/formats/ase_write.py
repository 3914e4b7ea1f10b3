"""Structures into an ASE database (SQLite, or ASE-LMDB through ``ase-db-backends``), labelled the
way DFT databases are: energy, forces and stress as calculator results, the rest as key-value
pairs (``data["__info__"]`` for what ASE refuses as one), virials under ``data``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from workbench.data.errors import StructureError
from workbench.data.keys import VOIGT_PAIRS, LabelKeys, as_matrix


def _split_info(info: dict, skip: set[str]) -> tuple[dict, dict]:
    """``(key_value_pairs, the rest)``: what ``ase.db`` takes as a key-value pair, and what it refuses."""
    from ase.db.core import check

    kvp, rest = {}, {}
    for key, value in info.items():
        if key in skip:
            continue
        try:
            check({key: value})
        except ValueError:
            rest[key] = value
        else:
            kvp[key] = value
    return kvp, rest


def _row(atoms, keys: LabelKeys) -> tuple:
    """``(atoms with a single-point calculator, key_value_pairs, data)`` for one structure."""
    import warnings

    from ase.calculators.singlepoint import SinglePointCalculator

    out = atoms.copy()
    out.info, out.calc = {}, None
    results = {}
    if keys.energy in atoms.info:
        results["energy"] = float(atoms.info[keys.energy])
    if keys.forces in atoms.arrays:
        results["forces"] = np.asarray(atoms.arrays[keys.forces], dtype=np.float64)
    if keys.stress in atoms.info:
        m = as_matrix(atoms.info[keys.stress])
        results["stress"] = np.array([m[i, j] for i, j in VOIGT_PAIRS])  # what atoms.get_stress() gives
    for name in list(out.arrays):  # before the calculator: a later change would make its results stale
        if name not in ("numbers", "positions"):
            del out.arrays[name]
    if results:
        out.calc = SinglePointCalculator(out, **results)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ase.db warns about keys that read like chemical formulas
        kvp, rest = _split_info(atoms.info, {keys.energy, keys.stress, keys.virials})
    data = {"__info__": rest} if rest else {}
    if keys.virials in atoms.info:
        data[keys.virials] = as_matrix(atoms.info[keys.virials])
    extra = {k: v for k, v in atoms.arrays.items() if k not in ("numbers", "positions", keys.forces)}
    if extra:
        data["__arrays__"] = extra
    return out, kvp, data


def write_rows(path: Path, structures: Sequence, keys: LabelKeys, db_type: str) -> Path:
    """Write ``structures`` as the rows of a new database ``path`` (``db_type``: ``"db"`` or
    ``"aselmdb"``), into a temporary file renamed at the end: a failed write leaves nothing. An
    existing file is refused, so nothing is appended by mistake."""
    import os

    import ase.db

    path = Path(path)
    if path.exists():
        raise StructureError(path, None, "exists already; choose a new file (rows are never appended to it)")
    if db_type == "aselmdb":
        try:
            import ase_db_backends  # noqa: F401  (ASE finds its LMDB backend there)
        except ImportError:
            raise StructureError(path, None, "writing .aselmdb needs 'pip install ase-db-backends'") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with ase.db.connect(tmp, type=db_type, use_lock_file=False) as db:
            for k, atoms in enumerate(structures):
                try:
                    row, kvp, data = _row(atoms, keys)
                except (ValueError, TypeError) as exc:  # a malformed label: name the structure, write nothing
                    raise StructureError(path, k, f"cannot write its labels ({exc})") from None
                db.write(row, key_value_pairs=kvp, data=data)
        os.replace(tmp, path)
    finally:
        for left in (tmp, Path(f"{tmp}-lock")):  # LMDB's lock file goes with the temporary
            left.unlink(missing_ok=True)
    return path
