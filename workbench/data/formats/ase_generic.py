"""Any other file ASE reads (``.traj``, ``.cif``, ``.json``, ...; ``.gz`` too), read whole through
``ase.io.iread``. It is the fallback for suffixes no other format claims; ``data prepare`` does
not take it (convert such files first: ``workbench data convert``)."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

from workbench.data.errors import StructureError
from workbench.data.formats.base import Format, take_calculator_labels
from workbench.data.keys import LabelKeys


class AseFormat(Format):
    name = "ase"
    summary = "anything else ASE reads (ase.io; not for data prepare)"
    preparable = False

    def __init__(self, ase_format: str | None = None) -> None:
        self.ase_format = ase_format  # an ASE format name; None: ASE guesses from the file

    def claims(self, path: Path) -> bool:
        return False  # only the fallback of formats.detect

    def read_all(self, path: Path, keys: LabelKeys) -> list:
        import ase.io
        import ase.io.formats

        from workbench.data.formats.extxyz import parse_failure

        source: object = str(path)
        fmt = self.ase_format
        if path.suffix == ".gz":
            try:
                source = io.StringIO(gzip.decompress(path.read_bytes()).decode())
            except (EOFError, OSError, UnicodeDecodeError) as exc:
                raise StructureError(path, None, f"cannot decompress ({type(exc).__name__}: {exc})") from None
            fmt = fmt or ase.io.formats.filetype(path.name[:-3], read=False)
        frames: list = []
        try:
            for atoms in ase.io.iread(source, index=":", format=fmt):
                take_calculator_labels(atoms, keys)
                frames.append(atoms)
        except Exception as exc:  # ASE raises many types for malformed files
            raise StructureError(path, len(frames), parse_failure(exc)) from exc
        return frames
