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

from workbench.train.config import TrainConfig
from workbench.train.rundir import RunDir


def export_models(model: torch.nn.Module, ema, config: TrainConfig, run_dir: Path) -> Path:
    final = copy.deepcopy(model).cpu()
    if ema is not None:
        ema.copy_to(final.parameters())  # same parameter order: final is a deep copy of model
    if config.backend != "e3nn":
        torch.save(final, RunDir(run_dir).accelerated_model(config.backend))
        from workbench.kernels import accelerate

        accelerate(final, backend="e3nn")
    path = RunDir(run_dir).model
    torch.save(final, path)
    _warn_if_refused(path)
    return path


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
