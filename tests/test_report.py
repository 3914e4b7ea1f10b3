"""The run report: its numbers against the run's own logs, the CLI, and the page in a real browser."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.record import read_packing, read_run_record
from workbench.train.rundir import read_steps
from workbench.viz.report import run_summary, smooth, write_report
from workbench.viz.style import family_label

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "runs" / "test-artifacts"))
SECTIONS = ("what-ran", "summary", "curves", "families", "ranks", "layout")


@pytest.fixture(scope="module")
def report_run(tmp_path_factory):
    """A short tiny-MACE run on 2 ranks under torchrun (gloo), two epochs validated."""
    from train_fixtures import run_cli, tiny

    tmp = tmp_path_factory.mktemp("report")
    cfg = tiny(tmp, "report", max_structures=40, max_steps=16, checkpoint_every=8)
    out = run_cli(cfg, tmp, nproc=2, restarts=0)
    assert out.returncode == 0, out.stderr[-4000:]
    return cfg, tmp


def test_run_record_says_what_ran(report_run):
    cfg, _ = report_run
    info = read_run_record(cfg.run_dir)
    assert (info["world_size"], info["sampler"], info["capacity"], info["dtype"], info["backend"]) == (
        2,
        cfg.sampler,
        cfg.capacity,
        cfg.dtype,
        cfg.backend,
    )
    assert info["model"]["hidden_irreps"] == cfg.hidden_irreps and info["model"]["correlation"] == cfg.correlation
    assert sorted(info["data"]["families"]) == sorted(cfg.families)
    assert info["commit"] is None or len(info["commit"].split("+")[0]) == 12
    packing, sizes = read_packing(cfg.run_dir)
    # Every training graph exactly once, never over capacity, families as configured.
    assert np.array_equal(np.sort(packing.flat), np.arange(info["data"]["train_graphs"]))
    assert packing.loads().max() <= cfg.capacity and packing.num_replicas == 2
    assert int(sizes["atoms"].sum()) == info["data"]["train_atoms"] and set(sizes["family"]) <= set(cfg.families)


def test_summary_numbers_match_the_logs(report_run):
    cfg, _ = report_run
    s = run_summary(cfg.run_dir)
    r0, r1 = read_steps(cfg.run_dir, 0), read_steps(cfg.run_dir, 1)
    # Throughput by hand: graphs of both ranks over the slower rank's time, after 2 warm-up steps.
    pairs = [(a, b) for a, b in zip(r0, r1) if a["global_step"] > 2]
    seconds = sum(max(a["step_s"], b["step_s"]) for a, b in pairs)
    assert s["throughput"]["graphs_per_s"] == pytest.approx(sum(a["graphs"] + b["graphs"] for a, b in pairs) / seconds)
    assert s["throughput"]["atoms_per_s"] == pytest.approx(sum(a["atoms"] + b["atoms"] for a, b in pairs) / seconds)
    # Padding waste and straggler share of the run's packing, by hand from its batch loads.
    p = s["packing"]["packing"]
    loads = p.loads()
    assert s["packing"]["run"]["padding_fraction"] == pytest.approx(
        1 - loads.sum() / (p.n_bins * max(p.capacity, loads.max()))
    )
    per = loads.reshape(-1, 2)
    assert s["packing"]["run"]["straggler_share"] == pytest.approx(np.mean(1 - per.mean(1) / per.max(1)))
    # The comparison packs the same graphs with fixed-count batches of batch_size graphs.
    base = s["packing"]["baseline"]
    assert base.algorithm == "fixed-count" and np.array_equal(np.sort(base.flat), np.sort(p.flat))
    n = p.flat.size
    batches = -(-n // cfg.batch_size)  # ceil division
    assert base.batch_sizes().max() <= cfg.batch_size and base.n_bins == -(-batches // 2) * 2
    assert s["valid"]["graphs"] == sum(f["graphs"] for f in s["valid"]["families"].values())


def test_smoothing_is_a_bias_corrected_moving_average():
    x = np.random.default_rng().normal(size=50)
    y = smooth(x, 0.8)
    assert y[0] == pytest.approx(x[0])
    acc = norm = 0.0
    for t in range(50):
        acc, norm = 0.8 * acc + 0.2 * x[t], 0.8 * norm + 0.2
    assert y[-1] == pytest.approx(acc / norm)
    assert np.allclose(smooth(np.full(10, 3.5)), 3.5)


def test_report_cli(report_run, tmp_path):
    cfg, _ = report_run
    out = tmp_path / "r.html"
    exe = str(Path(sys.executable).parent / "workbench")
    done = subprocess.run([exe, "report", str(cfg.run_dir), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert all(f"id='{sid}'" in page for sid in SECTIONS)
    assert page.count("plotly.js v") == 1  # plotly.js inlined once: the page opens offline
    bad = subprocess.run([exe, "report", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and str(tmp_path) in bad.stderr and "no training logs" in bad.stderr


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make system-deps)")
def test_report_renders_at_1400px(report_run):
    from playwright.sync_api import sync_playwright

    cfg, _ = report_run
    report = write_report(cfg.run_dir)
    packing, sizes = read_packing(cfg.run_dir)
    shown_families = {family_label(f) for f in sizes["family"][packing.flat[packing.offsets[0] : packing.offsets[2]]]}
    base = run_summary(cfg.run_dir)["packing"]["baseline"]
    shown_families |= {family_label(f) for f in sizes["family"][base.flat[base.offsets[0] : base.offsets[2]]]}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report.as_uri())
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 3", timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
            assert not errors, errors
            for sid in SECTIONS:
                box = page.locator(f"section#{sid}").bounding_box()
                assert box and box["height"] > 60 and box["x"] >= 0 and box["x"] + box["width"] <= 1400, (sid, box)
            assert page.evaluate("document.documentElement.scrollWidth") <= 1400
            # No legend clipped: every legend lies inside its figure, and every legend entry is drawn.
            figures = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(g => {
                const svg = g.querySelector('.main-svg').getBoundingClientRect();
                const leg = g.querySelector('g.legend');
                const box = leg ? leg.getBoundingClientRect() : null;
                return {id: g.closest('section').id, svg: [svg.left, svg.top, svg.right, svg.bottom],
                        legend: box && [box.left, box.top, box.right, box.bottom],
                        entries: [...g.querySelectorAll('g.legend .legendtext')].map(t => t.textContent)};
            })""")
            assert [f["id"] for f in figures] == ["curves", "ranks", "layout"]
            for f in figures:
                assert f["legend"] is not None, f["id"]
                (l, t, r, b), (L, T, R, B) = f["svg"], f["legend"]
                assert l - 1 <= L and r + 1 >= R and t - 1 <= T and b + 1 >= B, f
            layout = next(f for f in figures if f["id"] == "layout")
            assert set(layout["entries"]) == shown_families
            cells = page.locator("section#families table.wb-family-errors tr").count()
            assert cells == 1 + len(run_summary(cfg.run_dir)["valid"]["families"]) + 1  # header, families, all
            (ARTIFACTS / "report.json").write_text(json.dumps(figures, indent=1))
        finally:
            browser.close()
