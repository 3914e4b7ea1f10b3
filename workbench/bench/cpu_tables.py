"""The text of ``workbench bench cpu``'s results (:mod:`workbench.bench.cpu`): the steps table,
the hot ops' GFLOP/s, the profile, and the other parts' lines."""

from __future__ import annotations

from workbench.bench.table import Column, render
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["format_table"]


def _steps_table(cases: list[dict]) -> str:
    def ms(key: str):
        return lambda c: c[key]["median_ms"]

    bar = Column("|", lambda c: "|")
    columns = [
        Column("model", "model", width=6, align="<"),
        Column("system", "system", width=10, align="<"),
        Column("dtype", "dtype", width=8, align="<"),
        Column("atoms", "atoms", "d", 5),
        Column("edges", "edges", "d", 6),
        bar,
        Column("MD e3nn", ms("e3nn_md"), ".1f", 8),
        Column(DEFAULT_BACKEND, ms(f"{DEFAULT_BACKEND}_md"), ".1f", 7),
        Column("x", "speedup_md", ".2f", 5),
        bar,
        Column("train e3nn", ms("e3nn_train"), ".1f", 10),
        Column(DEFAULT_BACKEND, ms(f"{DEFAULT_BACKEND}_train"), ".1f", 7),
        Column("x", "speedup_train", ".2f", 5),
        bar,
        Column("+stress e3nn", lambda c: c["e3nn_stress"]["median_ms"] if "e3nn_stress" in c else None, ".1f", 12),
        Column(
            DEFAULT_BACKEND,
            lambda c: c[f"{DEFAULT_BACKEND}_stress"]["median_ms"] if f"{DEFAULT_BACKEND}_stress" in c else None,
            ".1f",
            7,
        ),
        Column("x", lambda c: c.get("speedup_stress"), ".2f", 5),
    ]
    return render(cases, columns, rule=False)


def _ops_lines(res: dict, ops: list[dict]) -> list[str]:
    peak = res.get("peak_gflops", {})
    lines = [
        "",
        "hot ops in one numba step: ms (share of the step), GFLOP/s of the term-by-term work (program's executed) "
        f"and % of the torch.mm peak ({', '.join(f'{d} {v:.0f}' for d, v in peak.items())} GFLOP/s)",
    ]
    for c in ops:
        for step, rec in c["ops"].items():
            cells = [
                f"{name.split('_')[0]}: {r['ms']:.1f} ms ({100 * r['share']:.0f}%) {r['gflops']:.1f} "
                f"({r['program_gflops']:.1f}) {100 * r['of_peak']:.1f}%"
                for name, r in rec.items()
                if isinstance(r, dict)
            ]
            lines.append(f"  {c['model']:6} {c['system']:10} {c['dtype']:8} {step:5}  " + "; ".join(cells))
    return lines


def _profile_table(pr: dict) -> str:
    keys = [k for k in pr if k.endswith(("_md", "_train"))]
    cats = sorted({c for k in keys for c in pr[k] if c != "total_ms"})
    rows = [{"what": "total (profiled) ms", **{k: f"{pr[k]['total_ms']:.1f}" for k in keys}}]
    rows += [{"what": cat, **{k: f"{100 * pr[k].get(cat, 0.0):.1f}%" for k in keys}} for cat in cats]
    columns = [Column("", "what", width=48, align="<"), *(Column(k, k, width=12) for k in keys)]
    title = f"\nprofile ({pr['model']}, {pr['system']}, {pr['dtype']}): share of self CPU time"
    return render(rows, columns, title=title, rule=False, indent="  ")


def format_table(res: dict) -> str:
    """The steps table (ms, e3nn / numba, speed-up), the hot ops' GFLOP/s, the profile and the
    trajectory verdict, as text."""
    from workbench.bench.cpu_trajectory import trajectory_lines

    lines = []
    cases = [c for c in res["cases"] if "e3nn_md" in c]
    if cases:
        lines.append(_steps_table(cases))
    ops = [c for c in res["cases"] if "ops" in c]
    if ops:
        lines += _ops_lines(res, ops)
    if "profile" in res:
        lines.append(_profile_table(res["profile"]))
    if "trajectory" in res:
        lines += ["", *trajectory_lines(res["trajectory"])]
    if "md" in res:
        from workbench.bench.cpu_md import md_lines

        lines += md_lines(res["md"])
    if "compiled" in res:
        from workbench.bench.cpu_compiled import compiled_lines

        lines += compiled_lines(res["compiled"])
    if "families" in res:
        from workbench.bench.nequip_env import family_lines

        lines += family_lines(res["families"])
    return "\n".join(lines)
