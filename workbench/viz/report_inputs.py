"""The report's inputs, read so that one broken or old-format file costs only its own sections.

Each reader returns what it could read and appends a :class:`Problem` per file it could not:
the report is still written from the rest, notes what it left out, and ``workbench report``
prints one line per problem.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.train.rundir import RunDir, read_jsonl

# Fields the report computes with; a record without them is from an older workbench.
STEP_NUMBERS = ("loss",)
STEP_TIMING = ("step_s", "graphs", "atoms")
EPOCH_NUMBERS = (
    "global_step",
    "valid_e_mae_mev_atom",
    "valid_f_mae_mev_a",
    "valid_s_mae_mev_a3",
    "data_share",
    "compute_share",
    "allreduce_share",
)
# What a damaged npz raises while it is read.
_NPZ_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile, zlib.error)


class ReportInputWarning(UserWarning):
    """An input file of the report is broken or in an old format; the report leaves its sections out."""


@dataclass(frozen=True)
class Problem:
    """One input file the report could not use (fully), and the sections that lack it."""

    path: Path
    why: str
    sections: tuple[str, ...]
    left_out: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}; {self.left_out}"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_info(run_dir: str | os.PathLike, problems: list[Problem]) -> dict:
    """``run.json`` as a dict; empty when missing or broken (a problem, then)."""
    path = RunDir(run_dir).info
    if not path.exists():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = f"not a readable JSON file ({_one_line(exc)})"
    else:
        if isinstance(info, dict):
            return info
        why = f"expected a JSON object, found {type(info).__name__}"
    problems.append(Problem(path, why, ("what-ran",), "'What ran' is left out"))
    return {}


def _epoch_error(rec: Any) -> str | None:
    from workbench.train.evaluation import METRICS  # here: importing the report must not import torch

    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not a record"
    if not _is_int(rec.get("epoch")):
        return f"epoch={rec.get('epoch')!r} is not an integer"
    for key in EPOCH_NUMBERS:
        if rec.get(key) is not None and not _is_number(rec[key]):
            return f"{key}={rec[key]!r} is not a number"
    if rec.get("valid_e_mae_mev_atom") is not None and rec.get("valid_f_mae_mev_a") is None:
        return "valid_e_mae_mev_atom without valid_f_mae_mev_a"
    fams = rec.get("valid_families")
    if fams is None:
        return None
    if not isinstance(fams, dict):
        return f"valid_families is a {type(fams).__name__}, not a mapping"
    for name, m in fams.items():
        if not isinstance(m, dict) or not _is_int(m.get("graphs")) or not all(_is_number(m.get(k)) for k in METRICS):
            return f"valid_families[{name!r}] lacks graphs or {', '.join(METRICS)} as numbers"
    return None


def read_epochs_checked(run_dir: str | os.PathLike, problems: list[Problem]) -> list[dict]:
    """Epoch records of ``metrics.jsonl``; none when any of them is broken (a problem, then)."""
    path = RunDir(run_dir).epoch_log
    try:
        epochs = read_jsonl(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = _one_line(exc).removeprefix("ValueError: ").removeprefix(f"{path}, ")
    else:
        errors = [(k, e) for k, rec in enumerate(epochs, 1) if (e := _epoch_error(rec)) is not None]
        if not errors:
            return epochs
        why = f"record {errors[0][0]}: {errors[0][1]}"
    left_out = "the validation errors and per-family table are left out"
    problems.append(Problem(path, why, ("families", "curves"), left_out))
    return []


def _step_error(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not a record"
    for key in ("rank", "global_step"):
        if not _is_int(rec.get(key)):
            return f"{key}={rec.get(key)!r} is not an integer"
    for key in STEP_NUMBERS + STEP_TIMING:
        if key in rec and rec[key] is not None and not _is_number(rec[key]):
            return f"{key}={rec[key]!r} is not a number"
    if any(_is_number(rec.get(k)) for k in STEP_NUMBERS):
        return None
    return f"no {' or '.join(STEP_NUMBERS)}"


def read_steps_checked(run_dir: str | os.PathLike, problems: list[Problem]) -> tuple[list[dict], bool]:
    """Step records of every readable rank log, and whether all carry the timings (``step_s`` ...).

    As :func:`workbench.train.rundir.read_steps`: a step redone after a restart replaces the lost
    attempt's record, sorted by (step, rank). A broken log is left out (a problem); an old one
    without timings keeps its losses (a problem too: no throughput or per-rank times)."""
    last: dict[tuple[int, int], dict] = {}
    timed = True
    for path in RunDir(run_dir).step_logs():
        try:
            recs = [r for r in read_jsonl(path) if not isinstance(r, dict) or r.get("type", "step") == "step"]
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = _one_line(exc).removeprefix("ValueError: ").removeprefix(f"{path}, ")
            problems.append(Problem(path, why, ("curves", "ranks"), "this rank's steps are left out"))
            continue
        errors = [(k, e) for k, rec in enumerate(recs, 1) if (e := _step_error(rec)) is not None]
        if errors:
            why = f"step record {errors[0][0]}: {errors[0][1]}"
            problems.append(Problem(path, why, ("curves", "ranks"), "this rank's steps are left out"))
            continue
        missing = [k for k in STEP_TIMING if any(not _is_number(r.get(k)) for r in recs)]
        if missing:
            timed = False
            why = f"old-format step records without {', '.join(missing)}"
            problems.append(Problem(path, why, ("ranks",), "throughput and the per-rank step times are left out"))
        for rec in recs:
            last[(rec["rank"], rec["global_step"])] = rec
    return [last[k] for k in sorted(last, key=lambda k: (k[1], k[0]))], timed


def guarded_packing(run_dir: str | os.PathLike, problems: list[Problem], compare) -> dict | None:
    """``compare(run_dir)`` (the packing comparison); None, with a problem, when ``packing.npz``
    is damaged or does not fit the run."""
    path = RunDir(run_dir).packing
    try:
        return compare(run_dir)
    except _NPZ_ERRORS as exc:
        why = f"not a readable packing ({_one_line(exc)})"
    problems.append(Problem(path, why, ("layout",), "padding waste, straggler share and the layout are left out"))
    return None
