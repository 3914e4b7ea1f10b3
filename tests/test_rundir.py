"""The run directory: one layout, one record schema, one reader that a live run cannot break."""

import json

import pytest

from workbench.launch import read_metrics
from workbench.train.rundir import (
    EPOCH_FIELDS,
    STEP_FIELDS,
    JsonlLog,
    RunDir,
    latest_run,
    read_epochs,
    read_jsonl,
    read_steps,
)


def _step(rank, global_step, loss=1.0):
    rec = dict.fromkeys(STEP_FIELDS, 0)
    rec.update(type="step", rank=rank, global_step=global_step, loss=loss)
    return rec


def test_half_written_last_line_is_skipped_until_complete(tmp_path):
    run = RunDir(tmp_path / "r")
    with JsonlLog(run.step_log(0), STEP_FIELDS) as log:
        log.write(_step(0, 1))
        log.write(_step(0, 2))
    line = json.dumps(_step(0, 3))
    with open(run.step_log(0), "a") as fh:
        fh.write(line[: len(line) // 2])  # a rank is in the middle of writing step 3
    assert [r["global_step"] for r in read_steps(run.path)] == [1, 2]
    assert read_metrics(run.path).global_step == 2  # the launcher's view agrees
    with open(run.step_log(0), "a") as fh:
        fh.write(line[len(line) // 2 :] + "\n")
    assert [r["global_step"] for r in read_steps(run.path)] == [1, 2, 3]


def test_corrupt_line_in_the_middle_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 0}\n{"epoch": 1, oops\n{"epoch": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 2: not a JSON record"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_replayed_steps_keep_the_last_record_per_rank_and_step(tmp_path):
    run = RunDir(tmp_path)
    with JsonlLog(run.step_log(1), STEP_FIELDS) as one, JsonlLog(run.step_log(0), STEP_FIELDS) as zero:
        for s in (1, 2, 3, 2, 3, 4):  # steps 2-3 redone after a restart
            zero.write(_step(0, s, loss=float(s)))
            one.write(_step(1, s, loss=10.0 + s))
    recs = read_steps(run.path)
    assert [(r["global_step"], r["rank"]) for r in recs] == [(s, r) for s in (1, 2, 3, 4) for r in (0, 1)]
    assert [r["global_step"] for r in read_steps(run.path, rank=1)] == [1, 2, 3, 4]
    with pytest.raises(KeyError, match="lacks"), JsonlLog(run.epoch_log, EPOCH_FIELDS) as log:
        log.write({"type": "epoch", "epoch": 0})
    assert read_epochs(run.path) == []


def test_layout_and_latest_run(tmp_path):
    run = RunDir(tmp_path / "a")
    assert run.step_log(3).relative_to(run.path).as_posix() == "metrics/rank3.jsonl"
    assert run.epoch_log.name == "metrics.jsonl" and run.checkpoint.name == "checkpoint.pt"
    assert run.accelerated_model("numba").name == "model_numba.model"
    assert run.launch_config.relative_to(run.path).as_posix() == "launch/config.yaml"
    assert latest_run(tmp_path) is None
    with JsonlLog(run.step_log(0), STEP_FIELDS) as log:
        for s in range(1, 7):
            log.write(_step(0, s))
    assert latest_run(tmp_path).path == run.path
    assert latest_run(tmp_path, min_steps=7) is None
