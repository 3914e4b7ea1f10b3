"""Run monitor: the launcher's status panel, live loss and per-rank step times of a run directory.

Everything here reads a run directory (``metrics/rank*.jsonl`` and
``metrics.jsonl``, via :mod:`workbench.train.rundir`), so the same views work
on a finished run, on a live one, and on a run started elsewhere and attached.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from workbench.viz.style import panel_row, style

RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")
FIELDS = ("global_step", "epoch", "loss", "data_s", "compute_s", "allreduce_s", "step_s", "atoms", "edges", "time")


def _run_dir(run) -> Path:
    return Path(getattr(run, "run_dir", run))


def step_series(run_dir: str | os.PathLike) -> dict[int, dict[str, np.ndarray]]:
    """Per rank, the step records as arrays (fields of :data:`FIELDS` the log has), in step order."""
    from workbench.train.rundir import read_steps

    recs = read_steps(_run_dir(run_dir))
    out: dict[int, dict[str, np.ndarray]] = {}
    for r in sorted({rec["rank"] for rec in recs}):
        mine = [rec for rec in recs if rec["rank"] == r]
        out[r] = {f: np.array([rec.get(f, np.nan) for rec in mine], dtype=float) for f in FIELDS}
    return out


def rank_time_shares(series: dict[int, dict[str, np.ndarray]], skip_first: int = 2) -> dict[int, dict[str, float]]:
    """Mean seconds per step spent loading data, computing and waiting in all-reduce, per rank.

    The all-reduce wait includes waiting for the slowest rank: a balanced
    packing shows up as short, even all-reduce bars (the paper's Figure 13).
    """
    out = {}
    for r, s in series.items():
        keep = s["global_step"] > skip_first if np.any(s["global_step"] > skip_first) else np.ones_like(s["loss"], bool)
        out[r] = {
            k: float(np.nanmean(s[k][keep])) if keep.any() else 0.0 for k in ("data_s", "compute_s", "allreduce_s")
        }
    return out


#: per-epoch error traces: (epoch field, legend name, dash, panel) with panel "e", "f" (the energy
#: panel's second axis) or "s" (a third panel, drawn only for runs with stress)
EPOCH_TRACES = (
    ("train_e_mae_mev_atom", "train E MAE", "solid", "e"),
    ("valid_e_mae_mev_atom", "valid E MAE", "dot", "e"),
    ("train_f_mae_mev_a", "train F MAE", "solid", "f"),
    ("valid_f_mae_mev_a", "valid F MAE", "dot", "f"),
    ("train_s_mae_mev_a3", "train S MAE", "solid", "s"),
    ("valid_s_mae_mev_a3", "valid S MAE", "dot", "s"),
)
_PANEL_COLOR = {"e": "#4C78A8", "f": "#E45756", "s": "#54A24B"}


def loss_figure(run_dir, title: str | None = None):
    """Training loss per rank (log scale); per epoch, train/validation energy and force MAE; and,
    for a run that trains or validates stress, its MAE in a panel of its own (meV/Å³)."""
    from workbench.train.rundir import read_epochs

    series = step_series(run_dir)
    epochs = read_epochs(_run_dir(run_dir))
    shown = [t for t in EPOCH_TRACES if any(e.get(t[0]) is not None for e in epochs)]
    stress = any(t[3] == "s" for t in shown)
    titles = ("loss per step", "error per epoch", *(("stress error per epoch",) if stress else ()))
    fig = panel_row(titles, specs=[[{}, {"secondary_y": True}, *([{}] if stress else [])]])
    for r, s in series.items():
        hover = f"rank {r}<br>step %{{x}}<br>loss %{{y:.4g}}<extra></extra>"
        _rank_line(fig, s, "loss", f"rank {r}", dict(color=RANK_COLORS[r % len(RANK_COLORS)], width=1.6), hover)
    if epochs:
        _epoch_traces(fig, epochs, shown)
    else:
        fig.add_annotation(
            text="no finished epoch yet", showarrow=False, xref="x2 domain", yref="y2 domain", x=0.5, y=0.5
        )
    fig.update_yaxes(type="log", title_text="loss (the run's loss)", row=1, col=1)
    fig.update_xaxes(title_text="optimizer step", row=1, col=1)
    fig.update_xaxes(title_text="epoch", row=1, col=2)
    fig.update_yaxes(title_text="energy MAE (meV/atom)", row=1, col=2, secondary_y=False)
    fig.update_yaxes(title_text="force MAE (meV/Å)", row=1, col=2, secondary_y=True)
    if stress:
        fig.update_xaxes(title_text="epoch", row=1, col=3)
        fig.update_yaxes(title_text="stress MAE (meV/Å³)", row=1, col=3)
    return style(fig, title or f"Run {_run_dir(run_dir).name}: loss", height=360)


def _epoch_traces(fig, epochs: list[dict], shown) -> None:
    import plotly.graph_objects as go

    x = [e["epoch"] for e in epochs]
    for key, name, dash, panel in shown:
        trace = go.Scatter(
            x=x,
            y=[e.get(key) for e in epochs],
            mode="lines+markers",
            name=name,
            line=dict(dash=dash, color=_PANEL_COLOR[panel]),
        )
        if panel == "s":
            fig.add_trace(trace, row=1, col=3)
        else:
            fig.add_trace(trace, row=1, col=2, secondary_y=panel == "f")


def _rank_line(fig, s: dict, key: str, name: str, line: dict, hover: str | None, **kw) -> None:
    """One rank's ``key`` against the optimizer step, in the left panel (``hover`` None: no hover)."""
    import plotly.graph_objects as go

    hovering = {"hovertemplate": hover} if hover else {"hoverinfo": "skip"}
    trace = go.Scatter(x=s["global_step"], y=s[key], mode="lines", name=name, line=line, **kw, **hovering)
    fig.add_trace(trace, 1, 1)


def _rank_step_traces(fig, series: dict) -> None:
    """Per rank: step time (solid, hover splits it) and compute time (dotted) against the step."""
    for r, s in series.items():
        c = RANK_COLORS[r % len(RANK_COLORS)]
        hover = (
            f"rank {r}, step %{{x}}<br>step %{{y:.3f}} s: compute "
            "%{customdata[0]:.3f} s, all-reduce wait %{customdata[1]:.3f} s<br>"
            "%{customdata[2]:.0f} atoms, %{customdata[3]:.0f} edges<extra></extra>"
        )
        split = np.column_stack([s["compute_s"], s["allreduce_s"], s["atoms"], s["edges"]])
        _rank_line(
            fig, s, "step_s", f"rank {r} step", dict(color=c, width=1.8), hover, legendgroup=f"r{r}", customdata=split
        )
        _rank_line(
            fig, s, "compute_s", f"rank {r} compute", dict(color=c, width=1, dash="dot"), None, legendgroup=f"r{r}"
        )


def _rank_share_bars(fig, series: dict) -> None:
    """Per rank, the mean step split into data loading, compute and all-reduce wait (stacked bars)."""
    import plotly.graph_objects as go

    shares = rank_time_shares(series)
    ranks = [f"rank {r}" for r in shares]
    for key, name, color in (
        ("data_s", "data loading", "#BAB0AC"),
        ("compute_s", "compute", "#4C78A8"),
        ("allreduce_s", "all-reduce wait", "#E45756"),
    ):
        fig.add_trace(
            go.Bar(
                y=ranks,
                x=[v[key] for v in shares.values()],
                orientation="h",
                name=name,
                marker_color=color,
                hovertemplate=f"%{{y}}: {name} %{{x:.3f}} s<extra></extra>",
            ),
            1,
            2,
        )


def step_time_figure(run_dir, title: str | None = None):
    """Step time per rank and step, and per rank the mean split into data / compute / all-reduce wait."""
    series = step_series(run_dir)
    fig = panel_row(("step time per rank", "where each rank's time goes (mean per step)"), [0.62, 0.38])
    _rank_step_traces(fig, series)
    _rank_share_bars(fig, series)
    if not series:
        fig.add_annotation(text="no step logged yet", showarrow=False, xref="x domain", yref="y domain", x=0.5, y=0.5)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="optimizer step", row=1, col=1)
    fig.update_yaxes(title_text="seconds", row=1, col=1)
    fig.update_xaxes(title_text="seconds per step (after 2 warm-up steps)", row=1, col=2)
    return style(fig, title or f"Run {_run_dir(run_dir).name}: step time per rank", height=360)


