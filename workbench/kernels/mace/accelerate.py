"""``accelerate(model)``: swap MACE's hot ops for the workbench kernels, in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["AVAILABLE_OPS", "KERNEL_BACKENDS", "accelerate", "model_ops", "precompile_model"]

#: ops :func:`accelerate` can swap
AVAILABLE_OPS: tuple[str, ...] = ("symmetric_contraction", "channelwise_tp")
#: how :func:`accelerate` runs them (the model's hot ops; not the training launch backends)
KERNEL_BACKENDS: tuple[str, ...] = ("numba", "e3nn", "cueq")


def _is_mace_sc(m: torch.nn.Module) -> bool:
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    return isinstance(m, MaceSC)


def _swap_symmetric_contractions(model: torch.nn.Module, backend: str) -> int:
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if backend == "numba" and _is_mace_sc(child):
                setattr(parent, name, SymmetricContraction.from_mace(child))
                n += 1
            elif backend == "e3nn" and isinstance(child, SymmetricContraction):
                setattr(parent, name, child.to_mace())
                n += 1
    return n


def _swap_channelwise_tps(model: torch.nn.Module, backend: str) -> int:
    """Fuse (``numba``) or unfuse (``e3nn``) the message op of every interaction block."""
    from workbench.kernels.mace.channelwise_tp import _is_interaction_block, fuse_conv_tp, unfuse_conv_tp

    blocks = [m for m in model.modules() if _is_interaction_block(m)]
    if backend == "numba":
        from workbench.kernels.mace.channelwise_tp import _check_block

        for b in blocks:  # check every block first: all or nothing
            _check_block(b)
        return sum(fuse_conv_tp(b) for b in blocks)
    return sum(unfuse_conv_tp(b) for b in blocks)


def accelerate(
    model: torch.nn.Module, backend: str = "numba", ops: Iterable[str] | None = None, precompile: bool | None = None
) -> torch.nn.Module:
    """Swap the hot ops of a mace-torch model (``MACE``, ``ScaleShiftMACE``, ...).

    Parameters
    ----------
    model : torch.nn.Module
        a mace-torch model (or any module containing mace's ``SymmetricContraction`` or
        interaction blocks)
    backend : str
        ``"numba"``: the workbench's sparse-polynomial kernels (CUDA on GPU tensors, numba CPU
        otherwise), in place, sharing the trained parameters (optimizers keep working);
        ``"e3nn"``: back to mace's original modules, in place, same parameters;
        ``"cueq"``: cuEquivariance through mace-torch's own converter
        (``mace.cli.convert_e3nn_cueq.run``); this builds and returns a *new* model.
    ops : tuple of str, optional
        op names to swap, among ``AVAILABLE_OPS``; ``None`` swaps every available op.
        ``"symmetric_contraction"``: the product blocks' contraction
        (:class:`~workbench.kernels.SymmetricContraction`); ``"channelwise_tp"``: gather +
        channelwise tensor product + scatter-sum of every interaction block fused into one op
        (:func:`~workbench.kernels.mace.channelwise_tp.fuse_conv_tp`; raises ``TypeError`` naming
        the class of an unsupported block). With ``backend="e3nn"`` the listed ops are restored.
    precompile : bool, optional
        ``backend="numba"`` on a model whose parameters are on a CUDA device: compile every
        kernel a force-training step launches now, in parallel processes, once per node, into
        the kernel cache (:func:`precompile_model`), instead of one by one at the first step.
        ``None`` (default): when the model is on a CUDA device and ``$WORKBENCH_PRECOMPILE`` is
        not ``0``.

    Returns
    -------
    the accelerated model (``model`` itself, except for ``backend="cueq"``). With ``"numba"``,
    an op that ends up with no module on the workbench kernels (nothing to swap) raises
    ``ValueError``: a model accelerated again stays as it is, one without mace's modules is refused.
    """
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {KERNEL_BACKENDS}")
    ops = AVAILABLE_OPS if ops is None else tuple(ops)
    for op in ops:
        if op not in AVAILABLE_OPS:
            raise ValueError(f"unknown op {op!r}; known ops: {AVAILABLE_OPS}")
    if backend == "cueq":
        return _to_cueq(model)
    if "channelwise_tp" in ops:
        _swap_channelwise_tps(model, backend)
    if "symmetric_contraction" in ops:
        _swap_symmetric_contractions(model, backend)
    if backend == "numba":
        done = _accelerated(model)
        missing = [op for op in ops if not done[op]]
        if missing:
            raise ValueError(
                f"accelerate: found nothing to swap for {', '.join(missing)} in this {type(model).__name__}: it holds "
                "no mace SymmetricContraction / interaction block with e3nn's tensor product (a model converted "
                "to cuEquivariance must go back to e3nn first, e.g. with mace's mace_cueq_to_e3nn)"
            )
        if precompile or (precompile is None and _precompile_by_default(model)):
            precompile_model(model)
    return model


def _to_cueq(model: torch.nn.Module) -> torch.nn.Module:
    """A new model on cuEquivariance, through mace-torch's own converter."""
    try:
        import cuequivariance  # noqa: F401
        import cuequivariance_torch  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "backend='cueq' needs cuequivariance and cuequivariance-torch (the [cuda] extra: "
            "pip install 'cfm-workbench[cuda]') and, to run fast, an NVIDIA GPU"
        ) from exc
    from mace.cli.convert_e3nn_cueq import run as run_e3nn_to_cueq

    accelerate(model, backend="e3nn")  # the converter reads mace's own module layout
    device = next(model.parameters()).device.type
    return run_e3nn_to_cueq(model, device=device, return_model=True)


