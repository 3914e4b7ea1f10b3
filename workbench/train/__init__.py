"""DDP training of real mace-torch models with the packer and the kernels.

>>> from workbench.train import TrainConfig, train
>>> result = train(TrainConfig(hidden_irreps="16x0e", max_ell=1, correlation=2, max_steps=20))
"""

from workbench.train.config import TrainConfig
from workbench.train.loop import TrainResult, evaluate, train

__all__ = ["TrainConfig", "TrainResult", "evaluate", "train"]
