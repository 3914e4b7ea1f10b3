"""The training losses, one registry (``TrainConfig.loss``): names, what each trains, and which
of the model's outputs it needs. Nothing here imports torch; the terms live in
:mod:`workbench.train.loss_terms`.

========== ============================================ =========================================
name       trains                                       mace-torch (``mace/modules/loss.py``)
========== ============================================ =========================================
weighted   energy per atom and forces, squared errors   ``WeightedEnergyForcesLoss``
stress     ... and the stress                           ``WeightedEnergyForcesStressLoss``
virials    ... and the virials per atom                 ``WeightedEnergyForcesVirialsLoss``
huber      Huber errors of energy/atom, forces, stress  ``WeightedHuberEnergyForcesStressLoss``
universal  Huber with force-size factors and weights    ``UniversalLoss`` (MACE-MP's)
========== ============================================ =========================================

One rule differs from mace: a graph without a stress label (its stress weight is 0) adds
nothing to the stress term of ``huber`` either. mace's ``huber`` ignores the per-graph weights
and so trains such a graph's stress towards zero; with every graph labelled the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOSSES", "LossSpec", "build_loss", "check_weights", "loss_names", "outputs_needed"]


@dataclass(frozen=True)
class LossSpec:
    """One loss: its ``name``, what it trains, mace's class of the same definition, and which
    label weights (``TrainConfig.stress_weight`` / ``virials_weight``) it may use (``uses``) or
    needs above zero (``needs``)."""

    name: str
    description: str
    mace_class: str
    target: str  # "module:Class" of its torch module
    uses: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec(
            "weighted",
            "energy per atom and forces, weighted squared errors",
            "WeightedEnergyForcesLoss",
            "workbench.train.loss_terms:EnergyForcesLoss",
        ),
        LossSpec(
            "stress",
            "energy, forces and stress, weighted squared errors",
            "WeightedEnergyForcesStressLoss",
            "workbench.train.loss_terms:EnergyForcesStressLoss",
            uses=("stress",),
            needs=("stress",),
        ),
        LossSpec(
            "virials",
            "energy, forces and virials per atom, weighted squared errors",
            "WeightedEnergyForcesVirialsLoss",
            "workbench.train.loss_terms:EnergyForcesVirialsLoss",
            uses=("virials",),
            needs=("virials",),
        ),
        LossSpec(
            "huber",
            "Huber errors of energy per atom, forces and stress",
            "WeightedHuberEnergyForcesStressLoss",
            "workbench.train.loss_terms:HuberLoss",
            uses=("stress",),
        ),
        LossSpec(
            "universal",
            "Huber errors, force-size factors and per-graph weights (MACE-MP's)",
            "UniversalLoss",
            "workbench.train.loss_terms:UniversalLoss",
            uses=("stress",),
        ),
    )
}


def loss_names() -> tuple[str, ...]:
    return tuple(LOSSES)


def outputs_needed(loss: str, stress_weight: float, virials_weight: float) -> tuple[bool, bool]:
    """``(compute_stress, compute_virials)``: the model computes them only for a term that trains,
    so an energy+forces run costs what it did before stress existed."""
    spec = LOSSES[loss]
    return ("stress" in spec.uses and stress_weight > 0), ("virials" in spec.uses and virials_weight > 0)


def check_weights(loss: str, stress_weight: float, virials_weight: float) -> str | None:
    """Why these weights do not fit ``loss`` (the field to blame first), or None."""
    spec = LOSSES[loss]
    for name, weight in (("stress", stress_weight), ("virials", virials_weight)):
        if name in spec.needs and weight <= 0:
            return f"{name}_weight: loss {loss!r} trains the {name}; set {name}_weight > 0 (mace's default is 1.0)"
        if weight > 0 and name not in spec.uses:
            takes = [s.name for s in LOSSES.values() if name in s.uses]
            return (
                f"{name}_weight: {weight:g}, but loss {loss!r} has no {name} term; "
                f"choose loss {' or '.join(takes)}, or set {name}_weight to 0"
            )
    return None


def build_loss(config):
    """The torch module of ``config.loss`` with the config's term weights (imports torch)."""
    import importlib

    module, _, name = LOSSES[config.loss].target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(
        energy_weight=config.energy_weight,
        forces_weight=config.forces_weight,
        stress_weight=config.stress_weight,
        virials_weight=config.virials_weight,
        huber_delta=config.huber_delta,
    )
