r"""The E0s of a run: the per-element reference energies :math:`E0_z` a mace model adds to its
interaction energy, :math:`E = \sum_i E0_{z_i} + E_\text{int}`.

``TrainConfig.e0s`` takes mace_run_train's ``--E0s`` choices:

* ``average`` — least squares on the training split (mace's ``compute_average_E0s``), the only
  choice when training from scratch;
* ``foundation`` — the foundation model's own (fine-tuning only; the default there);
* ``estimated`` — the foundation's, corrected by least squares so that the foundation's
  predictions on the training split best match its energies (mace's ``--E0s estimated``,
  fine-tuning only; the choice for multihead fine-tuning, where ``average`` is refused);
* ``{Z: eV}`` — an explicit map, keys atomic numbers or element symbols (fine-tuning only).

When a fine-tuned model keeps elements the data lacks (``foundation_elements: all``), those keep
the foundation's E0s under every choice: nothing in the data could refit them.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.train.values import ConfigError, brief

__all__ = ["E0S_CHOICES", "check_e0s", "choose_e0s"]

E0S_CHOICES = ("foundation", "average", "estimated")


def _atomic_number(key: Any) -> int | None:
    from ase.data import atomic_numbers

    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if 1 <= key <= 118 else None
    if isinstance(key, str):
        text = key.strip()
        if text.isdigit():
            return _atomic_number(int(text))
        return atomic_numbers.get(text) or None
    return None


def check_e0s(value: Any, foundation_model: str | None) -> str | dict[int, float] | None:
    """``value`` normalised (a choice, or ``{Z: eV}`` sorted by Z with float values); a
    :class:`ConfigError` naming ``TrainConfig.e0s`` for anything else."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"TrainConfig.e0s: {why}")

    if value is None:
        return None
    if isinstance(value, str):
        choice = value.strip().lower()
        if choice not in E0S_CHOICES:
            raise bad(f"{brief(value)} is not one of {', '.join(E0S_CHOICES)}, or a map {{Z: eV}}")
        if choice in ("foundation", "estimated") and not foundation_model:
            raise bad(f"{choice!r} starts from the E0s of foundation_model, which is not set")
        return choice
    if not isinstance(value, dict) or not value:
        raise bad(
            f"expected foundation, average, estimated or a map {{Z: eV}} like {{1: -13.6, 8: -2041.8}}, got {brief(value)}"
        )
    if not foundation_model:
        raise bad("an explicit map applies to fine-tuning (foundation_model); a run from scratch fits them (average)")
    out: dict[int, float] = {}
    for key, energy in value.items():
        z = _atomic_number(key)
        if z is None:
            raise bad(f"{brief(key)} is not an element (an atomic number 1-118 or a symbol like Cu)")
        if isinstance(energy, bool) or not isinstance(energy, (int, float)) or not math.isfinite(energy):
            raise bad(f"element {brief(key)}: {brief(energy)} is not a finite energy in eV")
        if z in out:
            raise bad(f"element {z} is given twice")
        out[z] = float(energy)
    return dict(sorted(out.items()))


def choose_e0s(
    spec: str | dict[int, float] | None, zs: list[int], fitted: dict[int, float], foundation: dict[int, float] | None
) -> list[float]:
    """The E0s of a model over elements ``zs``: ``fitted`` (least squares on the training data,
    its elements only), the foundation's, or the explicit map, per :data:`E0S_CHOICES`."""
    from ase.data import chemical_symbols

    if foundation is None:  # from scratch: always the fit
        return [float(fitted.get(z, 0.0)) for z in zs]
    choice = "foundation" if spec is None else spec
    out = []
    for z in zs:
        if isinstance(choice, dict) and z in choice:
            out.append(choice[z])
        elif choice == "average" and z in fitted:
            out.append(float(fitted[z]))
        elif isinstance(choice, dict) and z in fitted:
            raise ConfigError(
                f"TrainConfig.e0s: no energy for {chemical_symbols[z]} (Z={z}), which the training data holds; "
                "give every element of the data, or use foundation or average"
            )
        else:
            out.append(float(foundation[z]))
    return out
