"""``accelerate(model)``: run a model's hot ops on a registered backend, in place.

The model family is found in :data:`workbench.kernels.registry.MODELS`, the backend in
:data:`workbench.kernels.registry.BACKENDS`; this module knows neither by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from workbench.kernels.options import kernel_options
from workbench.kernels.registry import BACKENDS, DEFAULT_BACKEND, adapter_for, get_backend

__all__ = ["AVAILABLE_OPS", "KERNEL_BACKENDS", "accelerate", "model_ops", "precompile_model"]

#: ops :func:`accelerate` can swap (over every registered model family)
AVAILABLE_OPS: tuple[str, ...] = ("symmetric_contraction", "channelwise_tp", "strided_contraction")
#: the backends registered when the package was imported (not the training launch backends); one
#: registered later is in :func:`~workbench.kernels.registry.backend_names`, which code should read
KERNEL_BACKENDS: tuple[str, ...] = tuple(BACKENDS)


def _check_ops(ops: Iterable[str] | str | None, known: tuple[str, ...], family: str) -> tuple[str, ...]:
    """``ops`` as a tuple of the family's op names; one name alone is that one op (a string is
    iterable: ``tuple("channelwise_tp")`` would be its letters)."""
    if ops is None:
        return known
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    for op in ops:
        if not isinstance(op, str) or op not in known:
            raise ValueError(f"accelerate: unknown op {op!r} for {family} models; valid ops: {', '.join(known)}")
    return ops


def accelerate(
    model: torch.nn.Module,
    backend: str = DEFAULT_BACKEND,
    ops: Iterable[str] | str | None = None,
    precompile: bool | None = None,
) -> torch.nn.Module:
    """Run the hot ops of ``model`` on ``backend`` (a registered backend's name).

    Parameters
    ----------
    model : torch.nn.Module
        a model of a registered family (mace-torch's ``MACE``, ``ScaleShiftMACE``, ..., or any
        module holding mace's ``SymmetricContraction`` or interaction blocks)
    backend : str
        a name of :func:`~workbench.kernels.registry.backend_names`. The built-in ones:
        ``numba`` (the default, :data:`~workbench.kernels.registry.DEFAULT_BACKEND`): the
        workbench's fused kernels (CUDA on GPU tensors, numba CPU otherwise);
        ``"torch"``: the same modules evaluated by the plain-torch reference (slow, exact);
        both in place, sharing the trained parameters (optimizers keep working).
        ``"e3nn"``: back to the family's own modules, in place, same parameters.
        ``"cueq"`` and ``"oeq"``: cuEquivariance or OpenEquivariance through the family's
        converter; builds and returns a *new* model.
    ops : str or tuple of str, optional
        op names to swap, among the family's (mace: ``"symmetric_contraction"``,
        ``"channelwise_tp"``); one name alone is that op; ``None`` swaps every one. A block the kernels do not support
        raises ``TypeError`` naming its class. With ``backend="e3nn"`` the listed ops are restored.
    precompile : bool, optional
        a compiled backend (the default) on a model whose parameters are on a CUDA device: compile every
        kernel a force-training step launches now, in parallel processes, once per node, into
        the kernel cache (:func:`precompile_model`). ``None`` (default): when the model is on a
        CUDA device and ``$WORKBENCH_PRECOMPILE`` is not ``0``.

    Returns
    -------
    the accelerated model (``model`` itself, except for ``"convert"`` backends such as ``"cueq"``).
    A descriptor backend that finds nothing to swap for an op raises ``ValueError``.
    """
    b = get_backend(backend)
    family = adapter_for(model)
    adapter = family.module()
    ops = _check_ops(ops, adapter.OPS, family.name)
    if b.kind == "convert":
        if b.name not in family.converts:
            raise ValueError(f"{family.name} models have no {b.name!r} converter; they convert to {family.converts}")
        return adapter.convert(model, b.name)
    if b.kind == "native":
        adapter.to_native(model, ops)
        return model
    adapter.to_workbench(model, ops, b.name)
    done = adapter.accelerated(model)
    missing = [op for op in ops if not done[op]]
    if missing:
        raise ValueError(
            f"accelerate: found nothing to swap for {', '.join(missing)} in this {type(model).__name__}: it holds "
            f"none of the {family.name} modules with e3nn's tensor product (a model converted to cuEquivariance "
            "must go back to e3nn first, e.g. with mace's mace_cueq_to_e3nn)"
        )
    if b.compiled and (precompile or (precompile is None and _precompile_by_default(model))):
        precompile_model(model)
    return model


def model_ops(model: torch.nn.Module) -> list:
    """Where ``model`` runs the workbench kernels: an :class:`~workbench.kernels.launches.OpSite`
    per accelerated module, in module order (the family adapter's ``model_ops``)."""
    return adapter_for(model).module().model_ops(model)


def _precompile_by_default(model: torch.nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cuda" and kernel_options().precompile


def precompile_model(model: torch.nn.Module, progress: bool = True, modules: Iterable[str] | None = None, **kwargs):
    """Compile the CUDA kernels that force training of ``model`` (accelerated, on a CUDA device)
    launches, in parallel processes under the node lock; returns the
    :class:`~workbench.kernels.precompile.PrecompileReport`. ``modules``: only the modules whose
    name starts with one of these (``"products.0."``; names as :func:`model_ops` gives them).
    ``kwargs`` go to :func:`~workbench.kernels.precompile.precompile` (``target="ptx"`` needs no GPU)."""
    from workbench.kernels.numba.gpu.device import cuda_available
    from workbench.kernels.precompile import precompile

    p = next(model.parameters())
    dtype = "float64" if p.dtype == torch.float64 else "float32"
    target = kwargs.pop("target", "device")
    if target == "device" and (p.device.type != "cuda" or not cuda_available()):
        raise ValueError(
            "precompile_model: the model is not on a CUDA device numba can launch on "
            f"(parameters on {p.device}); move it first, or pass target='ptx' to compile for a GPU elsewhere"
        )
    ops = model_ops(model)
    if modules is not None:
        prefixes = tuple(modules)
        ops = [o for o in ops if o.label.startswith(prefixes)]
        if not ops:
            raise ValueError(
                f"precompile_model: no accelerated module starts with {prefixes}; "
                f"the model's are {[o.label for o in model_ops(model)]}"
            )
    return precompile(
        ops, dtype, device=p.device if target == "device" else None, target=target, progress=progress, **kwargs
    )
