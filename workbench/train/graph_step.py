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
from collections.abc import Callable, Sequence

import torch

from workbench.kernels.library import capture_safe
from workbench.kernels.rows import forget_graphs
from workbench.train.session import Session
from workbench.train.step import _culprits, _non_finite

__all__ = ["WARMUP_STEPS", "ShapeGraphs", "StepGraphs", "batch_key", "device_step", "take_graph_step"]

#: eager steps on a GPU before the first capture: cuBLAS handles, numba modules, optimiser state
WARMUP_STEPS = 3
#: what the step returns besides the model's outputs
_OUTPUTS = ("energy", "forces", "stress", "virials")


def _ema_update(ema, rate: torch.Tensor) -> None:
    """torch_ema's update, ``shadow -= rate * (shadow - param)`` over every parameter it shadows
    (frozen ones too, as torch_ema 0.3 does), with ``rate`` a device scalar."""
    params = list(ema._get_parameters(None))
    with torch.no_grad():
        diff = torch._foreach_sub(ema.shadow_params, params)
        torch._foreach_mul_(diff, rate)
        torch._foreach_sub_(ema.shadow_params, diff)


def device_step(s: Session, batch, ema_rate: torch.Tensor) -> dict[str, torch.Tensor]:
    """One train step with no host synchronisation (the module docstring): returns device
    tensors ``loss``, ``norm``, ``finite`` and the model's ``energy``, ``forces`` (and
    ``stress``, ``virials`` when computed). ``s.optimizer`` is fused Adam whose ``found_inf``
    this sets; ``ema_rate``: :math:`1 - \\mathrm{decay}` of this step's EMA update."""
    # the gradients keep their memory, from the eager warm-up on: every captured graph
    # accumulates into it in place, and freeing it would hand a graph's memory to other tensors
    s.optimizer.zero_grad(set_to_none=False)
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


class ShapeGraphs:
    """``fn(inputs)`` (a capture-safe function of a mace batch or batch dict, returning device
    tensors) as one CUDA graph per ``key``: eagerly on the CPU; on a GPU eagerly on a side stream
    for the first ``warmup`` calls, then captured the first time a key comes up (the inputs'
    tensors become the graph's) and replayed after copying each call's inputs into them.

    All graphs share one memory pool, so a call's outputs are valid until the next call (another
    graph may reuse their memory for its temporaries). ``fn`` must allocate every tensor that
    outlives it (gradients, optimiser state) in the warm-up and never free it: every replay
    writes into that memory."""

    def __init__(self, fn: Callable, device: torch.device, warmup: int = WARMUP_STEPS) -> None:
        self.fn, self.device, self.warmup = fn, torch.device(device), warmup
        self.calls = 0
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, inputs, outputs)
        self.pool = None
        self.captures = 0

    def __call__(self, inputs, key: tuple):
        self.calls += 1
        if self.device.type != "cuda":
            return self.fn(inputs)
        if self.calls <= self.warmup:
            return self._eager_on_side_stream(inputs)
        if key not in self.graphs:
            return self._capture(key, inputs)
        graph, static, out = self.graphs[key]
        with torch.no_grad():  # the model set requires_grad on some inputs (positions) in the capture
            for name, value in _tensors(static).items():
                value.copy_(inputs[name], non_blocking=True)
        graph.replay()
        return out

    def clear(self) -> None:
        """Drop every graph, and their pool: the next capture starts a new one (torch refuses to
        capture into a pool whose graphs are all gone)."""
        self.graphs.clear()
        self.pool = None

    def _eager_on_side_stream(self, inputs):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self.fn(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def _capture(self, key: tuple, inputs):
        forget_graphs()  # the edges' CSR groups must be built inside the capture, not reused
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fn(inputs)
        except RuntimeError as e:
            raise RuntimeError(
                f"cuda_graph: capturing the train step for shape {key} failed ({e}); "
                "train with cuda_graph: false to go on"
            ) from e
        self.pool = graph.pool()
        self.graphs[key] = (graph, inputs, out)
        self.captures += 1
        graph.replay()
        return out


def _tensors(inputs) -> dict[str, torch.Tensor]:
    """The tensors of a batch dict or a mace ``Batch`` (whose ``keys`` is a property)."""
    names = inputs.keys() if isinstance(inputs, dict) else inputs.keys
    return {n: inputs[n] for n in names if isinstance(inputs[n], torch.Tensor)}


def batch_key(batch) -> tuple[int, int, int]:
    """``(atoms, edges, graphs)`` of a mace ``Batch`` or batch dict: what a graph is captured for."""
    ptr = batch["ptr"]
    return (int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1]), int(ptr.shape[0]) - 1)


class StepGraphs:
    """:func:`device_step` for a session through :class:`ShapeGraphs`, keyed by the batch's
    shape and the learning rates (Adam holds them as constants: a new rate drops the graphs)."""

    def __init__(self, s: Session, warmup: int = WARMUP_STEPS) -> None:
        self.s = s
        dtype = next(s.model.parameters()).dtype
        self.ema_rate = torch.zeros((), dtype=dtype, device=s.device)
        self.runner = ShapeGraphs(lambda batch: device_step(s, batch, self.ema_rate), s.device, warmup)
        self.lrs: tuple[float, ...] | None = None

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        s = self.s
        if s.ema is not None:
            self.ema_rate.fill_(1.0 - _ema_decay(s.ema))
        lrs = tuple(float(g["lr"]) for g in s.optimizer.param_groups)
        if lrs != self.lrs:
            self.runner.clear()
            self.lrs = lrs
        return self.runner(batch, batch_key(batch))


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
