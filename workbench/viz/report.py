"""The run report: one self-contained HTML page a user would show (``report.html``).

Everything comes from the run directory (:mod:`workbench.train.rundir`,
:mod:`workbench.train.record`), so the report can be written for any run, finished or not::

    workbench report runs/demo            # -> runs/demo/report.html

Sections, top to bottom (each a ``<section id=...>``):

* ``what-ran``: model, data, ranks, sampler, capacity, dtype, backend, device, commit;
* ``summary``: cards with the final validation MAEs, throughput (graphs/s, atoms/s), padding
  waste and straggler share, each against ``fixed-count`` packing the same graphs;
* ``curves``: loss per step and validation MAE per epoch, raw and smoothed;
* ``families``: validation errors per ``config_type``;
* ``ranks``: per-rank step time split into data wait, compute and all-reduce wait;
* ``layout``: one step of the packing beside ``fixed-count``, with every family in the legend.

An input file that is broken or in an old format leaves out only what it would have given: the
page lists such files first (``problems``), each section lacking one says so, and
:func:`write_report` warns once per file (:class:`ReportInputWarning`).

plotly.js is inlined once, so the file opens offline.
"""

from __future__ import annotations

import html
import math
import os
import warnings
from pathlib import Path

import numpy as np

from workbench.viz.report_inputs import (
    Problem,
    ReportInputWarning,
    guarded_packing,
    read_epochs_checked,
    read_info,
    read_steps_checked,
)
from workbench.viz.style import panel_row, style

SMOOTHING = 0.9  # exponential moving average weight of the smoothed curves
WARMUP_STEPS = 2  # global steps left out of throughput (compilation, allocator warm-up)

CSS = """
body{font-family:Inter,Helvetica,Arial,sans-serif;color:#222;background:#f6f7f9;margin:0}
main{max-width:1360px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:26px;margin:4px 0 2px}h2{font-size:18px;margin:0 0 10px}
.sub{color:#666;font-size:14px;margin-bottom:18px}
section{background:#fff;border:1px solid #e3e5e8;border-radius:8px;padding:16px 18px;margin:0 0 18px}
table.wb-kv{border-collapse:collapse;font-size:14px}
table.wb-kv th{text-align:left;color:#666;font-weight:500;padding:3px 18px 3px 0;vertical-align:top}
table.wb-kv td{padding:3px 24px 3px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(200px,1fr));gap:12px}
.card{border:1px solid #e3e5e8;border-radius:8px;padding:12px 14px;background:#fbfcfd}
.card .label{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:26px;font-weight:600;margin:4px 0 2px}
.card .note{font-size:12px;color:#555}
.good{color:#1B7F5E}.bad{color:#B0343C}
table.wb-family-errors{border-collapse:collapse;font-size:14px;text-align:right}
table.wb-family-errors caption{text-align:left;font-weight:600;padding-bottom:6px}
table.wb-family-errors th,table.wb-family-errors td{padding:5px 14px;border-bottom:1px solid #eceef0}
table.wb-family-errors td:first-child,table.wb-family-errors th:first-child{text-align:left}
table.wb-family-errors tr.wb-total td{font-weight:600;border-top:2px solid #ccc}
.empty{color:#888;font-style:italic}
ul.problem{color:#B0343C;margin:0 0 10px;padding-left:20px}
"""


def smooth(values, weight: float = SMOOTHING) -> np.ndarray:
    """Exponential moving average with bias correction (TensorBoard-style): ``s_t = w s_{t-1} + (1-w) x_t``."""
    x = np.asarray(values, dtype=np.float64)
    out = np.empty_like(x)
    acc, norm = 0.0, 0.0
    for t, v in enumerate(x):
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[t] = acc / norm
    return out


