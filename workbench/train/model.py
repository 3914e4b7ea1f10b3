"""Build a mace-torch ``ScaleShiftMACE`` the way mace-torch's own ``run_train`` does.

Statistics come from the training split with mace's functions: per-element
E0s by least squares (``compute_average_E0s``), the average number of
neighbours (``compute_avg_num_neighbors``), and the shift/scale of the
interaction energy from the mean per-atom energy and the RMS force
(``compute_mean_rms_energy_forces``, mace's default ``rms_forces_scaling``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workbench.train.config import TrainConfig


@dataclass
class ModelStats:
    """Data-derived constants baked into the model (saved in checkpoints for exact rebuilds)."""

    zs: list[int]
    e0s: list[float]
    avg_num_neighbors: float
    shift: float
    scale: float

    def to_dict(self) -> dict:
        return {"zs": self.zs, "e0s": self.e0s, "avg_num_neighbors": self.avg_num_neighbors,
                "shift": self.shift, "scale": self.scale}


def compute_stats(configs: list, train_data: list, z_table) -> ModelStats:
    """``configs``: mace ``Configuration`` list of the training split; ``train_data``: its ``AtomicData``."""
    from mace.data.utils import compute_average_E0s
    from mace.modules.utils import compute_avg_num_neighbors, compute_mean_rms_energy_forces
    from mace.tools.torch_geometric import DataLoader

    e0 = compute_average_E0s(configs, z_table)
    e0s = [float(e0[z]) for z in z_table.zs]
    loader = DataLoader(train_data, batch_size=32, shuffle=False)
    avg = float(compute_avg_num_neighbors(loader))
    mean, rms = compute_mean_rms_energy_forces(loader, np.array(e0s))
    return ModelStats(zs=[int(z) for z in z_table.zs], e0s=e0s, avg_num_neighbors=avg,
                      shift=float(np.ravel(mean)[0]), scale=float(np.ravel(rms)[0]))


def build_model(config: TrainConfig, stats: ModelStats) -> torch.nn.Module:
    """A ``mace.modules.ScaleShiftMACE`` with the config's hyperparameters and ``stats``."""
    from e3nn import o3
    from mace import modules

    dtype = getattr(torch, config.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # mace builds buffers in the default dtype
    try:
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
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype)
