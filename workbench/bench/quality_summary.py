"""The verdicts of ``workbench bench quality`` and its table: parity with ``mace_run_train``
(paired seed by seed, and unpaired over seeds) and what packing costs, from the per-run rows."""

from __future__ import annotations

import numpy as np

from workbench.bench.table import Column, render

__all__ = [
    "MACE_ORDER",
    "PAIRED_SEED_TOLERANCE",
    "PARITY_TOLERANCE",
    "format_table",
    "paired_interval",
    "ratio_interval",
    "summarise",
]

PARITY_TOLERANCE = 0.05  # relative, on the means over seeds
#: paired runs (mace-order against mace_run_train): each seed's ratio within 1 ± this
PAIRED_SEED_TOLERANCE = 1e-3
#: the sampler name of ``workbench.train.mace_order`` (importing that module would import torch)
MACE_ORDER = "mace-order"


def ratio_interval(ref: dict, other: dict, q: str, level: float = 0.95, tolerance: float = PARITY_TOLERANCE) -> dict:
    r"""How well the seeds pin down ``other``'s mean over ``ref``'s for quantity ``q`` (``"e"`` or ``"f"``).

    The ratio's ``level`` confidence interval is :math:`1 + (\bar b - \bar a \pm t\,\mathrm{SE}) / \bar a`
    with Welch's standard error :math:`\mathrm{SE} = \sqrt{s_a^2/n_a + s_b^2/n_b}` and its
    Welch-Satterthwaite degrees of freedom (``ref``'s mean taken as exact). ``seeds_needed``:
    seeds per trainer for that interval to be no wider than ``±tolerance`` at the same standard
    deviations (normal quantile), so that "within 5%" can be told apart from the seed noise.
    ``ci_low``/``ci_high`` are None with fewer than two seeds on either side."""
    from scipy import stats

    a_mean, b_mean = ref[f"{q}_mean"], other[f"{q}_mean"]
    va, vb = ref[f"{q}_std"] ** 2 / ref["seeds"], other[f"{q}_std"] ** 2 / other["seeds"]
    if ref["seeds"] < 2 or other["seeds"] < 2 or va + vb == 0:
        return {"ci_low": None, "ci_high": None, "seeds_needed": None}
    se = np.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (ref["seeds"] - 1) + vb**2 / (other["seeds"] - 1))
    half = float(stats.t.ppf(0.5 + level / 2, dof) * se)
    z = float(stats.norm.ppf(0.5 + level / 2))
    pooled = (ref[f"{q}_std"] ** 2 + other[f"{q}_std"] ** 2) / 2
    needed = int(np.ceil(2 * pooled * (z / (tolerance * a_mean)) ** 2))
    return {
        "ci_low": 1 + (b_mean - a_mean - half) / a_mean,
        "ci_high": 1 + (b_mean - a_mean + half) / a_mean,
        "seeds_needed": needed,
    }


def paired_interval(
    ref_rows: list[dict], other_rows: list[dict], key: str, level: float = 0.95, tolerance: float = PARITY_TOLERANCE
) -> dict | None:
    r"""Seed-by-seed ratio ``other / ref`` of ``key`` (e.g. ``"e_mae_mev_atom"``) over the seeds both ran.

    For paired runs (same seed, batches, statistics and initial weights) the seed noise cancels
    in the ratios :math:`r_s`: their mean and its ``level`` Student-t interval
    :math:`\bar r \pm t_{n-1}\, s_r / \sqrt n` say whether the two agree within ``tolerance``
    (``met``: the interval lies inside :math:`1 \pm` ``tolerance``). None without a common seed."""
    from scipy import stats

    ref = {r["seed"]: r[key] for r in ref_rows}
    pairs = [(ref[r["seed"]], r[key]) for r in other_rows if r["seed"] in ref]
    if not pairs:
        return None
    ratios = np.array([b / a for a, b in pairs])
    mean = float(ratios.mean())
    half = (
        float(stats.t.ppf(0.5 + level / 2, ratios.size - 1) * ratios.std(ddof=1) / np.sqrt(ratios.size))
        if ratios.size > 1
        else float("nan")
    )
    low, high = mean - half, mean + half
    deviation = float(np.abs(ratios - 1).max())
    return {
        "seeds": int(ratios.size),
        "ratios": ratios.tolist(),
        "mean": mean,
        "ci_low": low,
        "ci_high": high,
        "max_deviation": deviation,
        "per_seed_met": bool(deviation <= PAIRED_SEED_TOLERANCE),
        "met": bool(ratios.size > 1 and 1 - tolerance <= low and high <= 1 + tolerance),
    }


