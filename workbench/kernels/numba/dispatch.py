r"""The ``numba`` backend's ``evaluate``: which numba kernels run an op's outputs.

Tensors on CUDA and numba's CUDA target available -> fused CUDA kernels
(:mod:`~workbench.kernels.numba.gpu.atom`, :mod:`~workbench.kernels.numba.gpu.edge`; all outputs
of a pass in one launch where :mod:`~workbench.kernels.numba.gpu.atom_pass` /
:mod:`~workbench.kernels.numba.gpu.edge_pass` apply); ``WORKBENCH_KERNELS_CUDASIM=1`` with
``NUMBA_ENABLE_CUDASIM=1`` -> the same kernels in the simulator on CPU tensors; otherwise the CPU
path (:mod:`~workbench.kernels.numba.cpu.passes`: vector programs, SIMD over channels). CUDA
tensors where numba has no CUDA target are an error, or (``WORKBENCH_KERNELS_HOST_FALLBACK=1``)
run the CPU kernels on host copies.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from workbench.kernels.library import host_side
from workbench.kernels.numba.compiled import CompiledPolynomial
from workbench.kernels.numba.cpu import passes as _cpu
from workbench.kernels.numba.gpu import atom as _cuda
from workbench.kernels.numba.gpu import atom_pass as _apass
from workbench.kernels.numba.gpu import edge as _ecuda
from workbench.kernels.numba.gpu import edge_pass as _epass
from workbench.kernels.numba.gpu.device import cuda_available, cudasim_enabled
from workbench.kernels.options import kernel_options, variable
from workbench.kernels.rows import RowIndex

__all__ = ["cpu_plan", "evaluate", "evaluate_tabulated", "tabulated_supported"]

_WARNED: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


#: set to 1 to let CUDA tensors run the CPU kernels on host copies when numba has no CUDA target
HOST_FALLBACK_ENV = variable("host_fallback")


def _no_cuda_target(device: torch.device) -> None:
    """A CUDA tensor, but numba cannot launch here: an error naming why, unless host copies are allowed."""
    from workbench.kernels.numba.gpu.device import cuda_status

    why = cuda_status()[1]
    if not kernel_options().host_fallback:
        raise RuntimeError(
            f"workbench.kernels: {device} tensors, but {why}. Install numba-cuda (the [cuda] extra) with a "
            f"working driver, convert back with accelerate(model, backend='e3nn'), or set {HOST_FALLBACK_ENV}=1 "
            "to run the CPU kernels on host copies (correct, slow)"
        )
    _warn_once(f"workbench.kernels: {device} tensors run the CPU kernels on host copies ({HOST_FALLBACK_ENV}=1): {why}")


def _dtype_name(dtype: torch.dtype) -> str:
    return "float64" if dtype == torch.float64 else "float32"


def _cpu_output(shape: tuple, dtype) -> torch.Tensor:
    if kernel_options().poison:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def _uninitialised(shape: tuple, dtype, device) -> torch.Tensor:
    if device.type == "cpu":  # the simulator: NaN, so an element a kernel misses cannot pass a test
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def evaluate(op: Any, tensors: Sequence[torch.Tensor], index: RowIndex, channels: int) -> list[torch.Tensor]:
    """Every output of ``op`` (a :class:`~workbench.kernels.ops.PolyOp`) on ``tensors``, already
    checked, contiguous and of one dtype (``PolyOp.evaluate_rows`` does that for every backend)."""
    dtype, device = tensors[0].dtype, tensors[0].device
    on_gpu = device.type == "cuda" and cuda_available()
    kernels = on_gpu or (device.type == "cpu" and cudasim_enabled())
    outs = [_output(op, c, index, dtype, device, kernels) for c in op.compiled]
    if on_gpu:
        _run_cuda(op, tensors, index, channels, outs)
    elif device.type != "cpu":
        _no_cuda_target(device)
        host = [torch.zeros(o.shape, dtype=dtype) for o in outs]
        _run_host(op, [t.cpu() for t in tensors], index.cpu(), channels, host, sim=False)
        for o, h in zip(outs, host):
            o.copy_(h)
    else:
        with host_side():  # CPU tensors: never inside a GPU capture
            _run_host(op, tensors, index, channels, outs, sim=kernels)
    return outs


def _output(op, comp: CompiledPolynomial, index: RowIndex, dtype, device, kernels: bool) -> torch.Tensor:
    """The output of ``comp``: uninitialised where the kernels write every element
    (poisoned with NaN under the simulator and with ``WORKBENCH_KERNELS_POISON=1``, so a
    missed element fails the parity tests), zeros for the accumulating kernels."""
    shape = (index.num_rows(comp.out_rows), comp.output.width)
    if comp.num_terms == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    if not kernels:  # the CPU row passes store every row, and sum species outputs whole
        return (
            _cpu_output(shape, dtype) if comp.covers_output or comp.species_output else torch.zeros(shape, dtype=dtype)
        )
    full = comp.species_output or (_ecuda if op.edge else _cuda).writes_every_element(comp, _dtype_name(dtype))
    return _uninitialised(shape, dtype, device) if full else torch.zeros(shape, dtype=dtype, device=device)


def _partial(comp: CompiledPolynomial, index: RowIndex, out: torch.Tensor) -> torch.Tensor | None:
    """Per-atom partial rows of a species output (summed per species by the CUDA path)."""
    if not comp.species_output:
        return None
    shape = (int(index.species.shape[0]), comp.output.width)
    if _cuda.writes_every_element(comp, _dtype_name(out.dtype)):
        return _uninitialised(shape, out.dtype, out.device)
    return torch.zeros(shape, dtype=out.dtype, device=out.device)


def _arrays(op, tensors, dummy, convert, num_arrays: int) -> list:
    args = [dummy] * num_arrays
    for aid, t in zip(op.array_ids, tensors):
        args[aid] = convert(t.detach())
    return args


def _run_host(op, tensors, index: RowIndex, channels: int, outs, sim: bool) -> None:
    """numba CPU kernels, or (``sim``) the CUDA kernels in the simulator, on numpy views."""
    dummy = np.zeros((1, 1), dtype="float64" if tensors[0].dtype == torch.float64 else "float32")
    arrays = _arrays(op, tensors, dummy, lambda t: t.numpy(), _cpu.NUM_ARRAYS if not sim else index.num_arrays)
    if not sim:
        _run_cpu(op, arrays, index, channels, [o.numpy() for o in outs])
        return
    fused = _launch_pass(op, arrays, index, channels, outs, lambda t: t.numpy(), 0)
    for k, (comp, out) in enumerate(zip(op.compiled, outs)):
        if comp.num_terms == 0 or k in fused:
            continue
        idx = index.arrays(comp, lambda t: t.numpy())
        _launch(op, comp, arrays, idx, index, channels, out, lambda t: t.numpy(), 0)


def cpu_plan(op: Any, channels: int) -> _cpu.CpuPlan:
    """The CPU row passes of this op's outputs (vector programs, built once per channel count)."""
    options = kernel_options()  # the passes a plan merges depend on which programs are fused
    key = ("cpu", channels, options.cpu_merge_edges, options.cpu_kernels, options.cpu_unroll_max)
    return op._cached(key, lambda: _cpu.plan([c.poly for c in op.compiled], op.array_ids, channels))


