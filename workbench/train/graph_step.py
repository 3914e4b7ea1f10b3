r"""The train step as one CUDA graph per batch shape (``TrainConfig.cuda_graph``).

A fixed-shape batch (:mod:`workbench.train.padding`) takes the same launches every step, so the
whole step (forward, forces by autograd, loss, backward, clipping, Adam and the EMA update) is
captured once per shape and replayed: one launch from the host instead of about 1,500.

:func:`device_step` is that step written so that a capture can take it: no value is read back to
the host inside (no ``.item()``, no branch on a device value, no output sized by the data):

* a non-finite loss or gradient norm skips the update **on the device**: fused Adam reads
  ``found_inf`` (the flag ``torch.amp.GradScaler`` uses) and the EMA's rate is multiplied by
  the finite flag, so a skipped step leaves weights, moments and averages as they were;
* the EMA's decay, :math:`\min(d, (1 + n)/(10 + n))` after :math:`n` updates (torch_ema's), is
  set by the host into a device scalar before each step;
* the host reads loss, norm and the flag once, after the step: the non-finite check, the log
  record and the epoch's sums move out of the captured region.

:class:`StepGraphs` runs it: eagerly on the CPU (the same function, so CPU tests check what a
GPU captures), and on a GPU eagerly on a side stream for the first :data:`WARMUP_STEPS` steps
(lazy initialisation), then captured per shape (and per learning rate: Adam takes it as a
constant; the plateau scheduler changes it rarely) into one shared memory pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from workbench.kernels.library import capture_safe
from workbench.kernels.rows import forget_graphs
from workbench.train.session import Session
from workbench.train.step import _culprits, _non_finite

__all__ = ["WARMUP_STEPS", "StepGraphs", "device_step", "take_graph_step"]

#: eager steps on a GPU before the first capture: cuBLAS handles, numba modules, optimiser state
WARMUP_STEPS = 3
#: what the step returns besides the model's outputs
_OUTPUTS = ("energy", "forces", "stress", "virials")


def _ema_update(ema, rate: torch.Tensor) -> None:
    """torch_ema's update, ``shadow -= rate * (shadow - param)``, with ``rate`` a device scalar."""
    params = [p for p in ema._get_parameters(None) if p.requires_grad]
    with torch.no_grad():
        diff = torch._foreach_sub(ema.shadow_params, params)
        torch._foreach_mul_(diff, rate)
        torch._foreach_sub_(ema.shadow_params, diff)


def device_step(s: Session, batch, ema_rate: torch.Tensor) -> dict[str, torch.Tensor]:
    """One train step with no host synchronisation (the module docstring): returns device
    tensors ``loss``, ``norm``, ``finite`` and the model's ``energy``, ``forces`` (and
    ``stress``, ``virials`` when computed). ``s.optimizer`` is fused Adam whose ``found_inf``
    this sets; ``ema_rate``: :math:`1 - \\mathrm{decay}` of this step's EMA update."""
    s.optimizer.zero_grad(set_to_none=False)  # grads stay where a captured graph wrote them
    with capture_safe():
        out = s.model(batch.to_dict(), training=True, compute_force=True, **s.outputs)
        loss = s.loss_fn(pred=out, ref=batch, ddp=False)
        loss.backward()
    max_norm = s.config.clip_grad or math.inf
    norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), max_norm, foreach=True)
    finite = torch.isfinite(norm) & torch.isfinite(loss.detach())
    s.optimizer.found_inf.copy_(~finite)  # fused Adam: no update where 1
    s.optimizer.step()
    if s.ema is not None:
        _ema_update(s.ema, ema_rate * finite)
    kept = {k: out[k].detach() for k in _OUTPUTS if out.get(k) is not None}
    return {"loss": loss.detach(), "norm": norm.detach(), "finite": finite, **kept}


def _ema_decay(ema) -> float:
    """The decay of the EMA's next update (torch_ema's rule)."""
    if ema.num_updates is None:
        return ema.decay
    n = ema.num_updates + 1
    return min(ema.decay, (1 + n) / (10 + n))


class StepGraphs:
    """Runs :func:`device_step` for a session: eagerly on the CPU; on a GPU, eagerly for the
    first :data:`WARMUP_STEPS`, then one captured graph per batch shape and learning rate,
    replayed after copying each batch into that graph's input tensors."""

    def __init__(self, s: Session, warmup: int = WARMUP_STEPS) -> None:
        self.s = s
        self.warmup = warmup
        self.steps = 0
        dtype = next(s.model.parameters()).dtype
        self.ema_rate = torch.zeros((), dtype=dtype, device=s.device)
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, input batch, outputs)
        self.pool = None
        self.captures = 0

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        s = self.s
        if s.ema is not None:
            self.ema_rate.fill_(1.0 - _ema_decay(s.ema))
        self.steps += 1
        if s.device.type != "cuda":
            return device_step(s, batch, self.ema_rate)
        if self.steps <= self.warmup:
            return self._eager_on_side_stream(batch)
        key = self._key(batch)
        if key not in self.graphs:
            return self._capture(key, batch)
        graph, inputs, out = self.graphs[key]
        for name in inputs.keys:
            value = inputs[name]
            if isinstance(value, torch.Tensor):
                value.copy_(batch[name], non_blocking=True)
        graph.replay()
        return out

    def _key(self, batch) -> tuple:
        lrs = tuple(float(g["lr"]) for g in self.s.optimizer.param_groups)
        if self.graphs and next(iter(self.graphs))[-1] != lrs:
            self.graphs.clear()  # a new learning rate: Adam holds it as a constant
        return (batch.num_nodes, int(batch.edge_index.shape[1]), batch.num_graphs, lrs)

    def _eager_on_side_stream(self, batch) -> dict[str, torch.Tensor]:
        side = torch.cuda.Stream(self.s.device)
        side.wait_stream(torch.cuda.current_stream(self.s.device))
        with torch.cuda.stream(side):
            out = device_step(self.s, batch, self.ema_rate)
        torch.cuda.current_stream(self.s.device).wait_stream(side)
        return out

    def _capture(self, key: tuple, batch) -> dict[str, torch.Tensor]:
        """Capture the step on ``batch``, whose tensors become the graph's inputs, and replay it."""
        forget_graphs()  # the edges' CSR groups must be built inside the capture, not reused
        self.s.optimizer.zero_grad(set_to_none=True)  # gradients live in the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = device_step(self.s, batch, self.ema_rate)
        except RuntimeError as e:
            raise RuntimeError(
                f"cuda_graph: capturing the train step for a batch of {key[0]} atoms, {key[1]} edges and "
                f"{key[2]} graphs failed ({e}); train with cuda_graph: false to go on"
            ) from e
        self.pool = graph.pool()
        self.graphs[key] = (graph, batch, out)
        self.captures += 1
        graph.replay()
        return out


def take_graph_step(s: Session, batch, indices: Sequence[int] = ()) -> tuple[torch.Tensor, dict, float, bool]:
    """:func:`~workbench.train.step.take_step` through :class:`StepGraphs` (``s.graphs``): the
    same return values, from one read of the step's scalars after it ran."""
    out = s.graphs(batch)
    dtype = out["loss"].dtype
    loss, norm, finite = torch.stack([out["loss"], out["norm"].to(dtype), out["finite"].to(dtype)]).tolist()
    skipped = not finite
    if skipped:
        _non_finite(s, loss, norm, _culprits(out, batch, indices))
    elif s.ema is not None and s.ema.num_updates is not None:
        s.ema.num_updates += 1
    return out["loss"], out, 0.0, skipped