def summary_html(run_dir, status: str | None = None) -> str:
    """One line (status, steps and epochs logged, last loss, ranks) and the latest per-family
    validation errors."""
    from workbench.train.rundir import read_epochs

    series = step_series(run_dir)
    epochs = read_epochs(_run_dir(run_dir))
    steps = int(max((s["global_step"].max() for s in series.values() if s["global_step"].size), default=0))
    last = [s["loss"][-1] for s in series.values() if s["loss"].size]
    badge = {"running": "#1B9E77", "pending": "#E6AB02", "done": "#4C78A8", "failed": "#D62728"}.get(
        status or "", "#777"
    )
    st = (
        f"<span class='wb-run-status' style='background:{badge};color:white;border-radius:4px;padding:1px 6px'>"
        f"{status}</span> "
        if status
        else ""
    )
    from workbench.train.evaluation import family_table_html, last_validation

    valid = last_validation(epochs)
    table = family_table_html(valid, f"Validation errors per config_type (epoch {valid['epoch']})") if valid else ""
    return (
        f"<div class='wb-run-summary' style='font-size:13px'>{st}<code>{_run_dir(run_dir)}</code> · "
        f"{len(series)} rank(s) · {steps} steps · {len(epochs)} epoch(s) logged"
        + (f" · last loss {np.mean(last):.4g}" if last else "")
        + f"</div>{table}"
    )


