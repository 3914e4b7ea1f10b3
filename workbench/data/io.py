"""Reading and writing structures (extxyz and anything ASE reads), with validation.

Every problem is reported as a :class:`StructureError` that names the file, the
frame and, where it applies, the atom or key, so a user can fix the input
instead of guessing. Validation never drops frames silently.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import ase
import ase.io
import ase.io.formats
import numpy as np

from workbench.data.errors import StructureError

ENERGY_KEY = "REF_energy"
FORCES_KEY = "REF_forces"
MIN_DISTANCE = 0.5  # Å; closer atoms are a corrupted frame, not chemistry
MAX_ENERGY_PER_ATOM = 1.0e7  # eV; all-electron total energies of the heaviest atoms are ~1e6
MAX_FORCE = 1.0e6  # eV/Å

__all__ = [
    "StructureError",
    "check_geometry",
    "check_labels",
    "close_pair_error",
    "read_structures",
    "validate_structure",
    "write_structures",
]


def _is_labelled(atoms: ase.Atoms) -> bool:
    # Families shipped without a calculator say so explicitly; anything else must carry labels.
    return bool(atoms.info.get("labelled", True))


def validate_structure(
    atoms: ase.Atoms,
    *,
    path: str | os.PathLike | None = None,
    frame: int | None = None,
    require_labels: bool = True,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
    min_distance: float = MIN_DISTANCE,
) -> None:
    """Raise :class:`StructureError` if ``atoms`` cannot be trained on.

    Checks: at least one atom; atomic numbers 1-118; finite positions (and cell) within a sane
    extent (:func:`check_geometry`); no two atoms closer than ``min_distance`` Å (periodic
    images included); and, when ``require_labels`` and the frame is not marked
    ``info["labelled"] = False``, a finite scalar ``info[energy_key]`` and a finite
    ``(n_atoms, 3)`` ``arrays[forces_key]``.
    """
    check_geometry(atoms, path=path, frame=frame)
    if len(atoms) > 1:
        from workbench.data.neighbours import neighbour_stats

        nb = neighbour_stats(atoms.positions, atoms.cell.array, atoms.pbc, 0.0, min_distance)
        if nb.closest is not None:
            raise close_pair_error(*nb.closest, nb.close_pairs, min_distance, path=path, frame=frame)
    if require_labels and _is_labelled(atoms):
        check_labels(atoms, path=path, frame=frame, energy_key=energy_key, forces_key=forces_key)


def close_pair_error(
    i: int,
    j: int,
    d: float,
    pairs: int,
    min_distance: float,
    *,
    path: str | os.PathLike | None = None,
    frame: int | None = None,
) -> StructureError:
    """The error for overlapping atoms: the closest pair ``(i, j, d)`` and how many pairs are too close."""
    return StructureError(
        path, frame, f"atoms {i} and {j} are {d:.3f} Å apart (< {min_distance} Å); {pairs} close pair(s) in total"
    )


#: Å. A non-periodic structure wider than this, or a periodic one with an atom this many cells
#: away, is a corrupted frame; such coordinates also overflow neighbour-list cell binning.
MAX_EXTENT = 1.0e4
MAX_CELLS_AWAY = 1.0e3


def _symbol(z: int) -> str:
    # ASE's symbol table ends at 118: a larger number has no symbol to look up.
    from ase.data import chemical_symbols

    return f"symbol {chemical_symbols[z]!r}" if 0 <= z < len(chemical_symbols) else "no such element"


def check_geometry(atoms: ase.Atoms, *, path: str | os.PathLike | None = None, frame: int | None = None) -> None:
    """Atoms present, atomic numbers 1-118, finite coordinates within :data:`MAX_EXTENT`, a
    finite cell with non-zero volume when periodic: everything a neighbour list needs."""
    n = len(atoms)
    if n == 0:
        raise StructureError(path, frame, "structure has no atoms")
    z = atoms.numbers
    bad = np.where((z < 1) | (z > 118))[0]
    if bad.size:
        k = int(bad[0])
        raise StructureError(
            path,
            frame,
            f"atom {k} has atomic number {int(z[k])} ({_symbol(int(z[k]))}); "
            "only real elements (1-118) can be trained on",
        )
    pos = atoms.get_positions()
    bad = np.where(~np.isfinite(pos).all(axis=1))[0]
    if bad.size:
        raise StructureError(
            path, frame, f"non-finite (NaN/inf) coordinates at atom {int(bad[0])} ({bad.size} atom(s) affected)"
        )
    cell = atoms.cell.array
    if not np.isfinite(cell).all():
        raise StructureError(path, frame, "non-finite (NaN/inf) cell")
    if atoms.pbc.any():
        if abs(np.linalg.det(cell)) < 1e-12:
            raise StructureError(path, frame, "periodic structure with a degenerate (zero-volume) cell")
        frac = np.linalg.solve(cell.T, pos.T).T
        far = np.where(np.abs(frac[:, atoms.pbc]).max(axis=1) > MAX_CELLS_AWAY)[0]
        if far.size:
            k = int(far[0])
            raise StructureError(
                path,
                frame,
                f"atom {k} at {pos[k].tolist()} Å lies more than {MAX_CELLS_AWAY:g} cells "
                "outside the periodic cell: corrupted coordinates",
            )
    span = pos.max(axis=0) - pos.min(axis=0)
    if (span[~atoms.pbc] > MAX_EXTENT).any():
        k = int(np.argmax(np.abs(pos - pos.mean(axis=0))[:, ~atoms.pbc].max(axis=1)))
        raise StructureError(
            path,
            frame,
            f"structure spans {float(span.max()):.3g} Å (atom {k} at {pos[k].tolist()}); "
            f"more than {MAX_EXTENT:g} Å across a non-periodic direction is corrupted coordinates",
        )


def check_labels(
    atoms: ase.Atoms,
    *,
    path: str | os.PathLike | None = None,
    frame: int | None = None,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
) -> None:
    """A finite scalar ``info[energy_key]`` and finite ``(n_atoms, 3)`` ``arrays[forces_key]``."""
    n = len(atoms)
    if energy_key not in atoms.info:
        raise StructureError(
            path, frame, f"missing energy label info[{energy_key!r}] (keys present: {sorted(atoms.info)})"
        )
    try:
        energy = float(atoms.info[energy_key])
    except (TypeError, ValueError):
        raise StructureError(
            path, frame, f"energy label {energy_key!r} is not a number: {atoms.info[energy_key]!r}"
        ) from None
    if not np.isfinite(energy):
        raise StructureError(path, frame, f"energy label {energy_key!r} is {energy}")
    if abs(energy) > MAX_ENERGY_PER_ATOM * n:
        raise StructureError(
            path,
            frame,
            f"energy label {energy_key!r} is {energy:.4g} eV for {n} atoms, beyond "
            f"{MAX_ENERGY_PER_ATOM:g} eV/atom (even all-electron totals stay below): "
            "a corrupted label or the wrong unit",
        )
    if forces_key not in atoms.arrays:
        raise StructureError(
            path,
            frame,
            f"missing forces label arrays[{forces_key!r}] (per-atom arrays present: {sorted(atoms.arrays)})",
        )
    forces = np.asarray(atoms.arrays[forces_key], dtype=float)
    if forces.shape != (n, 3):
        raise StructureError(path, frame, f"forces {forces_key!r} have shape {forces.shape}, expected ({n}, 3)")
    bad = np.where(~np.isfinite(forces).all(axis=1))[0]
    if bad.size:
        raise StructureError(path, frame, f"non-finite forces {forces_key!r} at atom {int(bad[0])}")
    big = np.abs(forces).max(axis=1)
    if big.max() > MAX_FORCE:
        k = int(np.argmax(big))
        raise StructureError(
            path,
            frame,
            f"force {forces_key!r} on atom {k} is {big[k]:.4g} eV/Å, beyond "
            f"{MAX_FORCE:g} eV/Å: a corrupted label or the wrong unit",
        )


def read_structures(
    path: str | os.PathLike,
    index: str | int | slice = ":",
    *,
    format: str | None = None,
    validate: bool = True,
    require_labels: bool = True,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
) -> list[ase.Atoms]:
    """Read every frame of ``path`` (extxyz, gzipped or not, or any ASE format).

    Returns a list of :class:`ase.Atoms`. With ``validate`` each frame goes
    through :func:`validate_structure`; the first problem raises a
    :class:`StructureError` naming the file and frame (0-based). extxyz is read frame by
    frame (:mod:`workbench.data.extxyz`), so a malformed frame is named wherever it is;
    parsed frames are cached as arrays (:mod:`workbench.data.cache`).
    """
    from workbench.data import cache as cache_mod

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such structure file")
    if path.is_dir():
        raise StructureError(path, None, "is a directory, expected a structure file")
    if path.stat().st_size == 0:
        raise StructureError(path, None, "file is empty: it contains no structures")
    raw = path.read_bytes()
    options = (index, format, validate, require_labels, energy_key, forces_key)
    cache = cache_mod.cache_path(raw, path, options)
    frames = cache_mod.load(cache) if cache is not None else None
    if frames is not None:
        if validate:  # cheap checks again: a cache entry is not trusted blindly
            for k, atoms in enumerate(frames):
                check_geometry(atoms, path=path, frame=k)
                if require_labels and _is_labelled(atoms):
                    check_labels(atoms, path=path, frame=k, energy_key=energy_key, forces_key=forces_key)
        return frames
    frames = _parse(path, raw, index, format)
    if not frames:
        raise StructureError(path, None, "file contains no structures")
    if validate:
        for k, atoms in enumerate(frames):
            validate_structure(
                atoms, path=path, frame=k, require_labels=require_labels, energy_key=energy_key, forces_key=forces_key
            )
    if cache is not None:
        cache_mod.save(cache, frames)
    return frames


def _parse(path: Path, raw: bytes, index: str | int | slice, format: str | None) -> list:
    from ase.io.formats import string2index

    from workbench.data.extxyz import is_extxyz, parse_failure, read_frames

    if is_extxyz(path, format):
        frames = read_frames(path)
        pick = string2index(index) if isinstance(index, str) else index
        return frames[pick] if isinstance(pick, slice) else [frames[pick]]
    source: object = str(path)
    if path.suffix == ".gz":
        try:
            source = io.StringIO(gzip.decompress(raw).decode())
        except (EOFError, OSError, UnicodeDecodeError) as exc:
            raise StructureError(path, None, f"cannot decompress ({type(exc).__name__}: {exc})") from None
        format = format or ase.io.formats.filetype(path.name[:-3], read=False)
    frames: list = []
    try:
        for atoms in ase.io.iread(source, index=index, format=format):
            frames.append(atoms)
    except Exception as exc:  # ASE raises many types for malformed files
        raise StructureError(path, len(frames), parse_failure(exc)) from exc
    return frames


def _clean_for_write(atoms: ase.Atoms) -> ase.Atoms:
    # Labels live in REF_* keys; an attached calculator would add a second copy under other names.
    out = atoms.copy()
    out.calc = None
    return out


def write_structures(path: str | os.PathLike, structures: Iterable[ase.Atoms]) -> Path:
    """Write ``structures`` as extxyz; a ``.gz`` suffix gzips it reproducibly.

    The gzip header carries no timestamp or file name, so the same structures
    give the same bytes on every run (the embedded dataset relies on this).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    ase.io.write(text, [_clean_for_write(a) for a in structures], format="extxyz")
    data = text.getvalue().encode()
    if path.suffix == ".gz":
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
        ):
            gz.write(data)
    else:
        path.write_bytes(data)
    return path


def structures_to_text(structures: Sequence[ase.Atoms]) -> str:
    """The extxyz text :func:`write_structures` would write (used to compare bit for bit)."""
    text = io.StringIO()
    ase.io.write(text, [_clean_for_write(a) for a in structures], format="extxyz")
    return text.getvalue()
