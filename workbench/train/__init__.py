"""DDP training of real mace-torch models with the packer and the kernels.

>>> from workbench.train import TrainConfig, train
>>> result = train(TrainConfig(hidden_irreps="16x0e", max_ell=1, correlation=2, max_steps=20))

The names below load on first use, so that importing a light submodule (``workbench.train.cli``,
``workbench.train.preempt``) does not import torch: the command line builds its parser from them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.train.config import TrainConfig
    from workbench.train.loop import TrainResult, evaluate, train

#: public name -> the submodule that defines it
_LAZY = {
    "TrainConfig": "workbench.train.config",
    "TrainResult": "workbench.train.loop",
    "evaluate": "workbench.train.loop",
    "train": "workbench.train.loop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.train' has no attribute {name!r}")


__all__ = ["TrainConfig", "TrainResult", "evaluate", "train"]
