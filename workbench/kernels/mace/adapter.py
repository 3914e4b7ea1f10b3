"""The MACE model family for :func:`~workbench.kernels.accelerate`: which modules are the hot ops,
how they go to the workbench's modules and back, and the converters to cuEquivariance and
OpenEquivariance.

Registered in :mod:`workbench.kernels.registry` as ``"mace"``; the functions below are the
adapter protocol (:class:`~workbench.kernels.registry.ModelAdapter`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

__all__ = [
    "CONVERTERS",
    "OPS",
    "accelerated",
    "companions",
    "convert",
    "cueq_unavailable",
    "matches",
    "model_ops",
    "oeq_unavailable",
    "to_native",
    "to_workbench",
    "use_companions",
]

#: the ops this family can swap
OPS: tuple[str, ...] = ("symmetric_contraction", "channelwise_tp")


def _is_mace_sc(m: torch.nn.Module) -> bool:
    try:
        from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC
    except ImportError:  # an environment without mace-torch (the NequIP one) holds no mace module
        return False
    return isinstance(m, MaceSC)


def matches(model: torch.nn.Module) -> bool:
    """A mace-torch model, or any module holding mace's contraction, interaction blocks, or ours."""
    from workbench.kernels.mace.channelwise_tp import _is_interaction_block
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    return any(
        _is_mace_sc(m) or isinstance(m, SymmetricContraction) or _is_interaction_block(m) for m in model.modules()
    )


def _swap_contractions(model: torch.nn.Module, to_workbench: bool, backend: str) -> None:
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if to_workbench and _is_mace_sc(child):
                child = SymmetricContraction.from_mace(child)
                setattr(parent, name, child)
            elif not to_workbench and isinstance(child, SymmetricContraction):
                setattr(parent, name, child.to_mace())
            if to_workbench and isinstance(child, SymmetricContraction):
                child.kernel_backend = backend


def _swap_tps(model: torch.nn.Module, to_workbench: bool, backend: str) -> None:
    from workbench.kernels.mace.channelwise_tp import (
        _check_block,
        _fused_class,
        _is_interaction_block,
        fuse_conv_tp,
        unfuse_conv_tp,
    )

    blocks = [m for m in model.modules() if _is_interaction_block(m)]
    if not to_workbench:
        for b in blocks:
            unfuse_conv_tp(b)
        return
    for b in blocks:  # check every block first: all or nothing
        _check_block(b)
    for b in blocks:
        fuse_conv_tp(b)
        if isinstance(b.conv_tp, _fused_class()):
            b.conv_tp.kernel_backend = backend


def companions() -> tuple:
    """The swaps :func:`use_companions` makes (:mod:`workbench.kernels.class_swap`): e3nn's
    ``Linear`` (each interaction's ``linear_up`` and ``linear``, the product's ``linear``, the
    readouts) and the self-connection ``skip_tp`` (:mod:`workbench.kernels.e3nn.scalar_tp`: node
    features times the one-hot species, one matrix per species present). e3nn builds the
    latter as ``[N, 128 * elements]`` times ``[128 * elements, 128]``: for MACE-MP-0's 89
    elements the MD step took 0.93-0.94x the time without it (135 to 1,080 atoms); with the
    paper's two elements, 1.00-1.02x. And mace's ``reshape_irreps`` as one permutation
    (:mod:`workbench.kernels.mace.reshape`: 0.97-1.00x), and the edges' spherical harmonics as
    one pass each way (:mod:`workbench.kernels.e3nn.spherical_harmonics`)."""
    from workbench.kernels.e3nn import linear, scalar_tp, spherical_harmonics
    from workbench.kernels.mace import reshape

    return (linear.SWAP, scalar_tp.SWAP, reshape.SWAP, spherical_harmonics.SWAP)


