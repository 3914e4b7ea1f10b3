"""The inputs of ``workbench data prepare``: files in any preparable format, framed into chunks.

A source is a file; a folder stands for the files its format reads (mace HDF5 shards, ``.aselmdb``
or ``.lmdb`` files), sorted. Each format cuts its files into chunks of consecutive frames
(:meth:`~workbench.data.formats.base.Format.chunks`): extxyz is framed line by line in C, the
databases are listed by their row ids, mace HDF5 by its ``config_batch_N/config_M`` keys. A
chunk carries those to a worker, and how many input bytes precede its end (progress).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from workbench.data import formats
from workbench.data.formats import Chunk
from workbench.data.io import StructureError

__all__ = ["Chunk", "fingerprint", "format_of", "iter_chunks", "resolve_sources"]


def format_of(path: Path) -> formats.Format:
    """The format that reads the source file ``path`` (refused when ``data prepare`` cannot take it)."""
    fmt = formats.detect(path)
    if not fmt.preparable:
        takes = ", ".join(f.summary for f in formats.FORMATS.values() if f.preparable)
        raise StructureError(
            path, None, f"data prepare reads {takes}; convert this file first (workbench data convert)"
        )
    return fmt


def resolve_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """The source files, in order: files as given, a folder as its format's files, sorted."""
    out: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = [file for file, _ in formats.expand(p)]
            if not found:
                raise FileNotFoundError(f"{p}: folder holds no structure files")
            out.extend(found)
        elif p.is_file():
            if p.stat().st_size == 0:
                raise StructureError(p, None, "file is empty: it contains no structures")
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such structure file or directory")
    if not out:
        raise ValueError("data prepare: no sources given")
    for p in out:  # every file's format and magic checked before any work starts
        format_of(p).check(p)
    return out


def fingerprint(path: Path) -> dict:
    """What identifies a source's content for a resume: resolved path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def iter_chunks(paths: Sequence[Path], shard_size: int) -> Iterator[Chunk]:
    """Every chunk of every source, in input order (source, then frame)."""
    for source, path in enumerate(paths):
        yield from format_of(path).chunks(source, path, shard_size)
