"""The model and the train step that ``workbench bench step`` times, and ``workbench bench
cold-start`` runs first: a random-weight ``ScaleShiftMACE``, the loss against the batch's labels,
backward, an Adam step."""

from __future__ import annotations

import gc
from collections.abc import Sequence

from workbench.bench.workloads import MODEL_SETTINGS, MODELS

__all__ = ["LR", "base_model", "free_memory", "make_optimizer", "step_loss", "sync", "train_step"]

#: torch.optim.Adam's learning rate
LR = 1e-3


def make_optimizer(model):
    """Adam at :data:`LR`, ``foreach`` (one kernel per update on a GPU)."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=LR, foreach=True)


def step_loss(out: dict, batch: dict):
    """mean(((E - E_ref) / atoms)^2) + mean((F - F_ref)^2); the references are the batch's
    ``energy`` / ``forces`` (zeros where a structure has no label, or the keys are missing)."""
    import torch

    atoms = (batch["ptr"][1:] - batch["ptr"][:-1]).to(out["energy"].dtype)
    e_ref = batch.get("energy", torch.zeros_like(out["energy"]))
    f_ref = batch.get("forces", torch.zeros_like(out["forces"]))
    return ((out["energy"] - e_ref) / atoms).pow(2).mean() + (out["forces"] - f_ref).pow(2).mean()


def train_step(model, optimizer, batch: dict):
    """One full train step, its parts in profiler ranges ``forward``, ``backward``, ``optimizer``;
    returns the loss (a tensor: reading it would synchronise)."""
    from torch.profiler import record_function

    optimizer.zero_grad(set_to_none=True)
    with record_function("forward"):
        out = model({k: v.clone() for k, v in batch.items()}, training=True, compute_force=True)
        loss = step_loss(out, batch)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
    return loss


def sync(device: str) -> None:
    """Wait for the device (a no-op on a CPU), so a clock reading covers the work launched."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # this device's work, not the current one's (cuda:1)


def free_memory(device: str) -> None:
    """Collect garbage and return cached CUDA memory, between rows."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def base_model(model: str, zs: Sequence[int], info: dict, dtype: str, device: str):
    """The random-weight model every backend copies: ``MODELS[model]``, ``avg_num_neighbors`` =
    the workload's edges per atom."""
    import torch

    from workbench.kernels.tools.models import random_scaleshift_mace

    if model in MODEL_SETTINGS:  # its cutoff and embedding are not what the step workloads are built for
        raise ValueError(
            f"model {model!r} runs in `bench cpu` only; choose from {', '.join(m for m in MODELS if m not in MODEL_SETTINGS)}"
        )
    hidden, ell, corr = MODELS[model]
    return random_scaleshift_mace(hidden, ell, corr, list(zs), info["edges_per_atom"], getattr(torch, dtype), device)
