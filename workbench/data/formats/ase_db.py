"""ASE's SQLite database (``.db``), read through ``ase.db``: a frame is a row, in id order.

Labels are the rows' calculator results unless ``key_value_pairs`` or ``data`` carry the keys
asked for (:mod:`workbench.data.formats.ase_rows`). Errors name the file, the frame (0-based
position) and the row id.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from workbench.data.errors import StructureError
from workbench.data.formats.ase_rows import row_atoms
from workbench.data.formats.base import Format
from workbench.data.keys import LabelKeys

SQLITE_MAGIC = b"SQLite format 3\x00"
LMDB_MAGIC = b"\xde\xc0\xef\xbe"  # at byte 16 of an LMDB file: its first meta page


def sniff(path: Path) -> str:
    """``"sqlite"``, ``"lmdb"`` or ``"other"``: what the first bytes of ``path`` say it is."""
    with open(path, "rb") as fh:
        head = fh.read(20)
    if head.startswith(SQLITE_MAGIC):
        return "sqlite"
    return "lmdb" if head[16:20] == LMDB_MAGIC else "other"


def _row_fields(row) -> dict:
    """An ``ase.db`` row as the mapping :func:`~workbench.data.formats.ase_rows.row_atoms` reads."""
    fields = {name: row.get(name) for name in ("numbers", "positions", "cell", "pbc", "energy", "forces", "stress")}
    fields["key_value_pairs"] = dict(row.key_value_pairs)
    fields["data"] = dict(row.get("data") or {})
    return fields


class AseDbFormat(Format):
    """ASE SQLite databases, as ``ase.db.connect`` writes them."""

    name = "ase-db"
    summary = "ASE SQLite database (.db)"
    suffixes = (".db",)
    names_handles = True

    def check(self, path: Path) -> None:
        kind = sniff(path)
        if kind == "lmdb":
            raise StructureError(path, None, "is an LMDB file, not SQLite: rename it to .aselmdb")
        if kind != "sqlite":
            raise StructureError(path, None, "is not an SQLite database (ASE .db files are)")

    def handle_name(self, handle: object) -> str:
        return f"row id {handle}"

    def listing(self, path: Path) -> list[int]:
        self.check(path)
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
                return [int(r[0]) for r in con.execute("SELECT id FROM systems ORDER BY id")]
        except sqlite3.Error as exc:
            raise StructureError(path, None, f"cannot read as an ASE database ({exc})") from None

    def read(self, path: Path, first: int, payload: object, keys: LabelKeys) -> list[tuple[int, object]]:
        import ase.db

        ids: Sequence[int] = payload  # type: ignore[assignment]
        out: list[tuple[int, object]] = []
        rows = {}
        if ids:
            try:
                with ase.db.connect(path, type="db", create_indices=False, use_lock_file=False) as db:
                    rows = {r.id: r for r in db.select(f"id>={min(ids)},id<={max(ids)}")}
            except Exception as exc:  # sqlite3 and ase.db raise many types for a damaged file
                where = f"rows {min(ids)}-{max(ids)}"
                raise StructureError(path, first, f"{where}: cannot read ({type(exc).__name__}: {exc})") from None
        for k, row_id in enumerate(ids):
            try:
                if row_id not in rows:
                    raise ValueError("is gone from the database")
                out.append((first + k, row_atoms(_row_fields(rows[row_id]), keys)))
            except (ValueError, TypeError, KeyError) as exc:
                out.append((first + k, StructureError(path, first + k, f"row id {row_id}: {exc}")))
        return out

    def write(self, path: Path, structures: Sequence, keys: LabelKeys) -> Path:
        from workbench.data.formats.ase_write import write_rows

        return write_rows(path, structures, keys, "db")
