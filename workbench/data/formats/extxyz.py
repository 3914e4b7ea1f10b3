"""extxyz, frame by frame: framing by atom-count lines, parsing with ASE, errors that name the frame.

ASE's ``iread(..., index=":")`` scans the whole file for frame boundaries before it yields the
first frame, so a bad atom count anywhere is reported at frame 0, and a gzip stream is
re-decompressed at every seek. Here the file is read once, as a stream (``.gz`` decompressed
on the fly): :func:`iter_frames` cuts it at the atom-count lines and checks each frame's
shape, :func:`parse_frames` hands frames to ASE's extxyz parser (a whole block at once, frame
by frame only to locate a failure), so every error names its file and 0-based frame. When the
``extxyz`` package (libAtoms' C parser) is installed, blocks of frames go through it, ~7x faster
than ASE, into the same ``ase.Atoms``; ASE takes whatever it refuses. The C parser crashes the
process on some malformed frames (one with 0 atoms segfaults), so it sees only frames that pass
:func:`_check_frame`: at least one atom, a plain comment line, exactly the declared columns.
"""

from __future__ import annotations

import gzip
import io
import itertools
import os
import re
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from workbench.data.errors import StructureError
from workbench.data.formats.base import Chunk, Format, take_calculator_labels
from workbench.data.keys import LabelKeys

EXTXYZ_SUFFIXES = (".extxyz", ".xyz")
_STREAM_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, OSError)
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\{[^}]*\}')
_KEY = re.compile(r"(?:^|\s)([A-Za-z_][\w\-:.]*)\s*=")
_PROPERTIES = re.compile(r'(?:^|\s)Properties=("[^"]*"|\S*)')
_PROPERTY_SPEC = re.compile(r"[A-Za-z_][\w\-.]*:[SRIL]:[1-9]\d*(?::[A-Za-z_][\w\-.]*:[SRIL]:[1-9]\d*)*")
# Comment lines the C parser is trusted with: key=value pairs, values bare or plainly quoted.
_PLAIN_COMMENT = re.compile(r'\s*(?:[A-Za-z_][\w\-:.]*=(?:"[^"\\]*"|[^\s"{}=\\]+)\s*)*')


def _open(path: Path):
    raw = open(path, "rb")
    if path.suffix != ".gz":
        return raw, raw
    if raw.read(2) != b"\x1f\x8b":
        raw.close()
        raise StructureError(path, None, "not a gzip file, though its name ends in .gz")
    raw.seek(0)
    return gzip.GzipFile(fileobj=raw, mode="rb"), raw


def iter_frames(path: str | os.PathLike) -> Iterator[tuple[int, bytes, int]]:
    """Yield ``(frame, text, bytes_read)`` for every frame: ``text`` is the frame's lines,
    ``bytes_read`` how far into the (compressed) file the reader is, for progress bars."""
    path = Path(path)
    f, raw = _open(path)
    frame = 0
    n = 0
    try:
        while True:
            try:
                head = f.readline()
                if head and not head.strip():
                    continue  # blank lines between frames
                if not head:
                    return
                n = _atom_count(path, frame, head, n)
                body = list(itertools.islice(f, n + 1))
            except _STREAM_ERRORS as exc:
                raise StructureError(
                    path, frame, f"compressed stream is corrupt or truncated ({type(exc).__name__}: {exc})"
                ) from None
            if len(body) < n + 1:
                raise StructureError(
                    path, frame, f"file ends inside the frame: {max(len(body) - 1, 0)} of {n} atom lines present"
                )
            for k, line in enumerate(body[1:]):
                # An atom line has >= 4 columns; a short line of digits is the next frame's count.
                if len(line) < 24 and len(line.split(maxsplit=1)) == 1 and line.strip().isdigit():
                    raise StructureError(
                        path,
                        frame,
                        f"the atom count says {n} atoms, but the frame has {k}: "
                        f"its line {k + 3} ({line.strip()[:20]!r}) starts the next frame",
                    )
            yield frame, head + b"".join(body), raw.tell()
            frame += 1
    finally:
        f.close()
        if f is not raw:
            raw.close()


