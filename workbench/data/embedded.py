"""The small dataset shipped in git: ``data/mixture.extxyz.gz``.

It is ``make_mixture(n=EMBEDDED_N, seed=EMBEDDED_SEED)`` written by
:func:`workbench.data.write_structures`; ``workbench data make`` regenerates it.

What "regenerates" means, on any CPU (the dataset card quotes these tolerances):

* species, atom count, pbc, ``config_type``, ``family_index``, ``seed`` and the set of
  info keys are identical;
* cell and positions agree to :data:`GEOMETRY_ATOL` Å (the file prints positions to
  1e-8 Å; between CPUs they differ by ~1e-13 Å, since no decision of the generators
  depends on the last bits of a float);
* energies agree to :data:`ENERGY_RTOL` relative (plus :data:`ENERGY_ATOL` eV), forces
  to :data:`FORCE_ATOL` eV/Å and stresses to :data:`STRESS_ATOL` eV/Å³: EMT, TIP3P and xTB sum
  in orders that vary with the CPU's SIMD paths, which moves the 12th–13th significant digit.

On the machine that wrote it, the same code also reproduces the file's bytes
(``workbench data make`` then compares sha256).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from workbench.switches import switch

EMBEDDED_N = 2000
EMBEDDED_SEED = 0
EMBEDDED_NAME = "mixture.extxyz.gz"


def _default_path() -> Path:
    env = switch("WORKBENCH_DATA")
    if env:
        return Path(env)
    # Editable installs and checkouts: <repo>/data next to the package.
    return Path(__file__).resolve().parents[2] / "data" / EMBEDDED_NAME


EMBEDDED_PATH: Path = _default_path()


def load_embedded(path: str | os.PathLike | None = None, validate: bool = True) -> list:
    """Read the embedded mixture (list of ``ase.Atoms``), with a hint when it is missing."""
    from workbench.data.io import read_structures

    path = Path(path) if path is not None else EMBEDDED_PATH
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: embedded dataset not found; create it with `workbench data make --out {path}` "
            "or point WORKBENCH_DATA at a copy"
        )
    return read_structures(path, validate=validate)


GEOMETRY_ATOL = 1e-7  # Å, cell and positions
ENERGY_RTOL = 1e-9
ENERGY_ATOL = 1e-9  # eV, for energies near zero
FORCE_ATOL = 1e-7  # eV/Å
STRESS_ATOL = 1e-9  # eV/Å³ (1.6e-4 GPa); the mixture's stresses are 1e-3 to 1e-1 eV/Å³

_EXACT_INFO = ("config_type", "family_index", "seed", "labelled", "calculator", "prototype")


def compare_structures(expected, actual, where: str = "") -> list[str]:
    """Differences between two ``ase.Atoms`` beyond the regeneration tolerances (empty: same).

    Each entry is one line that names ``where`` and the first offending field or atom.
    """
    import numpy as np

    tag = f"{where}: " if where else ""
    if len(expected) != len(actual):
        return [f"{tag}{len(actual)} atoms, expected {len(expected)}"]
    out = []
    if expected.get_chemical_symbols() != actual.get_chemical_symbols():
        k = next(i for i, (a, b) in enumerate(zip(expected.symbols, actual.symbols)) if a != b)
        out.append(f"{tag}species differ from atom {k} ({actual.symbols[k]}, expected {expected.symbols[k]})")
    if list(expected.pbc) != list(actual.pbc):
        out.append(f"{tag}pbc {list(actual.pbc)}, expected {list(expected.pbc)}")
    for key in _EXACT_INFO:
        if expected.info.get(key) != actual.info.get(key):
            out.append(f"{tag}info[{key!r}] = {actual.info.get(key)!r}, expected {expected.info.get(key)!r}")
    extra = set(actual.info) ^ set(expected.info)
    if extra:
        out.append(f"{tag}info keys differ: {sorted(extra)}")
    dcell = float(np.abs(actual.cell.array - expected.cell.array).max())
    if dcell > GEOMETRY_ATOL:
        out.append(f"{tag}cell differs by {dcell:.3g} Å (> {GEOMETRY_ATOL:g})")
    dpos = np.abs(actual.positions - expected.positions).max(1)
    if len(dpos) and dpos.max() > GEOMETRY_ATOL:
        out.append(
            f"{tag}positions differ by {dpos.max():.3g} Å from atom {int(np.argmax(dpos > GEOMETRY_ATOL))} "
            f"(> {GEOMETRY_ATOL:g})"
        )
    if "REF_energy" in expected.info and "REF_energy" in actual.info:
        e0, e1 = float(expected.info["REF_energy"]), float(actual.info["REF_energy"])
        if abs(e1 - e0) > ENERGY_ATOL + ENERGY_RTOL * abs(e0):
            out.append(
                f"{tag}REF_energy {e1!r}, expected {e0!r} (relative {abs(e1 - e0) / max(abs(e0), 1e-300):.2g} "
                f"> {ENERGY_RTOL:g})"
            )
    if "REF_forces" in expected.arrays and "REF_forces" in actual.arrays:
        df = np.abs(actual.arrays["REF_forces"] - expected.arrays["REF_forces"]).max(1)
        if df.max() > FORCE_ATOL:
            out.append(f"{tag}REF_forces differ by {df.max():.3g} eV/Å at atom {int(np.argmax(df))} (> {FORCE_ATOL:g})")
    if "REF_stress" in expected.info and "REF_stress" in actual.info:
        ds = float(np.abs(np.asarray(actual.info["REF_stress"]) - np.asarray(expected.info["REF_stress"])).max())
        if ds > STRESS_ATOL:
            out.append(f"{tag}REF_stress differs by {ds:.3g} eV/Å³ (> {STRESS_ATOL:g})")
    return out


#: what each frame of a mixture file carries so that it can be rebuilt from its seed
REGENERATION_KEYS = ("config_type", "family_index", "seed")


def regeneration_frames(structures: Sequence, per_family: int = 2, skip: Sequence[str] = ("al_hcl",)) -> list[int]:
    """Frame numbers of the first ``per_family`` frames of each family not in ``skip``.

    al_hcl's frame needs ~2 minutes of GFN1-xTB, so it is skipped by default.
    """
    seen: dict[str, int] = {}
    picks = []
    for k, a in enumerate(structures):
        fam = a.info["config_type"]
        if fam in skip or seen.get(fam, 0) >= per_family:
            continue
        seen[fam] = seen.get(fam, 0) + 1
        picks.append(k)
    return picks


def check_regeneration(
    path: str | os.PathLike | None = None, per_family: int = 2, skip: Sequence[str] = ("al_hcl",)
) -> tuple[int, list[str]]:
    """Rebuild frames of the shipped file from their seeds and compare within the tolerances.

    Returns ``(frames checked, problems)``; an empty problem list means the file regenerates.
    """
    from workbench.data.chemical_families import FAMILY_NAMES
    from workbench.data.synth.generators import generate

    path = Path(path) if path is not None else EMBEDDED_PATH
    structures = load_embedded(path, validate=False)
    for k, a in enumerate(structures):
        missing = [key for key in REGENERATION_KEYS if key not in a.info]
        if missing or a.info["config_type"] not in FAMILY_NAMES:
            what = (
                f"no {', '.join(missing)}" if missing else f"family {a.info['config_type']!r} is not a mixture family"
            )
            raise ValueError(
                f"{path}, frame {k}: {what}; verify rebuilds frames of a mixture written by 'workbench data make' "
                "from their seeds (for a prepared dataset, give its directory)"
            )
    picks = regeneration_frames(structures, per_family, skip)
    problems = []
    for k in picks:
        a = structures[k]
        again = generate(
            a.info["config_type"], a.info["family_index"], a.info["seed"], labelled=bool(a.info.get("labelled", True))
        )
        problems += compare_structures(a, again, where=f"{path.name}, frame {k} ({a.info['config_type']})")
    return len(picks), problems
