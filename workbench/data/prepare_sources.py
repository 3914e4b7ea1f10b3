"""The inputs of ``workbench data prepare``, framed into chunks of consecutive frames of one source.

An extxyz file (``.gz`` too) is framed line by line in C (:func:`workbench.data.extxyz.iter_frames`);
a mace ``preprocess_data`` HDF5 file is listed by its ``config_batch_N/config_M`` keys. A chunk
carries the frames' text or keys to a worker, and how many input bytes precede its end (progress).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from workbench.data.extxyz import iter_frames
from workbench.data.io import StructureError
from workbench.data.mace_h5 import mace_h5_keys

H5_SUFFIXES = (".h5", ".hdf5")


def resolve_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """Files as given; a directory stands for its ``*.h5`` / ``*.hdf5`` files (mace shards), sorted."""
    out: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in H5_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: directory holds no .h5/.hdf5 files (mace preprocess_data shards)")
            out.extend(found)
        elif p.is_file():
            if p.stat().st_size == 0:
                raise StructureError(p, None, "file is empty: it contains no structures")
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such structure file or directory")
    if not out:
        raise ValueError("data prepare: no sources given")
    return out


def fingerprint(path: Path) -> dict:
    """What identifies a source's content for a resume: resolved path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_h5(path: Path) -> bool:
    """Whether ``path`` is a mace HDF5 file (by suffix); anything else is read as extxyz."""
    return path.suffix in H5_SUFFIXES


@dataclass
class Chunk:
    """Consecutive frames of one source, the unit of work of a worker and of a shard."""

    source: int
    chunk: int
    first_frame: int
    n_frames: int
    payload: object  # extxyz: the frames' text; mace HDF5: list of (batch, config) keys
    done_bytes: int  # input bytes consumed up to the end of this chunk (progress)


def _extxyz_chunks(source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
    """Consecutive frames of an extxyz file (framed by :func:`workbench.data.extxyz.iter_frames`)."""
    texts: list[bytes] = []
    first = chunk_no = 0
    for frame, text, done in iter_frames(path):
        if not texts:
            first = frame
        texts.append(text)
        if len(texts) == shard_size:
            yield Chunk(source, chunk_no, first, len(texts), texts, done)
            chunk_no, texts = chunk_no + 1, []
    if texts:
        yield Chunk(source, chunk_no, first, len(texts), texts, path.stat().st_size)


def _h5_chunks(source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
    keys = mace_h5_keys(path)  # an empty or malformed file is named here, not in the output
    size = path.stat().st_size
    for chunk_no, k in enumerate(range(0, len(keys), shard_size)):
        part = keys[k : k + shard_size]
        yield Chunk(source, chunk_no, k, len(part), part, int(size * (k + len(part)) / max(len(keys), 1)))


def iter_chunks(paths: Sequence[Path], shard_size: int) -> Iterator[Chunk]:
    """Every chunk of every source, in input order (source, then frame)."""
    for source, path in enumerate(paths):
        yield from (_h5_chunks if is_h5(path) else _extxyz_chunks)(source, path, shard_size)
