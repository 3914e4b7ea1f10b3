"""Dataset view: how many graphs each family brings and how big they are (Table 3 / Figure 5)."""

from __future__ import annotations

import numpy as np

from workbench.viz.style import family_color, family_html, family_order, panel_row, style

QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)


def distribution_stats(sizes: np.ndarray) -> list[dict]:
    """Per family (Table-3 order): graph count and share, and atoms/edges min, quartiles, max, mean.

    Box plots are drawn from these numbers rather than from the raw points, so the
    2.65M-graph synthetic set costs the browser eight boxes, not 2.65M points.
    """
    out = []
    for fam in family_order(sizes["family"]):
        sel = sizes[sizes["family"] == fam]
        row = {"family": fam, "graphs": int(sel.size), "share": sel.size / sizes.size}
        for field in ("atoms", "edges"):
            q = np.quantile(sel[field], QUANTILES)
            row[field] = dict(zip(("min", "q1", "median", "q3", "max"), map(float, q)), mean=float(sel[field].mean()))
        out.append(row)
    return out


def _share_bars(stats: list[dict], names: list[str], colors: list[str]):
    """Horizontal bars: graphs per family, labelled with their share."""
    import plotly.graph_objects as go

    return go.Bar(
        y=names,
        x=[s["graphs"] for s in stats],
        orientation="h",
        marker_color=colors,
        text=[f"{100 * s['share']:.1f}%" for s in stats],
        textposition="outside",
        cliponaxis=False,
        customdata=[s["share"] * 100 for s in stats],
        showlegend=False,
        hovertemplate="%{y}: %{x:,} graphs (%{customdata:.1f}%)<extra></extra>",
    )


def _size_box(d: dict, name: str, color: str):
    """One family's distribution of a size (min, quartiles, max, mean) as a precomputed box."""
    import plotly.graph_objects as go

    return go.Box(
        y=[name],
        q1=[d["q1"]],
        median=[d["median"]],
        q3=[d["q3"]],
        lowerfence=[d["min"]],
        upperfence=[d["max"]],
        mean=[d["mean"]],
        orientation="h",
        name=name,
        marker_color=color,
        fillcolor=color,
        line=dict(color="#333", width=1),
        showlegend=False,
        hoverinfo="x+name",
    )


def dataset_figure(sizes: np.ndarray, title: str | None = None, log: bool = True):
    """Three panels: share of graphs, atoms per graph, edges per graph, one colour per family."""
    stats = distribution_stats(sizes)
    fig = panel_row(("graphs per family", "atoms per graph", "edges per graph"), [0.26, 0.37, 0.37], 0.07)
    names = [family_html(s["family"]) for s in stats]
    colors = [family_color(s["family"]) for s in stats]
    fig.add_trace(_share_bars(stats, names, colors), 1, 1)
    for col, field in ((2, "atoms"), (3, "edges")):
        for s, name, color in zip(stats, names, colors):
            fig.add_trace(_size_box(s[field], name, color), 1, col)
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=names)
    fig.update_yaxes(showticklabels=False, col=2)
    fig.update_yaxes(showticklabels=False, col=3)
    fig.update_xaxes(title_text="graphs", col=1)
    fig.update_xaxes(title_text="atoms (vertices) per graph", type="log" if log else "linear", col=2)
    fig.update_xaxes(title_text="directed edges per graph (4.5 Å cutoff)", type="log" if log else "linear", col=3)
    style(fig, title or f"{sizes.size:,} graphs: families and graph sizes (boxes: min, quartiles, max)", height=380)
    return fig


def family_table_html(sizes: np.ndarray) -> str:
    """Table 3 as HTML: graphs, share, atoms range and mean, edges mean, edges per atom, per family."""
    from workbench.data.summary import summarize

    rows = summarize(sizes)
    head = ("family", "graphs", "share", "atoms min–max", "atoms mean", "edges mean", "edges/atom")
    cells = []
    for r in rows:
        swatch = (
            ""
            if r["family"] == "total"
            else f"<span style='display:inline-block;width:10px;height:10px;background:{family_color(r['family'])};"
            f"margin-right:6px;border-radius:2px'></span>"
        )
        name = "total" if r["family"] == "total" else family_html(r["family"])
        weight = "font-weight:600;border-top:1px solid #999" if r["family"] == "total" else ""
        vals = (
            f"{swatch}{name}",
            f"{r['graphs']:,}",
            f"{100 * r['share']:.1f}%",
            f"{r['atoms_min']:,}–{r['atoms_max']:,}",
            f"{r['atoms_mean']:.1f}",
            f"{r['edges_mean']:,.0f}",
            f"{r['edges_per_atom']:.1f}",
        )
        cells.append(
            "<tr>"
            + "".join(
                f"<td style='padding:2px 10px;text-align:{'left' if i == 0 else 'right'};{weight}'>{v}</td>"
                for i, v in enumerate(vals)
            )
            + "</tr>"
        )
    return (
        "<table class='wb-family-table' style='border-collapse:collapse;font-size:13px'><tr>"
        + "".join(
            f"<th style='padding:2px 10px;text-align:{'left' if i == 0 else 'right'};"
            f"border-bottom:1px solid #999'>{h}</th>"
            for i, h in enumerate(head)
        )
        + "</tr>"
        + "".join(cells)
        + "</table>"
    )
