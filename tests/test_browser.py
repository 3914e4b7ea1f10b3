"""The notebooks in a real browser: JupyterLab driven by Playwright (python) and Debian chromium.

Headless execution (tests/test_notebooks.py) cannot see frontend failures such as nglview
4.0.1's frontend-version mismatch; only a browser can. This test starts its own JupyterLab on
127.0.0.1 (free port, random token, private config/runtime/settings/workspace directories, a
temporary copy of notebooks/ so autosave cannot write outputs into the committed files), runs
notebooks 01, 02 and 05 with "Run All Cells" and 04's SLURM cell on a real two-node SLURM,
checks what is on screen, saves screenshots under ``$WORKBENCH_ARTIFACTS`` (default
``runs/test-artifacts/``) and stops the server by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_slurm import WaitError, free_port, http_ok, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("WORKBENCH_ARTIFACTS", ROOT / "runs" / "test-artifacts"))
RUN_TIMEOUT_MS = 180_000  # a whole notebook, on a busy 2-core CI machine

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make system-deps)")
]


def _settings(d: Path) -> None:
    """User settings: no news popup, no notebook windowing (every cell stays in the DOM)."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, value in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def two_nodes():
    """A two-node SLURM for notebook 04's launch cell; None where SLURM is not installed."""
    from local_slurm import LocalSlurm, missing_daemons

    if missing_daemons():
        yield None
        return
    with LocalSlurm(nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def lab(tmp_path_factory, two_nodes):
    pytest.importorskip("playwright.sync_api")
    pytest.importorskip("jupyterlab")
    tmp = tmp_path_factory.mktemp("lab")
    nbdir = tmp / "notebooks"
    shutil.copytree(ROOT / "notebooks", nbdir, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for sub in ("config", "runtime", "data", "settings", "workspaces", "ipython", "runs"):
        (tmp / sub).mkdir()
    _settings(tmp / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        IPYTHONDIR=str(tmp / "ipython"),
        WORKBENCH_RUNS=str(tmp / "runs"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    if two_nodes is not None:  # notebook 04's SLURM cell submits there, one rank on each node
        env.update(two_nodes.env, WORKBENCH_NOTEBOOK_SLURM="1", WORKBENCH_NOTEBOOK_NODES="2")
        env["WORKBENCH_NOTEBOOK_TINY"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={nbdir}",
        f"--LabApp.user_settings_dir={tmp / 'settings'}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        "--LabApp.news_url=",
        "--ServerApp.open_browser=False",
        "--LabApp.extension_manager=readonly",  # no PyPI queries from the test
        "--LabApp.expose_app_in_browser=True",
    ]  # window.jupyterapp: run commands, read kernel status  # no PyPI queries from the test
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    log = open(tmp / "jupyter.log", "wb")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=nbdir, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: http_ok(f"{base}/api/status?token={token}"),
            "JupyterLab to answer /api/status",
            120,
            {"jupyter lab": proc},
            interval_s=0.5,
        )
    except WaitError as exc:
        proc.kill()
        pytest.fail(f"JupyterLab did not start ({exc}): {(tmp / 'jupyter.log').read_text()[-3000:]}")
    try:
        yield {"base": base, "token": token, "log": tmp / "jupyter.log"}
    finally:
        # Stop our server by its PID; it shuts down its kernels. Then its process group, in case.
        stop_process(proc, 30, kill_timeout_s=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS, viewport={"width": 1440, "height": 1800}
        )
        try:
            yield ctx
        finally:
            ctx.close()


def _open_and_run(ctx, lab, name: str):
    """Open a notebook in JupyterLab, wait for its kernel, run all cells; returns the page."""
    page = _open(ctx, lab, name)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page


def _open(ctx, lab, name: str):
    """Open a notebook in JupyterLab and wait until its kernel is idle; returns the page."""
    page = ctx.new_page()
    _pages[name] = page
    page.on("console", lambda m: _console.append(f"{name} [{m.type}] {m.text}") if m.type == "error" else None)
    page.goto(f"{lab['base']}/lab/tree/{name}?token={lab['token']}&reset", wait_until="domcontentloaded")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function(
        f"""() => {{
        const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
        return w && w.context && w.context.path.endsWith({json.dumps(name)}) && k && k.status === 'idle';
    }}""",
        timeout=120_000,
    )
    return page


def _run_cells(page, indices: list[int], timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    """Run these cells (by index, markdown included) one after the other; wait until the last ran."""
    page.evaluate(
        """async (indices) => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        for (const i of indices) {
            nb.activeCellIndex = i;
            await window.jupyterapp.commands.execute('notebook:run-cell');
        }
    }""",
        indices,
    )
    page.wait_for_function(
        """(last) => {
        const w = window.jupyterapp.shell.currentWidget;
        const cell = w.content.widgets[last];
        return cell.model.executionCount !== null && w.sessionContext.session.kernel.status === 'idle';
    }""",
        arg=indices[-1],
        timeout=timeout_ms,
    )


_console: list[str] = []
_pages: dict = {}


@pytest.fixture(autouse=True)
def _last_screen(request):
    """After each test, keep the last screen of its pages (a failure shows where it stopped) and console errors."""
    yield
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, page in list(_pages.items()):
        try:
            page.screenshot(path=str(ARTIFACTS / f"last_screen_{request.node.name}.png"))
            page.close()
        except Exception:
            pass
        _pages.pop(name, None)
    if _console:
        (ARTIFACTS / "browser_console_errors.txt").write_text("\n".join(_console))


def _wait_finished(page, timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    """All code cells executed: no cell prompt shows [*], every code cell has a number."""
    page.wait_for_function(
        """() => {
        const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent);
        return prompts.length > 0 && prompts.every(t => /\\[\\d+\\]/.test(t));
    }""",
        timeout=timeout_ms,
    )


def _assert_no_errors(page, name: str) -> None:
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t.split("\n")[0]]
    assert not tracebacks, f"{name}: error output in the notebook: {tracebacks[:2]}"
    widget_errors = page.locator(".jupyter-widgets.widget-error, .jupyter-widget-error, .widget-error")
    assert widget_errors.count() == 0, f"{name}: widget error box: {widget_errors.all_inner_texts()[:2]}"
    body = page.inner_text(".jp-Notebook")
    for marker in ("Failed to load model class", "Error displaying widget", "Loading widget..."):
        assert marker not in body, f"{name}: '{marker}' on screen"


def _shot(page, locator, filename: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / filename
    if locator is None:
        page.screenshot(path=str(path))
    else:
        locator.scroll_into_view_if_needed()
        locator.screenshot(path=str(path))
    return path


def test_01_nglview_renders(lab, browser):
    page = _open_and_run(browser, lab, "01_explore_dataset.ipynb")
    _wait_finished(page)
    gallery = page.locator(".wb-gallery")
    gallery.wait_for(timeout=60_000)
    # nglview draws into a WebGL canvas inside each viewer (software GL in headless chromium).
    page.wait_for_function("() => document.querySelectorAll('.wb-gallery canvas').length >= 8", timeout=90_000)
    page.wait_for_function(
        """() => [...document.querySelectorAll('.wb-gallery canvas')]
                              .every(c => c.width > 50 && c.height > 50)""",
        timeout=60_000,
    )
    _assert_no_errors(page, "01")
    page.wait_for_timeout(1500)  # let the viewers finish their first frame before the screenshot
    _shot(page, gallery, "01_gallery.png")
    _shot(page, page.locator(".jp-RenderedPlotly").first, "01_dataset_figure.png")
    tables = page.locator(".wb-family-table")
    assert tables.count() == 2  # the extxyz file, then the same data prepared (its index)
    for k in range(2):
        assert tables.nth(k).locator("tr").count() == 10  # header, 8 families, total
    assert tables.nth(0).inner_text() == tables.nth(1).inner_text()
    assert "average neighbours" in page.inner_text(".jp-Notebook")  # statistics from the index


def _cards(page) -> dict:
    return page.evaluate("""() => {
        const root = document.querySelector('.wb-capacity-metrics');
        const val = c => root.querySelector(`.${c} .wb-value`).textContent;
        return {capacity: root.dataset.capacity, padding: val('wb-padding'), bins: val('wb-bins'),
                source: root.querySelector('.wb-source').textContent,
                title: document.querySelector('.wb-capacity-layout .gtitle').textContent,
                bars: document.querySelectorAll('.wb-capacity-layout .barlayer path').length};
    }""")


def test_02_capacity_slider_updates_layout_and_padding(lab, browser):
    page = _open_and_run(browser, lab, "02_bin_capacity_study.ipynb")
    _wait_finished(page)
    page.locator(".wb-capacity-layout .barlayer path").first.wait_for(timeout=60_000)
    _assert_no_errors(page, "02")
    _shot(page, page.locator(".wb-layout-app"), "02_bin_layout_app.png")
    app = page.locator(".wb-capacity-app")
    before = _cards(page)
    assert before["capacity"] == "3072" and "capacity 3,072" in before["title"]
    assert "Precomputed grid" in before["source"]
    _shot(page, app, "02_capacity_app_before.png")
    handle = page.locator(".wb-capacity-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()

    def move_and_settle(presses: int, capacity: int) -> float:
        # Waits for the final state, not the first repaint: cards and layout figure at the same grid point.
        t0 = time.perf_counter()
        for _ in range(presses):
            handle.focus()
            page.keyboard.press("ArrowRight")
        page.wait_for_function(
            f"() => document.querySelector('.wb-capacity-metrics').dataset.capacity === '{capacity}'", timeout=30_000
        )
        page.wait_for_function(
            f"() => /capacity {capacity:,}/.test(document.querySelector('.wb-capacity-layout .gtitle').textContent)",
            timeout=30_000,
        )
        return time.perf_counter() - t0

    seconds_one = move_and_settle(1, 3328)  # 3072 -> 3328 on the grid
    after = _cards(page)
    assert after["capacity"] == "3328"
    assert after["padding"] != before["padding"], (before, after)
    assert "capacity 3,328" in after["title"]
    assert after["bars"] > 0
    seconds = move_and_settle(2, 3840)  # two quick moves: 3584, then 3840; the view must end consistent
    final = _cards(page)
    assert final["capacity"] == "3840" and "capacity 3,840" in final["title"] and final["bins"] != after["bins"]
    _shot(page, app, "02_capacity_app_after.png")
    (ARTIFACTS / "02_capacity_interaction.json").write_text(
        json.dumps(
            {
                "before": before,
                "after": after,
                "final": final,
                "browser_seconds_one_move": round(seconds_one, 3),
                "browser_seconds_two_moves": round(seconds, 3),
            },
            indent=1,
        )
    )


def test_05_scaling_figures_render(lab, browser):
    page = _open_and_run(browser, lab, "05_scaling_projection.ipynb")
    _wait_finished(page)
    page.wait_for_function("() => document.querySelectorAll('.jp-RenderedPlotly').length >= 2", timeout=60_000)
    _assert_no_errors(page, "05")
    titles = page.locator(".jp-RenderedPlotly .gtitle").all_text_contents()
    assert any("strong scaling" in t for t in titles) and any("weak scaling" in t for t in titles), titles
    body = page.inner_text(".jp-Notebook")
    assert "PROJECTION, not a measurement" in body
    plots = page.locator(".jp-RenderedPlotly")
    _shot(page, plots.nth(0), "05_strong_scaling.png")
    _shot(page, plots.nth(1), "05_weak_scaling.png")


def test_04_two_node_launch_shows_both_nodes(lab, browser, two_nodes):
    """Notebook 04's SLURM cell on a two-node SLURM: the run panel lists one rank on each node."""
    if two_nodes is None:
        pytest.skip("SLURM is not installed here (make system-deps)")
    page = _open(browser, lab, "04_train_and_launch.ipynb")
    cells = page.evaluate(
        "() => window.jupyterapp.shell.currentWidget.content.widgets.map(c => c.model.sharedModel.source)"
    )
    config_cell = next(i for i, src in enumerate(cells) if "config = TrainConfig(" in src)
    slurm_cell = next(i for i, src in enumerate(cells) if "RUN_ON_SLURM =" in src)
    _run_cells(page, [config_cell, slurm_cell], timeout_ms=300_000)
    _assert_no_errors(page, "04")
    panel = page.locator(".jp-Notebook .jp-Cell").nth(slurm_cell).locator("table").filter(has_text="node")
    text = panel.first.inner_text()
    first, second = two_nodes.node_names
    assert first in text and second in text, text
    rows = [line.split("\t") for line in text.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("0", first), ("1", second)], rows
    output = page.locator(".jp-Notebook .jp-Cell").nth(slurm_cell).inner_text()
    assert "done" in output and "finished" in output
    _shot(page, page.locator(".jp-Notebook .jp-Cell").nth(slurm_cell), "04_two_node_panel.png")
