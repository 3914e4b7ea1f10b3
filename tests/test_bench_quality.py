"""The quality bench's pieces: the split it writes, the mace_run_train command, the verdicts; valid_dataset."""

from pathlib import Path

import numpy as np
import pytest

from workbench.bench.quality import PRESETS, base_config, mace_command, write_split
from workbench.bench.quality_summary import summarise
from workbench.data.embedded import EMBEDDED_PATH
from workbench.train import TrainConfig

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")


def _small(tmp_path: Path) -> TrainConfig:
    from dataclasses import replace

    return replace(base_config(PRESETS["small"], tmp_path), max_structures=60, families=["water_clusters", "cuni"])


def test_split_files_and_valid_dataset_give_the_same_partition(tmp_path):
    from dataclasses import replace

    from workbench.data.io import read_structures
    from workbench.train.data import prepare_data

    cfg = _small(tmp_path)
    split = write_split(cfg, tmp_path / "split")
    assert (split["n_train"], split["n_valid"]) == (54, 6)
    train = read_structures(split["train"])
    valid = read_structures(split["valid"])
    # Training from the written files, validation from valid_dataset: the same graphs, none held back.
    data = prepare_data(
        replace(cfg, dataset=split["train"], valid_dataset=split["valid"], max_structures=None, families=None)
    )
    assert len(data.valid) == len(valid) and len(data.train) == len(train)
    assert sorted(data.train_atoms.tolist()) == sorted(len(a) for a in train)
    assert sorted(int(d.num_nodes) for d in data.valid) == sorted(len(a) for a in valid)
    # The written validation frames are the split's validation graphs.
    direct = prepare_data(cfg)
    key = lambda ds: np.sort([float(d.positions.sum()) for d in ds])  # noqa: E731
    assert np.allclose(key(direct.valid), key(data.valid), rtol=0, atol=1e-6)
    assert np.allclose(key(direct.train), key(data.train), rtol=0, atol=1e-6)


def test_valid_dataset_is_refused_with_a_prepared_dataset(tmp_path):
    from workbench.train.data import _from_store

    with pytest.raises(ValueError, match="valid_dataset.*structure file"):
        _from_store(TrainConfig(dataset=str(tmp_path), valid_dataset="v.extxyz"), tmp_path)


def test_mace_command_parses_with_the_installed_mace(tmp_path):
    from mace.tools import build_default_arg_parser

    cfg = _small(tmp_path)
    cmd = mace_command(cfg, {"train": "t.xyz", "valid": "v.xyz"}, tmp_path, epochs=2)
    args = build_default_arg_parser().parse_args(cmd[1:])
    assert (args.hidden_irreps, args.max_ell, args.correlation, args.num_interactions) == (
        cfg.hidden_irreps,
        cfg.max_ell,
        cfg.correlation,
        cfg.num_interactions,
    )
    assert (args.lr, args.ema_decay, args.forces_weight, args.energy_weight, args.clip_grad, args.weight_decay) == (
        cfg.lr,
        cfg.ema_decay,
        cfg.forces_weight,
        cfg.energy_weight,
        cfg.clip_grad,
        cfg.weight_decay,
    )
    assert cfg.weight_decay == 5e-7  # mace_run_train's default, on the same parameters (loop.param_groups)
    assert (args.model, args.E0s, args.default_dtype, args.batch_size, args.max_num_epochs) == (
        "ScaleShiftMACE",
        "average",
        "float64",
        8,
        2,
    )
    assert args.amsgrad and args.ema and args.r_max == cfg.cutoff and args.radial_MLP == "[32,32]"


def _rows(trainer, sampler, e, f):
    return [
        {"trainer": trainer, "sampler": sampler, "seed": k, "e_mae_mev_atom": a, "f_mae_mev_a": b}
        for k, (a, b) in enumerate(zip(e, f))
    ]


def test_verdicts_by_hand():
    rng = np.random.default_rng()
    # Seeds spread at least 1 meV apart: the "paper" rows' +0.1 excess must stay inside the spread.
    e_m, f_m = rng.uniform([50, 61, 72], [58, 69, 80]), rng.uniform([40, 47, 54], [46, 53, 60])
    rows = (
        _rows("mace_run_train", "fixed 8", e_m, f_m)
        + _rows("workbench", "fixed-count", e_m * 1.03, f_m * 0.98)
        + _rows("workbench", "paper", e_m * 1.03 - 1, f_m * 0.98 + 0.1)
        + _rows("workbench", "shuffled-paper", e_m + 50, f_m)
    )
    s = summarise(rows)
    assert s["parity"]["e_ratio"] == pytest.approx(1.03) and s["parity"]["f_ratio"] == pytest.approx(0.98)
    assert s["parity"]["met"]
    fc = s["groups"]["workbench/fixed-count"]
    assert fc["e_std"] == pytest.approx(np.std(e_m * 1.03, ddof=1))
    assert s["packing"]["paper"]["met"] and s["packing"]["paper"]["e_excess"] == pytest.approx(-1)
    assert not s["packing"]["shuffled-paper"]["met"]  # 50 meV/atom worse, far beyond the spread
    far = summarise(_rows("mace_run_train", "fixed 8", e_m, f_m) + _rows("workbench", "fixed-count", e_m * 1.06, f_m))
    assert not far["parity"]["met"]


