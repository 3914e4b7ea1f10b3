"""Plotly views of the measured GPU rows (:mod:`workbench.viz.gpu_results`): per pass, per train step, profile.

A missing row is drawn, not dropped: an empty hatched stub at the bottom of its slot,
labelled "not measured" and hovering its reason. A row recovered from a run's log is
hatched in its backend's colour. Plotly renders tags in text, so every string that
comes from a result file is HTML-escaped.
"""

from __future__ import annotations

import math
import textwrap
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.kernels.registry import DEFAULT_BACKEND
from workbench.viz.gpu_results import (
    DTYPES,
    FROM_LOG,
    NO_FILE,
    NOT_MEASURED,
    OPS,
    _grouped,
    config_name,
    gpu_backends,
    gpu_pass_rows,
    gpu_step_profile,
    gpu_step_rows,
)
from workbench.viz.kernels import PASS_LABELS, PASS_ORDER
from workbench.viz.style import BACKEND_COLORS, backend_color, style

if TYPE_CHECKING:  # plotly is imported only when a view is built
    import plotly.graph_objects as go

STUB_LABEL_MAX = 24  # longer reasons stay in the hover: a vertical label has no room for them
LEGEND_NOTE = (
    "hatched: recovered from the run's log · empty hatched stub: not measured (hover for why) · "
    f"{DEFAULT_BACKEND}/cueq above a group: below 1, {DEFAULT_BACKEND} is faster"
)


def _wrap(text: str, width: int = 70) -> str:
    """Escaped ``text`` with ``<br>`` breaks, for hover boxes and annotations."""
    return "<br>".join(escape(line) for line in textwrap.wrap(str(text), width)) or escape(str(text))


def _devices(rows: list[dict]) -> str:
    names = sorted({str(r["device_name"]) for r in rows if r.get("device_name")})
    return escape(", ".join(names)) if names else "no GPU result file"


def _refs(fig, row: int, col: int) -> tuple[str, str]:
    """Axis references (``x3``, ``y3``) of a subplot, for annotations placed in it."""
    sp = fig.get_subplot(row, col)
    return sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")


def _stub_text(reason: str | None, sep: str = ": ") -> str:
    short = reason and len(reason) <= STUB_LABEL_MAX
    return f"{NOT_MEASURED}{sep}{escape(reason)}" if short else NOT_MEASURED


def _label(y: float) -> str:
    return f"{y:.0f}" if y >= 100 else f"{y:.3g}"


def _gone_marker(fig, groups: list[list[dict]], stub: float, row: int, col: int) -> None:
    """One grey marker and label for a group where no backend was measured (three stubs would say it thrice)."""
    import plotly.graph_objects as go

    same = [len({s["reason"] for s in g}) == 1 for g in groups]
    fig.add_trace(
        go.Scatter(
            x=[g[0]["x"] for g in groups],
            y=[stub] * len(groups),
            mode="markers+text",
            marker=dict(symbol="x-thin-open", size=12, color="#777", line=dict(width=2)),
            text=[_stub_text(g[0]["reason"] if ok else None, ":<br>") for g, ok in zip(groups, same)],
            textposition="top center",
            textfont=dict(size=10, color="#555"),
            cliponaxis=False,
            hovertext=["<br>".join(s["hover"] for s in g) for g in groups],
            hoverinfo="text",
            name=NOT_MEASURED,
            showlegend=False,
        ),
        row=row,
        col=col,
    )


def _bar_style(backend: str) -> dict:
    """Keywords shared by a backend's measured bars and its stubs."""
    # One offsetgroup per backend: its stubs stand in its own slot, not in a fourth one.
    return dict(
        legendgroup=backend,
        offsetgroup=backend,
        textposition="outside",
        cliponaxis=False,
        hoverinfo="text",
        constraintext="none",
        textfont=dict(size=10),
    )


def _measured_bar(backend: str, have: list[dict], shown: set) -> go.Bar:
    """The measured slots of ``backend``: solid, hatched where recovered from a log."""
    import plotly.graph_objects as go

    return go.Bar(
        x=[s["x"] for s in have],
        y=[s["y"] for s in have],
        name=backend,
        showlegend=backend not in shown,
        marker=dict(
            color=backend_color(backend),
            pattern=dict(shape=["/" if s["status"] == FROM_LOG else "" for s in have], fgcolor="white"),
        ),
        text=[_label(s["y"]) for s in have],
        hovertext=[s["hover"] for s in have],
        **_bar_style(backend),
    )