def _table_operand(op, operand: int, coeffs: np.ndarray, rows: tuple, cotangent: int, dr=None):
    from workbench.kernels.numba.cpu.tabulated import TableOperand

    return TableOperand(op.array_ids[operand], coeffs, rows[0], rows[1], cotangent, dr)


def tabulated_supported(op: Any, operand: int, coeffs: np.ndarray, cotangent: int = -1) -> bool:
    """Whether :func:`evaluate_tabulated` can run ``op`` with operand ``operand`` read from
    ``coeffs`` (every pass that reads it, or stores output ``cotangent``, fused)."""
    dummy = np.zeros(1)
    table = _table_operand(op, operand, coeffs, (dummy, dummy), cotangent)
    return table.supports(cpu_plan(op, op.channels))


def evaluate_tabulated(
    op: Any,
    tensors: Sequence[torch.Tensor | None],
    index: Any,
    operand: int,
    coeffs: np.ndarray,
    rows: tuple,
    cotangent: int = -1,
) -> tuple[list[torch.Tensor], np.ndarray | None]:
    """The outputs of edge ``op`` on CPU tensors with ``tensors[operand]`` (None) read from the
    table ``coeffs`` at each edge's ``rows = (interval, centred coordinate)``
    (:class:`~workbench.kernels.numba.cpu.tabulated.TableOperand`); output ``cotangent`` (that
    operand's cotangent; -1: none) is returned dotted with the slopes in ``s``, ``[E]``, in its
    place. ``tensors`` are contiguous, of the table's dtype; checked by :func:`tabulated_supported`."""
    dtype = torch.float64 if coeffs.dtype == np.float64 else torch.float32
    dummy = np.zeros((1, 1), dtype=coeffs.dtype)
    outs = [
        _output(op, c, index, dtype, torch.device("cpu"), False) for k, c in enumerate(op.compiled) if k != cotangent
    ]
    host = [o.numpy() for o in outs]
    dr = None
    if cotangent >= 0:  # every element is written; NaN under poison shows one that is not
        dr = np.empty(index.num_edges, dtype=coeffs.dtype)
        if kernel_options().poison:
            dr.fill(np.nan)
        host.insert(cotangent, dummy)
    arrays = [dummy] * _cpu.NUM_ARRAYS
    for aid, t in zip(op.array_ids, tensors):
        if t is not None:
            arrays[aid] = t.detach().numpy()
    table = _table_operand(op, operand, coeffs, rows, cotangent, dr)
    with host_side():
        _run_cpu(op, arrays, index, op.channels, host, table)
    return outs, dr