def throughput(steps: list[dict], warmup: int = WARMUP_STEPS) -> dict:
    """Graphs/s and atoms/s over the logged steps after ``warmup``: per global step, the graphs of
    every rank over the slowest rank's step time."""
    per: dict[int, list[dict]] = {}
    for s in steps:
        per.setdefault(int(s["global_step"]), []).append(s)
    keep = [recs for g, recs in sorted(per.items()) if g > warmup] or list(per.values())
    seconds = sum(max(r["step_s"] for r in recs) for recs in keep)
    graphs = sum(r["graphs"] for recs in keep for r in recs)
    atoms = sum(r["atoms"] for recs in keep for r in recs)
    return {
        "steps": len(keep),
        "seconds": seconds,
        "graphs_per_s": graphs / seconds if seconds > 0 else float("nan"),
        "atoms_per_s": atoms / seconds if seconds > 0 else float("nan"),
    }


def packing_comparison(run_dir, info: dict) -> dict | None:
    """The run's epoch-0 packing and ``fixed-count`` on the same graphs: metrics of both."""
    from workbench.packing import pack
    from workbench.train.record import read_packing

    got = read_packing(run_dir)
    if got is None:
        return None
    packing, sizes = got
    base = pack(
        sizes["atoms"],
        packing.capacity,
        packing.num_replicas,
        algorithm="fixed-count",
        seed=packing.seed,
        graphs_per_batch=_count(info.get("batch_size"), 8),
    )
    return {
        "packing": packing,
        "sizes": sizes,
        "baseline": base,
        "run": packing.metrics(randomness=False),
        "fixed": base.metrics(randomness=False),
    }


def run_summary(run_dir: str | os.PathLike) -> dict:
    """The numbers the report shows, as a dict (``info``, ``valid``, ``throughput``, ``packing``, ...).

    ``problems`` lists the input files that are broken or in an old format (see
    :mod:`workbench.viz.report_inputs`); what they would have given is left out."""
    from workbench.train.evaluation import last_validation

    problems: list[Problem] = []
    info = read_info(run_dir, problems)
    epochs = read_epochs_checked(run_dir, problems)
    steps, timed = read_steps_checked(run_dir, problems)
    shares = {
        k: float(np.mean([e[k] for e in epochs if e.get(k) is not None]))
        for k in ("data_share", "compute_share", "allreduce_share")
        if any(e.get(k) is not None for e in epochs)
    }
    return {
        "info": info,
        "epochs": epochs,
        "steps": steps,
        "timed": timed,
        "valid": last_validation(epochs),
        "throughput": throughput(steps) if steps and timed else None,
        "shares": shares,
        "packing": guarded_packing(run_dir, problems, lambda d: packing_comparison(d, info)),
        "problems": problems,
    }


def _n(x) -> str:
    """A count with thousands separators; anything else as it is (run.json may say anything)."""
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else str(x)


def _count(x, default: int) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else default


def _loss_text(loss, data: dict) -> str:
    """The run's loss and the weights of its terms (runs from before stress recorded none)."""
    if not isinstance(loss, dict):
        return "weighted (energy + forces)"
    terms = [
        f"{name} {_n(loss.get(f'{name}_weight'))}"
        for name in ("energy", "forces", "stress", "virials")
        if isinstance(loss.get(f"{name}_weight"), (int, float)) and loss.get(f"{name}_weight")
    ]
    stress = (
        f"; {_n(data.get('train_with_stress'))} training graphs with a stress label"
        if loss.get("stress_weight")
        else ""
    )
    return f"{loss.get('name')}: " + ", ".join(terms) + stress


