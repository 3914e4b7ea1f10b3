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

plotly.js is inlined once, so the file opens offline.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path

import numpy as np

from workbench.viz.style import style

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
        graphs_per_batch=int(info.get("batch_size") or 8),
    )
    return {
        "packing": packing,
        "sizes": sizes,
        "baseline": base,
        "run": packing.metrics(randomness=False),
        "fixed": base.metrics(randomness=False),
    }


def run_summary(run_dir: str | os.PathLike) -> dict:
    """The numbers the report shows, as a dict (``info``, ``valid``, ``throughput``, ``packing``)."""
    from workbench.train.evaluate import last_validation
    from workbench.train.record import read_run_record
    from workbench.train.rundir import read_epochs, read_steps

    info = read_run_record(run_dir)
    epochs = read_epochs(run_dir)
    steps = read_steps(run_dir)
    shares = {
        k: float(np.mean([e[k] for e in epochs if e.get(k) is not None]))
        for k in ("data_share", "compute_share", "allreduce_share")
        if any(e.get(k) is not None for e in epochs)
    }
    return {
        "info": info,
        "epochs": epochs,
        "steps": steps,
        "valid": last_validation(epochs),
        "throughput": throughput(steps) if steps else None,
        "shares": shares,
        "packing": packing_comparison(run_dir, info),
    }


def _what_ran(run_dir: Path, info: dict, summary: dict) -> str:
    m, d = info.get("model", {}), info.get("data", {})
    if not info:
        return "<p class=empty>This run has no run.json (written by runs since this report exists).</p>"
    sampler = info.get("sampler", "?")
    batch = (
        f"{info.get('batch_size')} graphs per batch"
        if sampler == "fixed-count"
        else f"capacity {info.get('capacity'):,} atoms per batch"
    )
    fams = d.get("families", [])
    rows = [
        (
            "model",
            f"MACE {m.get('hidden_irreps')}, max_ell {m.get('max_ell')}, correlation {m.get('correlation')}, "
            f"{m.get('num_interactions')} interactions, cutoff {m.get('cutoff')} Å",
        ),
        (
            "data",
            f"{d.get('source')}: {d.get('train_graphs', 0):,} training graphs ({d.get('train_atoms', 0):,} atoms), "
            f"{d.get('valid_graphs', 0):,} validation graphs; {len(fams)} families ({', '.join(fams)})",
        ),
        ("ranks", f"{info.get('world_size')} on {info.get('device')} ({info.get('host')})"),
        ("sampler", f"{sampler}, {batch}"),
        ("precision / kernels", f"{info.get('dtype')} / {info.get('backend')}"),
        (
            "trained",
            f"{len(summary['steps']) // max(1, int(info.get('world_size') or 1))} steps, "
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
                f"meV/atom, epoch {v['epoch']}, {v['graphs']} graphs",
            )
        )
        cards.append(_card("validation force MAE", f"{v['f_mae_mev_a']:.1f}", "meV/Å"))
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
    fig.update_yaxes(title_text="loss (weighted E + F)", row=1, col=1, **_loss_axis(y))


def _validation_traces(fig, epochs: list[dict]) -> None:
    """Validation energy (panel 2) and force (panel 3) MAE per epoch; smoothed once there are 3 points."""
    import plotly.graph_objects as go

    ep = [e for e in epochs if e.get("valid_e_mae_mev_atom") is not None]
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
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        column_widths=[0.44, 0.28, 0.28],
        subplot_titles=("training loss per step (mean over ranks)", "validation energy MAE", "validation force MAE"),
    )
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


def report_html(run_dir: str | os.PathLike) -> str:
    """The report page as a string (see the module docstring)."""
    from workbench.train.evaluate import family_table_html
    from workbench.viz.monitor import step_time_figure

    run_dir = Path(run_dir)
    summary = run_summary(run_dir)
    info = summary["info"]
    plotly_js = {"include_plotlyjs": True}

    def fig_html(fig) -> str:
        out = fig.to_html(full_html=False, config={"displaylogo": False, "responsive": True}, **plotly_js)
        plotly_js["include_plotlyjs"] = False
        return f"<div class=figure>{out}</div>"

    parts = [
        _section("what-ran", "What ran", _what_ran(run_dir, info, summary)),
        _section("summary", "Summary", _cards(summary)),
    ]
    if summary["steps"]:
        parts.append(_section("curves", "Loss and errors", fig_html(curves_figure(summary))))
    if summary["valid"] is not None:
        parts.append(
            _section(
                "families",
                "Validation errors per family",
                family_table_html(summary["valid"], f"epoch {summary['valid']['epoch']}"),
            )
        )
    if summary["steps"]:
        fig = step_time_figure(run_dir).update_layout(title=None, margin=dict(t=40))
        parts.append(_section("ranks", "Where each rank's time goes", fig_html(fig)))
    if summary["packing"] is not None:
        parts.append(_section("layout", "Packing layout", fig_html(layout_figure(summary["packing"]))))
    title = f"Run {html.escape(info.get('name', run_dir.name))}"
    sub = " · ".join(x for x in (info.get("sampler"), info.get("dtype"), info.get("started")) if x)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title} · cfm-workbench</title>"
        f"<meta name=viewport content='width=device-width'><style>{CSS}</style></head><body><main>"
        f"<h1>{title}</h1><div class=sub>cfm-workbench run report · {html.escape(sub)}</div>"
        + "\n".join(parts)
        + "</main></body></html>"
    )


def write_report(run_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Write the report to ``path`` (default ``<run_dir>/report.html``) and return the path."""
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
    tmp.write_text(report_html(run.path), encoding="utf-8")
    os.replace(tmp, out)
    return out
