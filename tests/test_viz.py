"""workbench.viz: the data behind every view, checked against the packer, the logs and the files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.data import FAMILY_NAMES, synthetic_sizes
from workbench.packing import pack
from workbench.train.rundir import RunDir

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

import itertools

from workbench import viz
from workbench.viz import capacity as cap
from workbench.viz.style import FAMILY_COLORS, family_label

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return synthetic_sizes(4000, seed=3)


# ---------------------------------------------------------------- bin layout (Figure 12)
@pytest.mark.parametrize("algorithm,opts", [("paper", {}), ("fixed-count", {"graphs_per_batch": 4}), ("dynamic", {})])
def test_rectangles_sum_to_each_rank_load(small, algorithm, opts):
    p = pack(small, 3072, 8, algorithm, seed=0, **opts)
    loads = p.loads()
    seen = []
    for s in range(p.n_steps):
        rects = viz.layout_rectangles(p, s, small)
        np.testing.assert_allclose(rects.rank_loads(), loads[s * 8 : (s + 1) * 8])
        for r in range(8):  # rectangles of a rank are laid end to end from 0
            mine = rects.rank == r
            ends = rects.x0[mine] + rects.length[mine]
            np.testing.assert_allclose(rects.x0[mine], np.concatenate(([0.0], ends[:-1])))
        np.testing.assert_array_equal(rects.length, small["atoms"][rects.graph])
        assert set(rects.family) <= set(FAMILY_NAMES)
        seen.append(rects.graph)
    seen = np.concatenate(seen)
    assert seen.size == small.size and np.unique(seen).size == small.size  # every graph once per epoch


def test_rectangles_first_ranks_only_and_out_of_range(small):
    p = pack(small, 2048, 64, "paper")
    rects = viz.layout_rectangles(p, 1, small, ranks=8)
    assert rects.num_ranks == 8 and rects.rank.max() == 7
    with pytest.raises(IndexError, match="steps"):
        viz.layout_rectangles(p, p.n_steps, small)


def test_bin_layout_figure_draws_every_graph_in_family_colours(small):
    p = pack(small, 3072, 4, "paper")
    rects = viz.layout_rectangles(p, 0, small)
    fig = viz.bin_layout_figure([("fixed-count", None), ("paper", rects)], capacity=3072)
    bars = [t for t in fig.data if t.type == "bar"]
    assert sum(len(t.x) for t in bars) == rects.graph.size
    for t in bars:  # one trace per family, in its colour, hover names the graph
        fam = next(f for f in FAMILY_NAMES if family_label(f) == t.name)
        assert t.marker.color == FAMILY_COLORS[fam]
        assert "graph %{customdata[0]}" in t.hovertemplate
    per_rank = np.zeros(4)
    for t in bars:
        np.add.at(per_rank, np.asarray(t.y, int), np.asarray(t.x, float))
    np.testing.assert_allclose(per_rank, p.loads()[:4])
    assert any("no such step" in a.text for a in fig.layout.annotations)


def test_bin_layout_app_steps_and_repacks(small):
    app = viz.bin_layout_app(small, capacity=3072, num_replicas=8)
    (cap_w, _algo_w), (step_w, _play) = app.children[0].children, app.children[1].children
    info, fig = app.children[2], app.children[3]
    assert "steps per epoch" in info.value
    title0 = fig.layout.title.text
    step_w.value = 2
    assert fig.layout.title.text != title0 and "step 3" in fig.layout.title.text
    import re

    def packer_steps() -> int:
        return int(re.search(r"paper: <b>(\d+)</b> steps", info.value).group(1))

    n_before = packer_steps()
    cap_w.value = 1536  # smaller bins: more steps for the packer
    assert packer_steps() > n_before
    assert "capacity 1,536" in fig.layout.xaxis.title.text


# ---------------------------------------------------------------- capacity study
def test_capacity_grid_is_exact_for_the_paper_sizes():
    """The packaged grid equals live pack(...).metrics() on all 2.65M graphs (spot checks), and a lookup is fast."""
    path = cap.grid_path()
    if not path.exists():
        pytest.fail(f"{path} missing: build it with `python -m workbench.viz.capacity`")
    big = synthetic_sizes(cap.PAPER_N, seed=cap.PAPER_SEED)
    study = viz.CapacityStudy(big)
    assert study.source == "grid", "the grid's sizes fingerprint no longer matches synthetic_sizes(2.65M, 0)"
    assert not study.stale_code and "Note" not in study.describe()  # the packers still give its results
    for c, r, a in ((3072, 64, "paper"), (1024, 740, "dynamic"), (4096, 16, "fixed-count")):
        grid = study.query(c, r, a)
        live = cap.compute_point(big, c, r, a)
        for k in cap.METRICS:
            if k != "pack_seconds":
                assert grid["metrics"][k] == live["metrics"][k], (c, r, a, k)
        for kind in cap.LAYOUT_STEPS:
            (s1, b1), (s2, b2) = grid["layouts"][kind], live["layouts"][kind]
            assert s1 == s2 and all(np.array_equal(x, y) for x, y in zip(b1, b2))
        # the fastest of three lookups: one preemption on a busy CI runner costs tens of ms
        assert min([grid["seconds"]] + [study.query(c, r, a)["seconds"] for _ in range(2)]) < 0.05
    # The interaction itself: every slider move re-queries the point and the baseline and rebuilds both figures.
    app = viz.capacity_app(study, capacity=3072, num_gpus=64)
    cap_w = app.children[1]
    times = []
    for value in (3328, 800, 4096, 2048):
        t0 = time.perf_counter()
        cap_w.value = value
        times.append(time.perf_counter() - t0)
    print(f"capacity app update on 2.65M sizes (grid): {', '.join(f'{t * 1e3:.0f} ms' for t in times)}")
    assert sorted(times)[-2] < 1.0  # the second slowest: a busy runner may stall any one update


def test_capacity_grid_roundtrip_and_live_mode(small, tmp_path):
    path = cap.precompute_grid(
        small,
        tmp_path / "g.npz",
        capacities=(1024, 3072),
        gpus=(1, 8),
        algorithms=("paper", "fixed-count"),
        echo=lambda *a: None,
    )
    grid, live = viz.CapacityStudy(small, grid=path), viz.CapacityStudy(small, grid=None)
    assert grid.source == "grid" and live.source == "live"
    assert "Precomputed grid" in grid.describe() and "Live" in live.describe()
    for c in (1024, 3072):
        for r in (1, 8):
            for a in ("paper", "fixed-count"):
                g, lv = grid.query(c, r, a), live.query(c, r, a)
                assert {k: v for k, v in g["metrics"].items() if k != "pack_seconds"} == {
                    k: v for k, v in lv["metrics"].items() if k != "pack_seconds"
                }
    assert live.query(1024, 8, "paper")["source"] == "cache"
    assert not grid.stale_code
    # Keyed on what the packers do, not on their files: another behaviour marks the grid stale.
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    assert meta["packing_behaviour"] == cap.packing_behaviour(["paper", "fixed-count"])
    assert cap.packing_behaviour(["paper"]) != cap.packing_behaviour(["fixed-count"])
    meta["packing_behaviour"] = cap.packing_behaviour(["fixed-count", "paper"])  # the same packers, other results
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(tmp_path / "stale.npz", **arrays)
    stale = viz.CapacityStudy(small, grid=tmp_path / "stale.npz")
    assert stale.stale_code and "packers now give other results" in stale.describe()
    other = synthetic_sizes(4000, seed=4)  # different sizes: the grid must not be used
    assert viz.CapacityStudy(other, grid=path).source == "live"
    assert grid.curve(8, "paper", "padding_fraction")[0] == [1024, 3072]


def test_capacity_app_moves_change_cards_and_layout(small):
    app = viz.capacity_app(small, grid=None, capacity=3072, num_gpus=8)
    cap_w, cards, layout_fig = app.children[1], app.children[4], app.children[6]
    assert "data-capacity='3072'" in cards.value and "wb-padding" in cards.value
    title, html = layout_fig.layout.title.text, cards.value
    cap_w.value = 1024
    assert "data-capacity='1024'" in cards.value and cards.value != html
    assert layout_fig.layout.title.text != title and "1,024" in layout_fig.layout.title.text
    m = app.study.query(1024, 8, "paper")["metrics"]
    assert f"{100 * m['padding_fraction']:.2f}%" in cards.value
    assert m["n_bins"] % 8 == 0 and m["n_bins"] >= m["lower_bound_bins"]


def test_baseline_matches_mean_batch_atoms(small):
    k = cap.baseline_graphs_per_batch(small, 3072)
    assert abs(k * small["atoms"].mean() - 3072) <= small["atoms"].mean() / 2 + 1e-9


# ---------------------------------------------------------------- dataset view
def test_distribution_stats_and_figure(small):
    stats = viz.distribution_stats(small)
    assert [s["family"] for s in stats] == [f for f in FAMILY_NAMES if f in set(small["family"])]
    assert sum(s["graphs"] for s in stats) == small.size
    for s in stats:
        sel = small[small["family"] == s["family"]]
        for f in ("atoms", "edges"):
            d = s[f]
            assert d["min"] <= d["q1"] <= d["median"] <= d["q3"] <= d["max"]
            assert d["min"] == sel[f].min() and d["max"] == sel[f].max()
    fig = viz.dataset_figure(small)
    assert len(fig.data) == 1 + 2 * len(stats)
    assert list(fig.data[0].marker.color) == [FAMILY_COLORS[s["family"]] for s in stats]
    html = viz.family_table_html(small)
    assert html.count("<tr>") == len(stats) + 2


# ---------------------------------------------------------------- kernel timings
def _gpu_result(bench: str, target: str) -> dict:
    runs = []
    for backend, ms in (("e3nn", 10.0), ("numba", 2.5)):
        for kind in ("forward", "double_backward"):
            runs.append(
                {
                    "backend": backend,
                    "dtype": "float32",
                    "target": target,
                    "pass": kind,
                    "median_ms": ms * (3 if kind == "double_backward" else 1),
                    "min_ms": ms,
                }
            )
    runs.append({"backend": "cueq", "dtype": "float32", "skipped": "ImportError: no cuequivariance"})
    runs.append({"backend": "numba", "dtype": "float64", "target": target, "pass": "forward", "error": "boom\ntb"})
    return {
        "label": "GPU",
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "runs": runs,
        "descriptor": {
            "float32": {
                "flops": {"forward": 2e9, "double_backward": 2e10},
                "min_bytes": {"forward": 1e8, "double_backward": 5e8},
            }
        },
    }


def test_kernel_reader_is_tolerant(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "symmetric_contraction_cpu_paper_config.json", d)
    (d / "symmetric_contraction_gpu_20261201T000000Z.json").write_text(json.dumps(_gpu_result("sc", "contraction")))
    tp = _gpu_result("tp", "channelwise_tp")
    tp["bench"] = "channelwise_tp"
    del tp["descriptor"]
    tp["runs"][0]["flops"], tp["runs"][0]["bytes"] = 1e9, 1e9  # counts given per run instead
    (d / "channelwise_tp_gpu_x.json").write_text(json.dumps(tp))
    (d / "broken.json").write_text("{not json")
    (d / "other.json").write_text(json.dumps({"hello": 1}))
    records, notes = viz.read_kernel_results(d)
    files = {r["file"] for r in records}
    assert files == {
        "symmetric_contraction_cpu_paper_config.json",
        "symmetric_contraction_gpu_20261201T000000Z.json",
        "channelwise_tp_gpu_x.json",
    }
    assert any("broken.json" in n and "unreadable" in n for n in notes)
    assert any("other.json" in n for n in notes)
    assert any("cueq" in n and "skipped" not in n.split("—")[0] for n in notes)
    gpu = [r for r in records if r["gpu"] and r["bench"] == "symmetric_contraction"]
    fwd = next(r for r in gpu if r["backend"] == "numba" and r["pass"] == "forward")
    assert fwd["gflops"] == pytest.approx(2e9 / 2.5e-3 / 1e9) and fwd["intensity"] == pytest.approx(20.0)
    cpu_products = [r for r in records if r["target"] == "products0"]
    assert cpu_products and all(r["flops"] is None for r in cpu_products)  # whole blocks stay off the roofline
    tp_recs = [r for r in records if r["bench"] == "channelwise_tp"]
    assert sum(r["intensity"] is not None for r in tp_recs) == 1
    bars, roof = viz.kernel_timings_figure(records), viz.roofline_figure(records)
    assert sum(len(t.y) for t in bars.data if t.type == "bar") == len(records)
    on_roof = [t for t in roof.data if t.mode == "markers" and t.x and t.x[0] is not None]
    assert len(on_roof) == sum(r["intensity"] is not None for r in records)
    roof_line = roof.data[0]
    assert max(roof_line.y) == pytest.approx(67e3)  # GFLOP/s
    speed = viz.kernel_speedup_from_results(records)
    assert speed.atoms == pytest.approx(4.0) and speed.edges == pytest.approx(4.0)
    assert "numba vs e3nn" in speed.source


def test_kernel_reader_without_results(tmp_path):
    records, notes = viz.read_kernel_results(tmp_path / "missing")
    assert records == [] and "no results directory" in notes[0]
    assert viz.kernel_speedup_from_results([]) == viz.KernelSpeedup()
    fig = viz.kernel_timings_figure([])
    assert "no kernel results" in fig.layout.annotations[0].text


def test_kernel_app_without_gpu_disables_the_button():
    app = viz.kernel_app()
    button = app.children[0].children[0]
    if not viz.kernels.gpu_available():
        assert button.disabled and "No GPU" in button.description
    assert "timings from" in app.children[1].value


# ---------------------------------------------------------------- measured GPU rows: numba / cueq / e3nn
RESULTS = ROOT / "benchmarks" / "results"
H100_FILES = (
    "symmetric_contraction_gpu_h100_paper.json",
    "symmetric_contraction_gpu_h100_128x2e.json",
    "channelwise_tp_gpu_h100_paper.json",
    "channelwise_tp_gpu_h100_128x2e.json",
    "train_step_gpu_h100.json",
)


def _panel(fig, title: str) -> tuple[list, list]:
    """Traces and annotations of the subplot whose title starts with ``title``."""
    titles = [a.text for a in fig.layout.annotations if a.xref == "paper" and a.yref == "paper"]
    i = next(k for k, t in enumerate(titles) if t.startswith(title))
    axis = "x" if i == 0 else f"x{i + 1}"
    return ([t for t in fig.data if t.xaxis == axis], [a for a in fig.layout.annotations if a.xref == axis])


@pytest.fixture(scope="module")
def h100_pass_figure():
    return viz.gpu_pass_figure(RESULTS)


def test_gpu_pass_figure_has_every_backend_for_the_paper_config(h100_pass_figure):
    fig = h100_pass_figure
    assert "NVIDIA H100 80GB HBM3" in fig.layout.title.text
    for op in ("symmetric contraction", "channelwise TP"):
        traces, notes = _panel(fig, f"{op} · paper (128x0e+128x1o) · float32")
        bars = {t.name: t for t in traces if t.type == "bar"}
        # OpenEquivariance is a registered GPU backend with no measured row yet: a stub says so
        assert set(bars) == {"numba", "cueq", "e3nn", "oeq (not measured)"}
        assert all(bars[b].x == ("forward", "forward + backward", "double backward") for b in bars)
        assert all(t.startswith("not measured") for t in bars["oeq (not measured)"].text)
        ratios = [a.text for a in notes if a.text.startswith("numba/cueq")]
        assert len(ratios) == 3
    rows = json.loads((RESULTS / "symmetric_contraction_gpu_h100_paper.json").read_text())["runs"]
    ms = {
        r["backend"]: r["median_ms"]
        for r in rows
        if (r.get("dtype"), r.get("target"), r.get("pass")) == ("float32", "contraction", "double_backward")
    }
    traces, notes = _panel(fig, "symmetric contraction · paper (128x0e+128x1o) · float32")
    numba = next(t for t in traces if t.name == "numba")
    assert numba.y[2] == pytest.approx(ms["numba"])
    assert any(f"{ms['numba'] / ms['cueq']:.2f}" in a.text for a in notes)


def test_gpu_pass_figure_marks_missing_rows(h100_pass_figure):
    fig = h100_pass_figure
    traces, _ = _panel(fig, "symmetric contraction · 128x2e (128x0e+128x1o+128x2e) · float32")
    stub = next(t for t in traces if t.name == "cueq (not measured)")
    assert stub.x == ("double backward",) and stub.text == ("not measured",)
    assert "never finished" in stub.hovertext[0].replace("<br>", " ")
    logged = next(t for t in traces if t.name == "numba")
    assert set(logged.marker.pattern.shape) == {"/"}  # recovered from the run's log: hatched
    cueq = next(t for t in traces if t.name == "cueq")
    assert "2 rows in the file" in cueq.hovertext[0]  # two runs wrote cueq's forward: the first is shown
    texts = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("not measured<br>") and "cueq" in t for t in texts)  # 128x2e float64: nothing measured
    assert any(
        "no result file" in t and "symmetric contraction 256x0e+256x1o" in t and "channelwise TP 256x0e+256x1o" in t
        for t in texts
    )


def test_gpu_missing_rows_on_the_h100_files():
    missing = viz.gpu_missing_rows(RESULTS)
    for line in (
        "symmetric_contraction 256x0e+256x1o float32: no result file",
        "channelwise_tp 256x0e+256x1o float64: no result file",
        "train step water-768 float32 numba, e3nn, cueq, oeq, numba+graph, cueq+fixed: not measured (time budget)",
        "train step mixture-3072 float32 e3nn: not measured (time budget)",
    ):
        assert line in missing
    db = [m for m in missing if m.startswith("symmetric_contraction 128x0e+128x1o+128x2e float32 cueq double_backward")]
    assert len(db) == 1 and "never finished" in db[0]
    assert any(m.startswith("channelwise_tp 128x0e+128x1o+128x2e float32 cueq: not measured") for m in missing)
    measured = [m for m in missing if m.startswith(("channelwise_tp 128x0e+128x1o float", "train step water-3072"))]
    # owed: no oeq run yet, nor the CUDA-graph step and cueq on fixed shapes
    assert measured and all(" oeq: not measured (no row in the file)" in m for m in measured if "channelwise" in m)
    assert "train step water-3072 float32 oeq, numba+graph, cueq+fixed: not measured (no row in the file)" in missing
    sources = viz.gpu_sources(RESULTS)
    assert sources[0].startswith("symmetric_contraction paper: symmetric_contraction_gpu_h100_paper.json (NVIDIA H100")
    assert sources[-1].startswith("train step: train_step_gpu_h100.json")


def test_gpu_step_figure_marks_skipped_workloads():
    fig = viz.gpu_step_figure(RESULTS)
    assert "NVIDIA H100 80GB HBM3" in fig.layout.title.text
    steps = json.loads((RESULTS / "train_step_gpu_h100.json").read_text())["steps"]
    traces, notes = _panel(fig, "median step time · float32")
    bars = {t.name: t for t in traces if t.type == "bar"}
    assert {"numba", "cueq", "e3nn"} <= set(bars)
    i = bars["numba"].x.index("water-3072")
    assert bars["numba"].y[i] == pytest.approx(steps["float32"]["water-3072"]["backends"]["numba"]["step_ms_median"])
    assert bars["e3nn (not measured)"].x == ("mixture-3072",)
    assert bars["e3nn (not measured)"].text == ("not measured: time budget",)
    gone = next(t for t in traces if t.type == "scatter")
    assert set(gone.x) == {"water-768", "water-1536", "water-6144"}
    assert all(t == "not measured:<br>time budget" for t in gone.text)
    assert len([a for a in notes if a.text.startswith("numba/cueq")]) == 2
    memory, _ = _panel(fig, "peak memory · float32")
    e3nn = next(t for t in memory if t.name == "e3nn")
    assert e3nn.y[0] == pytest.approx(steps["float32"]["water-3072"]["backends"]["e3nn"]["peak_mem_gb"])
    assert any(
        "float64: mixture-3072, water-768" in a.text and "not run at float64" in a.text for a in fig.layout.annotations
    )


def test_gpu_profile_figure_and_table():
    saved = json.loads((RESULTS / "train_step_gpu_h100.json").read_text())
    prof = saved["profile"]
    fig = viz.gpu_profile_figure(RESULTS)
    bar = fig.data[0]
    assert len(bar.y) == len(prof["categories"]) and bar.y[0] == prof["top5"][0][0]
    coloured = [name for name, c in zip(bar.y, bar.marker.color) if c != "#bbb"]
    assert set(coloured) == {name for name, _ in prof["top5"]}
    assert sum(bar.x) == pytest.approx(100, abs=0.5)
    table = viz.gpu_results_table(RESULTS)
    sc = next(
        r
        for r in table
        if (r["what"], r["dtype"], r["pass"]) == ("symmetric_contraction paper", "float32", "double_backward")
    )
    assert sc["numba/cueq"] == pytest.approx(sc["numba ms"] / sc["cueq ms"]) and sc["numba/cueq"] < 1
    step = next(r for r in table if r["what"] == "train step water-3072" and r["dtype"] == "float32")
    assert step["numba/e3nn"] == pytest.approx(saved["steps"]["float32"]["water-3072"]["ratios"]["numba/e3nn"])
    assert not any(r["what"].startswith("train step water-768") for r in table)  # not measured: not a row
    text = viz.format_gpu_table(table)
    assert "train step water-3072" in text and "from log: numba, e3nn" in text


def test_gpu_rows_in_a_synthetic_directory(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    for name in H100_FILES:
        shutil.copy(RESULTS / name, d)
    (d / "channelwise_tp_gpu_h100_paper.json").unlink()
    older = json.loads((RESULTS / "symmetric_contraction_gpu_h100_paper.json").read_text())
    older.update(device_name="<b>Old</b> GPU", timestamp="20200101T000000Z")
    older["runs"] = [{"backend": "cueq", "dtype": "float32", "skipped": "ImportError: <no cueq>"}]
    (d / "symmetric_contraction_gpu_old.json").write_text(json.dumps(older))
    missing = viz.gpu_missing_rows(d)
    assert "channelwise_tp 128x0e+128x1o float32: no result file" in missing
    assert "channelwise_tp 128x0e+128x1o float64: no result file" in missing
    newest = [m for m in missing if m.startswith("symmetric_contraction 128x0e+128x1o float32")]
    assert len(newest) == 1 and newest[0].startswith(
        "symmetric_contraction 128x0e+128x1o float32 oeq: not measured (no row in the file"
    )  # the newest file won: only the backend it never ran is missing
    fig = viz.gpu_pass_figure(d)
    assert any("channelwise TP 128x0e+128x1o" in a.text and "no result file" in a.text for a in fig.layout.annotations)
    # The older file alone: its skipped cueq row says why, and its strings are escaped.
    old = viz.gpu_missing_rows(d, gpu="old")
    assert "symmetric_contraction 128x0e+128x1o float32 cueq: not measured (skipped: ImportError: <no cueq>)" in old
    assert "train step: no result file (train_step_gpu_*.json)" in old
    fig = viz.gpu_pass_figure(d, gpu="old")
    assert "&lt;b&gt;Old&lt;/b&gt; GPU" in fig.layout.title.text and "<b>Old" not in fig.layout.title.text
    assert any("&lt;no cueq&gt;" in a.text for a in fig.layout.annotations)
    assert "no result file" in viz.gpu_step_figure(d, gpu="old").layout.annotations[0].text
    assert "not measured" in viz.gpu_profile_figure(d, gpu="old").layout.annotations[0].text
    assert viz.gpu_results_table(d, gpu="old") == [] and viz.format_gpu_table([]) == "no measured GPU rows"


# ---------------------------------------------------------------- scaling projection
def test_allreduce_model():
    ar = viz.AllReduceModel()
    assert ar.seconds(1) == 0.0
    t = [ar.seconds(r) for r in (2, 4, 8, 64, 740)]
    assert t[2] > t[1]  # leaving the node: NIC bandwidth
    assert all(b >= a for a, b in itertools.pairwise(t))
    assert ar.seconds(740) == pytest.approx(2 * 739 / 740 * ar.grad_bytes / 25e9 + 2 * 10 * 10e-6)


def test_simulate_epoch_is_the_sum_of_slowest_ranks(small):
    from workbench.packing import CostModel

    cm = CostModel(a=0.01, b=1e-4, c=2e-6)
    p = pack(small, 3072, 4, "fixed-count", graphs_per_batch=20)
    sim = viz.simulate_epoch(p, small, cm, viz.AllReduceModel(latency=0.0, grad_bytes=0.0))
    t = np.array([cm.a + cm.b * small["atoms"][b].sum() + cm.c * small["edges"][b].sum() for b in p.batches])
    assert sim["compute_s"] == pytest.approx(t.reshape(-1, 4).max(axis=1).sum())
    assert sim["balanced_s"] == pytest.approx(t.reshape(-1, 4).mean(axis=1).sum())
    assert sim["allreduce_s"] == 0.0 and sim["steps"] == p.n_steps


def test_project_scaling_strong_and_weak():
    sizes = synthetic_sizes(60_000, seed=5)
    gpus = (4, 8, 16)
    strong = viz.project_scaling(sizes, gpus, "strong")
    assert len(strong) == 4 * len(gpus)
    for r in strong:
        assert r["epoch_s"] == pytest.approx(r["compute_s"] + r["allreduce_s"])
        assert r["compute_s"] >= r["balanced_s"] - 1e-9 and r["graphs"] == sizes.size
    by = {(r["gpus"], r["variant"]): r for r in strong}
    for g in gpus:
        assert by[(g, "baseline (fixed-count)")]["speedup"] == 1.0
        assert by[(g, "packer (paper)")]["epoch_s"] < by[(g, "baseline (fixed-count)")]["epoch_s"]
        assert by[(g, "packer + kernels")]["epoch_s"] < by[(g, "packer (paper)")]["epoch_s"]
    assert by[(16, "packer (paper)")]["epoch_s"] < by[(4, "packer (paper)")]["epoch_s"]
    weak = viz.project_scaling(sizes, gpus, "weak")
    assert [r["graphs"] for r in weak if r["variant"] == "packer (paper)"] == [15_000, 30_000, 60_000]
    fig = viz.scaling_figure(strong, "strong", ["assumption one", "assumption two"])
    note = fig.layout.annotations[-1].text
    assert "PROJECTION" in note and "assumption two" in note
    assert "Projected strong scaling" in fig.layout.title.text
    with pytest.raises(ValueError):
        viz.project_scaling(sizes, gpus, "sideways")


def _fake_run(tmp_path: Path, a=0.02, b=1e-4, c=3e-6, ranks=2, steps=12, name="fake") -> Path:
    rng = np.random.default_rng(0)
    run = tmp_path / name
    paths = RunDir(run)
    paths.metrics_dir.mkdir(parents=True)
    for r in range(ranks):
        lines = []
        for s in range(1, steps + 1):
            atoms = int(rng.integers(200, 3000))
            edges = int(atoms * rng.uniform(10, 60))
            comp = a + b * atoms + c * edges
            lines.append(
                json.dumps(
                    {
                        "type": "step",
                        "rank": r,
                        "epoch": (s - 1) // 4,
                        "step": (s - 1) % 4,
                        "global_step": s,
                        "data_s": 0.01,
                        "compute_s": comp,
                        "allreduce_s": 0.05 * r,
                        "step_s": comp + 0.01 + 0.05 * r,
                        "atoms": atoms,
                        "edges": edges,
                        "graphs": 10,
                        "loss": 10.0 / s + r,
                        "lr": 0.01,
                        "time": float(s),
                    }
                )
            )
        paths.step_log(r).write_text("\n".join(lines) + "\n")
    paths.epoch_log.write_text(
        "\n".join(
            json.dumps(
                {
                    "type": "epoch",
                    "epoch": e,
                    "train_e_mae_mev_atom": 50.0 - e,
                    "valid_e_mae_mev_atom": 55.0 - e,
                    "train_f_mae_mev_a": 300.0 - e,
                    "valid_f_mae_mev_a": 310.0 - e,
                }
            )
            for e in range(3)
        )
        + "\n"
    )
    return run


def test_fit_step_cost_model_recovers_coefficients(tmp_path):
    run = _fake_run(tmp_path)
    model, desc = viz.scaling.fit_step_cost_model(run)
    assert model.a == pytest.approx(0.02, rel=1e-6) and model.b == pytest.approx(1e-4, rel=1e-6)
    assert model.c == pytest.approx(3e-6, rel=1e-6)
    assert "NNLS fit to 20 measured" in desc  # 2 ranks x 10 steps after 2 warm-up steps
    assert viz.projection_cost_model(root=tmp_path)[0] == model
    neg = _fake_run(tmp_path, a=0.5, b=-1e-4, c=2e-6, name="neg")  # an unconstrained fit would go negative
    m2, _ = viz.scaling.fit_step_cost_model(neg)
    assert min(m2.a, m2.b, m2.c) >= 0.0
    assert "H100 anchor" in viz.projection_cost_model(root=tmp_path / "none")[1]


# ---------------------------------------------------------------- run monitor
def test_stress_errors_get_a_panel_and_axis_of_their_own(tmp_path):
    run = _fake_run(tmp_path)
    epochs = [json.loads(line) for line in RunDir(run).epoch_log.read_text().splitlines()]
    for e in epochs:
        e["valid_s_mae_mev_a3"] = 4.0 - e["epoch"]
    RunDir(run).epoch_log.write_text("".join(json.dumps(e) + "\n" for e in epochs))
    fig = viz.loss_figure(run)
    stress = [t for t in fig.data if t.name == "valid S MAE"]
    assert len(stress) == 1 and list(stress[0].y) == [4.0, 3.0, 2.0]
    assert stress[0].yaxis not in {t.yaxis for t in fig.data if "E MAE" in t.name or "F MAE" in t.name}
    assert fig.layout[stress[0].yaxis.replace("y", "yaxis")].title.text == "stress MAE (meV/Å³)"
    assert [a.text for a in fig.layout.annotations][-1] == "stress error per epoch"


def test_run_monitor_reads_any_run_dir(tmp_path):
    run = _fake_run(tmp_path)
    series = viz.step_series(run)
    assert sorted(series) == [0, 1] and series[0]["loss"].size == 12
    shares = viz.monitor.rank_time_shares(series)
    assert shares[1]["allreduce_s"] == pytest.approx(0.05) and shares[0]["allreduce_s"] == 0.0
    loss = viz.loss_figure(run)
    assert [t.name for t in loss.data[:2]] == ["rank 0", "rank 1"] and len(loss.data) == 6
    assert len(loss.layout.annotations) == 2  # two panel titles: no stress panel for an E+F run
    times = viz.step_time_figure(run)
    assert sum(t.type == "bar" for t in times.data) == 3
    np.testing.assert_allclose(times.data[0].y, series[0]["step_s"])

    class FakeRun:  # what workbench.launch.Run offers the monitor
        run_dir = run
        status = "done"

        def panel(self):
            import ipywidgets as W

            return W.HTML("launcher panel")

    mon = viz.run_monitor(FakeRun())
    assert any(getattr(w, "value", "") == "launcher panel" for w in mon.widget.children)
    assert "12 steps" in mon.header.value and "done" in mon.header.value
    assert mon._thread is None  # finished runs are not polled
    empty = viz.run_monitor(tmp_path / "nothing-yet")
    assert "0 steps" in empty.header.value


def test_run_monitor_refresh_is_safe_while_polling(tmp_path):
    """The poll thread and a cell's refresh() redraw the same FigureWidgets; neither may break the other."""
    import threading

    run = _fake_run(tmp_path)
    mon = viz.run_monitor(run, interval=0.001, live=True)  # a bare directory polls until stop()
    errors = []

    def hammer():
        try:
            for _ in range(12):
                mon.refresh()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mon.stop()
    assert not errors, errors
    assert len(mon.loss.data) == 6 and "12 steps" in mon.header.value


