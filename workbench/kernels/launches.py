"""What a training step launches: every CUDA kernel of an op and its training derivatives,
planned on tiny arrays, without running anything.

The static resource report (:mod:`~workbench.bench.resources`) compiles these launches
to PTX; :mod:`~workbench.kernels.precompile` compiles them to machine code ahead of the first
step. A kernel's types depend only on the dtypes, ranks and layouts of its arguments, never on
their sizes, so four rows plan the same kernels as a 3072-atom batch.

    >>> for label, op in training_ops(model.products[0].symmetric_contractions.op):
    ...     for launch in launches(op, "float32", channels=128):
    ...         kernel, blocks, threads, args = launch.plan
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.kernels.options import kernel_options

__all__ = ["Launch", "OpSite", "launches", "training_ops"]


@dataclass(frozen=True)
class OpSite:
    """An op where a model uses it: the module's name, the op, its channel count, and the
    operands that do not depend on the atom positions (e.g. the node features entering a MACE
    model's first interaction: an embedding of the species)."""

    label: str
    op: Any
    channels: int
    position_free: tuple[str, ...] = ()


def training_ops(op, position_free: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """``(label, op)`` for the forward op and the derivative ops force training launches.

    The backward computes only the gradients the autograd run uses
    (:func:`~workbench.kernels.ops.engine_uses`). The loss's backward runs the first derivative
    to every operand (the energy's gradient reaches every weight). The forces' first derivative,
    toward the positions only, is to every operand but the per-species weights (``"species"``
    rows, e.g. the contraction's ``W``) and those in ``position_free``, with the forward
    output's cotangent: listed last, where it differs from the full one. The double backward is
    that op's derivative to every one of its operands, with cotangents on all its outputs."""
    skipped = tuple(o.rows == "species" or o.name in position_free for o in op.operands)
    forces = op.derivative(tuple(not s for s in skipped), (True,) * len(op.outputs))
    d2 = forces.derivative((True,) * len(forces.operands), (True,) * len(forces.outputs))
    full = op.derivative((True,) * len(skipped), (True,) * len(op.outputs))
    ops = [("forward", op), ("backward", full), ("double backward", d2)]
    return ops + [("forces' backward", forces)] if any(skipped) else ops


@dataclass
class Launch:
    """One kernel launch of an op: ``plan`` is ``(kernel, blocks, threads_per_block, args)``."""

    output: str
    kernel: str  # launch shape: atom, atom partial, atom pass, species sum, node, edge, edge reduce, pass
    variant: str  # unrolled, table or segment
    terms: int
    slots: int
    plan: tuple | None
    degree: int = 0  # factors per term of a table kernel (its term loop's loads per term)


def _output_launches(comp, dtype: str, shape: str, plans: list[tuple]) -> Iterator[Launch]:
    """One output's launches, as its backend planned them: the table kernel, or one generated
    kernel per part (:func:`~workbench.kernels.numba.gpu.unrolled.unrolled_parts`), named ``k/n``."""
    from workbench.kernels.numba.gpu.unrolled import unrolled_parts

    parts = unrolled_parts(comp, dtype)
    for k, plan in enumerate(plans):
        if parts is None:
            yield Launch(comp.output.name, shape, "table", comp.num_terms, comp.num_slots, plan, comp.degree)
        else:
            name = comp.output.name if len(parts) == 1 else f"{comp.output.name} {k + 1}/{len(parts)}"
            yield Launch(name, shape, "unrolled", parts[k].num_terms, parts[k].num_slots, plan)


def _host(shape: tuple, dtype: str) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def _edge_launches(op, dtype: str, channels: int, alloc: Callable, host: bool) -> Iterator[Launch]:
    from workbench.kernels.numba.gpu import edge as edge_cuda
    from workbench.kernels.numba.gpu import edge_pass

    rows = 4
    dummy = alloc((1, 1), dtype)
    idx = alloc((rows,), "int64")
    arrays = [alloc((rows, o.width), dtype) for o in op.operands]
    arrays += [dummy] * (8 - len(arrays))
    seg = (alloc((rows + 1,), "int64"), idx)
    outs = [alloc((rows, comp.output.width), dtype) for comp in op.compiled]
    fused = (
        None
        if not kernel_options().fuse_passes
        else edge_pass.plan(op.compiled, arrays, idx, idx, lambda _: seg, channels, outs)
    )
    done: tuple[int, ...] = ()
    if fused is not None:  # one launch for these outputs of the pass
        done = fused[4]
        live = [op.compiled[k] for k in done]
        slots = len({k for c in live for k in edge_pass._slot_keys(c.table)})
        yield Launch(
            ", ".join(c.output.name for c in live), "pass", "unrolled", sum(c.num_terms for c in live), slots, fused[:4]
        )
    for k, comp in enumerate(op.compiled):
        if k in done:
            continue
        out = alloc((rows, comp.output.width), dtype)
        shape = "node" if comp.node_output else ("edge reduce" if comp.reduce_channels else "edge")
        yield from _output_launches(
            comp,
            dtype,
            shape,
            edge_cuda.plans(comp, arrays, idx, idx, seg if comp.node_output else None, channels, out, host=host),
        )


def _atom_launches(op, dtype: str, channels: int, alloc: Callable, host: bool) -> Iterator[Launch]:
    from workbench.kernels.numba.gpu import atom as _cuda
    from workbench.kernels.numba.gpu import atom_pass, segment

    rows = 4
    idx = alloc((rows,), "int64")
    arrays = [alloc((1, 1), dtype)] * 10
    for aid, o in zip(op.array_ids, op.operands):
        arrays[aid] = alloc((rows, o.width), dtype)
    outs = [alloc((rows, comp.output.width), dtype) for comp in op.compiled]
    pk = None if not kernel_options().fuse_passes else atom_pass.pass_kernels(op.compiled, dtype)
    fused = None if pk is None else atom_pass.plan(op.compiled, arrays, idx, channels, outs, pk)
    done: tuple[int, ...] = ()
    if fused is not None:  # one launch for these outputs (all their parts) per kernel, then the species sums
        plans, done = fused
        kernels = pk[1]
        for j, (parts, plan) in enumerate(zip(kernels, plans)):
            names = ", ".join(dict.fromkeys(op.compiled[k].output.name for k, _ in parts))
            if len(kernels) > 1:
                names += f" {j + 1}/{len(kernels)}"
            yield Launch(
                names,
                "atom pass",
                "unrolled",
                sum(t.num_terms for _, t in parts),
                max(t.num_slots for _, t in parts),
                plan,
            )
        for k in done:
            if op.compiled[k].species_output:
                yield Launch(
                    op.compiled[k].output.name,
                    "species sum",
                    "segment",
                    0,
                    0,
                    segment.plan_segment_sum(outs[k], idx, idx, outs[k][:2]),
                )
    for i, comp in enumerate(op.compiled):
        if i in done:
            continue
        out = outs[i]
        shape = "atom partial" if comp.species_output else "atom"
        yield from _output_launches(comp, dtype, shape, _cuda.plans(comp, arrays, idx, channels, out, host=host))
        if comp.species_output:
            yield Launch(
                comp.output.name, "species sum", "segment", 0, 0, segment.plan_segment_sum(out, idx, idx, out[:2])
            )


def launches(op, dtype: str, channels: int, alloc: Callable[[tuple, str], Any] | None = None) -> Iterator[Launch]:
    """Every launch of ``op`` (a :class:`~workbench.kernels.ops.PolyOp` or ``EdgePolyOp``) in
    ``dtype``, planned by its backend on arrays of four rows. A species output is its per-atom
    partial kernels (one per part when split), then the per-species sum.

    ``alloc(shape, dtype)`` makes the planning arrays: host numpy arrays by default (for PTX
    compilation: table arguments stay on the host too); ``numba.cuda.device_array`` plans the
    launch exactly as the device sees it."""
    host = alloc is None
    alloc = _host if alloc is None else alloc
    if op.edge:
        return _edge_launches(op, dtype, channels, alloc, host)
    return _atom_launches(op, dtype, channels, alloc, host)
