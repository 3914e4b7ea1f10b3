"""Fault injection for the resume and rank-failure tests, through the training loop's one testing
hook (:mod:`workbench.train.hooks`): a rank dies with ``os._exit`` right after a given step."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def die_after_step(global_step: int, rank: int) -> None:
    """The hook: exit ``FAULT_CODE`` (17) after step ``FAULT_AT_STEP`` on rank ``FAULT_RANK`` (any
    rank when unset), on the first ``FAULT_ATTEMPTS`` (1) attempts of a torchrun group only."""
    if int(os.environ["FAULT_AT_STEP"]) != global_step:
        return
    if int(os.environ.get("FAULT_RANK", str(rank))) != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) >= int(os.environ.get("FAULT_ATTEMPTS", "1")):
        return
    os._exit(int(os.environ.get("FAULT_CODE", "17")))


def fault_env(at_step: int, rank: int | None = None) -> dict[str, str]:
    """The environment that makes a training run's rank ``rank`` (every rank: None) die after ``at_step``."""
    env = {
        "WORKBENCH_STEP_HOOK": f"{__name__}:die_after_step",
        "FAULT_AT_STEP": str(at_step),
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }
    if rank is not None:
        env["FAULT_RANK"] = str(rank)
    return env