def use_companions(model: torch.nn.Module, backend: str) -> None:
    """e3nn's modules around the ops of an accelerated ``model`` onto the workbench's forms of
    them, in place (:func:`companions`; exact classes the check accepts, the rest stay e3nn's).
    For MD: the paper config's step at 1,536 atoms took 0.90x the time (the 5,120-wide message's
    linear, forward and backward: 70 against 210 ms), while a training step at 96 atoms took
    1.05x, so :func:`~workbench.kernels.accelerate` leaves them out and the MD calculator
    puts them in. :func:`to_native` takes them back out with the last op."""
    for companion in companions():
        companion.swap_all(model, backend)


def to_workbench(model: torch.nn.Module, ops: Sequence[str], backend: str) -> None:
    """Swap ``ops`` for the workbench's modules, in place, evaluated by descriptor ``backend``."""
    if "channelwise_tp" in ops:
        _swap_tps(model, True, backend)
    if "symmetric_contraction" in ops:
        _swap_contractions(model, True, backend)


def to_native(model: torch.nn.Module, ops: Sequence[str]) -> None:
    """Back to mace's own e3nn modules, in place, same parameters."""
    if "channelwise_tp" in ops:
        _swap_tps(model, False, "")
    if "symmetric_contraction" in ops:
        _swap_contractions(model, False, "")
    if not any(accelerated(model).values()):
        for companion in companions():
            companion.unswap_all(model)


def accelerated(model: torch.nn.Module) -> dict[str, bool]:
    """Which ops of ``model`` run on the workbench's modules (at least one module each)."""
    from workbench.kernels.mace.channelwise_tp import _fused_class, _is_interaction_block
    from workbench.kernels.mace.symmetric_contraction import SymmetricContraction

    fused = _fused_class()
    mods = list(model.modules())
    return {
        "symmetric_contraction": any(isinstance(m, SymmetricContraction) for m in mods),
        "channelwise_tp": any(_is_interaction_block(m) and isinstance(m.conv_tp, fused) for m in mods),
    }


#: converter backend -> (the modules it needs, how to install them, mace-torch's converter module)
CONVERTERS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "cueq": (
        ("cuequivariance", "cuequivariance_torch"),
        "the [cuda] extra: pip install 'cfm-workbench[cuda]'",
        "mace.cli.convert_e3nn_cueq",
    ),
    "oeq": (("openequivariance",), "pip install openequivariance", "mace.cli.convert_e3nn_oeq"),
}


def _library_missing(backend: str) -> str | None:
    modules, install, _ = CONVERTERS[backend]
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as exc:  # ImportError, or an extension failing to build
        return f"{' and '.join(modules)} do not import ({type(exc).__name__}: {exc}); {install}"
    return None


def cueq_unavailable() -> str | None:
    """Why cuEquivariance cannot run here, or ``None``."""
    missing = _library_missing("cueq")
    if missing:
        return missing
    return None if torch.cuda.is_available() else "no CUDA GPU is visible (cuEquivariance has no CPU kernels)"


def oeq_unavailable() -> str | None:
    """Why OpenEquivariance cannot run here, or ``None``."""
    missing = _library_missing("oeq")
    if missing:
        return missing
    return None if torch.cuda.is_available() else "no CUDA GPU is visible (OpenEquivariance has no CPU kernels)"


def convert(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """A new model on another library's modules, by mace-torch's converter for ``backend``
    (one of :data:`CONVERTERS`: ``"cueq"``, ``"oeq"``)."""
    if backend not in CONVERTERS:
        raise ValueError(f"the mace adapter converts to {', '.join(CONVERTERS)}, not {backend!r}")
    missing = _library_missing(backend)
    if missing:
        raise ImportError(f"backend={backend!r}: {missing}")
    run = importlib.import_module(CONVERTERS[backend][2]).run
    to_native(model, OPS)  # the converter reads mace's own module layout
    device = next(model.parameters()).device.type
    return run(model, device=device, return_model=True)


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