def _what_ran(run_dir: Path, info: dict, summary: dict) -> str:
    if not info:
        return "<p class=empty>This run has no run.json (written by runs since this report exists).</p>"
    m = info.get("model") if isinstance(info.get("model"), dict) else {}
    d = info.get("data") if isinstance(info.get("data"), dict) else {}
    sampler = info.get("sampler", "?")
    batch = (
        f"{_n(info.get('batch_size'))} graphs per batch"
        if sampler == "fixed-count"
        else f"capacity {_n(info.get('capacity'))} atoms per batch"
    )
    fams = d.get("families", [])
    fams = [str(f) for f in fams] if isinstance(fams, list) else [str(fams)]
    rows = [
        (
            "model",
            f"MACE {m.get('hidden_irreps')}, max_ell {m.get('max_ell')}, correlation {m.get('correlation')}, "
            f"{m.get('num_interactions')} interactions, cutoff {m.get('cutoff')} Å",
        ),
        (
            "data",
            f"{d.get('source')}: {_n(d.get('train_graphs', 0))} training graphs ({_n(d.get('train_atoms', 0))} "
            f"atoms), {_n(d.get('valid_graphs', 0))} validation graphs; {len(fams)} families ({', '.join(fams)})",
        ),
        ("ranks", f"{info.get('world_size')} on {info.get('device')} ({info.get('host')})"),
        ("sampler", f"{sampler}, {batch}"),
        ("loss", _loss_text(info.get("loss"), d)),
        ("precision / kernels", f"{info.get('dtype')} / {info.get('backend')}"),
        (
            "trained",
            f"{len(summary['steps']) // _count(info.get('world_size'), 1)} steps, "
            f"{sum(1 for e in summary['epochs'] if e.get('complete', True))} epochs, started {info.get('started')}",
        ),
        (
            "code",
            f"cfm-workbench {info.get('workbench')}, commit {info.get('commit') or 'unknown (not a git checkout)'}",
        ),
        ("run directory", str(run_dir)),
    ]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table class=wb-kv>{body}</table>"


def _card(label: str, value: str, note: str = "") -> str:
    """``note`` is HTML (the caller escapes what it did not make); label and value are text."""
    label, value = html.escape(label), html.escape(value)
    return f"<div class=card><div class=label>{label}</div><div class=value>{value}</div><div class=note>{note}</div></div>"


def _versus(run: float, fixed: float, same: bool) -> str:
    if same:
        return "this run packs with fixed-count"
    better = run <= fixed
    return f"<span class={'good' if better else 'bad'}>fixed-count would give {fixed:.1%}</span>"


def _cards(summary: dict) -> str:
    cards = []
    v = summary["valid"]
    if v is not None:
        cards.append(
            _card(
                "validation energy MAE",
                f"{v['e_mae_mev_atom']:.1f}",
                html.escape(f"meV/atom, epoch {v['epoch']}, {v['graphs']} graphs"),
            )
        )
        cards.append(_card("validation force MAE", f"{v['f_mae_mev_a']:.1f}", "meV/Å"))
        if isinstance(v.get("s_mae_mev_a3"), (int, float)):
            graphs = html.escape(f"meV/Å³, {v.get('stress_graphs', 0)} graphs with a stress label")
            cards.append(_card("validation stress MAE", f"{v['s_mae_mev_a3']:.1f}", graphs))
    t = summary["throughput"]
    if t is not None and math.isfinite(t["graphs_per_s"]):
        cards.append(
            _card(
                "throughput",
                f"{t['graphs_per_s']:,.1f} graphs/s",
                f"{t['atoms_per_s']:,.0f} atoms/s over {t['steps']} steps (all ranks)",
            )
        )
    p = summary["packing"]
    if p is not None:
        same = p["packing"].algorithm == "fixed-count"
        cards.append(
            _card(
                "padding waste",
                f"{p['run']['padding_fraction']:.1%}",
                _versus(p["run"]["padding_fraction"], p["fixed"]["padding_fraction"], same),
            )
        )
        cards.append(
            _card(
                "straggler share",
                f"{p['run']['straggler_share']:.1%}",
                _versus(p["run"]["straggler_share"], p["fixed"]["straggler_share"], same)
                + "<br>rank time waiting for the slowest rank (by load)",
            )
        )
    sh = summary["shares"]
    if "allreduce_share" in sh:
        cards.append(
            _card(
                "measured all-reduce wait",
                f"{sh['allreduce_share']:.1%}",
                f"of step time; data wait {sh.get('data_share', float('nan')):.1%}",
            )
        )
    return f"<div class=cards>{''.join(cards)}</div>" if cards else "<p class=empty>no step logged yet</p>"


def _loss_axis(y: np.ndarray) -> dict:
    """Log scale only when the loss spans a decade or more, with one label per decade when it spans
    several (minor labels crowd a short log axis)."""
    y = y[np.isfinite(y) & (y > 0)]
    span = float(np.log10(y.max() / y.min())) if y.size else 0.0
    if span >= 2:
        return dict(type="log", dtick=1, exponentformat="power")
    if span >= 1:
        return dict(type="log", tickformat="~g", nticks=6)
    return dict(type="linear", tickformat="~g", nticks=6)