def _paired(maces: list[dict], paired: list[dict]) -> dict:
    """The paired verdict over E and F, and S where every run has a stress error."""
    quantities = [("e", "e_mae_mev_atom"), ("f", "f_mae_mev_a")]
    if all(r.get("s_mae_mev_a3") is not None for r in maces + paired):
        quantities.append(("s", "s_mae_mev_a3"))
    got = {q: paired_interval(maces, paired, key) for q, key in quantities}
    if got["e"] is None:
        return {}
    return {
        "paired": {
            **{f"{q}_{k}": v for q, g in got.items() for k, v in g.items() if k not in ("met", "per_seed_met")},
            "quantities": [q for q, _ in quantities],
            "tolerance": PARITY_TOLERANCE,
            "seed_tolerance": PAIRED_SEED_TOLERANCE,
            "met": all(g["met"] for g in got.values()),
            "per_seed_met": all(g["per_seed_met"] for g in got.values()),
        }
    }


def summarise(rows: list[dict]) -> dict:
    """Mean and standard deviation over seeds per (trainer, sampler), and the two verdicts."""
    groups: dict[str, dict] = {}
    for r in rows:
        key = f"{r['trainer']}/{r['sampler']}"
        g = groups.setdefault(key, {"e": [], "f": []})
        g["e"].append(r["e_mae_mev_atom"])
        g["f"].append(r["f_mae_mev_a"])
    stats = {
        k: {
            "seeds": len(g["e"]),
            "e_mean": float(np.mean(g["e"])),
            "e_std": float(np.std(g["e"], ddof=1)) if len(g["e"]) > 1 else 0.0,
            "f_mean": float(np.mean(g["f"])),
            "f_std": float(np.std(g["f"], ddof=1)) if len(g["f"]) > 1 else 0.0,
        }
        for k, g in groups.items()
    }
    out: dict = {"groups": stats}
    mace = next((g for k, g in stats.items() if k.startswith("mace_run_train/")), None)
    fc = stats.get("workbench/fixed-count")
    if mace and fc:
        ratio_e, ratio_f = fc["e_mean"] / mace["e_mean"], fc["f_mean"] / mace["f_mean"]
        out["parity"] = {
            "e_ratio": ratio_e,
            "f_ratio": ratio_f,
            "tolerance": PARITY_TOLERANCE,
            "e_spread": max(mace["e_std"], fc["e_std"]) / mace["e_mean"],
            "f_spread": max(mace["f_std"], fc["f_std"]) / mace["f_mean"],
            "met": bool(abs(ratio_e - 1) <= PARITY_TOLERANCE and abs(ratio_f - 1) <= PARITY_TOLERANCE),
        }
        for q in ("e", "f"):
            out["parity"].update({f"{q}_{k}": v for k, v in ratio_interval(mace, fc, q).items()})
    paired = [r for r in rows if r["trainer"] == "workbench" and r["sampler"] == MACE_ORDER]
    maces = [r for r in rows if r["trainer"] == "mace_run_train"]
    if paired and maces:
        out.update(_paired(maces, paired))
    if fc:
        packing = {}
        for s in ("paper", "shuffled-paper"):
            g = stats.get(f"workbench/{s}")
            if g is None:
                continue
            spread_e, spread_f = max(fc["e_std"], g["e_std"]), max(fc["f_std"], g["f_std"])
            packing[s] = {
                "e_excess": g["e_mean"] - fc["e_mean"],
                "f_excess": g["f_mean"] - fc["f_mean"],
                "e_spread": spread_e,
                "f_spread": spread_f,
                "met": bool(g["e_mean"] - fc["e_mean"] <= spread_e and g["f_mean"] - fc["f_mean"] <= spread_f),
            }
        out["packing"] = packing
    return out


def _runs_table(res: dict) -> list[str]:
    fams = sorted({f for r in res["rows"] for f in r["families"]})

    def family(f: str):
        return lambda r: r["families"][f]["f_mae_mev_a"] if f in r["families"] else None

    columns = [
        Column("trainer", "trainer", width=15, align="<"),
        Column("sampler", "sampler", width=15, align="<"),
        Column("seed", "seed", width=4),
        Column("steps", "steps", width=5),
        Column("E MAE", "e_mae_mev_atom", ".1f", 7),
        Column("F MAE", "f_mae_mev_a", ".1f", 7),
        *(
            [Column("S MAE", "s_mae_mev_a3", ".2f", 7)]
            if any(r.get("s_mae_mev_a3") is not None for r in res["rows"])
            else []
        ),
        Column("", lambda r: ""),  # a wider gap before the families
        *(Column(f[:12], family(f), ".1f", 12) for f in fams),
    ]
    split = res["split"]
    lines = [
        f"Quality bench ({res['preset']}, {res['dtype']}, workbench on {res.get('backend', 'e3nn')}, "
        f"loss {res.get('loss', 'weighted')}, "
        f"{split['n_train']} train / {split['n_valid']} valid graphs, {res['steps']} steps, packers at capacity "
        f"{res['capacity']})",
        "MAE: energy meV/atom, force meV/Å, stress meV/Å³; per family: force MAE",
        render(res["rows"], columns),
    ]
    if not res.get("complete", True):
        lines.insert(1, f"PARTIAL: {len(res['rows'])} runs finished; 'workbench bench quality --resume' runs the rest")
    return lines


