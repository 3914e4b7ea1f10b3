"""The report reads the run directory as untrusted input: every string is escaped in the page, and
a broken or old-format file costs only its own sections, with one line naming it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from workbench.cli import main
from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.rundir import RunDir
from workbench.viz.report import ReportInputWarning, write_report

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
ALL_SECTIONS = ("what-ran", "summary", "curves", "families", "ranks", "layout")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real run directory: a tiny MACE on one rank, validated per family."""
    from train_fixtures import run_cli, tiny

    tmp = tmp_path_factory.mktemp("inputs")
    cfg = tiny(tmp, "inputs", max_structures=24, max_steps=4, checkpoint_every=4, epochs=2)
    out = run_cli(cfg, tmp, nproc=1)
    assert out.returncode == 0, out.stderr[-4000:]
    return Path(cfg.run_dir)


def copy_run(trained: Path, tmp_path: Path, name: str = "run") -> RunDir:
    dst = tmp_path / name
    shutil.copytree(trained, dst)
    (dst / "report.html").unlink(missing_ok=True)
    return RunDir(dst)


def edit_jsonl(path: Path, edit) -> None:
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in recs))


def report_cli(run: RunDir, capsys) -> tuple[int, str, str]:
    code = main(["report", str(run.path)])
    out, err = capsys.readouterr()
    if code == 0:  # whatever was left out, plotly.js comes once, before the first figure uses it
        page = run.report.read_text()
        assert page.count("plotly.js v") == 1 and page.index("plotly.js v") < page.index("Plotly.newPlot(")
    return code, out, err


def sections(page: str) -> list[str]:
    return [sid for sid in (*ALL_SECTIONS, "problems") if f"<section id='{sid}'>" in page]


def rename_families(run: RunDir, names: list[str]) -> None:
    """The user's family names (config_type) everywhere the run directory holds them."""

    def epoch(r: dict) -> dict:
        if r.get("valid_families"):
            first = next(iter(r["valid_families"].values()))
            r["valid_families"] = dict.fromkeys(names, first)
        return r

    edit_jsonl(run.epoch_log, epoch)
    info = json.loads(run.info.read_text())
    info["data"]["families"] = names
    info.update(name=IMG, host=SCRIPT, started=SCRIPT, commit=IMG)
    info["data"]["source"] = SCRIPT
    run.info.write_text(json.dumps(info))
    with np.load(run.packing) as z:
        arrays = dict(z)
    arrays["family_names"] = np.array([names[i % len(names)] for i in range(len(arrays["family_names"]))])
    np.savez(run.packing, **arrays)


def test_user_strings_are_escaped(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path, f"dir{IMG.replace('/', '')}")  # the run directory's own name too
    rename_families(run, [SCRIPT, IMG])
    code, _, err = report_cli(run, capsys)
    assert code == 0 and err == ""
    page = run.report.read_text()
    assert sections(page) == list(ALL_SECTIONS)
    for raw in (SCRIPT, IMG, "<img src=x"):
        assert raw not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;img src=x onerror=alert(2)&gt;" in page


def test_epoch_that_is_not_a_number_is_refused(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    edit_jsonl(run.epoch_log, lambda r: {**r, "epoch": SCRIPT})
    code, _, err = report_cli(run, capsys)
    page = run.report.read_text()
    assert code == 0 and SCRIPT not in page and "<script>alert" not in page
    assert err.count("\n") == 1 and f"{run.epoch_log}: record 1: epoch=" in err
    families = page.split("<section id='families'>")[1].split("</section>")[0]
    assert "class=problem" in families and "wb-family-errors" not in families


def test_broken_run_json(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    run.info.write_text('{"name": "x", "world')
    code, out, err = report_cli(run, capsys)
    assert code == 0 and out.strip() == str(run.report)
    assert err.count("\n") == 1 and err.startswith(f"workbench: warning: {run.info}: not a readable JSON file")
    page = run.report.read_text()
    assert sections(page) == ["what-ran", "summary", "curves", "families", "ranks", "layout", "problems"]
    what_ran = page.split("<section id='what-ran'>")[1].split("</section>")[0]
    assert "class=problem" in what_ran and "run.json" in what_ran


def test_run_json_with_values_of_the_wrong_type(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    info = json.loads(run.info.read_text())
    info.update(capacity="lots", world_size="two", batch_size=[1], model=["x"], data={"families": 3})
    run.info.write_text(json.dumps(info))
    code, _, err = report_cli(run, capsys)
    assert code == 0 and err == ""
    assert "capacity lots atoms per batch" in run.report.read_text()


def test_run_json_that_is_not_an_object(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    run.info.write_text("[1, 2]")
    code, _, err = report_cli(run, capsys)
    assert code == 0 and err.count("\n") == 1 and f"{run.info}: expected a JSON object, found list" in err


def test_truncated_packing(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    data = run.packing.read_bytes()
    run.packing.write_bytes(data[: len(data) // 2])
    code, _, err = report_cli(run, capsys)
    assert code == 0 and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith(f"workbench: warning: {run.packing}: not a readable packing")
    page = run.report.read_text()
    layout = page.split("<section id='layout'>")[1].split("</section>")[0]
    assert "class=problem" in layout and "packing.npz" in layout and "plotly" not in layout
    assert {"curves", "families", "ranks"} <= set(sections(page))


def test_old_step_records_without_step_s(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    old = ("step_s", "data_s", "compute_s", "allreduce_s")
    edit_jsonl(run.step_log(0), lambda r: {k: v for k, v in r.items() if k not in old})
    code, _, err = report_cli(run, capsys)
    assert code == 0
    assert err.count("\n") == 1 and f"{run.step_log(0)}: old-format step records without step_s" in err
    page = run.report.read_text()
    assert "curves" in sections(page)  # the losses are still there
    ranks = page.split("<section id='ranks'>")[1].split("</section>")[0]
    assert "class=problem" in ranks and "plotly" not in ranks
    assert "graphs/s" not in page.split("<section id='summary'>")[1].split("</section>")[0]


@pytest.mark.parametrize(
    ("corrupt", "why"),
    [
        (lambda p: p.write_text(p.read_text() + "{broken\n"), "not a JSON record"),
        (lambda p: edit_jsonl(p, lambda r: {**r, "loss": "low"}), "step record 1: loss='low' is not a number"),
        (lambda p: edit_jsonl(p, lambda r: {**r, "global_step": None}), "global_step=None is not an integer"),
    ],
)
def test_broken_step_log(trained, tmp_path, capsys, corrupt, why):
    run = copy_run(trained, tmp_path)
    corrupt(run.step_log(0))
    code, _, err = report_cli(run, capsys)
    assert code == 0 and err.count("\n") == 1 and f"{run.step_log(0)}: " in err and why in err
    assert "ranks" in sections(run.report.read_text())  # with the note instead of the figure


def test_each_problem_is_one_warning(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    run.info.write_text("{")
    run.packing.write_bytes(b"PK\x03\x04 truncated")
    with pytest.warns(ReportInputWarning) as caught:
        write_report(run.path)
    messages = [str(w.message) for w in caught if issubclass(w.category, ReportInputWarning)]
    assert len(messages) == 2 and messages[0].startswith(str(run.info)) and messages[1].startswith(str(run.packing))