def test_resume_keeps_finished_runs_only_under_the_same_settings(tmp_path):
    import json

    from workbench.bench.quality import _resumed_rows

    settings = {"preset": "standard", "preset_config": {"epochs": 3}, "dtype": "float64", "batch_size": 8}
    assert _resumed_rows(tmp_path, settings) is None  # nothing there: start afresh
    (tmp_path / "bench.json").write_text(json.dumps(settings))
    assert _resumed_rows(tmp_path, settings) == []
    rows = [
        {"trainer": "mace_run_train", "sampler": "fixed 8", "seed": 0, "e_mae_mev_atom": 70.5},
        {"trainer": "workbench", "sampler": "paper", "seed": 0, "e_mae_mev_atom": 68.25},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _resumed_rows(tmp_path, settings) == rows
    with pytest.raises(ValueError, match=r"settings differ \(batch_size, dtype\)"):
        _resumed_rows(tmp_path, dict(settings, dtype="float32", batch_size=4))


def _bench_result(rows: list[dict], **extra) -> dict:
    """A quality bench result of ``rows`` (10 steps each), as bench_quality writes it."""
    for r in rows:
        r.update(steps=10, families={})
    split = {"n_train": 10, "n_valid": 2}
    res = {"preset": "standard", "dtype": "float64", "split": split, "steps": 10, "capacity": 900, **extra}
    return {**res, "rows": rows, "summary": summarise(rows)}


def test_partial_bench_table_says_so():
    from workbench.bench.quality import format_table

    text = format_table(_bench_result(_rows("mace_run_train", "fixed 8", [70.0], [50.0]), complete=False))
    assert text.splitlines()[1].startswith("PARTIAL: 1 runs finished")


def test_parity_interval_matches_welch_and_sizes_the_seeds():
    """The ratio's 95% interval is Welch's interval on the difference of means (scipy's own
    ttest_ind), over the reference mean; ``seeds_needed`` is the fewest seeds per trainer whose
    interval (normal quantile, same standard deviations) fits inside ±5%."""
    from scipy import stats

    from workbench.bench.quality_summary import ratio_interval

    rng = np.random.default_rng()
    e_m, f_m = rng.uniform(50, 110, 4), rng.uniform(45, 60, 4)
    e_w, f_w = rng.uniform(50, 90, 3), rng.uniform(45, 60, 3)
    s = summarise(_rows("mace_run_train", "fixed 8", e_m, f_m) + _rows("workbench", "fixed-count", e_w, f_w))
    pa = s["parity"]
    for q, a, b in (("e", e_m, e_w), ("f", f_m, f_w)):
        lo, hi = stats.ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
        assert pa[f"{q}_ci_low"] == pytest.approx(1 + lo / a.mean()) and pa[f"{q}_ci_high"] == pytest.approx(
            1 + hi / a.mean()
        )
        assert pa[f"{q}_ci_low"] < pa[f"{q}_ratio"] < pa[f"{q}_ci_high"]
        n, sd2 = pa[f"{q}_seeds_needed"], (a.var(ddof=1) + b.var(ddof=1)) / 2

        def half(k, sd2=sd2, a=a):
            return 1.959964 * np.sqrt(2 * sd2 / k) / a.mean()

        assert half(n) <= 0.05 < half(n - 1) if n > 1 else half(n) <= 0.05
    one = ratio_interval({"seeds": 1, "e_mean": 80.0, "e_std": 0.0}, {"seeds": 3, "e_mean": 70.0, "e_std": 5.0}, "e")
    assert one == {"ci_low": None, "ci_high": None, "seeds_needed": None}


def test_paired_parity_is_a_t_interval_on_the_per_seed_ratios():
    """mace-order runs pair with mace's seed by seed: the verdict rests on the per-seed ratios'
    Student-t interval (scipy's one-sample interval), not on the spread between seeds."""
    from scipy import stats

    from workbench.bench.quality import format_table

    rng = np.random.default_rng()
    e_m, f_m = rng.uniform(50, 110, 3), rng.uniform(45, 60, 3)
    close_e, close_f = 1 + rng.uniform(-0.01, 0.01, 3), 1 + rng.uniform(-0.01, 0.01, 3)
    rows = _rows("mace_run_train", "fixed 8", e_m, f_m) + _rows("workbench", "mace-order", e_m * close_e, f_m * close_f)
    pa = summarise(rows)["paired"]
    for q, r in (("e", close_e), ("f", close_f)):
        assert pa[f"{q}_ratios"] == pytest.approx(r.tolist())
        lo, hi = stats.ttest_1samp(r, 1.0).confidence_interval(0.95)
        assert (pa[f"{q}_ci_low"], pa[f"{q}_ci_high"]) == pytest.approx((lo, hi))
    assert pa["met"] == (min(pa["e_ci_low"], pa["f_ci_low"]) >= 0.95 and max(pa["e_ci_high"], pa["f_ci_high"]) <= 1.05)
    # the seed spread (here ±30%) does not enter; a consistent 8% gap fails
    far = summarise(_rows("mace_run_train", "fixed 8", e_m, f_m) + _rows("workbench", "mace-order", e_m * 1.08, f_m))
    assert not far["paired"]["met"] and far["paired"]["e_mean"] == pytest.approx(1.08)
    # only seeds both trainers ran are paired
    part = summarise(rows[:3] + rows[3:5])["paired"]
    assert part["e_seeds"] == 2
    assert "parity, paired seed by seed" in format_table(_bench_result(rows))


def test_the_mace_order_sampler_name_matches_the_trainers():
    """The bench names mace-order without importing its module (which imports torch)."""
    from workbench.bench.quality_summary import MACE_ORDER
    from workbench.train.mace_order import NAME

    assert MACE_ORDER == NAME
