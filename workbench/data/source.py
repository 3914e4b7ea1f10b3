"""What a run trains on, as one typed value.

A ``dataset`` setting is a path whose meaning used to be decided wherever it was read. It is
resolved once, here, into one of three kinds:

* ``"embedded"``: no path given, the mixture shipped with the package (:data:`EMBEDDED_PATH`);
* ``"structures"``: a structure file or folder in any format of :mod:`workbench.data.formats`
  (extxyz, mace HDF5, ASE ``.db``, ``.aselmdb``, mace LMDB, ...), read whole into memory;
* ``"prepared"``: a directory written by ``workbench data prepare`` (:mod:`workbench.data.store`),
  read graph by graph.

>>> data_source(None).kind
'embedded'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SOURCE_KINDS = ("embedded", "structures", "prepared")


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset: its ``kind`` (one of :data:`SOURCE_KINDS`) and ``path``."""

    kind: str
    path: Path

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"data source kind {self.kind!r}: choose one of {', '.join(SOURCE_KINDS)}")

    @property
    def in_memory(self) -> bool:
        """True when every structure is read up front (a file, or the embedded mixture)."""
        return self.kind != "prepared"

    def label(self) -> str:
        """How run records and reports name this source."""
        return "embedded mixture" if self.kind == "embedded" else str(self.path)


def data_source(dataset: str | os.PathLike | None, field: str = "dataset") -> DataSource:
    """Resolve a ``dataset`` setting: ``None`` is the embedded mixture, a directory must be a
    finished prepared dataset, anything else is a structure file (its reader reports a missing
    or malformed file). ``field`` names the setting in errors."""
    if dataset is None:
        from workbench.data.embedded import EMBEDDED_PATH

        return DataSource("embedded", EMBEDDED_PATH)
    text = os.fspath(dataset)
    if not text.strip():
        raise ValueError(
            f"{field}: an empty path; leave it unset for the embedded mixture, or give a structure file "
            "or a prepared dataset directory"
        )
    path = Path(text).expanduser()
    if path.is_dir():
        from workbench.data.formats import FORMATS
        from workbench.data.store import MANIFEST

        if (path / MANIFEST).is_file():  # a manifest, even a broken one: the store names what is wrong
            return DataSource("prepared", path)
        if any(fmt.claims(path) for fmt in FORMATS.values()):  # a folder of mace shards or LMDB files
            return DataSource("structures", path)
        raise ValueError(
            f"{path}: a directory, but not a finished prepared dataset (nor a folder of structure files); "
            f"create one with 'workbench data prepare SRC... --out {path}' (or run that again to resume)"
        )
    return DataSource("structures", path)
