"""Kernel timings: recorded benchmark results (``benchmarks/results/*.json``) as bars and on the roofline.

The reader accepts every result file the kernel lab writes (the symmetric
contraction bench, the channelwise tensor-product bench, CPU smoke runs and GPU
runs) and tolerates missing fields, skipped backends, failed runs and unreadable
files: each becomes a record or a note, never an exception.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from workbench.bench import table as bench_table
from workbench.viz.style import backend_color, style

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / bench_table.RESULTS_DIR
#: H100 SXM peaks used for the roofline: HBM3 bandwidth and non-tensor-core FP32 / FP64 throughput.
H100_BANDWIDTH = 3.35e12  # bytes/s
H100_FP32_FLOPS = 67e12  # FLOP/s
H100_FP64_FLOPS = 34e12  # FLOP/s
BLOCK_TARGETS = ("products", "interactions", "block", "model")
PASS_ORDER = ("forward", "forward_backward", "double_backward")
PASS_LABELS = {"forward": "forward", "forward_backward": "forward + backward", "double_backward": "double backward"}


def _bench_name(path: Path, data: dict) -> str:
    if data.get("bench"):
        return str(data["bench"])
    stem = path.stem
    for marker in ("_gpu", "_cpu", "_cuda"):
        if marker in stem:
            return stem.split(marker)[0]
    return stem


def _lookup(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _run_record(common: dict, data: dict, run: dict) -> dict:
    """One timed run as a record (see :func:`read_kernel_results`), with its FLOP/byte counts where known."""
    dtype, kind = run.get("dtype"), run.get("pass")
    sec = float(run["median_ms"]) * 1e-3
    # The descriptor counts the kernel alone; whole-block targets (products0, ...) also run
    # linear layers, so they get no FLOP/byte counts and stay off the roofline.
    counted = not str(run.get("target") or "").startswith(BLOCK_TARGETS)
    flops = run.get("flops") or (_lookup(data, "descriptor", dtype, "flops", kind) if counted else None)
    nbytes = (
        run.get("bytes")
        or run.get("min_bytes")
        or (_lookup(data, "descriptor", dtype, "min_bytes", kind) if counted else None)
    )
    rec = dict(
        common,
        backend=run.get("backend", "?"),
        dtype=dtype,
        target=run.get("target", common["bench"]),
        **{"pass": kind},
        median_ms=float(run["median_ms"]),
        min_ms=run.get("min_ms"),
        flops=float(flops) if flops else None,
        bytes=float(nbytes) if nbytes else None,
        peak_mem_mb=run.get("peak_mem_MB"),
        source=run.get("source"),
    )
    rec["gflops"] = rec["flops"] / sec / 1e9 if rec["flops"] and sec > 0 else None
    rec["gbps"] = rec["bytes"] / sec / 1e9 if rec["bytes"] and sec > 0 else None
    rec["intensity"] = rec["flops"] / rec["bytes"] if rec["flops"] and rec["bytes"] else None
    return rec


def _file_common(path: Path, data: dict) -> dict:
    device = str(data.get("device", "unknown"))
    return {
        "file": path.name,
        "bench": _bench_name(path, data),
        "label": data.get("label", ""),
        "device": device,
        "device_name": data.get("device_name", device),
        "gpu": device.startswith("cuda") or "gpu" in path.stem.lower(),
        "timestamp": data.get("timestamp"),
        "config": data.get("config", {}),
        "stopped": data.get("stopped"),
    }


def read_kernel_results(
    directory: str | Path | None = None, files: Iterable[str | Path] | None = None, include_skipped: bool = False
) -> tuple[list[dict], list[str]]:
    """Flatten result files into records; returns ``(records, notes)``.

    Each record: ``file, bench, label, device, device_name, gpu (bool), timestamp,
    config, stopped, backend, dtype, target, pass, median_ms, min_ms, flops, bytes,
    peak_mem_mb, source, gflops (achieved), gbps (achieved), intensity (FLOP/byte)``;
    fields a file does not have are ``None``. Skipped or failed runs become notes,
    and with ``include_skipped`` also records with ``median_ms=None`` and their
    ``skipped`` or ``error`` text (so a view can say why a row is missing).
    """
    directory = Path(directory) if directory is not None else RESULTS_DIR
    paths = sorted(Path(f) for f in files) if files is not None else sorted(directory.glob("*.json"))
    records, notes = [], []
    if files is None and not directory.exists():
        return [], [f"{directory}: no results directory yet (run a kernel benchmark first)"]
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            notes.append(f"{path.name}: unreadable ({type(exc).__name__}: {exc})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
            notes.append(f"{path.name}: no 'runs' list, skipped")
            continue
        common = _file_common(path, data)
        for run in data["runs"]:
            if not isinstance(run, dict):
                continue
            if "skipped" in run or "error" in run:
                why = str(run.get("skipped") or run.get("error")).splitlines()[0][:160]
                notes.append(
                    f"{path.name}: {run.get('backend', '?')} {run.get('dtype', '')} "
                    f"{run.get('target', '')} {run.get('pass', '')} — {why}"
                )
                if include_skipped:
                    records.append(
                        dict(
                            common,
                            backend=run.get("backend", "?"),
                            dtype=run.get("dtype"),
                            target=run.get("target"),
                            median_ms=None,
                            **{"pass": run.get("pass")},
                            **{k: why for k in ("skipped", "error") if k in run},
                        )
                    )
                continue
            if run.get("median_ms") is not None:
                records.append(_run_record(common, data, run))
    if not paths:
        notes.append(f"{directory}: no result files yet")
    return records, notes


def _panel_key(r: dict) -> str:
    dev = "GPU" if r["gpu"] else "CPU"
    return f"{r['bench']} · {r['target']} · {r['dtype']} · {dev} ({r['device_name']})"


def kernel_timings_figure(records: list[dict], title: str = "Kernel timings (median of repeats)"):
    """Bars per backend and pass, one panel per (bench, target, dtype, device); log time axis."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not records:
        fig = go.Figure()
        fig.add_annotation(
            text="no kernel results yet: run workbench bench symmetric-contraction / channelwise-tp",
            showarrow=False,
            font_size=16,
        )
        return style(fig, title, height=240)
    panels = sorted({_panel_key(r) for r in records}, key=lambda k: (" GPU " not in k, k))
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=panels,
        vertical_spacing=0.5 / max(rows, 1) ** 0.5 / 2,
        horizontal_spacing=0.08,
    )
    shown = set()
    for i, key in enumerate(panels):
        row, col = i // cols + 1, i % cols + 1
        mine = [r for r in records if _panel_key(r) == key]
        for backend in sorted({r["backend"] for r in mine}):
            rs = {r["pass"]: r for r in mine if r["backend"] == backend}
            passes = [p for p in PASS_ORDER if p in rs] + sorted(set(rs) - set(PASS_ORDER))
            fig.add_trace(
                go.Bar(
                    x=[PASS_LABELS.get(p, p) for p in passes],
                    y=[rs[p]["median_ms"] for p in passes],
                    name=backend,
                    legendgroup=backend,
                    showlegend=backend not in shown,
                    marker_color=backend_color(backend),
                    text=[f"{rs[p]['median_ms']:.3g}" for p in passes],
                    textposition="outside",
                    cliponaxis=False,
                    hovertemplate=f"{backend}<br>%{{x}}: %{{y:.3f}} ms<extra>{key}</extra>",
                ),
                row=row,
                col=col,
            )
            shown.add(backend)
        fig.update_yaxes(title_text="time (ms, log)", type="log", row=row, col=col)
    fig.update_layout(barmode="group", legend=dict(title="backend"))
    return style(fig, title, height=max(320, 300 * rows))


