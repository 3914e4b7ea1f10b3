"""Build a mace-torch ``ScaleShiftMACE`` the way mace-torch's own ``run_train`` does, from a
config and the training split's statistics (:mod:`workbench.train.stats`)."""

from __future__ import annotations

import numpy as np
import torch

from workbench.dtypes import default_dtype
from workbench.train.config import TrainConfig
from workbench.train.stats import ModelStats


def build_model(config: TrainConfig, stats: ModelStats) -> torch.nn.Module:
    """A ``mace.modules.ScaleShiftMACE`` with the config's hyperparameters and ``stats``."""
    from e3nn import o3
    from mace import modules

    dtype = getattr(torch, config.dtype)
    with default_dtype(dtype):  # mace builds buffers in the default dtype
        model = modules.ScaleShiftMACE(
            r_max=config.cutoff,
            num_bessel=config.num_bessel,
            num_polynomial_cutoff=config.num_polynomial_cutoff,
            max_ell=config.max_ell,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=config.num_interactions,
            num_elements=len(stats.zs),
            hidden_irreps=o3.Irreps(config.hidden_irreps),
            MLP_irreps=o3.Irreps(config.mlp_irreps),
            atomic_energies=np.array(stats.e0s),
            avg_num_neighbors=stats.avg_num_neighbors,
            atomic_numbers=stats.zs,
            correlation=config.correlation,
            gate=modules.gate_dict["silu"],
            radial_MLP=list(config.radial_mlp),
            atomic_inter_scale=stats.scale,
            atomic_inter_shift=stats.shift,
        )
    return model.to(dtype)
