"""Bin layouts per GPU (the paper's Figure 12): one row per rank, one rectangle per graph.

Batch ``k`` of a packing runs on rank ``k % R`` at step ``k // R``
(:mod:`workbench.packing.core`). For one step, :func:`layout_rectangles` lays the
graphs of each rank's batch end to end; a rectangle's length is the graph's
packing cost (atoms by default), so a row's length is that rank's load and the
longest row is the straggler every other rank waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workbench.limits import DEFAULT_CAPACITY
from workbench.packing.api import ALGORITHMS, algorithm_named, pack
from workbench.viz.style import family_color, family_html, family_order, style


@dataclass
class Rectangles:
    """Rectangles of one step, as parallel arrays (one entry per graph)."""

    rank: np.ndarray  # int64: the rank (row)
    graph: np.ndarray  # int64: graph index into the dataset
    x0: np.ndarray  # float64: start (sum of the costs before it on that rank)
    length: np.ndarray  # float64: the graph's cost
    family: np.ndarray  # str: family of the graph
    atoms: np.ndarray  # int64
    edges: np.ndarray  # int64 (-1 when unknown)
    num_ranks: int  # rows, including ranks with nothing to show

    def rank_loads(self) -> np.ndarray:
        """Total rectangle length of every rank (``num_ranks`` entries)."""
        return np.bincount(self.rank, weights=self.length, minlength=self.num_ranks)


def rectangles_from_batches(
    batches: Sequence[np.ndarray], sizes: np.ndarray, cost: str | np.ndarray = "atoms"
) -> Rectangles:
    """Rectangles for ``batches[r]`` (graph indices) on row ``r``.

    ``sizes``: structured array with ``atoms`` (and optionally ``edges``, ``family``)
    or a plain 1-D array of costs. ``cost``: a field name or a per-graph cost array.
    """
    sizes = np.asarray(sizes)
    named = sizes.dtype.names or ()
    if isinstance(cost, str):
        costs = np.asarray(sizes[cost] if named else sizes, dtype=np.float64)
    else:
        costs = np.asarray(cost, dtype=np.float64)
    atoms = np.asarray(sizes["atoms"] if "atoms" in named else costs, dtype=np.int64)
    edges = np.asarray(sizes["edges"], dtype=np.int64) if "edges" in named else None
    fams = sizes["family"] if "family" in named else None
    ranks, graphs, x0 = [], [], []
    for r, members in enumerate(batches):
        members = np.asarray(members, dtype=np.int64)
        c = costs[members]
        ranks.append(np.full(members.size, r, dtype=np.int64))
        graphs.append(members)
        x0.append(np.concatenate(([0.0], np.cumsum(c)[:-1])) if members.size else np.zeros(0))
    g = np.concatenate(graphs) if graphs else np.zeros(0, np.int64)
    return Rectangles(
        rank=np.concatenate(ranks) if ranks else np.zeros(0, np.int64),
        graph=g,
        x0=np.concatenate(x0) if x0 else np.zeros(0),
        length=costs[g],
        family=np.asarray(fams[g]).astype(str) if fams is not None else np.full(g.size, "graph"),
        atoms=atoms[g],
        edges=edges[g] if edges is not None else np.full(g.size, -1, np.int64),
        num_ranks=len(batches),
    )


def layout_rectangles(
    packing, step: int, sizes: np.ndarray, ranks: int | None = None, cost: str | np.ndarray | None = None
) -> Rectangles:
    """Rectangles of step ``step`` of ``packing`` (first ``ranks`` ranks; all by default).

    The default cost is the packing's own cost array, so each row sums to the
    batch load :meth:`~workbench.packing.Packing.loads` reports.
    """
    r_all = packing.num_replicas
    if not 0 <= step < packing.n_steps:
        raise IndexError(f"step {step} out of range: the packing has {packing.n_steps} steps")
    shown = r_all if ranks is None else min(int(ranks), r_all)
    lo, hi = packing.offsets, packing.flat
    batches = [hi[lo[step * r_all + r] : lo[step * r_all + r + 1]] for r in range(shown)]
    return rectangles_from_batches(batches, sizes, packing.costs if cost is None else cost)


def _add_rectangles(fig, rects: Rectangles, row: int, col: int, shown: set, unit: str) -> None:
    import plotly.graph_objects as go

    for fam in family_order(rects.family):
        sel = rects.family == fam
        edges = np.where(rects.edges[sel] >= 0, rects.edges[sel], 0)
        fig.add_trace(
            go.Bar(
                y=rects.rank[sel],
                x=rects.length[sel],
                base=rects.x0[sel],
                orientation="h",
                width=np.full(int(sel.sum()), 0.72),  # explicit: plotly infers widths per trace otherwise
                name=family_html(fam),
                legendgroup=fam,
                showlegend=fam not in shown,
                marker=dict(color=family_color(fam), line=dict(color="white", width=0.6)),
                customdata=np.column_stack([rects.graph[sel], rects.atoms[sel], edges]),
                hovertemplate=(
                    f"<b>{family_html(fam)}</b><br>graph %{{customdata[0]}}<br>"
                    "%{customdata[1]} atoms, %{customdata[2]} edges<br>"
                    f"%{{x:.0f}} {unit}, starts at %{{base:.0f}}<extra>rank %{{y}}</extra>"
                ),
            ),
            row=row,
            col=col,
        )
        shown.add(fam)


def _no_step(fig, col: int) -> None:
    fig.add_annotation(
        text="no such step:<br>this epoch is shorter",
        showarrow=False,
        font_size=14,
        xref=f"x{col if col > 1 else ''} domain",
        yref="y domain",
        x=0.5,
        y=0.5,
    )


def _panel(fig, col: int, rects: Rectangles, capacity: float | None, shown: set, unit: str) -> float:
    """Draw one panel's rectangles, mark its slowest rank and the capacity; returns its longest row."""
    _add_rectangles(fig, rects, 1, col, shown, unit)
    loads = rects.rank_loads()
    longest = 0.0
    if loads.size:
        longest = float(loads.max())
        worst = int(np.argmax(loads))
        fig.add_annotation(
            x=float(loads[worst]),
            y=worst,
            text=" slowest",
            showarrow=False,
            xanchor="left",
            font=dict(size=11, color="#555"),
            row=1,
            col=col,
        )
    if capacity:
        fig.add_vline(x=float(capacity), line=dict(dash="dash", color="#333", width=1.2), row=1, col=col)
    return longest