PASS_SYMBOLS = {"forward": "circle", "forward_backward": "square", "double_backward": "diamond"}


def _roof_traces(fig, lo: float, hi: float, bandwidth: float, fp32_flops: float, fp64_flops: float) -> None:
    """The FP32 and FP64 roofs: min(peak, intensity x bandwidth) over ``[lo, hi]`` FLOP/byte."""
    import numpy as np
    import plotly.graph_objects as go

    ai = np.logspace(np.log10(lo), np.log10(hi), 200)
    for peak, name, dash in ((fp32_flops, "FP32", "solid"), (fp64_flops, "FP64", "dot")):
        fig.add_trace(
            go.Scatter(
                x=ai,
                y=np.minimum(peak, ai * bandwidth) / 1e9,
                mode="lines",
                line=dict(color="#444", dash=dash, width=1.5),
                name=f"H100 roof {name} ({peak / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s)",
                hoverinfo="skip",
            )
        )


def _roofline_point(r: dict, bandwidth: float, fp32_flops: float, fp64_flops: float):
    """One record as a marker: colour by backend, shape by pass, hollow for CPU runs; hover gives % of roof."""
    import plotly.graph_objects as go

    mark = dict(size=11, color=backend_color(r["backend"]), symbol=PASS_SYMBOLS.get(r["pass"], "x"))
    if not r["gpu"]:
        mark.update(symbol=mark["symbol"] + "-open", line=dict(width=2, color=mark["color"]))
    roof = min(fp32_flops if r["dtype"] != "float64" else fp64_flops, r["intensity"] * bandwidth)
    pct = 100 * r["gflops"] * 1e9 / roof
    return go.Scatter(
        x=[r["intensity"]],
        y=[r["gflops"]],
        mode="markers",
        marker=mark,
        showlegend=False,
        name=f"{r['backend']} {r['pass']}",
        hovertemplate=(
            f"<b>{r['backend']}</b> {PASS_LABELS.get(r['pass'], r['pass'])} ({r['dtype']}, "
            f"{'GPU' if r['gpu'] else 'CPU'} {r['device_name']})<br>{r['median_ms']:.3g} ms · "
            f"%{{y:.3g}} GFLOP/s · {r['gbps']:.3g} GB/s<br>intensity %{{x:.2f}} FLOP/byte · "
            f"{pct:.2g}% of the H100 roof<extra>{r['bench']}</extra>"
        ),
    )