def _loss_traces(fig, steps: list[dict]) -> None:
    """Training loss per optimizer step, averaged over ranks, raw and smoothed, in the first panel."""
    import plotly.graph_objects as go

    per: dict[int, list[float]] = {}
    for s in steps:
        per.setdefault(int(s["global_step"]), []).append(float(s["loss"]))
    if not per:
        return
    x = np.array(sorted(per))
    y = np.array([np.mean(per[g]) for g in x])
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name="loss", line=dict(color="#9ECAE9", width=1)), 1, 1)
    fig.add_trace(
        go.Scatter(x=x, y=smooth(y), mode="lines", name="loss, smoothed", line=dict(color="#1F4E79", width=2.4)), 1, 1
    )
    fig.update_yaxes(title_text="loss (the run's loss)", row=1, col=1, **_loss_axis(y))


def _validation_traces(fig, epochs: list[dict]) -> None:
    """Validation energy (panel 2) and force (panel 3) MAE per epoch; smoothed once there are 3 points."""
    import plotly.graph_objects as go

    ep = [e for e in epochs if e.get("valid_e_mae_mev_atom") is not None and e.get("global_step") is not None]
    x = [e["global_step"] for e in ep]
    for col, key, unit, color in (
        (2, "valid_e_mae_mev_atom", "meV/atom", "#4C78A8"),
        (3, "valid_f_mae_mev_a", "meV/Å", "#E45756"),
    ):
        y = np.array([e[key] for e in ep], dtype=float)
        what = "energy" if col == 2 else "force"
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="markers+lines",
                name=f"valid {what} MAE",
                opacity=0.5,
                line=dict(color=color, width=1),
                marker=dict(size=7),
            ),
            1,
            col,
        )
        if y.size > 2:
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=smooth(y, 0.6),
                    mode="lines",
                    name=f"valid {what} MAE, smoothed",
                    line=dict(color=color, width=2.4),
                ),
                1,
                col,
            )
        fig.update_yaxes(title_text=f"MAE ({unit})", rangemode="tozero", tickformat="~g", row=1, col=col)


def curves_figure(summary: dict):
    """Loss per step (mean over ranks) and validation energy and force MAE per epoch, raw and smoothed."""
    titles = ("training loss per step (mean over ranks)", "validation energy MAE", "validation force MAE")
    fig = panel_row(titles, [0.44, 0.28, 0.28], 0.08)
    _loss_traces(fig, summary["steps"])
    _validation_traces(fig, summary["epochs"])
    fig.update_xaxes(title_text="optimizer step")
    style(fig, None, height=400)
    fig.update_layout(
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0), margin=dict(t=40, b=90)
    )
    return fig


def layout_figure(comparison: dict, step: int = 0):
    """Step ``step`` of the run's packing beside fixed-count (graphs coloured by family)."""
    from workbench.viz.layout import bin_layout_figure, layout_rectangles

    packing, base, sizes = comparison["packing"], comparison["baseline"], comparison["sizes"]
    ranks = min(packing.num_replicas, 16)
    panels = [("fixed-count", layout_rectangles(base, min(step, base.n_steps - 1), sizes, ranks, cost=sizes["atoms"]))]
    if packing.algorithm != "fixed-count":
        panels.append((packing.algorithm, layout_rectangles(packing, step, sizes, ranks, cost=sizes["atoms"])))
    fig = bin_layout_figure(
        panels, capacity=packing.capacity, title=f"Graphs per rank in step {step}", total_ranks=packing.num_replicas
    )
    fig.update_layout(
        legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0, title_text="family "),
        margin=dict(b=100),
    )
    return fig


def _section(sid: str, title: str, body: str) -> str:
    return f"<section id='{sid}'><h2>{title}</h2>{body}</section>"


