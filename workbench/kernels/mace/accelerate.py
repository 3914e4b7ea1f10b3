"""``accelerate(model)``: swap MACE's hot ops for the workbench kernels, in place."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["accelerate", "AVAILABLE_OPS", "KERNEL_BACKENDS"]

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


def accelerate(model: torch.nn.Module, backend: str = "numba", ops: Iterable[str] | None = None) -> torch.nn.Module:
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
                "to cuEquivariance must go back to e3nn first, e.g. with mace's mace_cueq_to_e3nn)")
    return model


def _accelerated(model: torch.nn.Module) -> dict[str, bool]:
    """Which ops of ``model`` run on the workbench kernels (at least one module each)."""
    from workbench.kernels.mace.channelwise_tp import _fused_class, _is_interaction_block
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    fused = _fused_class()
    mods = list(model.modules())
    return {"symmetric_contraction": any(isinstance(m, SymmetricContraction) for m in mods),
            "channelwise_tp": any(_is_interaction_block(m) and isinstance(m.conv_tp, fused) for m in mods)}