# ---------------------------------------------------------------- molecules and the nglview fix
def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_nglview_frontend_fix_matches_the_shipped_extension():
    from importlib import metadata

    nglview_version = metadata.version("nglview")
    ext = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "nglview-js-widgets" / "package.json"
    if nglview_version != "4.0.1" or not ext.exists():
        pytest.skip(f"fix targets nglview 4.0.1 with its lab extension (have {nglview_version})")
    shipped = json.loads(ext.read_text())["version"]
    assert shipped == viz.molecules.SHIPPED_FRONTEND
    probe = "w = nglview.NGLWidget(); print(w._view_module_version, w._model_module_version)"
    # Before the import (the notebooks' path): nglview sees the shipped version from the start.
    assert _python(f"import workbench.viz, nglview; {probe}") == f"{shipped} {shipped}"
    # The bug itself (so the fix is not dead code), then the fix applied after nglview was imported.
    assert _python(f"import nglview; {probe}; import workbench.viz; {probe}").split("\n") == [
        "4.0 4.0",
        f"{shipped} {shipped}",
    ]


def test_periodic_images_and_molecule_view():
    import ase

    cell = np.eye(3) * 5.0
    crystal = ase.Atoms("Cu2", positions=[[0, 0, 0], [2.5, 2.5, 0]], cell=cell, pbc=True, info={"config_type": "cuni"})
    offs = viz.molecules.image_offsets(crystal)
    assert len(offs) == 26 and not (offs == 0).all(axis=1).any()
    imgs = viz.molecules.periodic_images(crystal)
    assert len(imgs) == 52
    np.testing.assert_allclose(imgs.positions[:2], crystal.positions + offs[0] @ cell)
    big = crystal.repeat((6, 6, 6))  # 432 atoms: the full shell would draw 11,664
    assert len(viz.molecules.image_offsets(big)) == 7
    slab = ase.Atoms("Mo", positions=[[0, 0, 0]], cell=cell, pbc=[True, True, False])
    assert len(viz.molecules.image_offsets(slab)) == 8
    molecule = ase.Atoms(
        "H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], info={"config_type": "water_clusters"}
    )
    assert viz.molecules.periodic_images(molecule) is None
    view = viz.molecule_view(crystal)
    assert len(view._ngl_component_ids) == 2  # the structure (with its cell) and its images
    assert len(viz.molecule_view(molecule)._ngl_component_ids) == 1
    gallery = viz.family_gallery([molecule, crystal])
    assert len(gallery.children) == 2


def test_family_names_from_a_users_file_are_escaped_in_html_and_figures(small):
    import ipywidgets as W
    from ase import Atoms

    from workbench.viz.molecules import _card

    payload = "<img src=x>"  # sizes hold 14 characters of a family name
    sizes = small[:200].copy()
    sizes["family"][:50] = payload
    assert payload not in viz.family_table_html(sizes)
    assert "&lt;img src=x&gt;" in viz.family_table_html(sizes)
    fig = viz.dataset_figure(sizes)
    p = pack(sizes, 3072, 2, "paper")
    fig2 = viz.bin_layout_figure([("paper", viz.layout_rectangles(p, 0, sizes))], capacity=3072)
    texts = [str(t.name) + str(getattr(t, "hovertemplate", "")) for f in (fig, fig2) for t in f.data]
    assert not [t for t in texts if payload in t] and any("&lt;img" in t for t in texts)
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    atoms.info["config_type"] = payload
    assert payload not in _card(atoms, W.HTML()).children[0].value
