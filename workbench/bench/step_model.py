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


def make_optimizer(model, capturable: bool = False):
    """Adam at :data:`LR`, ``foreach`` (one kernel per update on a GPU); ``capturable`` (its step
    count on the device) for a CUDA graph."""
    import torch

    return torch.optim.Adam(model.parameters(), lr=LR, foreach=True, capturable=capturable)


def step_loss(out: dict, batch: dict):
    """mean(((E - E_ref) / atoms)^2) + mean((F - F_ref)^2) over the real graphs and atoms (all of
    them without ``real_graphs``), against the batch's labels (zeros where missing). No host sync."""
    import torch

    atoms = (batch["ptr"][1:] - batch["ptr"][:-1]).clamp(min=1).to(out["energy"].dtype)
    e_err = ((out["energy"] - batch.get("energy", torch.zeros_like(out["energy"]))) / atoms).pow(2)
    f_err = (out["forces"] - batch.get("forces", torch.zeros_like(out["forces"]))).pow(2)
    real = batch.get("real_graphs")
    if real is None:
        return e_err.mean() + f_err.mean()
    graphs = torch.arange(e_err.shape[0], device=real.device) < real
    nodes = torch.arange(f_err.shape[0], device=real.device) < batch["ptr"].index_select(0, real.view(1))
    zero = torch.zeros((), dtype=e_err.dtype, device=e_err.device)
    e_mean = torch.where(graphs, e_err, zero).sum() / graphs.sum()
    f_mean = torch.where(nodes[:, None], f_err, zero).sum() / (nodes.sum() * f_err.shape[1])
    return e_mean + f_mean


def train_step(model, optimizer, batch: dict, set_to_none: bool = True):
    """One full train step, its parts in profiler ranges ``forward``, ``backward``, ``optimizer``;
    returns the loss (a tensor: reading it would synchronise). ``set_to_none=False`` keeps the
    gradients where they are (a captured graph's)."""
    from torch.profiler import record_function

    optimizer.zero_grad(set_to_none=set_to_none)
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