def _stub_bar(backend: str, miss: list[dict], stub: float) -> go.Bar:
    """The missing slots of ``backend``: empty hatched stubs of height ``stub``, labelled with the reason."""
    import plotly.graph_objects as go

    color = backend_color(backend)
    return go.Bar(
        x=[s["x"] for s in miss],
        y=[stub] * len(miss),
        name=f"{backend} ({NOT_MEASURED})",
        showlegend=False,
        marker=dict(color="rgba(0,0,0,0)", line=dict(color=color, width=1.5), pattern=dict(shape="x", fgcolor=color)),
        text=[_stub_text(s["reason"]) for s in miss],
        textangle=-90,
        hovertext=[s["hover"] for s in miss],
        **_bar_style(backend),
    )


def _bars(fig, slots: list[dict], row: int, col: int, shown: set) -> tuple[float, float]:
    """Grouped bars per backend; a missing slot gets an empty hatched stub below every measured bar.

    ``slots``: ``x, backend, y`` (None = missing), ``status, reason, hover`` (escaped). Returns the
    smallest (the stub) and largest bar height, for the caller's axis range.
    """
    ys = [s["y"] for s in slots if s["y"]]
    stub = min(ys) / 3 if ys else 1.0
    groups = {x: [s for s in slots if s["x"] == x] for x in dict.fromkeys(s["x"] for s in slots)}
    gone = [g for g in groups.values() if all(s["y"] is None for s in g)]
    gone_x = {g[0]["x"] for g in gone}
    for b in dict.fromkeys((*gpu_backends(), *(s["backend"] for s in slots))):
        have = [s for s in slots if s["backend"] == b and s["y"] is not None]
        miss = [s for s in slots if s["backend"] == b and s["y"] is None and s["x"] not in gone_x]
        if have:
            fig.add_trace(_measured_bar(b, have, shown), row=row, col=col)
            shown.add(b)
        if miss:
            fig.add_trace(_stub_bar(b, miss, stub), row=row, col=col)
    if gone:
        _gone_marker(fig, gone, stub, row, col)
    return stub, max(ys, default=stub)


def _ratio_notes(fig, slots: list[dict], row: int, col: int) -> None:
    """Ours over cuEquivariance above each group where both were measured."""
    xref, yref = _refs(fig, row, col)
    for x in dict.fromkeys(s["x"] for s in slots):
        ms = {s["backend"]: s["y"] for s in slots if s["x"] == x and s["y"]}
        if DEFAULT_BACKEND in ms and "cueq" in ms:
            fig.add_annotation(
                x=x,
                y=0.99,
                xref=xref,
                yref=f"{yref} domain",
                yanchor="top",
                showarrow=False,
                text=f"{DEFAULT_BACKEND}/cueq<br>{ms[DEFAULT_BACKEND] / ms['cueq']:.2f}",
                font=dict(size=10, color=BACKEND_COLORS["cueq"]),
            )


def _log_range(fig, lo: float, hi: float, row: int, col: int, title: str) -> None:
    # Headroom above the tallest bar for its label and the ratio line.
    fig.update_yaxes(type="log", range=[math.log10(lo) - 0.2, math.log10(hi) + 0.9], title_text=title, row=row, col=col)


def _empty_note(fig, text: str, row: int, col: int) -> None:
    # Paper coordinates: plotly.js misplaces "x4 domain" references on a subplot without traces.
    sp = fig.get_subplot(row, col)
    fig.add_annotation(
        text=text,
        x=sum(sp.xaxis.domain) / 2,
        y=sum(sp.yaxis.domain) / 2,
        xref="paper",
        yref="paper",
        showarrow=False,
        font=dict(size=12, color="#666"),
    )
    fig.update_xaxes(visible=False, row=row, col=col)
    fig.update_yaxes(visible=False, row=row, col=col)


def _footnote(fig, lines: list[str], below: int = 45) -> None:
    """Lines ``below`` px under the plot area (clear of the tick labels), in a bottom margin made for them."""
    fig.add_annotation(
        text="<br>".join(lines),
        xref="paper",
        yref="paper",
        x=0,
        y=0,
        yshift=-below,
        yanchor="top",
        xanchor="left",
        showarrow=False,
        font=dict(size=11, color="#555"),
        align="left",
    )
    fig.update_layout(margin=dict(b=below + 25 + 18 * len(lines)))