def _axes(fig, nrows: int, total_ranks: int | None, capacity: float | None, unit: str, xmax: float) -> None:
    fig.update_layout(
        barmode="overlay", bargap=0.25, legend=dict(orientation="h", y=-0.18, x=0), height=max(260, 130 + 34 * nrows)
    )
    fig.update_yaxes(
        autorange="reversed",
        tickmode="array",
        tickvals=list(range(nrows)),
        ticktext=[f"GPU {r}" for r in range(nrows)],
        range=[nrows - 0.5, -0.5],
    )
    fig.update_yaxes(
        title_text="rank" + (f" (first {nrows} of {total_ranks})" if total_ranks and total_ranks > nrows else ""), col=1
    )
    cap_note = f" (dashed: capacity {capacity:,.0f})" if capacity else ""
    fig.update_xaxes(title_text=f"{unit} in the batch{cap_note}", range=[0, 1.08 * max(xmax, 1.0)])


def bin_layout_figure(
    panels: Sequence[tuple[str, Rectangles | None]],
    capacity: float | None = None,
    title: str = "Graphs per GPU in one step",
    unit: str = "atoms",
    total_ranks: int | None = None,
    figure_widget: bool = False,
):
    """Side-by-side layouts, e.g. ``[("fixed-count", rects_a), ("paper", rects_b)]``.

    A panel whose rectangles are ``None`` shows "no such step" (that epoch is
    shorter). ``capacity`` draws a dashed line; ``total_ranks`` notes when only
    the first ranks are drawn.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    titles = [t for t, _ in panels]
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.04)
    shown: set = set()
    nrows = max([r.num_ranks for _, r in panels if r is not None] or [1])
    xmax = float(capacity or 0)
    for c, (_, rects) in enumerate(panels, start=1):
        if rects is None:
            _no_step(fig, c)
        else:
            xmax = max(xmax, _panel(fig, c, rects, capacity, shown, unit))
    _axes(fig, nrows, total_ranks, capacity, unit, xmax)
    style(fig, title)
    fig.update_layout(margin=dict(t=80))
    if figure_widget:
        return go.FigureWidget(fig)
    return fig


#: The packers the layout app offers: the registered algorithms that respect a capacity.
LAYOUT_PACKERS: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.respects_capacity)


def _controls(capacity: int, algorithm: str) -> dict:
    """The app's widgets: capacity slider, packer dropdown, step slider and its play button, info line."""
    import ipywidgets as W

    label = {"description_width": "80px"}
    slider = dict(style=label, layout=W.Layout(width="420px"))
    w = {
        "capacity": W.IntSlider(
            value=capacity, min=800, max=4096, step=64, description="capacity", continuous_update=False, **slider
        ),
        "algorithm": W.Dropdown(options=list(LAYOUT_PACKERS), value=algorithm, description="packer", style=label),
        "step": W.IntSlider(value=0, min=0, max=1, description="step", continuous_update=True, **slider),
        "play": W.Play(value=0, min=0, max=1, interval=600, description="play"),
        "info": W.HTML(),
    }
    W.jslink((w["play"], "value"), (w["step"], "value"))
    return w


