"""ASE rows in LMDB: fairchem's ``.aselmdb`` (OMat24, OMol25) and mace-torch's LMDB datasets.

Both write the same file (``lmdb`` with ``subdir=False``): each row under its id as ASCII
(``b"1"``, ``b"2"``, ...), its value zlib-compressed JSON of the ASE row (fairchem and mace use
orjson, ``ase-db-backends`` ASE's own JSON), and bookkeeping under ``nextid``, ``deleted_ids``
and ``metadata``. A frame is a row, in id order; a folder stands for its files in sorted order,
as fairchem's ``AseDBDataset`` and mace's ``LMDBDataset`` read them.

Read here with ``lmdb`` and a JSON decoder only: nothing is unpickled, a row that decompresses
beyond :data:`MAX_ROW_BYTES` is refused, and every bad row is named by file, frame and id
(:mod:`workbench.data.formats.ase_rows` maps the row's fields onto the labels).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

from workbench.data.errors import StructureError
from workbench.data.formats.ase_db import sniff
from workbench.data.formats.ase_rows import decode_arrays, row_atoms
from workbench.data.formats.base import Format
from workbench.data.keys import LabelKeys

#: the largest decompressed row accepted: far above any structure (a 10k-atom row is ~1 MB)
MAX_ROW_BYTES = 256 * 2**20


def _open(path: Path):
    import lmdb

    try:
        return lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False, max_readers=1)
    except lmdb.Error as exc:
        raise StructureError(path, None, f"cannot open as LMDB ({type(exc).__name__}: {exc})") from None


def decode_row(raw: bytes) -> dict:
    """One stored row: zlib, then JSON (never pickle); ``ValueError`` says what is wrong."""
    import orjson

    inflate = zlib.decompressobj()
    try:
        text = inflate.decompress(raw, MAX_ROW_BYTES)
    except zlib.error as exc:
        raise ValueError(f"not zlib-compressed ({exc})") from None
    if inflate.unconsumed_tail:
        raise ValueError(f"decompresses to more than {MAX_ROW_BYTES // 2**20} MiB")
    try:
        row = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        try:  # ASE's own encoder writes NaN and Infinity, which strict JSON (orjson) refuses
            row = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not a row")
    return decode_arrays(row)  # type: ignore[return-value]


class AseLmdbFormat(Format):
    """fairchem's ASE-LMDB files (``.aselmdb``), or a folder of them (how OMat24 ships)."""

    name = "aselmdb"
    summary = "fairchem ASE-LMDB (.aselmdb; a folder of them, as OMat24 and OMol25 ship)"
    suffixes = (".aselmdb",)
    folder_suffixes = (".aselmdb",)
    names_handles = True

    def claims(self, path: Path) -> bool:
        # a folder that also holds .lmdb files is mace's (which reads both kinds): none is left out
        if path.is_dir() and any(q.suffix.lower() == ".lmdb" for q in path.iterdir()):
            return False
        return super().claims(path)

    def check(self, path: Path) -> None:
        if sniff(path) != "lmdb":
            raise StructureError(path, None, "is not an LMDB file (no LMDB meta page at its start)")

    def handle_name(self, handle: object) -> str:
        return f"row id {handle}"

    def listing(self, path: Path) -> list[int]:
        """The row ids, ascending: every all-digit key (the bookkeeping keys are words)."""
        import lmdb

        self.check(path)
        env = _open(path)
        try:
            with env.begin(buffers=False) as txn:
                keys = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        except lmdb.Error as exc:
            raise StructureError(path, None, f"cannot read as LMDB ({type(exc).__name__}: {exc})") from None
        finally:
            env.close()
        ids = sorted(int(k) for k in keys if k.isdigit())
        if not ids:
            raise StructureError(path, None, "holds no rows (no numeric keys): an empty database")
        return ids

    def read(self, path: Path, first: int, payload: object, keys: LabelKeys) -> list[tuple[int, object]]:
        import lmdb

        ids: Sequence[int] = payload  # type: ignore[assignment]
        out: list[tuple[int, object]] = []
        env = _open(path)
        try:
            with env.begin() as txn:
                for k, row_id in enumerate(ids):
                    try:
                        raw = txn.get(str(row_id).encode("ascii"))
                        if raw is None:
                            raise ValueError("is gone from the database")
                        out.append((first + k, row_atoms(decode_row(raw), keys)))
                    except (ValueError, TypeError, KeyError, lmdb.Error) as exc:  # a damaged page too
                        reason = str(exc).replace("\n", " ")[:200]
                        out.append((first + k, StructureError(path, first + k, f"row id {row_id}: {reason}")))
        finally:
            env.close()
        return out

    def write(self, path: Path, structures: Sequence, keys: LabelKeys) -> Path:
        from workbench.data.formats.ase_write import write_rows

        return write_rows(path, structures, keys, "aselmdb")


class MaceLmdbFormat(AseLmdbFormat):
    """mace-torch's LMDB datasets: ``.lmdb`` files of the same rows, or a folder of them (mace
    takes a folder named ``*_lmdb`` or holding ``.lmdb`` files)."""

    name = "mace-lmdb"
    summary = "mace-torch LMDB (.lmdb; a folder of them, or named *_lmdb)"
    suffixes = (".lmdb",)
    folder_suffixes = (".lmdb", ".aselmdb")

    def claims(self, path: Path) -> bool:
        if path.name.endswith("_lmdb") and not path.exists():  # mace's naming, for a folder to be written
            return True
        return (path.is_dir() and bool(self.folder_files(path))) or (not path.is_dir() and super().claims(path))

    def write(self, path: Path, structures: Sequence, keys: LabelKeys) -> Path:
        """A folder (``path``, best named ``*_lmdb``) holding one ``data.lmdb`` of the rows."""
        from workbench.data.formats.ase_write import write_rows

        path.mkdir(parents=True, exist_ok=True)
        write_rows(path / "data.lmdb", structures, keys, "aselmdb")
        return path
