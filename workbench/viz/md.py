"""The energy of an MD run against time: the check that a trained model conserves energy."""

from __future__ import annotations

from typing import Any

__all__ = ["md_energy_figure"]


def md_energy_figure(result: Any):
    """Total and potential energy per atom (relative to the start) against time, from a
    :class:`workbench.train.md.MDResult`, with the fitted drift in the title."""
    import numpy as np
    import plotly.graph_objects as go

    t = np.asarray(result.time_ps)
    n = result.atoms
    etot = (np.asarray(result.total_energy) - result.total_energy[0]) / n
    epot = (np.asarray(result.potential_energy) - result.total_energy[0]) / n
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=t, y=etot, name="total", mode="lines", line={"width": 3}))
    fig.add_trace(go.Scatter(x=t, y=epot, name="potential", mode="lines", line={"dash": "dot"}))
    fig.update_layout(
        title=f"{result.ensemble.upper()} with the trained model: drift {result.drift_ev_atom_ps:+.2e} eV/atom/ps, "
        f"{result.ns_per_day:.2f} ns/day ({result.backend})",
        xaxis_title="time (ps)",
        yaxis_title="E − E_total(0) (eV/atom)",
        height=380,
        margin={"t": 60, "r": 20},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig
