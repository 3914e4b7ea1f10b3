"""Reading and writing structures in any format of :mod:`workbench.data.formats`, with validation.

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
from workbench.data.keys import ENERGY_KEY, FORCES_KEY, STRESS_KEY, VIRIALS_KEY, as_matrix

MIN_DISTANCE = 0.5  # Å; closer atoms are a corrupted frame, not chemistry
MAX_ENERGY_PER_ATOM = 1.0e7  # eV; all-electron total energies of the heaviest atoms are ~1e6
MAX_FORCE = 1.0e6  # eV/Å
MAX_STRESS = 1.0e3  # eV/Å³ (160 TPa; DFT stresses stay below ~1 eV/Å³)

__all__ = [
    "StructureError",
    "check_geometry",
    "check_labels",
    "check_tensor_label",
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
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
) -> None:
    """Raise :class:`StructureError` if ``atoms`` cannot be trained on.

    Checks: at least one atom; atomic numbers 1-118; finite positions (and cell) within a sane
    extent (:func:`check_geometry`); no two atoms closer than ``min_distance`` Å (periodic
    images included); and, when ``require_labels`` and the frame is not marked
    ``info["labelled"] = False``, a finite scalar ``info[energy_key]`` and a finite
    ``(n_atoms, 3)`` ``arrays[forces_key]``, and a well-formed stress and virial label where
    present (:func:`check_labels`).
    """
    check_geometry(atoms, path=path, frame=frame)
    if len(atoms) > 1:
        from workbench.data.neighbours import neighbour_stats

        nb = neighbour_stats(atoms.positions, atoms.cell.array, atoms.pbc, 0.0, min_distance)
        if nb.closest is not None:
            raise close_pair_error(*nb.closest, nb.close_pairs, min_distance, path=path, frame=frame)
    if require_labels and _is_labelled(atoms):
        keys = dict(energy_key=energy_key, forces_key=forces_key, stress_key=stress_key, virials_key=virials_key)
        check_labels(atoms, path=path, frame=frame, **keys)


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
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
) -> None:
    """A finite scalar ``info[energy_key]`` and finite ``(n_atoms, 3)`` ``arrays[forces_key]``;
    a stress or virial label, when present, of a shape :func:`~workbench.data.keys.as_matrix`
    reads and finite (:func:`check_tensor_label`). Stress and virials may be absent: such a
    graph is left out of their loss terms, never trained towards zero."""
    _check_energy(atoms, path, frame, energy_key)
    _check_forces(atoms, path, frame, forces_key)
    for key, kind in ((stress_key, "stress"), (virials_key, "virials")):
        check_tensor_label(atoms, key, kind, path=path, frame=frame)


def _check_energy(atoms: ase.Atoms, path, frame, energy_key: str) -> None:
    n = len(atoms)
    if energy_key not in atoms.info:
        raise StructureError(
            path, frame, f"missing energy label info[{energy_key!r}] (keys present: {sorted(atoms.info)})"
        )
    try:
        energy = float(atoms.info[energy_key])
    except (TypeError, ValueError):
        raise StructureError(
            path, frame, f"energy label {energy_key!r} is not a number: {str(atoms.info[energy_key])[:80]!r}"
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


def _check_forces(atoms: ase.Atoms, path, frame, forces_key: str) -> None:
    n = len(atoms)
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


#: eV per atom: a virial beyond this is a corrupted label or the wrong unit
MAX_VIRIAL_PER_ATOM = 1.0e4


def check_tensor_label(
    atoms: ase.Atoms, key: str, kind: str, *, path: str | os.PathLike | None = None, frame: int | None = None
) -> np.ndarray | None:
    """``info[key]`` as a 3x3 matrix (``kind``: ``"stress"`` or ``"virials"``), or None when the
    frame has no such label. A label of another shape, not finite, beyond :data:`MAX_STRESS`
    (:data:`MAX_VIRIAL_PER_ATOM`), or non-zero on a structure with no periodic direction (whose
    stress mace defines as zero) raises :class:`StructureError`."""
    if key not in atoms.info:
        return None
    try:
        m = as_matrix(atoms.info[key])
    except ValueError as exc:
        raise StructureError(path, frame, f"{kind} label {key!r} {exc}") from None
    if not np.isfinite(m).all():
        raise StructureError(path, frame, f"{kind} label {key!r} is not finite: {m.ravel().tolist()}")
    bound = MAX_STRESS if kind == "stress" else MAX_VIRIAL_PER_ATOM * len(atoms)
    if np.abs(m).max() > bound:
        unit = "eV/Å³" if kind == "stress" else "eV"
        raise StructureError(
            path,
            frame,
            f"{kind} label {key!r} reaches {np.abs(m).max():.4g} {unit}, beyond {bound:g} {unit}: "
            "a corrupted label or the wrong unit (stress in eV/Å³, virials in eV)",
        )
    if not atoms.pbc.any() and np.abs(m).max() > 0:
        raise StructureError(
            path, frame, f"{kind} label {key!r} on a structure with no periodic direction (no cell volume)"
        )
    return m


def read_structures(
    path: str | os.PathLike,
    index: str | int | slice = ":",
    *,
    format: str | None = None,
    validate: bool = True,
    require_labels: bool = True,
    energy_key: str = ENERGY_KEY,
    forces_key: str = FORCES_KEY,
    stress_key: str = STRESS_KEY,
    virials_key: str = VIRIALS_KEY,
) -> list[ase.Atoms]:
    """Read every frame of ``path``: a file or folder in any format of
    :mod:`workbench.data.formats` (extxyz, mace HDF5, ASE ``.db``, ``.aselmdb``, mace LMDB, or
    anything ASE reads), found by its name unless ``format`` names it (a registry name, or an
    ASE format such as ``"vasp"``).

    Returns a list of :class:`ase.Atoms` with the labels under the given keys. With
    ``validate`` each frame goes through :func:`validate_structure`; the first problem raises a
    :class:`StructureError` naming the file and frame (0-based; a folder's frames are numbered
    across its files in order). Parsed files are cached as arrays (:mod:`workbench.data.cache`).
    """
    from workbench.data import cache as cache_mod
    from workbench.data.keys import LabelKeys

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such structure file")
    if path.is_file() and path.stat().st_size == 0:
        raise StructureError(path, None, "file is empty: it contains no structures")
    keys = LabelKeys(energy_key, forces_key, stress_key, virials_key)
    fmt = _format(path, format)
    options = (index, format, validate, require_labels, energy_key, forces_key, stress_key, virials_key)
    cache = cache_mod.cache_path(path.read_bytes(), path, options) if fmt.name in ("extxyz", "ase") else None
    frames = cache_mod.load(cache) if cache is not None else None
    if frames is not None:
        if validate:  # cheap checks again: a cache entry is not trusted blindly
            for k, atoms in enumerate(frames):
                check_geometry(atoms, path=path, frame=k)
                if require_labels and _is_labelled(atoms):
                    check_labels(atoms, path=path, frame=k, **_key_args(keys))
        return frames
    frames, origins = _read_all(path, fmt, keys)
    frames = _pick(frames, index)
    if not frames:
        raise StructureError(path, None, "file contains no structures")
    if validate:
        try:
            for k, atoms in enumerate(frames):
                validate_structure(atoms, path=path, frame=k, require_labels=require_labels, **_key_args(keys))
        except StructureError as exc:
            raise (_located(exc, origins) if index == ":" else exc) from None
    if cache is not None:
        cache_mod.save(cache, frames)
    return frames


def _key_args(keys) -> dict:
    return {
        "energy_key": keys.energy,
        "forces_key": keys.forces,
        "stress_key": keys.stress,
        "virials_key": keys.virials,
    }


def _format(path: Path, name: str | None):
    """The registry's format for ``path``; a ``name`` the registry lacks is taken as an ASE format."""
    from workbench.data import formats

    if name is None or name in formats.FORMATS:
        return formats.detect(path, name)
    from workbench.data.formats.ase_generic import AseFormat

    return AseFormat(name)


