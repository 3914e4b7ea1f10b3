"""Capacity study: how bin capacity, GPU count and algorithm change padding, balance and epoch time.

At the paper's scale (2.65M graphs) one :func:`workbench.packing.pack` call takes
0.3-1.6 s on one CPU core, too slow for a slider that must answer in under a
second. So the app on the 2.65M synthetic sizes reads a **precomputed grid**:
exact ``pack(...).metrics()`` results for every capacity x GPU count x algorithm
on the grid below, computed once by ``python -m workbench.viz.capacity`` and
stored with the fingerprint of the sizes it was computed on. Sliders snap to the
grid points; nothing is interpolated or subsampled. For any other sizes array
(e.g. the embedded 2,000 graphs) the app packs live and caches each point.
The screen always says which of the two it shows, and how long the answer took.

Baseline: ``fixed-count`` (PyG's default) with ``round(capacity / mean atoms)``
graphs per batch, i.e. the same mean atoms per batch as the packers, so both
have about the same number of steps and differ only in how sizes are spread.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from workbench.limits import DEFAULT_CAPACITY
from workbench.packing.grid import (  # noqa: F401 (re-exported: the grid's computation lives in packing)
    BASELINE,
    GRID_ALGORITHMS,
    GRID_CAPACITIES,
    GRID_GPUS,
    LAYOUT_RANKS,
    LAYOUT_STEPS,
    METRICS,
    baseline_graphs_per_batch,
    compute_point,
    packing_behaviour,
    precompute_grid,
    sizes_fingerprint,
)
from workbench.viz.style import ALGORITHM_COLORS, panel_row, style

GRID_DIR = Path(__file__).resolve().parent / "data"
PAPER_N, PAPER_SEED = 2_650_000, 0
WIDGET_WIDTH = 1000  # px, the figures of the capacity app


def grid_path(n: int = PAPER_N, seed: int = PAPER_SEED) -> Path:
    """Where the precomputed grid for ``synthetic_sizes(n, seed)`` lives."""
    return GRID_DIR / f"capacity_grid_{n}_seed{seed}.npz"


class CapacityStudy:
    """Metrics of any (capacity, GPUs, algorithm) point on one sizes array.

    ``source`` is ``"grid"`` when a precomputed grid matches the sizes exactly
    (fingerprint), else ``"live"`` (pack on demand, LRU-cached). ``grid`` may be
    a path, ``"auto"`` (the packaged grid for ``synthetic_sizes(2_650_000, 0)``)
    or ``None`` (always live).
    """

    def __init__(
        self,
        sizes: np.ndarray,
        grid: str | Path | None = "auto",
        seed: int = 0,
        label: str | None = None,
        cache_size: int = 64,
    ) -> None:
        self.sizes = sizes
        self.seed = int(seed)
        self.label = label or f"{sizes.size:,} graphs"
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        self.meta: dict | None = None
        self.stale_code = False
        path = grid_path(sizes.size, seed) if grid == "auto" else grid
        if path is not None and Path(path).exists():
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta["n"] == sizes.size and meta["sizes_sha1"] == sizes_fingerprint(sizes):
                    self.meta = meta
                    self.grid_file = Path(path)
                    self._metrics, self._steps = z["metrics"], z["steps"]
                    self._lranks, self._loff, self._lflat = z["layout_ranks"], z["layout_offsets"], z["layout_flat"]
                    self.stale_code = meta.get("packing_behaviour") != packing_behaviour(meta["algorithms"], seed)
        self.source = "grid" if self.meta else "live"

    # -- grid geometry
    @property
    def capacities(self) -> list[int]:
        return list(self.meta["capacities"]) if self.meta else list(GRID_CAPACITIES)

    @property
    def gpus(self) -> list[int]:
        gp = list(self.meta["gpus"]) if self.meta else list(GRID_GPUS)
        return [r for r in gp if r <= self.sizes.size]

    @property
    def algorithms(self) -> list[str]:
        return list(self.meta["algorithms"]) if self.meta else list(GRID_ALGORITHMS)

    def describe(self) -> str:
        """One line on where the numbers come from (shown on screen)."""
        if self.meta:
            m = self.meta
            what = m.get("description") or "the sizes array"
            txt = (
                f"Precomputed grid: exact pack(...).metrics() on all {m['n']:,} graphs of "
                f"{what} at {len(m['capacities'])} capacities × "
                f"{len(m['gpus'])} GPU counts × {len(m['algorithms'])} algorithms "
                f"(computed {m['created']} in {m['seconds'] / 60:.0f} min); sliders snap to grid points, "
                f"nothing is subsampled or interpolated."
            )
            if self.stale_code:
                txt += (
                    " Note: the packers now give other results than when it was computed; regenerate with "
                    "<code>python -m workbench.viz.capacity</code>."
                )
            return txt
        return f"Live: every point is packed on demand on all {self.label} (cached once computed)."

    def _index(self, capacity: float, num_gpus: int, algorithm: str) -> tuple[int, int, int] | None:
        if not self.meta:
            return None
        try:
            return (
                self.meta["capacities"].index(int(capacity)),
                self.meta["gpus"].index(int(num_gpus)),
                self.meta["algorithms"].index(algorithm),
            )
        except ValueError:
            return None

    def query(self, capacity: float, num_gpus: int, algorithm: str) -> dict:
        """``{"metrics", "layouts", "source", "seconds"}`` for one point (grid lookup or live pack)."""
        t0 = time.perf_counter()
        idx = self._index(capacity, num_gpus, algorithm)
        if idx is not None:
            vals = self._metrics[idx]
            metrics = {k: float(v) for k, v in zip(self.meta["metrics"], vals)}
            flat_id = np.ravel_multi_index(idx, self._metrics.shape[:3]) * len(self.meta["layout_steps"])
            # Layout records were written point after point, kind after kind: find this point's start.
            start_rank = int(self._lranks[:flat_id].sum())
            layouts = {}
            for q, kind in enumerate(self.meta["layout_steps"]):
                n_r = int(self._lranks[flat_id + q])
                b = [
                    self._lflat[self._loff[start_rank + r] : self._loff[start_rank + r + 1]].astype(np.int64)
                    for r in range(n_r)
                ]
                layouts[kind] = (int(self._steps[idx][q]), b)
                start_rank += n_r
            return {"metrics": metrics, "layouts": layouts, "source": "grid", "seconds": time.perf_counter() - t0}
        key = (int(capacity), int(num_gpus), algorithm)
        if key in self._cache:
            self._cache.move_to_end(key)
            out = dict(self._cache[key], source="cache", seconds=time.perf_counter() - t0)
            return out
        pt = compute_point(self.sizes, capacity, num_gpus, algorithm, self.seed)
        self._cache[key] = pt
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return dict(pt, source="live", seconds=time.perf_counter() - t0)

    def curve(self, num_gpus: int, algorithm: str, metric: str) -> tuple[list[int], list[float]]:
        """``metric`` against capacity at ``num_gpus`` (grid: all capacities; live: cached points only)."""
        if self.meta:
            j, k = self.meta["gpus"].index(int(num_gpus)), self.meta["algorithms"].index(algorithm)
            m = self.meta["metrics"].index(metric)
            return self.capacities, self._metrics[:, j, k, m].tolist()
        pts = sorted(
            (c, v["metrics"][metric]) for (c, r, a), v in self._cache.items() if r == num_gpus and a == algorithm
        )
        return [c for c, _ in pts], [v for _, v in pts]


def metrics_html(point: dict, base: dict, algorithm: str, capacity: int, gpus: int, source_line: str) -> str:
    """The metric cards of the capacity app (an HTML snippet with stable CSS classes for tests)."""
    m, b = point["metrics"], base["metrics"]
    speed = b["est_epoch_seconds"] / m["est_epoch_seconds"] if m["est_epoch_seconds"] else float("nan")

    def card(cls: str, title: str, value: str, sub: str) -> str:
        return (
            f"<div class='wb-card {cls}' style='flex:1;min-width:150px;border:1px solid #ddd;border-radius:8px;"
            f"padding:8px 12px;background:#fafafa'><div style='color:#666;font-size:12px'>{title}</div>"
            f"<div class='wb-value' style='font-size:22px;font-weight:600'>{value}</div>"
            f"<div style='color:#666;font-size:12px'>{sub}</div></div>"
        )

    took = point["seconds"] * 1e3
    how = {"grid": "grid lookup", "cache": "cached", "live": "packed live"}[point["source"]]
    cards = "".join(
        [
            card(
                "wb-padding",
                "padding waste",
                f"{100 * m['padding_fraction']:.2f}%",
                f"{BASELINE}: {100 * b['padding_fraction']:.1f}%",
            ),
            card(
                "wb-bins",
                "batches vs lower bound",
                f"{m['n_bins']:,.0f}",
                f"lower bound {m['lower_bound_bins']:,.0f} (×{m['bins_over_lb']:.3f}); {m['n_steps']:,.0f} steps",
            ),
            card(
                "wb-imbalance",
                "step imbalance (max / mean)",
                f"{m['step_imbalance_max']:.3f}",
                f"mean {m['step_imbalance_mean']:.4f}; {BASELINE}: {b['step_imbalance_max']:.2f}",
            ),
            card(
                "wb-epoch",
                "est. epoch time (cost model)",
                f"{m['est_epoch_seconds']:,.1f} s",
                f"{BASELINE}: {b['est_epoch_seconds']:,.1f} s → <b>{speed:.2f}×</b>",
            ),
        ]
    )
    return (
        f"<div class='wb-capacity-metrics' data-capacity='{capacity}' data-gpus='{gpus}' "
        f"data-algorithm='{algorithm}'><div style='display:flex;gap:10px;flex-wrap:wrap'>{cards}</div>"
        f"<div class='wb-source' style='color:#555;font-size:12px;margin-top:6px'>{source_line} "
        f"This answer: {how} in {took:.1f} ms.</div></div>"
    )


def capacity_curves_figure(
    study: CapacityStudy, num_gpus: int, algorithm: str, capacity: int, figure_widget: bool = False
):
    """Padding and estimated epoch time against capacity, algorithm vs baseline, current point marked."""
    import plotly.graph_objects as go

    fig = panel_row(("padding waste", "estimated epoch time (cost model)"), spacing=0.12)
    for a in dict.fromkeys([algorithm, BASELINE]):
        color = ALGORITHM_COLORS.get(a, "#333")
        for col, metric, scale in ((1, "padding_fraction", 100.0), (2, "est_epoch_seconds", 1.0)):
            xs, ys = study.curve(num_gpus, a, metric)
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[y * scale for y in ys],
                    mode="lines+markers",
                    name=a,
                    legendgroup=a,
                    showlegend=col == 1,
                    line=dict(color=color),
                    hovertemplate=f"{a}<br>capacity %{{x}}<br>%{{y:.3g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    for col in (1, 2):
        fig.add_vline(x=capacity, line=dict(color="#999", dash="dot"), row=1, col=col)
    fig.update_xaxes(title_text="bin capacity (atoms)")
    fig.update_yaxes(title_text="padding (% of reserved memory)", row=1, col=1)
    fig.update_yaxes(title_text="epoch time (s)", type="log", row=1, col=2)
    style(fig, f"{algorithm} vs {BASELINE} across capacities, {num_gpus} GPUs", height=330)
    return go.FigureWidget(fig) if figure_widget else fig


def _capacity_controls(study: CapacityStudy, capacity: int, num_gpus: int, algorithm: str) -> tuple:
    """The app's sliders and toggles: ``(capacity, GPUs, algorithm, step)``, nearest grid points picked."""
    import ipywidgets as W

    dstyle = {"description_width": "90px"}

    def slider(options, wanted, description):
        return W.SelectionSlider(
            options=options,
            value=min(options, key=lambda x: abs(x - wanted)),
            description=description,
            continuous_update=False,
            style=dstyle,
            layout=W.Layout(width="460px"),
        )

    cap_w = slider(study.capacities, capacity, "capacity")
    gpu_w = slider(study.gpus, num_gpus, "GPUs")
    algo_w = W.ToggleButtons(options=study.algorithms, value=algorithm, description="algorithm", style=dstyle)
    step_w = W.ToggleButtons(
        options=[("first step", "first"), ("middle step", "middle"), ("least balanced step", "worst")],
        value="first",
        description="show",
        style=dstyle,
    )
    cap_w.add_class("wb-capacity-slider")
    gpu_w.add_class("wb-gpus-slider")
    return cap_w, gpu_w, algo_w, step_w