def _groups_table(groups: dict) -> str:
    columns = [
        Column("group", "group", width=32, align="<"),
        Column("seeds", "seeds", width=5),
        Column("E MAE mean ± sd", lambda g: f"{g['e_mean']:>10.1f} ± {g['e_std']:<5.1f}", width=18),
        Column("F MAE mean ± sd", lambda g: f"{g['f_mean']:>10.1f} ± {g['f_std']:<5.1f}", width=18),
    ]
    return render([{"group": k, **g} for k, g in groups.items()], columns, title="", rule=False)


def _parity_lines(pa: dict) -> list[str]:
    noise = all(pa.get(f"{q}_ci_low") is not None and pa[f"{q}_ci_low"] <= 1 <= pa[f"{q}_ci_high"] for q in "ef")
    verdict = (
        "met"
        if pa["met"]
        else ("not within ±5%, but inside the seed noise (both intervals hold 1)" if noise else "NOT met")
    )
    lines = [
        f"\nparity, unpaired (workbench fixed-count, its own shuffle / mace_run_train): E {pa['e_ratio']:.3f}, "
        f"F {pa['f_ratio']:.3f} (target within ±{pa['tolerance']:.0%}; seed spread E ±{pa['e_spread']:.0%}, "
        f"F ±{pa['f_spread']:.0%}): {verdict}"
    ]
    for q, name in (("e", "E"), ("f", "F")):
        if pa.get(f"{q}_ci_low") is not None:
            lines.append(
                f"  {name} ratio, 95% interval over seeds: {pa[f'{q}_ci_low']:.2f} to {pa[f'{q}_ci_high']:.2f}; "
                f"telling ±{pa['tolerance']:.0%} from the seed noise takes ~{pa[f'{q}_seeds_needed']} seeds per trainer"
            )
    return lines


def _paired_lines(pa: dict) -> list[str]:
    qs = pa.get("quantities", ["e", "f"])
    names = "/".join(q.upper() for q in qs)
    per = ", ".join("/".join(f"{r:.6f}" for r in rs) for rs in zip(*(pa[f"{q}_ratios"] for q in qs)))

    def interval(q: str) -> str:
        return f"{pa[f'{q}_ci_low']:.6f} to {pa[f'{q}_ci_high']:.6f}" if pa["e_seeds"] > 1 else "needs 2 seeds"

    means = ", ".join(f"{q.upper()} {pa[f'{q}_mean']:.6f} (95% {interval(q)})" for q in qs)
    worst = max(pa.get(f"{q}_max_deviation", float("nan")) for q in qs)
    seed_verdict = "met" if pa.get("per_seed_met") else "NOT met"
    return [
        f"\nparity, paired seed by seed (workbench mace-order / mace_run_train), per seed {names}: {per}",
        f"  {means}; target ±{pa['tolerance']:.0%}: {'met' if pa['met'] else 'NOT met'}",
        f"  largest per-seed deviation {worst:.2e} (target ±{pa.get('seed_tolerance', PAIRED_SEED_TOLERANCE):g}): "
        f"{seed_verdict}",
    ]


def format_table(res: dict) -> str:
    """The per-run table, the means over seeds and the verdicts of a quality bench's result."""
    s = res["summary"]
    lines = [*_runs_table(res), _groups_table(s["groups"])]
    if "parity" in s:
        lines += _parity_lines(s["parity"])
    if "paired" in s:
        lines += _paired_lines(s["paired"])
    for name, v in s.get("packing", {}).items():
        worse = "no worse than the seed spread" if v["met"] else "WORSE than the seed spread"
        lines.append(
            f"{name} vs fixed-count: E {v['e_excess']:+.1f} (spread {v['e_spread']:.1f}), F {v['f_excess']:+.1f} "
            f"(spread {v['f_spread']:.1f}): {worse}"
        )
    return "\n".join(lines)
