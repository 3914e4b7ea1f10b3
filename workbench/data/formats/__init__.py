"""The structure formats, one registry: every reader of structures finds its format here.

===============  ==============================  ==============================================
name             what                            recognised by
===============  ==============================  ==============================================
``extxyz``       extended XYZ (``.gz`` too)      ``.extxyz``, ``.xyz``
``mace-h5``      mace ``preprocess_data`` HDF5   ``.h5``, ``.hdf5``; a folder of them
``ase-db``       ASE SQLite database             ``.db``
``aselmdb``      fairchem's ASE LMDB (OMat24)    ``.aselmdb``; a folder of them
``mace-lmdb``    mace-torch's LMDB datasets      ``.lmdb``; a folder of them (``.aselmdb`` too)
``ase``          anything else ASE reads         any other suffix (read only; not ``data prepare``)
===============  ==============================  ==============================================

``read_structures``, ``data prepare``, ``data info``, ``data sizes`` and ``workbench eval`` call
:func:`detect`; a new format is one module with a :class:`~workbench.data.formats.base.Format`
subclass and one line in :data:`FORMATS`.

>>> detect(Path("train.aselmdb")).name
'aselmdb'
"""

from __future__ import annotations

import os
from pathlib import Path

from workbench.data.errors import StructureError
from workbench.data.formats.ase_db import AseDbFormat
from workbench.data.formats.ase_generic import AseFormat
from workbench.data.formats.aselmdb import AseLmdbFormat, MaceLmdbFormat
from workbench.data.formats.base import Chunk, Format
from workbench.data.formats.extxyz import ExtxyzFormat
from workbench.data.formats.mace_h5 import MaceH5Format

__all__ = ["FORMATS", "Chunk", "Format", "detect", "expand", "register"]

#: name -> format; the order decides which format claims a folder first; ``ase`` takes the rest
FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add ``fmt`` under ``fmt.name`` (a second format of the same name is refused)."""
    if fmt.name in FORMATS:
        raise ValueError(f"a structure format named {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (ExtxyzFormat(), MaceH5Format(), AseDbFormat(), AseLmdbFormat(), MaceLmdbFormat(), AseFormat()):
    register(_fmt)


def detect(path: str | os.PathLike, name: str | None = None) -> Format:
    """The format of ``path``: ``name`` when given (one of :func:`format_names`), else the
    first format that claims the file by its suffix or the folder by the files it holds."""
    path = Path(path)
    if name is not None:
        if name not in FORMATS:
            raise ValueError(f"format {name!r}: choose one of {', '.join(FORMATS)}")
        return FORMATS[name]
    for fmt in FORMATS.values():
        if fmt.claims(path):
            return fmt
    if path.is_dir():
        kinds = ", ".join(f"{f.name} ({' '.join(f.folder_suffixes)})" for f in FORMATS.values() if f.folder_suffixes)
        raise StructureError(path, None, f"is a folder that holds no structure files this workbench reads: {kinds}")
    return FORMATS["ase"]


def expand(path: str | os.PathLike, name: str | None = None) -> list[tuple[Path, Format]]:
    """``path`` as the files to read, each with its format: a folder stands for its files."""
    path = Path(path)
    fmt = detect(path, name)
    if path.is_dir():
        return [(p, fmt) for p in fmt.folder_files(path)]
    return [(path, fmt)]
