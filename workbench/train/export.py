"""Final model files: what mace-torch's ``MACECalculator`` loads, plus an e3nn export.

``model.model`` always holds the e3nn (mace-torch original) modules, with the EMA
weights when EMA is on, so users without our kernels or a GPU can load it.
When training used a kernel backend, ``model_<backend>.model`` keeps that form.
Both load with the safe loader of ``workbench eval`` and ``workbench md``
(:mod:`workbench.train.model_file`); a model that would need ``--trust-model`` gets a warning.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from workbench.kernels.registry import get_backend
from workbench.train.checkpoint import torch_save_atomic
from workbench.train.config import TrainConfig
from workbench.train.rundir import RunDir


class ExportError(ValueError):
    """A model file that could not be written; the message names it and the way out."""


def export_models(model: torch.nn.Module, ema, config: TrainConfig, run_dir: Path) -> Path:
    final = copy.deepcopy(model).cpu()
    if ema is not None:
        ema.copy_to(final.parameters())  # same parameter order: final is a deep copy of model
    if get_backend(config.backend).kind != "native":
        _write(final, RunDir(run_dir).accelerated_model(config.backend))
        from workbench.kernels import accelerate
        from workbench.kernels.compiling import undo_swaps

        accelerate(final, backend="e3nn")
        undo_swaps(final)  # cuda_graph's swaps (workbench.kernels.compiling.capture_ready)
    path = RunDir(run_dir).model
    _write(final, path)
    _warn_if_refused(path)
    return path


def _write(model: torch.nn.Module, path: Path) -> None:
    """Atomically: a full disk leaves the earlier file (or none), never a truncated model."""
    try:
        torch_save_atomic(model, path)
    except OSError as exc:
        raise ExportError(
            f"{path}: cannot write the model ({exc.strerror or exc}); no partial file is left and the "
            "checkpoint is kept: free space and run the same command again to export it"
        ) from None


def _warn_if_refused(path: Path) -> None:
    """Say so when the safe loader would refuse the exported model (a class it does not know)."""
    from workbench.train.model_file import refused_globals

    refused = refused_globals(path)
    if refused:
        warnings.warn(
            f"{path}: names {', '.join(refused)}, which the safe model loader refuses; "
            "workbench eval and md will need --trust-model for it",
            stacklevel=3,
        )
