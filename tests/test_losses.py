"""The losses of ``TrainConfig.loss`` against mace-torch's own classes (``mace/modules/loss.py``):
the same values and gradients in float64; a graph without a stress label adds nothing to any
stress term; the registry refuses weights its loss cannot use."""

import pytest
import torch
from ase.build import bulk

from workbench.train.config import TrainConfig
from workbench.train.losses import LOSSES, build_loss, outputs_needed


def _batch(stress_everywhere: bool):
    """A mace batch of three periodic cells with EMT labels (one without stress unless
    ``stress_everywhere``), config and label weights that are not all 1, and random predictions."""
    from ase.calculators.emt import EMT
    from mace.data import AtomicData, config_from_atoms
    from mace.tools import AtomicNumberTable
    from mace.tools.torch_geometric import Batch

    from workbench.data.atomic_data import key_specification

    graphs = []
    torch.set_default_dtype(torch.float64)
    try:
        for k, reps in enumerate(((1, 1, 1), (2, 1, 1), (1, 2, 1))):
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
            atoms.rattle(0.05, seed=k)
            atoms.calc = EMT()
            atoms.info.update(REF_energy=atoms.get_potential_energy(), config_weight=1.0 + k)
            atoms.arrays["REF_forces"] = atoms.get_forces()
            if stress_everywhere or k != 1:
                atoms.info["REF_stress"] = atoms.get_stress()
                atoms.info["REF_virials"] = -atoms.get_stress(voigt=False) * atoms.get_volume()
            atoms.info["config_stress_weight"] = 0.5 if k == 2 else 1.0
            atoms.calc = None
            config = config_from_atoms(atoms, key_specification=key_specification())
            graphs.append(AtomicData.from_config(config, z_table=AtomicNumberTable([29]), cutoff=4.0))
    finally:
        torch.set_default_dtype(torch.float32)
    ref = Batch.from_data_list(graphs)
    g = torch.Generator().manual_seed(1)

    def near(t, scale):
        return (t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)).requires_grad_()

    pred = {
        "energy": near(ref.energy, 0.3),
        "forces": near(ref.forces, 0.5),
        "stress": near(ref.stress, 0.02),
        "virials": near(ref.virials, 0.5),
    }
    return ref, pred


def _mace(name: str, weights: dict):
    from mace.modules import loss as ml

    cls = {
        "weighted": ml.WeightedEnergyForcesLoss,
        "stress": ml.WeightedEnergyForcesStressLoss,
        "virials": ml.WeightedEnergyForcesVirialsLoss,
        "huber": ml.WeightedHuberEnergyForcesStressLoss,
        "universal": ml.UniversalLoss,
    }[name]
    keep = {"energy_weight", "forces_weight"} | ({"virials_weight"} if name == "virials" else set())
    keep |= {"stress_weight"} if name in ("stress", "huber", "universal") else set()
    keep |= {"huber_delta"} if name in ("huber", "universal") else set()
    return cls(**{k: v for k, v in weights.items() if k in keep})


def _value_and_grads(fn, ref, pred):
    loss = fn(ref=ref, pred=pred, ddp=False)
    return loss.detach(), torch.autograd.grad(loss, list(pred.values()), allow_unused=True)


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_is_maces_definition(name):
    """With every graph labelled the masking rule is moot: values and gradients equal mace's."""
    with torch.autograd.set_grad_enabled(True):
        torch.set_default_dtype(torch.float64)
        try:
            weights = dict(
                energy_weight=2.0, forces_weight=30.0, stress_weight=7.0, virials_weight=3.0, huber_delta=0.05
            )
            uses = LOSSES[name].uses
            config = TrainConfig(
                loss=name,
                **{
                    **weights,
                    "stress_weight": 7.0 if "stress" in uses else 0.0,
                    "virials_weight": 3.0 if "virials" in uses else 0.0,
                },
            )
            ref, pred = _batch(stress_everywhere=True)
            ours = build_loss(config)
            theirs = _mace(name, {**weights, "stress_weight": config.stress_weight})
            (a, ga), (b, gb) = _value_and_grads(ours, ref, pred), _value_and_grads(theirs, ref, pred)
        finally:
            torch.set_default_dtype(torch.float32)
    assert float(a) == pytest.approx(float(b), rel=1e-13)
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["stress", "huber", "universal", "virials"])
def test_a_graph_without_a_stress_label_adds_nothing(name):
    torch.set_default_dtype(torch.float64)
    try:
        weights = {"stress_weight": 5.0} if name != "virials" else {"virials_weight": 5.0}
        loss = build_loss(TrainConfig(loss=name, **weights))
        ref, pred = _batch(stress_everywhere=False)
        assert ref.stress_weight.tolist() == [1.0, 0.0, 0.5]
        base, grads = _value_and_grads(loss, ref, pred)
        key = "virials" if name == "virials" else "stress"
        moved = {**pred, key: pred[key].detach().clone()}
        moved[key][1] += 10.0  # the unlabelled graph's prediction, far off
        again, _ = _value_and_grads(loss, ref, {k: v.detach().requires_grad_() for k, v in moved.items()})
    finally:
        torch.set_default_dtype(torch.float32)
    assert float(again) == float(base)
    assert torch.count_nonzero(grads[list(pred).index(key)][1]) == 0
    assert torch.count_nonzero(grads[list(pred).index(key)][0]) == 9  # labelled graphs do train


def test_maces_huber_trains_unlabelled_stress_towards_zero_and_ours_does_not():
    """The one documented difference (workbench.train.losses): mace's huber ignores the weights."""
    torch.set_default_dtype(torch.float64)
    try:
        ref, pred = _batch(stress_everywhere=False)
        theirs = _mace("huber", dict(energy_weight=1.0, forces_weight=1.0, stress_weight=1.0))
        _, gb = _value_and_grads(theirs, ref, pred)
        _, ga = _value_and_grads(build_loss(TrainConfig(loss="huber", stress_weight=1.0)), ref, pred)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.count_nonzero(gb[2][1]) > 0 and torch.count_nonzero(ga[2][1]) == 0


def test_outputs_are_computed_only_for_a_term_that_trains():
    assert outputs_needed("weighted", 0.0, 0.0) == (False, False)
    assert outputs_needed("stress", 1.0, 0.0) == (True, False)
    assert outputs_needed("huber", 0.0, 0.0) == (False, False)
    assert outputs_needed("virials", 0.0, 2.0) == (False, True)
    with pytest.raises(
        ValueError, match="TrainConfig.stress_weight: loss 'stress' trains the stress; set stress_weight > 0"
    ):
        TrainConfig(loss="stress")
    with pytest.raises(
        ValueError, match="stress_weight: 1, but loss 'weighted' has no stress term; choose loss stress"
    ):
        TrainConfig(stress_weight=1.0)
    with pytest.raises(
        ValueError, match="virials_weight: 1, but loss 'stress' has no virials term; choose loss virials"
    ):
        TrainConfig(loss="stress", stress_weight=1.0, virials_weight=1.0)
    with pytest.raises(
        ValueError, match="TrainConfig.loss: 'mse' is not one of weighted, stress, virials, huber, universal"
    ):
        TrainConfig(loss="mse")
    with pytest.raises(ValueError, match="TrainConfig.huber_delta: must be"):
        TrainConfig(loss="huber", huber_delta=0)
