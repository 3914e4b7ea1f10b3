"""Runs never mix or lose their records: the demo can be run again, a fresh start moves the
earlier run aside, a resume refuses changed data, a full disk keeps the last good checkpoint
and leaves no partial model file."""

import subprocess
import sys
from pathlib import Path

import pytest
from train_fixtures import file_size_limit, run_cli

from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.presets import small_dataset, tiny_config
from workbench.train.rundir import RunDir, read_jsonl, read_steps

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("data") / "small.xyz", n=40)


def _config(tmp_path: Path, dataset: Path, **kw):
    return tiny_config(tmp_path, kw.pop("name", "run"), dataset=str(dataset), **{"max_steps": 4, "export": False, **kw})


def test_demo_runs_again_without_losing_the_finished_run(small, tmp_path, capsys, monkeypatch):
    from workbench.demo import run_demo

    monkeypatch.chdir(tmp_path)
    shrink = {"hidden_irreps": "8x0e", "correlation": 1, "radial_mlp": [8], "max_steps": 3, "checkpoint_every": 0}
    run_demo(str(small), capacity=400, overrides=shrink)
    run = RunDir(tmp_path / "runs" / "demo")
    steps, epochs, report = read_steps(run.path), read_jsonl(run.epoch_log), run.report.read_text()
    assert len(steps) == 6 and run.finished.exists()
    capsys.readouterr()
    run_demo(str(small), capacity=400, overrides=shrink)  # finished: said in one line, nothing touched
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("demo:")]
    assert len(said) == 1 and "already trained, in runs/demo (report runs/demo/report.html)" in said[0]
    assert "--fresh" in said[0]
    assert read_steps(run.path) == steps and run.report.read_text() == report
    run_demo(str(small), capacity=400, overrides=shrink, fresh=True)  # trains again; the first run moved aside
    (old,) = (run.path / "superseded").iterdir()
    assert read_steps(old) == steps and (old / "report.html").read_text() == report
    assert len(read_steps(run.path)) == 6 and len(read_jsonl(run.epoch_log)) == len(epochs) == 3


def test_fresh_start_never_mixes_two_runs(small, tmp_path):
    from workbench.train import train

    first = _config(tmp_path, small, seed=1)
    train(first)
    run = RunDir(first.run_dir)
    before = read_steps(run.path)
    train(_config(tmp_path, small, seed=2), resume=False)
    after = read_steps(run.path)
    assert [s["global_step"] for s in after] == [1, 2, 3, 4]
    assert [s["batch_hash"] for s in after] != [s["batch_hash"] for s in before]  # another seed, another order
    (old,) = (run.path / "superseded").iterdir()
    assert read_steps(old) == before and (old / "checkpoint.pt").exists()


def _edit_energy(path: Path, frame: int, out: Path) -> Path:
    from workbench.data.io import read_structures, write_structures

    frames = read_structures(path)
    frames[frame].info["REF_energy"] += 0.5
    return write_structures(out, frames)


def test_resume_refuses_changed_labels_or_a_re_prepared_store(small, tmp_path):
    import shutil

    from workbench.data.prepare import prepare
    from workbench.train import train

    data = Path(shutil.copy(small, tmp_path / "data.xyz"))
    cfg = _config(tmp_path, data, max_steps=2, checkpoint_every=2)
    train(cfg)
    _edit_energy(small, 7, data)  # same frame count, one label changed
    with pytest.raises(ValueError, match=r"checkpoint.pt: the training data changed since this checkpoint"):
        train(_config(tmp_path, data, max_steps=4, checkpoint_every=2))
    store = prepare([small], tmp_path / "store", workers=1, progress=False)
    cfg = _config(tmp_path, store.path, name="stored", max_steps=2, checkpoint_every=2)
    train(cfg)
    shutil.rmtree(store.path)
    prepare([_edit_energy(small, 7, tmp_path / "edited.xyz")], store.path, workers=1, progress=False)
    with pytest.raises(ValueError, match=r"the training data changed since this checkpoint"):
        train(_config(tmp_path, store.path, name="stored", max_steps=4, checkpoint_every=2))


def test_full_disk_while_checkpointing_keeps_the_last_good_one(small, tmp_path):
    import torch

    cfg = _config(tmp_path, small, max_steps=2, checkpoint_every=2)
    assert run_cli(cfg, tmp_path).returncode == 0
    run = RunDir(cfg.run_dir)
    good = run.checkpoint.read_bytes()
    longer = _config(tmp_path, small, max_steps=4, checkpoint_every=2)
    longer.to_yaml(tmp_path / "longer.yaml")
    cmd = [str(BIN / "workbench"), "train", "--config", str(tmp_path / "longer.yaml")]
    limit = len(good) // 2  # the logs fit, a checkpoint does not
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=file_size_limit(limit))
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("workbench: error:")]
    assert len(errors) == 1 and "cannot write the checkpoint" in errors[0] and "the last good one is kept" in errors[0]
    assert "Traceback" not in res.stderr
    assert run.checkpoint.read_bytes() == good and not list(run.path.glob("checkpoint.pt.tmp*"))
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    assert torch.load(run.checkpoint, weights_only=False)["global_step"] == 4


def test_validation_elements_absent_from_training_are_named(small, tmp_path):
    from workbench.data.io import read_structures, write_structures
    from workbench.train.data import prepare_data

    frames = read_structures(small)[:3]
    frames[1].numbers[0] = 3  # a lithium that no training graph has
    valid = write_structures(tmp_path / "valid.xyz", frames)
    cfg = _config(tmp_path, small, valid_dataset=str(valid))
    with pytest.warns(UserWarning, match=r"validation graphs hold elements that no training graph has: Li \(Z=3\)"):
        prepare_data(cfg)


def test_export_on_a_full_disk_leaves_no_partial_model_and_a_rerun_says_it_was_done(small, tmp_path):
    import math
    import re

    cfg = _config(tmp_path, small, max_steps=2, checkpoint_every=2)
    done = subprocess.run(_train_cmd(cfg, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = RunDir(cfg.run_dir)
    good = run.checkpoint.read_bytes()
    cmd = _train_cmd(cfg.replace(export=True), tmp_path)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=file_size_limit(64 << 10))
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("workbench: error:")]
    assert len(errors) == 1 and "cannot write the model" in errors[0] and "no partial file" in errors[0]
    assert "Traceback" not in res.stderr
    assert not run.model.exists() and not list(run.path.glob("*.model.tmp*"))
    assert run.checkpoint.read_bytes() == good and not run.finished.exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and run.model.stat().st_size > 64 << 10
    said = re.search(r"done already: 2 steps in \d+ epochs, last loss (\S+);", again.stdout)
    assert said and math.isfinite(float(said.group(1))), again.stdout  # was "final loss nan"


def _train_cmd(cfg, tmp_path: Path) -> list[str]:
    path = tmp_path / f"{cfg.name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    cfg.to_yaml(path)
    return [str(BIN / "workbench"), "train", "--config", str(path)]
