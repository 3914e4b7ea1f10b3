"""``compile_ready(model)``: an accelerated MACE model made traceable by dynamo as one graph,
for ``torch.compile(fullgraph=True)`` and ``torch.export``.

What stops dynamo on a mace model, and what this module does about each:

* e3nn's generated modules (``Linear``, ``TensorProduct``) run TorchScript, which dynamo does
  not enter: the workbench's forms of them (:mod:`workbench.kernels.e3nn.linear`,
  :mod:`~workbench.kernels.e3nn.scalar_tp`) take their place, as in the MD calculator;
* e3nn's ``Activation`` reads its ``Irreps`` in its forward, and dynamo's guards then call
  ``len()`` of an ``Irrep``, which e3nn refuses: it is traced once by ``torch.fx``, as
  mace-torch's own ``simplify`` does;
* ``torch.autograd.grad`` (the forces) is traced only with
  ``torch._dynamo.config.trace_autograd_ops`` on (mace-torch's ``configure_autograd_for_compile``);
* the kernels' ops, plans and keys are built here, not on first use inside a trace;
* the kernels themselves are the custom op ``workbench::sparse_poly``
  (:mod:`workbench.kernels.library`).

The caller sets ``positions.requires_grad_(True)`` before calling a compiled model for
forces: dynamo does not see mace's own ``requires_grad_`` on an input. A model made ready
stays ready: the swaps and traces are not undone by ``accelerate(model, "e3nn")``.
"""

from __future__ import annotations

import torch

from workbench.kernels.registry import DEFAULT_BACKEND, adapter_for

__all__ = ["capture_ready", "compile_ready", "energy_program", "undo_swaps"]


def _count(swap, model: torch.nn.Module, backend: str) -> int:
    before = sum(swap.is_ours(m) for m in model.modules())
    swap.swap_all(model, backend)
    return sum(swap.is_ours(m) for m in model.modules()) - before


def _trace_activations(module: torch.nn.Module) -> int:
    """e3nn ``Activation`` children of ``module`` replaced by their ``torch.fx`` trace."""
    from e3nn.nn import Activation
    from torch.fx import symbolic_trace

    traced = 0
    for name, child in module.named_children():
        if type(child) is Activation:
            setattr(module, name, symbolic_trace(child))
            traced += 1
        else:
            traced += _trace_activations(child)
    return traced


def _build(model: torch.nn.Module) -> int:
    """Build every op and plan the kernels and companions would build on first use."""
    from workbench.kernels.e3nn import linear, scalar_tp
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    built = 0
    for m in model.modules():
        device = next(m.parameters(), torch.empty(0)).device
        if isinstance(m, SymmetricContraction):
            m.stats()  # builds the op
        elif hasattr(m, "channelwise_op"):
            m.channelwise_op()
        elif linear.SWAP.is_ours(m):
            m.plan(linear.linear_plan, device)
            m.io_dims()
        elif scalar_tp.SWAP.is_ours(m):
            m.plans(device)
            m.dims()
        else:
            continue
        built += 1
    return built


def capture_ready(model: torch.nn.Module, backend: str = DEFAULT_BACKEND) -> list[str]:
    """Make mace ``model`` free of host syncs and first-use builds in its forward and backward, in
    place, for a CUDA-graph capture (:mod:`workbench.train.graph_step`): accelerated on
    ``backend`` when no op is, e3nn's TorchScript modules swapped for the workbench's (their
    profiling executor compares tensors on the host), every op and plan built ahead. Returns
    what it changed, one line each."""
    from workbench.kernels.acceleration import accelerate, model_ops
    from workbench.kernels.e3nn import linear, scalar_tp
    from workbench.kernels.registry import backend_names, get_backend

    family = adapter_for(model)
    if family.name != "mace":
        raise TypeError(f"a {family.name} model: only mace-torch models can be prepared here")
    if get_backend(backend).kind != "descriptor":
        raise ValueError(
            f"backend {backend!r}: choose one of the kernel backends, {', '.join(backend_names('descriptor'))}"
        )
    changes = []
    if not model_ops(model):
        accelerate(model, backend=backend, precompile=False)
        changes.append(f"accelerate: {len(model_ops(model))} modules onto the {backend} kernels")
    for swap, what in ((linear.SWAP, "e3nn Linear"), (scalar_tp.SWAP, "e3nn TensorProduct (skip_tp)")):
        if n := _count(swap, model, backend):
            changes.append(f"{what} -> {swap.ours().__name__}: {n} modules (no TorchScript in the graph)")
    changes.append(f"built ahead: the ops and plans of {_build(model)} modules")
    return changes


def undo_swaps(model: torch.nn.Module) -> None:
    """Put e3nn's ``Linear`` and ``TensorProduct`` back where :func:`capture_ready` swapped
    them, in place: what an exported model (for users without the workbench) needs."""
    from workbench.kernels.e3nn import linear, scalar_tp

    for swap in (linear.SWAP, scalar_tp.SWAP):
        swap.unswap_all(model)


def compile_ready(model: torch.nn.Module, backend: str = DEFAULT_BACKEND) -> list[str]:
    """Make mace ``model`` traceable as one graph (the module docstring), in place; returns
    what it changed, one line each. Accelerates the model on ``backend`` first when no op is."""
    from mace.tools.compile import configure_autograd_for_compile

    changes = capture_ready(model, backend)
    if n := _trace_activations(model):
        changes.insert(-1, f"e3nn Activation -> torch.fx GraphModule: {n} modules (no Irreps read in forward)")
    configure_autograd_for_compile(True)
    changes.insert(-1, "torch._dynamo.config.trace_autograd_ops = True (forces by autograd.grad in the graph)")
    return changes


class _Energy(torch.nn.Module):
    """``data -> energy`` of a mace model, without forces: what ``torch.export`` traces."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(data, training=False, compute_force=False)["energy"]


def _scripted(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.jit.ScriptModule)
    ]


def energy_program(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """``torch.export`` of ``data -> energy`` for a :func:`compile_ready` ``model``, on example
    ``data`` (mace's input dict). e3nn's TorchScript submodules that the ready model no longer
    calls are set aside while exporting (export cannot walk them) and put back after."""
    aside = _scripted(model)
    for parent, name, _ in aside:
        del parent._modules[name]
    try:
        return torch.export.export(_Energy(model), (data,))
    finally:
        for parent, name, child in aside:
            parent._modules[name] = child