def _roofline_notes(fig, empty: bool) -> None:
    """Marker legend under the plot, log axes, and a note when nothing has counts yet."""
    fig.add_annotation(
        text="filled: GPU run · hollow: CPU smoke run · ● forward ■ +backward ◆ double backward",
        xref="paper",
        yref="paper",
        x=0,
        y=-0.22,
        showarrow=False,
        font=dict(size=11),
        xanchor="left",
    )
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP / byte, minimum bytes moved)")
    fig.update_yaxes(type="log", title_text="achieved GFLOP/s (non-zero CG terms)")
    if empty:
        fig.add_annotation(
            text="no results with FLOP and byte counts yet",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            font_size=15,
        )


def roofline_figure(
    records: list[dict],
    bandwidth: float = H100_BANDWIDTH,
    fp32_flops: float = H100_FP32_FLOPS,
    fp64_flops: float = H100_FP64_FLOPS,
    title: str | None = None,
):
    """Achieved GFLOP/s against arithmetic intensity, under the H100 roofline.

    Only records with counted FLOPs and bytes appear (the contraction benches
    count the non-zero CG terms and the minimum bytes each pass must move).
    CPU smoke runs are drawn hollow: they show the position, not an H100 result.
    """
    import plotly.graph_objects as go

    pts = [r for r in records if r.get("intensity") and r.get("gflops")]
    fig = go.Figure()
    lo = min([r["intensity"] for r in pts] + [0.5]) / 2
    hi = max([r["intensity"] for r in pts] + [200.0]) * 2
    _roof_traces(fig, lo, hi, bandwidth, fp32_flops, fp64_flops)
    for r in pts:
        fig.add_trace(_roofline_point(r, bandwidth, fp32_flops, fp64_flops))
    for b in sorted({r["backend"] for r in pts}):
        fig.add_trace(
            go.Scatter(x=[None], y=[None], mode="markers", name=b, marker=dict(size=10, color=backend_color(b)))
        )
    _roofline_notes(fig, empty=not pts)
    return style(fig, title or "Symmetric contraction against the H100 roofline", height=460)


def gpu_available() -> bool:
    """Whether this Python sees a CUDA GPU (torch), without failing when torch is absent.

    Without NVIDIA device files there is no GPU, and we answer without importing torch (seconds).
    """
    if not any(Path("/dev").glob("nvidia[0-9]*")) and "torch" not in sys.modules:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


#: the kernel benchmarks the live button runs (``workbench bench NAME``, modules of workbench.bench)
KERNEL_BENCHMARKS: tuple[str, ...] = ("symmetric-contraction", "channelwise-tp")


def benchmark_commands(repeats: int) -> list[list[str]]:
    """The command lines of the kernel benchmarks, run with this interpreter."""
    return [
        [sys.executable, "-m", "workbench.cli", "bench", name, "--repeats", str(repeats)] for name in KERNEL_BENCHMARKS
    ]


def kernel_app(directory: str | Path | None = None, repeats: int = 10):
    """Bars and roofline of the recorded results; with a GPU, a button runs the benchmarks live."""
    import ipywidgets as W
    import plotly.graph_objects as go

    directory = Path(directory) if directory is not None else RESULTS_DIR
    bars, roof = go.FigureWidget(), go.FigureWidget()
    notes = W.HTML()
    log = W.Output(layout=W.Layout(max_height="240px", overflow="auto", border="1px solid #eee"))
    has_gpu = gpu_available()
    run_b = W.Button(
        description="Run benchmark on this GPU" if has_gpu else "No GPU here: benchmark disabled",
        icon="play",
        button_style="primary" if has_gpu else "",
        disabled=not has_gpu,
        layout=W.Layout(width="300px"),
        tooltip="runs workbench bench symmetric-contraction and channelwise-tp, adding result files"
        if has_gpu
        else "torch.cuda.is_available() is False in this kernel",
    )
    refresh_b = W.Button(description="Reload results", icon="refresh")

    def load(*_):
        records, msgs = read_kernel_results(directory)
        for fw, new in ((bars, kernel_timings_figure(records)), (roof, roofline_figure(records))):
            with fw.batch_update():
                fw.data = []
            fw.add_traces(list(new.data))
            fw.layout = new.layout
        files = sorted({r["file"] for r in records})
        notes.value = (
            f"<div class='wb-kernel-notes' style='font-size:12px;color:#555'>{len(records)} timings from "
            f"{len(files)} file(s) in <code>{directory}</code>: {', '.join(files) or '—'}"
            + "".join(f"<br>· {m}" for m in msgs[:12])
            + "</div>"
        )

    def run(*_):
        run_b.disabled = True
        try:
            for cmd in benchmark_commands(repeats):
                with log:
                    print(f"$ workbench {' '.join(cmd[3:])}", flush=True)
                    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
                    print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
            load()
        finally:
            run_b.disabled = False

    run_b.on_click(run)
    refresh_b.on_click(load)
    load()
    return W.VBox([W.HBox([run_b, refresh_b]), notes, bars, roof, log])
