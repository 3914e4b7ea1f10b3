"""Notebook 06's views of NequIP and Allegro: parity and CPU timings, measured in the NequIP
environment and shown in this one.

nequip 0.19 needs e3nn 0.6 and mace-torch pins e3nn 0.4, so the notebook's kernel (``.venv``)
cannot import nequip. The measurements run in the NequIP environment's interpreter
(:func:`nequip_python`) as subprocesses that print or write JSON:
``python -m workbench.bench.nequip_parity`` and ``workbench bench nequip``
(:func:`workbench.bench.nequip_env.run_families`).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from workbench.bench.nequip_env import NEQUIP_PYTHON_ENV, check_python, failure, named_python, run_families, run_python
from workbench.bench.table import Column, render
from workbench.switches import switch

__all__ = [
    "NEQUIP_PYTHON_ENV",
    "SETUP_HINT",
    "family_parity",
    "family_timings",
    "nequip_python",
    "parity_table",
    "timings_figure",
    "timings_table",
]

#: ``bench nequip`` settings of the notebook: both families at the tutorial config (about a minute)
NOTEBOOK_SETTINGS = {"configs": ("tutorial",), "dtypes": ("float32", "float64"), "repeat": 4, "repeats": 3}
SETUP_HINT = (
    "no NequIP environment: `make test-nequip` creates .venv-nequip beside the checkout, or set "
    f"{NEQUIP_PYTHON_ENV} to the python of an environment with `pip install 'cfm-workbench[nequip]'`"
)


def nequip_python() -> Path | None:
    """``$WORKBENCH_NEQUIP_PYTHON`` (checked), else ``.venv-nequip/bin/python`` of the checkout
    this package runs from, else None."""
    named = named_python()
    if named:
        return check_python(named, f"${NEQUIP_PYTHON_ENV}")
    beside = Path(__file__).resolve().parents[2] / ".venv-nequip" / "bin" / "python"
    return beside if beside.is_file() else None


def _tiny(tiny: bool | None) -> bool:
    return switch("WORKBENCH_NOTEBOOK_TINY") == "1" if tiny is None else tiny


def family_parity(python: str | os.PathLike | None = None, tiny: bool | None = None) -> dict:
    """:func:`workbench.bench.nequip_parity.parity_report` run by the NequIP environment
    (``{"skipped": why}`` without one; a RuntimeError saying why when it fails)."""
    python = check_python(python) if python is not None else nequip_python()
    if python is None:
        return {"skipped": SETUP_HINT}
    args = ["-m", "workbench.bench.nequip_parity", *(["--tiny"] if _tiny(tiny) else [])]
    done = run_python(python, args, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{python} {' '.join(args)} exited {done.returncode}: {failure(done)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parity_table(report: dict) -> str:
    """One row per family and quantity: the worst relative errors and whether they meet the tolerances."""
    if "skipped" in report:
        return f"parity: skipped ({report['skipped']})"
    tol = report["tolerances"]
    rows = [
        {"family": r["family"], "config": r["config"], "quantity": q, "f64": e, "f32": r["float32_vs_float64"][q]}
        for r in report["rows"]
        for q, e in r["float64"].items()
    ]
    for row in rows:
        row["ok"] = "yes" if row["f64"] <= tol["float64"] and row["f32"] <= tol["float32_vs_float64"] else "NO"
    columns = [
        Column("family", "family", align="<"),
        Column("config", "config", align="<"),
        Column("quantity", "quantity", align="<"),
        Column(f"float64 vs own (<= {tol['float64']:.0e})", "f64", ".1e"),
        Column(f"float32 vs float64 (<= {tol['float32_vs_float64']:.0e})", "f32", ".1e"),
        Column("within", "ok", align="<"),
    ]
    return render(rows, columns, title="Worst relative error, accelerated model against the family's own path")


def family_timings(python: str | os.PathLike | None = None, tiny: bool | None = None, threads: int = 2) -> dict:
    """MD and train steps of both families against their own path, run by the NequIP environment
    (the smoke settings of ``bench cpu`` when tiny)."""
    python = python if python is not None else nequip_python()
    if python is None:
        return {"skipped": SETUP_HINT}
    from workbench.bench.cpu import PRESETS

    settings = PRESETS["smoke"]["families"] if _tiny(tiny) else NOTEBOOK_SETTINGS
    return run_families(settings, threads, python)


def _label(case: dict) -> str:
    return f"{case['family']} {case['config']} {case['dtype']}"


def timings_figure(res: dict) -> Any:
    """Bars of the MD and train speedups per (family, config, dtype), with each step's bound
    (the replaced ops costing nothing) as a marker and the family targets as lines."""
    import plotly.graph_objects as go

    from workbench.bench.nequip import TARGETS
    from workbench.viz.style import style

    cases = res.get("cases", [])
    why = res.get("skipped") or res.get("error")
    x = [_label(c) for c in cases]
    fig = go.Figure()
    for step, color in (("md", "#4C78A8"), ("train", "#F58518")):
        fig.add_bar(name=f"{step} speedup", x=x, y=[c[f"speedup_{step}"] for c in cases], marker_color=color)
        bound = [c.get(f"bound_{step}") for c in cases]
        fig.add_scatter(name=f"{step} bound", x=x, y=bound, mode="markers", marker=dict(symbol="line-ew-open", size=28))
    for family, target in TARGETS.items():
        fig.add_hline(y=target, line_dash="dot", annotation_text=f"{family} target {target:g}x")
    fig.update_layout(barmode="group", yaxis_title="speedup over the family's own path (x)")
    if why:
        fig.add_annotation(text=html.escape(str(why))[:300], showarrow=False, xref="paper", yref="paper", x=0, y=1)
    return style(fig, f"NequIP and Allegro on {res.get('atoms', '?')} atoms, CPU ({res.get('edges', '?')} edges)")


def timings_table(res: dict) -> str:
    """The timings as ``bench cpu`` prints them (or why there are none)."""
    from workbench.bench.nequip_env import family_lines

    return "\n".join(family_lines(res)).strip()