def _pass_slot(c: dict) -> dict:
    head = f"<b>{escape(c['backend'])}</b> {PASS_LABELS[c['pass']]}, {c['dtype']}, {escape(c['config'])}"
    if c["median_ms"] is None:
        hover = f"{head}<br>{NOT_MEASURED}: {_wrap(c['reason'])}"
    else:
        peak = f" · peak {c['peak_mem_mb']:.0f} MB" if c.get("peak_mem_mb") is not None else ""
        more = (
            f"<br>{len(c['repeats'])} rows in the file: {', '.join(f'{v:.3g}' for v in c['repeats'])} ms; "
            "the first is shown"
            if len(c["repeats"]) > 1
            else ""
        )
        log = f"<br>{_wrap(c['reason'])}" if c["status"] == FROM_LOG else ""
        hover = f"{head}<br>{c['median_ms']:.3f} ms{peak}{more}{log}"
    hover += f"<br><i>{escape(str(c['file'] or NO_FILE))}</i>"
    return dict(
        x=PASS_LABELS[c["pass"]],
        backend=c["backend"],
        y=c["median_ms"],
        status=c["status"],
        reason=c["reason"],
        hover=hover,
    )


def gpu_pass_figure(directory: str | Path | None = None, gpu: str | None = None, title: str | None = None) -> go.Figure:
    """Median ms per pass for numba / cueq / e3nn: a panel per (op, config with a file) and dtype, log axis.

    Missing rows are stubs labelled "not measured" (hover: why); configs without a
    file are named under the figure. The title names the GPU(s) the files come from.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = gpu_pass_rows(directory, gpu)
    panels = list(dict.fromkeys((r["op"], r["config"]) for r in rows if r["file"]))
    absent = list(dict.fromkeys(f"{OPS[r['op']]} {escape(r['config'])}" for r in rows if not r["file"]))
    title = title or f"Per pass on {_devices(rows)}: numba, cuEquivariance, e3nn (median ms, log axis)"
    if not panels:
        fig = go.Figure()
        fig.add_annotation(text=f"no GPU result files: {', '.join(absent)} {NOT_MEASURED}", showarrow=False)
        return style(fig, title, height=260)
    names = [f"{OPS[op]} · {escape(config_name(h))} ({escape(h)}) · {d}" for op, h in panels for d in DTYPES]
    fig = make_subplots(
        rows=len(panels),
        cols=len(DTYPES),
        vertical_spacing=0.28 / len(panels),
        horizontal_spacing=0.1,
        subplot_titles=names,
    )
    shown: set = set()
    for i, (op, hidden) in enumerate(panels, start=1):
        for j, dtype in enumerate(DTYPES, start=1):
            cells = [r for r in rows if (r["op"], r["config"], r["dtype"]) == (op, hidden, dtype)]
            if all(c["median_ms"] is None for c in cells):
                reasons = sorted({c["reason"] for c in cells})
                _empty_note(fig, f"{NOT_MEASURED}<br>" + "<br>".join(_wrap(r, 50) for r in reasons), i, j)
                continue
            slots = [_pass_slot(c) for c in cells]
            lo, hi = _bars(fig, slots, i, j, shown)
            _ratio_notes(fig, slots, i, j)
            _log_range(fig, lo, hi, i, j, "ms")
            fig.update_xaxes(categoryorder="array", categoryarray=[PASS_LABELS[p] for p in PASS_ORDER], row=i, col=j)
    fig.update_layout(barmode="group", legend=dict(title="backend"), bargap=0.25)
    style(fig, title, height=300 * len(panels) + 150)
    _footnote(fig, [LEGEND_NOTE] + ([f"{NO_FILE} ({NOT_MEASURED}): " + ", ".join(absent)] if absent else []))
    return fig


def _step_slots(cells: list[dict], key: str) -> list[dict]:
    slots = []
    for c in cells:
        size = f" ({c['atoms']:.0f} atoms, {c.get('edges_per_atom') or 0:.0f} edges/atom)" if c.get("atoms") else ""
        head = f"<b>{escape(c['backend'])}</b> {escape(c['workload'])}{size}, {escape(c['dtype'])}"
        reason = c["reason"] or f"no {key} in the file"
        if c[key] is None:
            hover = f"{head}<br>{NOT_MEASURED}: {_wrap(reason)}"
        else:
            hover = (
                f"{head}<br>median {c['step_ms']:.1f} ms (min {c['step_ms_min'] or float('nan'):.1f})"
                f"<br>peak {c['peak_mem_gb'] or float('nan'):.2f} GB (torch's allocator)"
            )
        slots.append(
            dict(
                x=escape(c["workload"]),
                backend=c["backend"],
                y=c[key],
                status=c["status"],
                reason=reason,
                hover=f"{hover}<br><i>{escape(c['file'])}</i>",
            )
        )
    return slots


def gpu_step_figure(directory: str | Path | None = None, gpu: str | None = None, title: str | None = None) -> go.Figure:
    """The whole train step per workload: median ms (log) on top, peak memory (GB) below, a column per dtype.

    Workloads that were not measured (e.g. the time budget ran out) are stubs
    labelled "not measured: <reason>".
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = gpu_step_rows(directory, gpu)
    title = title or f"Train step on {_devices(rows)}: numba, cuEquivariance, e3nn"
    if not rows:
        fig = go.Figure()
        fig.add_annotation(text=f"train step: {NO_FILE} (train_step_gpu_*.json), {NOT_MEASURED}", showarrow=False)
        return style(fig, title, height=260)
    # A workload a dtype's run never planned is named below the figure, not drawn as three stubs.
    planned = [r for r in rows if r["reason"] != f"not run at {r['dtype']}"]
    unplanned = _grouped([r for r in rows if r not in planned], ("dtype",))
    notes = [LEGEND_NOTE] + [
        f"{escape(d)}: {escape(', '.join(dict.fromkeys(r['workload'] for r in rs)))} "
        f"{NOT_MEASURED} (not run at {escape(d)})"
        for (d,), rs in unplanned.items()
    ]
    dtypes = list(dict.fromkeys(r["dtype"] for r in planned))
    fig = make_subplots(
        rows=2,
        cols=max(len(dtypes), 1),
        vertical_spacing=0.2,
        horizontal_spacing=0.1,
        subplot_titles=[f"{what} · {escape(d)}" for what in ("median step time", "peak memory") for d in dtypes],
    )
    shown: set = set()
    for j, dtype in enumerate(dtypes, start=1):
        cells = [r for r in planned if r["dtype"] == dtype]
        slots = _step_slots(cells, "step_ms")
        lo, hi = _bars(fig, slots, 1, j, shown)
        _ratio_notes(fig, slots, 1, j)
        _log_range(fig, lo, hi, 1, j, "ms per step (log)")
        _bars(fig, _step_slots(cells, "peak_mem_gb"), 2, j, shown)
        fig.update_yaxes(title_text="peak GB (torch allocator)", row=2, col=j)
    fig.update_layout(barmode="group", legend=dict(title="backend"), bargap=0.25)
    style(fig, title, height=720)
    _footnote(fig, notes)
    return fig