def _read_all(path: Path, fmt, keys) -> tuple[list, list]:
    """Every frame of ``path`` (a folder: of each of its files in turn), and for each frame its
    ``(file, format, frame in that file)``."""
    from workbench.data import formats

    files = formats.expand(path, fmt.name) if path.is_dir() else [(path, fmt)]
    frames: list = []
    origins: list = []
    for file, file_fmt in files:
        file_fmt.check(file)
        read = file_fmt.read_all(file, keys)
        frames += read
        origins += [(file, file_fmt, k) for k in range(len(read))]
    return frames, origins


def _located(exc: StructureError, origins: list) -> StructureError:
    """A check's error on frame ``exc.frame`` of what was read, named by its own file, its frame
    there and, in a database, its row id."""
    if exc.frame is None or not 0 <= exc.frame < len(origins):
        return exc
    file, fmt, local = origins[exc.frame]
    found = StructureError(file, local, exc.reason)
    return fmt.locate(found, list(fmt.listing(file))[local]) if fmt.names_handles else found


def _pick(frames: list, index: str | int | slice) -> list:
    from ase.io.formats import string2index

    pick = string2index(index) if isinstance(index, str) else index
    return frames[pick] if isinstance(pick, slice) else [frames[pick]]


def _clean_for_write(atoms: ase.Atoms) -> ase.Atoms:
    # Labels live in REF_* keys; an attached calculator would add a second copy under other names.
    out = atoms.copy()
    out.calc = None
    return out


def write_structures(
    path: str | os.PathLike, structures: Iterable[ase.Atoms], format: str | None = None, keys=None
) -> Path:
    """Write ``structures`` as extxyz (a ``.gz`` suffix gzips it reproducibly), or in the format
    of :mod:`workbench.data.formats` that ``format`` names or the path's suffix gives (``.db``,
    ``.aselmdb``, a ``*_lmdb`` folder); ``keys`` (:class:`~workbench.data.keys.LabelKeys`, default
    the REF_ keys) say where the structures hold their labels. A suffix of another ASE format
    (``.traj``, ``.cif``) is refused rather than filled with extxyz text.

    The gzip header carries no timestamp or file name, so the same structures
    give the same bytes on every run (the embedded dataset relies on this).
    """
    from workbench.data import formats
    from workbench.data.keys import LabelKeys

    path = Path(path)
    fmt = formats.detect(path, format)
    if fmt.name not in ("extxyz", "ase"):
        return fmt.write(path, list(structures), keys or LabelKeys())
    if fmt.name == "ase":
        _refuse_other_ase_format(path)
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


def _refuse_other_ase_format(path: Path) -> None:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    try:
        guess = ase.io.formats.filetype(name, read=False)
    except ase.io.formats.UnknownFileTypeError:
        return  # no suffix ASE knows: extxyz text, as asked
    if guess in ase.io.formats.ioformats and guess not in ("extxyz", "xyz"):
        raise StructureError(
            path,
            None,
            f"a {guess!r} file name; workbench writes extxyz (.extxyz, .xyz, .gz), ASE .db, .aselmdb and "
            "*_lmdb folders: choose one of those names",
        )


def structures_to_text(structures: Sequence[ase.Atoms]) -> str:
    """The extxyz text :func:`write_structures` would write (used to compare bit for bit)."""
    text = io.StringIO()
    ase.io.write(text, [_clean_for_write(a) for a in structures], format="extxyz")
    return text.getvalue()