def _replace_figure(fig_w, new) -> None:
    """Swap the traces and layout of the widget ``fig_w`` for those of ``new``."""
    new.update_layout(width=WIDGET_WIDTH)  # widgets do not always size to the cell; be explicit
    with fig_w.batch_update():
        fig_w.data = []
    fig_w.add_traces(list(new.data))
    fig_w.layout = new.layout


def _step_panels(base: dict, point: dict, algorithm: str, step: str, sizes: np.ndarray) -> list[tuple]:
    """The baseline's and ``algorithm``'s graphs per GPU at ``step`` (first, middle, worst), as layout panels."""
    from workbench.viz.layout import rectangles_from_batches

    panels = []
    for name, q in (
        (f"{BASELINE} ({int(base['metrics']['graphs_per_batch_mean'] + 0.5)} graphs/batch)", base),
        (algorithm, point),
    ):
        s, batches = q["layouts"][step]
        panels.append(
            (f"{name}: step {s + 1:,} of {q['metrics']['n_steps']:,.0f}", rectangles_from_batches(batches, sizes))
        )
    return panels


def capacity_app(
    sizes: np.ndarray,
    grid: str | Path | None = "auto",
    capacity: int = DEFAULT_CAPACITY,
    num_gpus: int = 64,
    algorithm: str = "paper",
    seed: int = 0,
    label: str | None = None,
):
    """Sliders for capacity (800-4096), GPUs (1-1024) and algorithm; live metric cards and figures.

    Shows padding waste, batches against the lower bound, step imbalance and the
    estimated epoch time against the fixed-count baseline (default
    :class:`~workbench.packing.CostModel`), plus the graphs per GPU of the
    first, middle or least balanced step for the first 8 GPUs.
    """
    import ipywidgets as W

    from workbench.viz.layout import bin_layout_figure

    study = sizes if isinstance(sizes, CapacityStudy) else CapacityStudy(sizes, grid=grid, seed=seed, label=label)
    cap_w, gpu_w, algo_w, step_w = _capacity_controls(study, capacity, num_gpus, algorithm)
    cards = W.HTML()
    cards.add_class("wb-capacity-cards")
    layout_fig = bin_layout_figure([(BASELINE, None), (algorithm, None)], capacity, figure_widget=True)
    curves = capacity_curves_figure(study, gpu_w.value, algo_w.value, cap_w.value, figure_widget=True)
    layout_fig.add_class("wb-capacity-layout")
    curves.add_class("wb-capacity-curves")
    curves_for: dict = {}  # the first update builds the curves

    def update(*_):
        c, r, a = cap_w.value, gpu_w.value, algo_w.value
        pt, base = study.query(c, r, a), study.query(c, r, BASELINE)
        cards.value = metrics_html(pt, base, a, c, r, study.describe())
        panels = _step_panels(base, pt, a, step_w.value, study.sizes)
        _replace_figure(
            layout_fig,
            bin_layout_figure(panels, c, title=f"Graphs per GPU, capacity {c:,} atoms, {r:,} GPUs", total_ranks=r),
        )
        if curves_for.get("key") != (r, a):  # the curves depend on GPUs and algorithm only
            _replace_figure(curves, capacity_curves_figure(study, r, a, c))
            curves_for["key"] = (r, a)
        else:  # a capacity move only shifts the marker lines
            with curves.batch_update():
                for shape in curves.layout.shapes:
                    shape.x0 = shape.x1 = c

    for w in (cap_w, gpu_w, algo_w, step_w):
        w.observe(update, "value")
    update()
    head = W.HTML(f"<h3 style='margin:4px 0'>Capacity study on {study.label}</h3>")
    app = W.VBox([head, cap_w, gpu_w, algo_w, cards, step_w, layout_fig, curves])
    app.add_class("wb-capacity-app")
    app.study = study  # for scripted use: app.study.query(...)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workbench.viz.capacity``: (re)build the packaged grid for synthetic_sizes(2.65M, 0)."""
    import argparse

    from workbench.data import synthetic_sizes

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--n", type=int, default=PAPER_N)
    ap.add_argument("--seed", type=int, default=PAPER_SEED)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = synthetic_sizes(args.n, seed=args.seed)
    out = precompute_grid(
        sizes,
        args.out or grid_path(args.n, args.seed),
        seed=args.seed,
        description=f"synthetic_sizes({args.n}, seed={args.seed})",
    )
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