class RunMonitor:
    """Widget with the launcher's panel (when given a launcher ``Run``), live loss and step-time plots.

    ``run``: a :class:`workbench.launch.Run`-like object (``run_dir``,
    ``status``, optionally ``panel()``) or a run directory. :meth:`refresh`
    re-reads the logs; :meth:`start` polls every ``interval`` seconds in a
    background thread until the run is no longer pending/running (or, for a
    bare directory, until :meth:`stop`).
    """

    def __init__(self, run, interval: float = 2.0) -> None:
        import ipywidgets as W
        import plotly.graph_objects as go

        self.run = run
        self.run_dir = _run_dir(run)
        self.interval = float(interval)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The poll thread and a user's refresh() (or the button) must not edit a FigureWidget at once.
        self._lock = threading.RLock()
        self.header = W.HTML()
        self.loss = go.FigureWidget()
        self.times = go.FigureWidget()
        self.refresh_button = W.Button(description="Refresh", icon="refresh")
        self.refresh_button.on_click(lambda *_: self.refresh())
        parts = [self.header]
        panel = getattr(run, "panel", None)
        if callable(panel):
            try:
                parts.append(panel())
            except Exception as exc:
                parts.append(W.HTML(f"<i>launcher panel unavailable: {type(exc).__name__}: {exc}</i>"))
        parts += [self.refresh_button, self.loss, self.times]
        self.widget = W.VBox(parts)
        self.widget.add_class("wb-run-monitor")
        self.refresh()

    @property
    def status(self) -> str | None:
        st = getattr(self.run, "status", None)
        return st() if callable(st) else st

    def refresh(self) -> None:
        """Re-read the run's logs and redraw (safe to call while the poll thread runs)."""
        figures = ((self.loss, loss_figure(self.run_dir)), (self.times, step_time_figure(self.run_dir)))
        with self._lock:
            for fw, new in figures:
                with fw.batch_update():
                    fw.data = []
                fw.add_traces(list(new.data))
                fw.layout = new.layout
            self.header.value = summary_html(self.run_dir, self.status)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except OSError:  # a file replaced under us (checkpoint, marker): try again next tick
                continue
            if self.status not in (None, "pending", "running"):
                self.refresh()
                break

    def start(self) -> RunMonitor:
        """Poll in the background (no-op if already polling)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True, name="wb-run-monitor")
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling; returns once a redraw in flight has finished (figures are whole again)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)


def run_monitor(run, interval: float = 2.0, live: bool | None = None) -> RunMonitor:
    """A :class:`RunMonitor`; polls in the background when ``live`` (default: when the run is pending/running)."""
    mon = RunMonitor(run, interval)
    if live or (live is None and mon.status in ("pending", "running")):
        mon.start()
    return mon
