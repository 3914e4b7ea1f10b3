"""``bench quality --finetune``'s summary: paired ratios per seed and head, naive and multihead,
and what each run keeps of the pre-training families' errors."""

import math

import pytest

from workbench.bench.finetune import FINETUNE_TOLERANCE, format_finetune, summarise_finetune


def _r(run, seed, f, e=10.0, s=1.0, head=None):
    return {"run": run, "seed": seed, "head": head, "e_mae_mev_atom": e, "f_mae_mev_a": f, "s_mae_mev_a3": s}


def _rows(drift: float = 0.0):
    rows = [_r("foundation", None, 300.0)]
    retention = [_r("foundation", None, 50.0)]
    for seed in (0, 1):
        rows += [_r("mace", seed, 200.0 + seed), _r("finetuned", seed, (200.0 + seed) * (1 + drift))]
        rows += [_r("scratch", seed, 250.0), _r("mace-mh", seed, 210.0, head="Default")]
        rows += [_r("multihead", seed, 210.0, head="Default")]
        retention += [_r("mace", seed, 120.0), _r("finetuned", seed, 120.0)]
        for run in ("mace-mh", "multihead"):
            retention += [_r(run, seed, 60.0, head="Default"), _r(run, seed, 55.0 + seed, head="pt_head")]
        for run in ("mace-heads", "heads"):  # a head per family, each family through its own head
            for family, f in (("water", 150.0 + seed), ("hea", 90.0)):
                row = _r(run, seed, f, head=family)
                rows.append({**row, "families": {family: {"f_mae_mev_a": f, "e_mae_mev_atom": 1.0}}})
            retention.append(_r(run, seed, 58.0, head="pt_head"))
    return rows, retention


def test_paired_ratios_means_and_retention():
    s = summarise_finetune(*_rows())
    assert s["paired_ratios"]["finetuned"]["f_mae_mev_a"] == [1.0] * 4  # 2 seeds x (new, pre-training)
    assert len(s["paired_ratios"]["multihead"]["f_mae_mev_a"]) == 6  # 2 seeds x (new, pt via 2 heads)
    assert s["parity"] and s["worst_ratio_deviation"] == 0.0
    assert s["means"]["finetuned"]["f_mae_mev_a"] == pytest.approx(200.5)
    assert s["finetuned_beats_scratch"] and s["finetuned_beats_foundation"]
    assert s["retention"]["via_default_head"]["foundation"]["f_mae_mev_a"] == 50.0
    assert s["retention"]["via_default_head"]["multihead"]["f_mae_mev_a"] == 60.0
    assert s["retention"]["via_pt_head"]["multihead"]["f_mae_mev_a"] == pytest.approx(55.5)
    assert math.isnan(s["retention"]["via_pt_head"]["scratch"]["f_mae_mev_a"])
    assert len(s["paired_ratios"]["heads"]["f_mae_mev_a"]) == 6  # 2 seeds x (2 family heads, pt_head)
    assert s["per_family"]["heads"]["water"]["f_mae_mev_a"] == pytest.approx(150.5)
    assert s["per_family"]["heads"]["hea"]["f_mae_mev_a"] == 90.0 and set(s["per_family"]["heads"]) == {"hea", "water"}
    assert math.isnan(s["means"]["heads"]["f_mae_mev_a"])  # no pooled error: two heads
    assert s["retention"]["via_pt_head"]["heads"]["f_mae_mev_a"] == 58.0
    text = format_finetune({"summary": s})
    assert "retention" in text and "multihead" in text and "per new family" in text


def test_a_drift_beyond_the_tolerance_breaks_parity():
    s = summarise_finetune(*_rows(drift=3 * FINETUNE_TOLERANCE))
    assert not s["parity"] and s["worst_ratio_deviation"] == pytest.approx(3 * FINETUNE_TOLERANCE)