def _run_cpu(op, arrays, index: RowIndex, channels: int, outs, table=None) -> None:
    cp = cpu_plan(op, channels)
    if op.edge:
        _cpu.run_edge(
            cp,
            arrays,
            index.sender.numpy(),
            index.receiver.numpy(),
            lambda rows: tuple(t.numpy() for t in index.csr(rows)),
            index.num_nodes,
            channels,
            outs,
            table,
        )
    else:
        _cpu.run_atom(cp, arrays, index.species.detach().to(torch.int64).numpy(), index.num_species, channels, outs)


def _run_cuda(op, tensors, index: RowIndex, channels: int, outs) -> None:
    from numba import cuda

    device = tensors[0].device
    with torch.cuda.device(device):
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        dummy = cuda.as_cuda_array(torch.zeros((1, 1), dtype=tensors[0].dtype, device=device))
        arrays = _arrays(op, tensors, dummy, cuda.as_cuda_array, index.num_arrays)
        fused = _launch_pass(op, arrays, index, channels, outs, cuda.as_cuda_array, stream)
        for k, (comp, out) in enumerate(zip(op.compiled, outs)):
            if k in fused:
                continue
            idx = index.arrays(comp, cuda.as_cuda_array)
            _launch(op, comp, arrays, idx, index, channels, out, cuda.as_cuda_array, stream)


def _launch_pass(
    op, arrays, index: RowIndex, channels: int, outs, convert: Callable[[torch.Tensor], Any], stream
) -> tuple[int, ...]:
    """The outputs of the pass in one launch (:mod:`~workbench.kernels.numba.gpu.edge_pass`,
    :mod:`~workbench.kernels.numba.gpu.atom_pass`: then a per-species sum of each weight
    gradient) when it applies (``WORKBENCH_FUSE_PASSES=0``: never); the indices of those it
    computed."""
    if not kernel_options().fuse_passes:
        return ()
    if not op.edge:
        kernels = _apass.pass_kernels(op.compiled, _dtype_name(outs[0].dtype))
        if kernels is None:
            return ()  # before allocating partials the per-output launches would allocate again
        partials = [_partial(c, index, o) for c, o in zip(op.compiled, outs)]
        return _apass.launch(
            op.compiled,
            arrays,
            *index.arrays(op.compiled[0], convert),
            channels,
            [convert(o) for o in outs],
            [None if p is None else convert(p) for p in partials],
            tuple(convert(t) for t in index.csr()) if any(c.species_output for c in op.compiled) else None,
            stream,
            kernels,
        )
    planned = _epass.plan(
        op.compiled,
        arrays,
        convert(index.sender),
        convert(index.receiver),
        lambda rows: tuple(convert(t) for t in index.csr(rows)),
        channels,
        [convert(o) for o in outs],
    )
    return _epass.launch(planned, stream)


def _launch(
    op,
    comp: CompiledPolynomial,
    arrays,
    idx,
    index: RowIndex,
    channels: int,
    out: torch.Tensor,
    convert: Callable[[torch.Tensor], Any],
    stream,
) -> None:
    """One output through the CUDA kernels (or the simulator): ``convert`` hands tensors over."""
    if op.edge:
        _ecuda.launch(comp, arrays, *idx, channels, convert(out), stream)
        return
    partial = _partial(comp, index, out)
    _cuda.launch(
        comp,
        arrays,
        *idx,
        channels,
        convert(out),
        stream,
        partial=None if partial is None else convert(partial),
        csr=tuple(convert(t) for t in index.csr()) if comp.species_output else None,
    )