def _notes(problems: list[Problem], sid: str | None = None) -> str:
    """The problems (those affecting section ``sid``, or all) as an escaped list."""
    mine = [p for p in problems if sid is None or sid in p.sections]
    if not mine:
        return ""
    items = "".join(f"<li>{html.escape(str(p))}</li>" for p in mine)
    return f"<ul class=problem>{items}</ul>"


def _sections(run_dir: Path, summary: dict, fig_html) -> list[tuple[str, str, str | None]]:
    """``(id, title, body or None)`` of each section below the summary; None: nothing to show."""
    from workbench.train.evaluation import family_table_html
    from workbench.viz.monitor import step_time_figure

    steps, valid, packing = summary["steps"], summary["valid"], summary["packing"]
    # The rank figure reads every step log itself: only when all of them are whole and timed.
    ranks_ok = steps and summary["timed"] and not any("ranks" in p.sections for p in summary["problems"])
    # In page order: the first figure drawn carries plotly.js.
    curves = fig_html(curves_figure(summary)) if steps else None
    families = None
    if valid is not None:
        families = family_table_html(valid, f"epoch {int(valid['epoch'])}")  # epoch: checked an integer
    ranks = None
    if ranks_ok:
        ranks = fig_html(step_time_figure(run_dir).update_layout(title=None, margin=dict(t=40)))
    layout = fig_html(layout_figure(packing)) if packing is not None else None
    return [
        ("curves", "Loss and errors", curves),
        ("families", "Validation errors per family", families),
        ("ranks", "Where each rank's time goes", ranks),
        ("layout", "Packing layout", layout),
    ]


def report_html(run_dir: str | os.PathLike) -> str:
    """The report page as a string (see the module docstring).

    An input file that is broken or in an old format leaves out what it would have given: the
    page lists such files at the top, and each section that lacks one says so."""
    return _page(run_dir)[0]


def _page(run_dir: str | os.PathLike) -> tuple[str, list[Problem]]:
    run_dir = Path(run_dir)
    summary = run_summary(run_dir)
    info, problems = summary["info"], summary["problems"]
    plotly_js = {"include_plotlyjs": True}

    def fig_html(fig) -> str:
        out = fig.to_html(full_html=False, config={"displaylogo": False, "responsive": True}, **plotly_js)
        plotly_js["include_plotlyjs"] = False
        return f"<div class=figure>{out}</div>"

    parts = []
    if problems:
        parts.append(_section("problems", "Input files left out", _notes(problems)))
    parts.append(_section("what-ran", "What ran", _notes(problems, "what-ran") or _what_ran(run_dir, info, summary)))
    parts.append(_section("summary", "Summary", _cards(summary)))
    for sid, title, body in _sections(run_dir, summary, fig_html):
        if body is not None:
            parts.append(_section(sid, title, _notes(problems, sid) + body))
        elif _notes(problems, sid):
            parts.append(_section(sid, title, _notes(problems, sid)))
    title = f"Run {html.escape(str(info.get('name', run_dir.name)))}"
    sub = " · ".join(str(x) for x in (info.get("sampler"), info.get("dtype"), info.get("started")) if x)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title} · cfm-workbench</title>"
        f"<meta name=viewport content='width=device-width'><style>{CSS}</style></head><body><main>"
        f"<h1>{title}</h1><div class=sub>cfm-workbench run report · {html.escape(sub)}</div>"
        + "\n".join(parts)
        + "</main></body></html>"
    )
    return page, problems


def write_report(run_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Write the report to ``path`` (default ``<run_dir>/report.html``) and return the path.

    Each input file left out (broken, or an old format) is one :class:`ReportInputWarning`."""
    from workbench.train.rundir import RunDir

    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise FileNotFoundError(f"{run.path}: no such run directory")
    if not run.step_logs() and not run.epoch_log.exists():
        raise ValueError(
            f"{run.path}: holds no training logs (metrics/rank*.jsonl, metrics.jsonl); is it a run directory?"
        )
    out = Path(path) if path is not None else run.report
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    page, problems = _page(run.path)
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    for problem in problems:  # one warning per file; `workbench report` prints each as one line
        warnings.warn(ReportInputWarning(str(problem)), stacklevel=2)
    return out