def _baseline_options(algorithm: str, baseline: str, graphs_per_batch: int) -> dict:
    """Check the app's two algorithms; the baseline's options (its graph count, when it takes one)."""
    if algorithm not in LAYOUT_PACKERS:
        raise ValueError(f"algorithm {algorithm!r}: the app shows one of {', '.join(LAYOUT_PACKERS)}")
    return {"graphs_per_batch": graphs_per_batch} if algorithm_named(baseline).takes_graphs_per_batch else {}


def bin_layout_app(
    sizes: np.ndarray,
    capacity: int = DEFAULT_CAPACITY,
    num_replicas: int = 8,
    algorithm: str = "paper",
    baseline: str = "fixed-count",
    baseline_graphs_per_batch: int = 4,
    seed: int = 0,
    max_ranks: int = 16,
):
    """Figure-12 explorer: baseline and packer side by side, a slider steps through the epoch.

    Packs live (meant for datasets up to ~100k graphs, e.g. the embedded one): sliders for
    capacity and step, a dropdown for the packer (:data:`LAYOUT_PACKERS`). The baseline, any
    registered algorithm (default ``fixed-count`` with ``baseline_graphs_per_batch`` graphs,
    PyG's default, as in the paper's figure), gets the same capacity; a count-based one ignores it.
    """
    import ipywidgets as W

    b_opts = _baseline_options(algorithm, baseline, baseline_graphs_per_batch)
    w = _controls(capacity, algorithm)
    cap_w, algo_w, step_w, play, info = (w[k] for k in ("capacity", "algorithm", "step", "play", "info"))
    state: dict = {}  # the two packings at the current capacity
    fig = bin_layout_figure([(baseline, None), (algorithm, None)], capacity, figure_widget=True)

    def repack(*_):
        state["base"] = pack(sizes, cap_w.value, num_replicas, baseline, seed, **b_opts)
        state["pack"] = pack(sizes, cap_w.value, num_replicas, algo_w.value, seed)
        step_w.max = play.max = max(state["base"].n_steps, state["pack"].n_steps) - 1
        redraw()

    def redraw(*_):
        s = step_w.value
        panels = []
        for key, label in (
            ("base", f"{baseline} ({baseline_graphs_per_batch} graphs/batch)" if b_opts else baseline),
            ("pack", f"{algo_w.value} (capacity {cap_w.value:,})"),
        ):
            p = state[key]
            rects = layout_rectangles(p, s, sizes, ranks=max_ranks) if s < p.n_steps else None
            panels.append((f"{label}: step {s + 1} of {p.n_steps}", rects))
        new = bin_layout_figure(
            panels, cap_w.value, title=f"Graphs per GPU at step {s + 1} ({num_replicas} GPUs)", total_ranks=num_replicas
        )
        with fig.batch_update():
            fig.data = []
            fig.add_traces(list(new.data))
            fig.layout = new.layout
        info.value = _info(baseline, algo_w.value, state["base"], state["pack"], num_replicas, s)

    for widget, handler in ((cap_w, repack), (algo_w, repack), (step_w, redraw)):
        widget.observe(handler, "value")
    repack()
    fig.add_class("wb-layout-figure")
    app = W.VBox([W.HBox([cap_w, algo_w]), W.HBox([step_w, play]), info, fig])
    app.add_class("wb-layout-app")
    return app


def _info(baseline: str, packer: str, base, packed, r: int, step: int) -> str:
    """The line under the controls: steps per epoch of both, and the slowest GPU at this step."""
    return (
        f"<div class='wb-layout-info'>{baseline}: <b>{base.n_steps}</b> steps per epoch · "
        f"{packer}: <b>{packed.n_steps}</b> steps · slowest GPU at this step: "
        + " vs ".join(f"<b>{_step_max(p.loads(), r, step):,.0f}</b>" for p in (base, packed))
        + " atoms</div>"
    )


def _step_max(loads: np.ndarray, r: int, step: int) -> float:
    per = loads.reshape(-1, r)
    return float(per[step].max()) if step < per.shape[0] else float("nan")
