"""Random-weight mace-torch models with the architecture training builds: what the kernel
benchmarks time, what ``workbench kernels precompile`` compiles for, and what the resource
report inspects."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workbench.dtypes import default_dtype

__all__ = ["random_scaleshift_mace"]


def random_scaleshift_mace(
    hidden: str,
    max_ell: int,
    correlation: int,
    atomic_numbers: Sequence[int],
    avg_num_neighbors: float,
    dtype: torch.dtype,
    device: str | torch.device,
    perturb: float = 0.1,
    seed: int = 0,
    r_max: float = 4.5,
) -> torch.nn.Module:
    """A 2-layer ``ScaleShiftMACE`` (residual interaction blocks, 8 Bessel functions, ``r_max`` Å) in ``dtype``.

    ``perturb`` adds ``perturb * N(0, 1)`` to every trainable parameter, so that no kernel is
    timed or checked on mace's structured initial values alone.
    """
    from e3nn import o3
    from mace import modules

    with default_dtype(dtype):
        torch.manual_seed(seed)
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        model = modules.ScaleShiftMACE(
            r_max=r_max,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=max_ell,
            interaction_cls=block,
            interaction_cls_first=block,
            num_interactions=2,
            num_elements=len(atomic_numbers),
            hidden_irreps=o3.Irreps(hidden),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.zeros(len(atomic_numbers)),
            avg_num_neighbors=avg_num_neighbors,
            atomic_numbers=list(atomic_numbers),
            correlation=correlation,
            gate=torch.nn.functional.silu,
            atomic_inter_scale=1.0,
            atomic_inter_shift=0.0,
        )
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(perturb * torch.randn_like(p))
    return model.to(device)
