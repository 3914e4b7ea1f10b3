"""A self-contained HTML report of a run: loss curves, per-rank step time, packing layout."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from workbench.train.rundir import RunDir, read_epochs, read_steps


def _layout_figure(packing, families: np.ndarray | None, step: int = 0):
    import plotly.graph_objects as go

    fig = go.Figure()
    R = packing.num_replicas
    batches = packing.batches
    names = sorted(set(families.tolist())) if families is not None else ["graph"]
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#9D755D"]
    color = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    shown = set()
    for r in range(R):
        x0 = 0.0
        for g in batches[step * R + r]:
            size = float(packing.costs[g])
            fam = str(families[g]) if families is not None else "graph"
            fig.add_trace(go.Bar(y=[f"rank {r}"], x=[size], base=[x0], orientation="h", name=fam,
                                 marker_color=color[fam], showlegend=fam not in shown,
                                 hovertext=f"graph {int(g)}: {size:.0f} ({fam})"))
            shown.add(fam)
            x0 += size
    fig.add_vline(x=packing.capacity, line_dash="dash", annotation_text="capacity")
    fig.update_layout(barmode="overlay", title=f"Packing layout, step {step} ({packing.algorithm})",
                      xaxis_title="atoms", height=150 + 40 * R)
    return fig


def write_report(run_dir: str | os.PathLike, packing=None, families: np.ndarray | None = None) -> Path:
    """Write ``<run_dir>/report.html`` (plotly.js embedded, opens offline)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    run_dir = Path(run_dir)
    steps = read_steps(run_dir)
    epochs = read_epochs(run_dir)
    ranks = sorted({s["rank"] for s in steps})
    fig = make_subplots(rows=2, cols=1, subplot_titles=("training loss per rank", "step time per rank (s)"))
    for r in ranks:
        mine = [s for s in steps if s["rank"] == r]
        x = [s["global_step"] for s in mine]
        fig.add_trace(go.Scatter(x=x, y=[s["loss"] for s in mine], name=f"loss rank {r}", mode="lines"), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=[s["compute_s"] for s in mine], name=f"compute rank {r}", mode="lines"), 2, 1)
        fig.add_trace(go.Scatter(x=x, y=[s["allreduce_s"] for s in mine], name=f"all-reduce wait rank {r}",
                                 mode="lines", line_dash="dot"), 2, 1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(height=700, title=f"run {run_dir.name}")
    parts = [fig.to_html(full_html=False, include_plotlyjs=True)]
    if epochs:
        rows = "".join(
            f"<tr><td>{e['epoch']}</td><td>{e['epoch_s']:.1f}</td><td>{e['train_e_mae_mev_atom']:.1f}</td>"
            f"<td>{e['train_f_mae_mev_a']:.1f}</td><td>{e['valid_e_mae_mev_atom']:.1f}</td>"
            f"<td>{e['valid_f_mae_mev_a']:.1f}</td><td>{e['compute_share']:.0%}</td><td>{e['allreduce_share']:.0%}</td></tr>"
            for e in epochs)
        parts.append("<h3>Epochs</h3><table border=1 cellpadding=4><tr><th>epoch</th><th>s</th><th>train E MAE meV/atom</th>"
                     "<th>train F MAE meV/Å</th><th>valid E MAE</th><th>valid F MAE</th><th>compute</th>"
                     f"<th>all-reduce wait</th></tr>{rows}</table>")
    from workbench.train.evaluate import family_table_html, last_validation

    valid = last_validation(epochs)
    if valid is not None:
        parts.append(family_table_html(valid, f"Validation errors per config_type (epoch {valid['epoch']})"))
    if packing is not None:
        parts.append(_layout_figure(packing, families).to_html(full_html=False, include_plotlyjs=False))
    html = "<html><head><meta charset='utf-8'><title>cfm-workbench run report</title></head><body>" \
           + "\n".join(parts) + "</body></html>"
    out = RunDir(run_dir).report
    out.write_text(html)
    return out
