r"""The label keys and the shapes a stress or virial label may take.

Labels live under these keys whatever format they came from (extxyz ``info`` / ``arrays``;
the database formats map their calculator results onto them, :mod:`workbench.data.formats`):

================  =========  ======================================================
key               where      meaning
================  =========  ======================================================
``REF_energy``    info       total energy, eV
``REF_forces``    arrays     forces, eV/Å, ``(n_atoms, 3)``
``REF_stress``    info       stress, eV/Å³: ASE's sign (``atoms.get_stress()``)
``REF_virials``   info       virials, eV: :math:`W = -\sigma V` (mace's convention)
================  =========  ======================================================

A stress or virial label is a 3x3 matrix, the 6 Voigt components
:math:`(xx, yy, zz, yz, xz, xy)` (what ``atoms.get_stress()`` returns), or 9 numbers in row
order, as ASE's extxyz reader gives them; :func:`as_matrix` turns each into the 3x3 matrix mace
trains on (``mace.tools.torch_tools.voigt_to_matrix`` reads the same three shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ENERGY_KEY = "REF_energy"
FORCES_KEY = "REF_forces"
STRESS_KEY = "REF_stress"
VIRIALS_KEY = "REF_virials"

#: info keys of per-configuration loss weights mace reads (``config_{name}_weight``)
STRESS_WEIGHT_KEY = "config_stress_weight"
VIRIALS_WEIGHT_KEY = "config_virials_weight"

#: the Voigt order of ASE and mace: xx, yy, zz, yz, xz, xy
VOIGT_PAIRS = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))


@dataclass(frozen=True)
class LabelKeys:
    """Where a reader puts (and a check looks for) each label."""

    energy: str = ENERGY_KEY
    forces: str = FORCES_KEY
    stress: str = STRESS_KEY
    virials: str = VIRIALS_KEY


def as_matrix(value: object) -> np.ndarray:
    """A stress or virial label as a float64 3x3 matrix: from a 3x3 matrix, the 6 Voigt
    components (xx, yy, zz, yz, xz, xy) or 9 numbers in row order. ``ValueError`` names the
    shape it got; values are not checked for finiteness here."""
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"is not numeric: {str(value)[:60]!r}") from None
    if a.shape == (3, 3):
        return a.copy()
    if a.shape == (9,):
        return a.reshape(3, 3).copy()
    if a.shape == (6,):
        out = np.empty((3, 3))
        for k, (i, j) in enumerate(VOIGT_PAIRS):
            out[i, j] = out[j, i] = a[k]
        return out
    raise ValueError(f"has shape {a.shape}; expected 3x3, 6 Voigt components (xx yy zz yz xz xy) or 9 numbers")