def _atom_count(path: Path, frame: int, head: bytes, previous: int) -> int:
    words = head.split()
    try:
        n = int(words[0])
        if n >= 0 and len(words) == 1:
            return n
    except ValueError:
        pass
    if frame > 0 and len(words) >= 4:  # an atom line: the previous frame claimed too few atoms
        raise StructureError(
            path,
            frame - 1,
            f"the atom count says {previous} atoms, but more atom lines follow "
            f"({head.strip()[:40]!r} where the next frame should start)",
        )
    raise StructureError(path, frame, f"first line of a frame should be the atom count, got {head[:60]!r}")


def _check_comment(path: Path, frame: int, comment: str) -> None:
    keys = _KEY.findall(_QUOTED.sub('""', comment))
    seen = set()
    for key in keys:
        if key.lower() in seen:  # ASE's parser is case-insensitive for its own keys, and keeps the last
            raise StructureError(
                path,
                frame,
                f"key {key!r} appears more than once in the comment line; which value is meant is ambiguous",
            )
        seen.add(key.lower())


def _declared_columns(path: Path, frame: int, comment: str) -> int | None:
    """Columns per atom line that ``Properties`` declares; None when the comment has none."""
    found = _PROPERTIES.search(comment)
    if found is None:
        return None
    spec = found.group(1).strip('"')
    if _PROPERTY_SPEC.fullmatch(spec) is None:
        raise StructureError(
            path, frame, f"Properties={spec[:60]!r} is not a list of NAME:TYPE:COUNT (TYPE one of S, R, I, L)"
        )
    return sum(int(count) for count in spec.split(":")[2::3])


def _check_frame(path: Path, frame: int, text: str) -> bool:
    """Raise :class:`StructureError` for a frame no parser should see: no atoms, or atom lines
    whose column count differs from what ``Properties`` declares. True when the frame is plain
    enough for the C parser (which crashes the process on some malformed input)."""
    lines = text.split("\n")
    if int(lines[0].split()[0]) == 0:  # iter_frames checked the count line
        raise StructureError(path, frame, "the atom count is 0: a frame needs at least one atom")
    comment = lines[1].rstrip("\r") if len(lines) > 1 else ""
    _check_comment(path, frame, comment)
    columns = _declared_columns(path, frame, comment)
    if columns is None:
        return False
    for k, line in enumerate(lines[2 : 2 + int(lines[0].split()[0])]):
        got = len(line.split())
        if got != columns:
            raise StructureError(
                path,
                frame,
                f"cannot parse: line {k + 3} of the frame (atom {k}) has {got} columns, "
                f"but Properties declares {columns}",
            )
    return _PLAIN_COMMENT.fullmatch(comment) is not None