def gpu_profile_figure(
    directory: str | Path | None = None, gpu: str | None = None, title: str | None = None
) -> go.Figure:
    """Share of the profiled numba train step per category; the five largest coloured, the rest grey."""
    import plotly.graph_objects as go

    prof = gpu_step_profile(directory, gpu)
    fig = go.Figure()
    if prof is None:
        fig.add_annotation(text=f"train step profile: {NOT_MEASURED}", showarrow=False, font_size=15)
        return style(fig, title or "Profile of the numba train step", height=240)
    cats = sorted(prof["categories"].items(), key=lambda kv: -float(kv[1].get("share") or 0))
    top = {name for name, *_ in prof.get("top5") or cats[:5]}
    share = [100 * float(v.get("share") or 0) for _, v in cats]
    fig.add_trace(
        go.Bar(
            y=[escape(k) for k, _ in cats],
            x=share,
            orientation="h",
            showlegend=False,
            cliponaxis=False,
            marker_color=[BACKEND_COLORS[DEFAULT_BACKEND] if k in top else "#bbb" for k, _ in cats],
            text=[f"{s:.1f}% · {float(v.get('ms') or 0):.1f} ms" for s, (_, v) in zip(share, cats)],
            textposition="outside",
            hovertemplate="%{y}: %{x:.1f}% of the step<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="share of the step (%)", range=[0, max(share, default=1) * 1.3])
    head = (
        f"Where the numba step goes: {escape(str(prof.get('workload')))} {escape(str(prof.get('dtype')))} on "
        f"{escape(prof['device_name'])}, {float(prof.get('step_ms') or 0):.0f} ms per step (top five coloured)"
    )
    return style(fig, title or head, height=120 + 34 * len(cats))
