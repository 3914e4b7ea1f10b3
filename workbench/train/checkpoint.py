"""Checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint holds the model, optimizer, EMA and scheduler states, the RNG
states (python, numpy, torch, CUDA), the sampler's state (epoch and batches
consumed) and the step counters. It is written to a temporary file and renamed,
so a kill during the write never leaves a truncated checkpoint behind; the one it replaces
is kept as ``checkpoint.prev.pt``, the fallback when the latest turns out damaged.
"""

from __future__ import annotations

import io
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.train.rundir import previous_path


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


REQUIRED_KEYS = ("model", "optimizer", "epoch", "global_step", "sampler", "rng", "config")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the way out."""


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete ``<checkpoint>.tmp<pid>`` files a killed writer left behind (only one writer runs:
    the run directory is locked)."""
    path = Path(path)
    stale = list(path.parent.glob(path.name + ".tmp*")) if path.parent.is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def torch_save_atomic(obj: Any, path: str | os.PathLike, keep_previous: bool = False) -> Path:
    """``torch.save(obj, path)`` that leaves either the old file or the whole new one, never part of
    one: written to ``<path>.tmp<pid>`` and renamed. A full disk is one ``OSError`` and the temporary
    is gone. ``keep_previous`` keeps the file it replaces as ``*.prev.pt``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # serialised in memory, written with plain I/O: a full disk is one OSError
    try:
        with open(tmp, "wb") as fh:
            fh.write(buffer.getbuffer())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if keep_previous and path.exists():
        os.replace(path, previous_path(path))
    os.replace(tmp, path)
    return path


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically; the checkpoint it replaces is kept as ``*.prev.pt``."""
    return torch_save_atomic(state, path, keep_previous=True)


def _read(path: Path, trust: bool = False) -> dict[str, Any]:
    """The checkpoint's state, loaded without running code from the file unless ``trust``
    (:mod:`workbench.train.model_file`: tensors, numbers, strings and numpy arrays only)."""
    from workbench.train.model_file import load_torch_file

    try:
        state = load_torch_file(
            path, trust=trust, what="checkpoint", trust_hint="set trust_checkpoint: true (--set trust_checkpoint=true)"
        )
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a workbench checkpoint (missing {missing})")
    return state


def load_checkpoint(path: str | os.PathLike, trust: bool = False) -> dict[str, Any] | None:
    """The latest checkpoint, or None when there is none. A damaged one falls back, with a
    warning, to the previous checkpoint; with no usable one it raises, naming the file. The file
    is loaded without running code from it; ``trust=True`` loads a full pickle (a warning says so)."""
    path = Path(path)
    prev = previous_path(path)
    if not path.exists() and not prev.exists():
        return None
    try:
        if not path.exists():
            raise CheckpointError(f"{path}: missing (a write was interrupted)")
        return _read(path, trust)
    except CheckpointError as exc:
        if prev.exists():
            try:
                state = _read(prev, trust)
            except CheckpointError:
                pass
            else:
                warnings.warn(
                    f"{exc}; resuming from the previous checkpoint {prev.name} (step {state['global_step']})",
                    stacklevel=2,
                )
                return state
        raise CheckpointError(
            f"{exc}. No usable earlier checkpoint: start afresh with --fresh (or "
            "train(..., resume=False)), or restore the file"
        ) from None
