"""What every structure format provides: how to recognise it, cut it into chunks, and read them.

A format reads *frames*: the structures of one file in its own order, numbered from 0. It
returns each as ``ase.Atoms`` with the labels under the :class:`~workbench.data.keys.LabelKeys`
it is given (energy and stress in ``info``, forces in ``arrays``), or as a
:class:`~workbench.data.errors.StructureError` in its place that names the file, the frame and
the reason, so that ``data prepare --on-error skip`` can leave it out and go on.

``workbench data prepare`` runs :meth:`Format.chunks` in the main process (cheap: frame
boundaries or row keys, never labels) and :meth:`Format.read` in its workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from workbench.data.errors import StructureError
from workbench.data.keys import LabelKeys

#: frames a whole-file read takes per :meth:`Format.read` call
READ_BLOCK = 256


@dataclass
class Chunk:
    """Consecutive frames of one source, the unit of work of a worker and of a shard."""

    source: int
    chunk: int
    first_frame: int
    n_frames: int
    payload: object  # what the format's read() needs: frame texts, HDF5 keys, row ids
    done_bytes: int  # input bytes consumed up to the end of this chunk (progress)


def take_calculator_labels(atoms, keys: LabelKeys) -> None:
    """ASE's extxyz reader moves keys named like calculator results (``energy``, ``forces``,
    ``stress``) onto a calculator; where ``keys`` asks for such a name, copy the value back."""
    results = getattr(getattr(atoms, "calc", None), "results", None) or {}
    for key, where in ((keys.energy, atoms.info), (keys.forces, atoms.arrays), (keys.stress, atoms.info)):
        if key not in where and key in results:
            value = results[key]
            where[key] = float(value) if np.ndim(value) == 0 else np.array(value, dtype=np.float64)


def file_suffix(path: Path) -> str:
    """The suffix that names a file's format: ``.extxyz`` for ``x.extxyz.gz``, lower case."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).suffix


class Format:
    """One structure format. Subclasses set the class attributes and implement :meth:`listing`
    (or :meth:`chunks`) and :meth:`read`; a folder format also sets :attr:`folder_suffixes`."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: --help, errors, the README's table
    suffixes: ClassVar[tuple[str, ...]] = ()
    folder_suffixes: ClassVar[tuple[str, ...]] = ()  # a folder holding such files is this format
    preparable: ClassVar[bool] = True
    names_handles: ClassVar[bool] = False  # errors name a frame's handle (its row id), not the frame alone

    def claims(self, path: Path) -> bool:
        """Whether ``path`` (a file, or a folder) is in this format, by its name."""
        if path.is_dir():
            return bool(self.folder_suffixes) and bool(self.folder_files(path))
        return file_suffix(path) in self.suffixes

    def folder_files(self, path: Path) -> list[Path]:
        """The files of a folder this format reads, in sorted order."""
        return sorted(q for q in path.iterdir() if q.is_file() and q.suffix.lower() in self.folder_suffixes)

    def handle_name(self, handle: object) -> str | None:
        """How errors name one frame's handle (``"row id 7"``); None when the frame number says it all."""
        return None

    def locate(self, exc: StructureError, handle: object) -> StructureError:
        """``exc`` with the frame's handle named at the start of its reason (once)."""
        name = self.handle_name(handle)
        if name is None or exc.reason.startswith(f"{name}: "):
            return exc
        return StructureError(exc.path, exc.frame, f"{name}: {exc.reason}")

    def check(self, path: Path) -> None:
        """Raise :class:`StructureError` when ``path`` cannot be this format (a wrong magic number,
        an empty file): before any frame is read. The default checks nothing."""

    def listing(self, path: Path) -> Sequence:
        """A handle per frame, in frame order (row ids, HDF5 keys); a malformed file raises."""
        raise NotImplementedError

    def chunks(self, source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
        """Every chunk of ``shard_size`` consecutive frames of ``path``, in order."""
        handles = list(self.listing(path))
        size = path.stat().st_size
        for chunk_no, k in enumerate(range(0, len(handles), shard_size)):
            part = handles[k : k + shard_size]
            done = int(size * (k + len(part)) / max(len(handles), 1))
            yield Chunk(source, chunk_no, k, len(part), part, done)

    def read(self, path: Path, first: int, payload: object, keys: LabelKeys) -> list[tuple[int, object]]:
        """``[(frame, ase.Atoms or StructureError)]`` for one chunk's payload, numbered from ``first``."""
        raise NotImplementedError

    def read_all(self, path: Path, keys: LabelKeys) -> list:
        """Every frame of ``path`` as ``ase.Atoms``; the first bad frame raises its StructureError."""
        out: list = []
        for chunk in self.chunks(0, path, READ_BLOCK):
            for _, item in self.read(path, chunk.first_frame, chunk.payload, keys):
                if isinstance(item, StructureError):
                    raise item
                out.append(item)
        return out

    def write(self, path: Path, structures: Sequence, keys: LabelKeys) -> Path:
        """Write ``structures`` (labels under ``keys``) in this format; not every format writes."""
        raise StructureError(path, None, f"workbench does not write the {self.name} format")
