"""The trajectory part of ``workbench bench cpu``: the paper's Figure 9 check on a CPU.

``steps`` training steps of the same run with ``backend="e3nn"`` and ours (``numba``) (same seed,
data and batches), compared step by step: float64 must agree to :data:`FLOAT64_RTOL` relative,
float32 to :data:`FLOAT32_RTOL` (float32 noise: the two backends sum in different orders, and
training amplifies a rounding difference step by step; for scale, e3nn's own float32 run drifts
from its float64 run by tens of percent within 100 steps, which the result records).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.bench.workloads import MODELS
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["FLOAT32_RTOL", "FLOAT64_RTOL", "trajectory", "trajectory_figure", "trajectory_lines"]

#: float32 trajectories: relative loss difference allowed per step (about 800 float32 ulps; measured
#: over 100 steps of the small model: 2.4e-7)
FLOAT32_RTOL = 1e-4
#: float64 trajectories: relative loss difference allowed per step
FLOAT64_RTOL = 1e-8


def _run(
    dtype: str, backend: str, steps: int, workdir: str | os.PathLike, families: Sequence[str] | None = None
) -> list[float]:
    """The losses of one short training run of the small model (on ``families`` of the mixture, or all)."""
    from workbench.train.config import TrainConfig
    from workbench.train.loop import train
    from workbench.train.rundir import read_steps

    hidden, ell, corr = MODELS["small"]
    cfg = TrainConfig(
        name=f"trajectory-{dtype}-{backend}",
        output_dir=str(workdir),
        hidden_irreps=hidden,
        max_ell=ell,
        correlation=corr,
        dtype=dtype,
        backend=backend,
        sampler="fixed-count",
        batch_size=8,
        max_structures=max(64, 8 * steps),
        families=list(families) if families else None,
        epochs=100,
        max_steps=steps,
        checkpoint_every=0,
        progress=False,
        export=False,
        seed=0,
    )
    train(cfg, resume=False)
    return [s["loss"] for s in read_steps(cfg.run_dir)]


def trajectory(
    steps: int, dtypes: Sequence[str], workdir: str | os.PathLike, families: Sequence[str] | None = None
) -> dict:
    """The Figure 9 check: the same short training run with e3nn and numba, losses per step
    (on the embedded mixture's ``families``, or all of it)."""
    losses: dict[str, list[float]] = {}
    wanted = list(dtypes) + (["float64"] if "float32" in dtypes and "float64" not in dtypes else [])
    for dtype in wanted:
        for backend in ("e3nn", DEFAULT_BACKEND):
            if dtype in dtypes or backend == "e3nn":
                losses[f"{backend}-{dtype}"] = _run(dtype, backend, steps, workdir, families)
    res: dict[str, Any] = {"steps": steps, "families": list(families) if families else None, "losses": losses}

    def rel(a: str, b: str) -> float:
        x, y = np.asarray(losses[a]), np.asarray(losses[b])
        return float(np.max(np.abs(x - y) / np.abs(y)))

    if "float64" in dtypes:
        d = rel(f"{DEFAULT_BACKEND}-float64", "e3nn-float64")
        res["float64"] = {"max_rel_diff": d, "bound": FLOAT64_RTOL, "ok": d <= FLOAT64_RTOL}
    if "float32" in dtypes:
        d = rel(f"{DEFAULT_BACKEND}-float32", "e3nn-float32")
        noise = rel("e3nn-float32", "e3nn-float64")
        res["float32"] = {
            "max_rel_diff": d,
            "e3nn_float32_vs_float64": noise,
            "bound": FLOAT32_RTOL,
            "ok": d <= FLOAT32_RTOL,
        }
    return res


def trajectory_figure(res: dict, path: str | os.PathLike) -> None:
    """Both loss curves per dtype, and their relative difference, as a self-contained HTML file."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    losses = res["losses"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training loss per step", "|numba - e3nn| / e3nn"))
    for name, ys in losses.items():
        fig.add_trace(
            go.Scatter(
                y=ys, name=name, mode="lines", line={"dash": "dot" if name.startswith(DEFAULT_BACKEND) else "solid"}
            ),
            1,
            1,
        )
    for dtype in ("float32", "float64"):
        if f"{DEFAULT_BACKEND}-{dtype}" in losses and f"e3nn-{dtype}" in losses:
            x, y = np.asarray(losses[f"{DEFAULT_BACKEND}-{dtype}"]), np.asarray(losses[f"e3nn-{dtype}"])
            fig.add_trace(
                go.Scatter(y=(np.abs(x - y) / np.abs(y)).tolist(), name=f"{dtype} difference", mode="lines"), 1, 2
            )
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(
        title="Figure 9 check on a CPU: the numba kernels follow e3nn's training run", width=1300, height=480
    )
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)


def trajectory_lines(tr: dict) -> list[str]:
    """The verdict per dtype, as text."""
    lines = []
    for dtype in ("float64", "float32"):
        if dtype in tr:
            r = tr[dtype]
            extra = f" (e3nn float32 vs float64: {r['e3nn_float32_vs_float64']:.2e})" if dtype == "float32" else ""
            lines.append(
                f"trajectory {tr['steps']} steps, {dtype}: max |numba - e3nn| / e3nn = {r['max_rel_diff']:.2e}, "
                f"bound {r['bound']:.2e}{extra}: {'ok' if r['ok'] else 'FAILED'}"
            )
    return lines