def model_ops(model: torch.nn.Module) -> list:
    """Where ``model`` runs the workbench kernels: an
    :class:`~workbench.kernels.launches.OpSite` per accelerated module, in module order. The
    message op of a MACE model's first interaction takes node features that are an embedding
    of the species alone, so force training never differentiates through them (``x`` is
    position-free there), which changes the double backward it launches."""
    from workbench.kernels.launches import OpSite
    from workbench.kernels.mace.channelwise_tp import _fused_class
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    fused = _fused_class()
    interactions = getattr(model, "interactions", None)
    first = interactions[0] if isinstance(interactions, torch.nn.ModuleList) and len(interactions) else None
    first_tps = {id(m) for m in first.modules()} if first is not None else set()
    out = []
    for name, m in model.named_modules():
        if isinstance(m, SymmetricContraction):
            out.append(OpSite(name, m.op, m.num_channels))
        elif isinstance(m, fused):
            op = m.channelwise_op()[0]
            out.append(OpSite(name, op, op.channels, ("x",) if id(m) in first_tps else ()))
    return out


def _precompile_by_default(model: torch.nn.Module) -> bool:
    import os

    from workbench.kernels.precompile import PRECOMPILE_ENV

    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cuda" and os.environ.get(PRECOMPILE_ENV, "1") != "0"


def precompile_model(model: torch.nn.Module, progress: bool = True, modules: Iterable[str] | None = None, **kwargs):
    """Compile the CUDA kernels that force training of ``model`` (accelerated, on a CUDA device)
    launches, in parallel processes under the node lock; returns the
    :class:`~workbench.kernels.precompile.PrecompileReport`. ``modules``: only the modules whose
    name starts with one of these (``"products.0."``; names as :func:`model_ops` gives them).
    ``kwargs`` go to :func:`~workbench.kernels.precompile.precompile` (``target="ptx"`` needs no GPU)."""
    from workbench.kernels.backends.device import cuda_available
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


def _accelerated(model: torch.nn.Module) -> dict[str, bool]:
    """Which ops of ``model`` run on the workbench kernels (at least one module each)."""
    from workbench.kernels.mace.channelwise_tp import _fused_class, _is_interaction_block
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    fused = _fused_class()
    mods = list(model.modules())
    return {
        "symmetric_contraction": any(isinstance(m, SymmetricContraction) for m in mods),
        "channelwise_tp": any(_is_interaction_block(m) and isinstance(m.conv_tp, fused) for m in mods),
    }