def _c_frames(texts: list[str]) -> list | None:
    """The frames through libAtoms' C extxyz parser (the ``extxyz`` package, ~7x faster than
    ASE's); None when it is not installed or refuses the block. An entry is None where the frame
    needs ASE's general path (calculator results or constraints)."""
    try:
        import extxyz
    except ImportError:
        return None
    fd, name = tempfile.mkstemp(suffix=".extxyz", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with os.fdopen(fd, "w") as fh:  # the C reader takes a path only
            fh.write("".join(texts))
        frames = extxyz.read_dicts(name)
    except Exception:
        return None
    finally:
        os.unlink(name)
    frames = frames if isinstance(frames, list) else [frames]
    if len(frames) != len(texts):
        return None
    return [_atoms_or_none(f) for f in frames]


def _atoms_or_none(frame):
    try:
        return _atoms(frame)
    except Exception:
        return None


def _atoms(frame):
    """``ase.Atoms`` from a C-parsed frame, as ASE's own extxyz reader would build them."""
    import ase
    from ase.calculators.calculator import all_properties
    from ase.data import atomic_numbers
    from ase.io.extxyz import REV_PROPERTY_NAME_MAP, per_config_properties

    info = {k: _as_ase_reads(v) for k, v in frame.info.items()}
    arrays = {REV_PROPERTY_NAME_MAP.get(k, k): v for k, v in frame.arrays.items()}
    if any(k in per_config_properties for k in info) or any(k in all_properties or k == "move_mask" for k in arrays):
        return None  # ASE would make a calculator or constraints of these
    if any(isinstance(v, str) and v.startswith("_JSON ") for v in info.values()):
        return None  # ASE decodes these (how it writes a 3x3 stress); the C parser keeps the string
    numbers, symbols = arrays.pop("numbers", None), arrays.pop("symbols", None)
    if (numbers is None and symbols is None) or "positions" not in arrays:
        return None
    if numbers is None:  # each distinct symbol looked up once (ASE capitalises them)
        names, inverse = np.unique(symbols, return_inverse=True)
        numbers = np.array([atomic_numbers[str(x).capitalize()] for x in names], dtype=np.int64)[inverse]
    atoms = ase.Atoms(
        numbers=numbers, positions=arrays.pop("positions"), cell=np.asarray(frame.cell).T, pbc=frame.pbc, info=info
    )  # ASE transposes Lattice
    for name, value in arrays.items():
        atoms.new_array(name, value)
    return atoms


def _as_ase_reads(value):
    # The C parser folds 9 numbers into a 3x3 in column order; ASE keeps them flat, in the order written.
    if isinstance(value, np.ndarray) and value.shape == (3, 3):
        return value.T.reshape(9)
    return value


def parse_failure(exc: Exception) -> str:
    """What a parser's exception means, for a :class:`StructureError`: an element symbol ASE does
    not know arrives as a bare ``KeyError('Xx')`` from ``ase.symbols.symbols2numbers``."""
    import traceback

    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and frames[-1].name == "symbols2numbers":
            return f"unknown chemical symbol {exc.args[0]!r}"
    return f"cannot parse ({type(exc).__name__}: {exc})"


def parse_frames(path: str | os.PathLike, first: int, frames: list[bytes]) -> list[tuple[int, object]]:
    """``[(frame, ase.Atoms or StructureError)]`` for consecutive frames starting at ``first``:
    the C parser for the frames :func:`_check_frame` passes as plain, ASE for the rest."""
    import ase.io

    path = Path(path)
    texts: list[str | None] = []
    errors: dict[int, StructureError] = {}
    plain: list[int] = []
    for k, data in enumerate(frames):
        try:
            text = data.decode("utf-8")
            if _check_frame(path, first + k, text):
                plain.append(k)
            texts.append(text)
        except UnicodeDecodeError as exc:
            texts.append(None)
            errors[k] = StructureError(path, first + k, f"not UTF-8 text at byte {exc.start} of the frame")
        except StructureError as exc:
            texts.append(None)
            errors[k] = exc
    fast = _c_frames([texts[k] for k in plain]) if plain else None
    by_frame = dict(zip(plain, fast)) if fast is not None else {}
    out: list[tuple[int, object]] = []
    for k, text in enumerate(texts):
        atoms = errors[k] if k in errors else by_frame.get(k)
        if atoms is None:
            try:
                atoms = ase.io.read(io.StringIO(text), format="extxyz")
            except Exception as exc:
                atoms = StructureError(path, first + k, parse_failure(exc))
        out.append((first + k, atoms))
    return out


def read_frames(path: str | os.PathLike, block: int = 256) -> list:
    """Every frame of an extxyz file as ``ase.Atoms``; the first bad frame raises."""
    out = []
    pending: list[bytes] = []
    first = 0
    for frame, text, _ in iter_frames(path):
        if not pending:
            first = frame
        pending.append(text)
        if len(pending) == block:
            out.extend(_unwrap(parse_frames(path, first, pending)))
            pending = []
    if pending:
        out.extend(_unwrap(parse_frames(path, first, pending)))
    return out


def _unwrap(items: list[tuple[int, object]]) -> list:
    for _, item in items:
        if isinstance(item, StructureError):
            raise item
    return [item for _, item in items]


class ExtxyzFormat(Format):
    """Extended XYZ, gzipped or not: framed here, parsed by the C parser or ASE (module docstring)."""

    name = "extxyz"
    summary = "extended XYZ (.extxyz, .xyz; .gz too)"
    suffixes = EXTXYZ_SUFFIXES

    def chunks(self, source: int, path: Path, shard_size: int) -> Iterator[Chunk]:
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

    def read(self, path: Path, first: int, payload: object, keys: LabelKeys) -> list[tuple[int, object]]:
        out = parse_frames(path, first, payload)  # type: ignore[arg-type]
        for _, atoms in out:
            if not isinstance(atoms, StructureError):
                take_calculator_labels(atoms, keys)
        return out

    def read_all(self, path: Path, keys: LabelKeys) -> list:
        frames = read_frames(path)
        for atoms in frames:
            take_calculator_labels(atoms, keys)
        return frames
