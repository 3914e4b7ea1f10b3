r"""One launch per pass of an edge op: every output of a message op's backward (or double
backward) from one generated kernel, each operand component loaded once per edge.

The backward of the message :math:`M_r = \sum_{e \to r} P(h_{s_e}, Y_e, R_e)` has outputs of
three kinds: the gradient to the sender features (summed over the sender's edges), per-edge
gradients to the radial weights (one element per edge and channel) and to the spherical
harmonics (summed over channels). All three are owned by the thread that walks the *sender*
segments: thread (node :math:`n`, channel :math:`c`) visits every edge with :math:`s_e = n`
once, accumulates :math:`\bar h[n, c]` in registers, stores :math:`\bar R[e, c]` directly, and
the edge's :math:`\bar Y[e]` is summed over the node's channel threads in shared memory in a
fixed order. Every edge lies in exactly one sender segment, so no element has two writers: no
atomics, the same bits on every run. The double backward adds a receiver output (the gradient
to the incoming cotangent :math:`\bar M`), which a second *role* of the same launch computes:

* **role 1** (blocks ``[0, B1)``): ``NPB`` nodes x ``C`` channels per block (``NPB = 128 // C``,
  or one node of ``C`` threads when ``C > 128``). The node's threads walk its segment in step
  (the block loops to its longest segment), so that after each edge a barrier lets the first
  ``K`` threads of the node sum the ``C`` partials of the channel-summed output, ascending;
* **role 2** (blocks ``[B1, B1 + B2)``): thread per (node, channel) over the other rows' CSR,
  as the node kernel of :mod:`~workbench.kernels.numba.gpu.unrolled`.

Operand components are read with unsigned indices (no wraparound, offsets folded into the
loads) and shared by every output of a role (:func:`~workbench.kernels.numba.gpu.unrolled_sums.sums`
with one slot namespace). A pass is fused when every output runs unrolled on its own, the
role-1 union fits (:func:`fused_layout`), there is at most one channel-summed output with
contiguous components, and ``C <= 256`` when it has one (a node's threads share a block, and
its partials fit static shared memory); the outputs left out are launched one kernel each by
the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import numpy as np

from workbench.kernels.descriptor.tables import TermTable
from workbench.kernels.numba.gpu import unrolled
from workbench.kernels.numba.gpu.unrolled_source import EDGE_ROW_VARS, Index, edge_rows
from workbench.kernels.numba.gpu.unrolled_sums import Definitions, dtype_name, sums

__all__ = ["PassLayout", "block_shape", "fused_layout", "kernel_source", "launch", "layout", "plan"]

#: a channel-summed output is reduced inside one block, so a node's C threads share one: 256
#: threads at up to 255 registers each fill the 64K register file
MAX_REDUCE_CHANNELS = 256
MAX_CHANNELS = 1024
#: the partials of the channel-summed output live in static shared memory (48 KB a block)
MAX_SHARED_BYTES = 48 * 1024
IND = "    "


@dataclass(frozen=True)
class PassLayout:
    """Which output goes where: ``walked`` node outputs of rows ``walk`` and the per-edge outputs
    (``edge`` channelwise, ``reduce`` channel-summed) in role 1, node outputs of the other rows
    (``other``) in role 2; indices into the op's outputs."""

    walk: str
    walked: tuple[int, ...]
    edge: tuple[int, ...]
    reduce: int | None
    other: tuple[int, ...]

    @property
    def other_rows(self) -> str:
        return "receiver" if self.walk == "sender" else "sender"


def layout(compiled: Sequence[Any]) -> PassLayout | None:
    """The fused layout of an edge op's outputs (``CompiledPolynomial`` s), or None when there is
    nothing to fuse (one output) or the outputs do not fit one launch (no node output to walk,
    a channel-summed node output, several channel-summed edge outputs, or one whose components
    are not contiguous)."""
    live = [k for k, c in enumerate(compiled) if c.num_terms > 0]
    if len(live) < 2:
        return None
    rows = {compiled[k].out_rows for k in live if compiled[k].node_output}
    if not rows or any(compiled[k].node_output and compiled[k].reduce_channels for k in live):
        return None
    walk = "sender" if "sender" in rows else "receiver"
    reduce_ = [k for k in live if compiled[k].reduce_channels]
    if len(reduce_) > 1:
        return None
    if reduce_:
        c = compiled[reduce_[0]]
        off = np.asarray(c.out_off)
        if not c.covers_output or not np.array_equal(off, off[0] + np.arange(off.shape[0])):
            return None
    return PassLayout(
        walk=walk,
        walked=tuple(k for k in live if compiled[k].node_output and compiled[k].out_rows == walk),
        edge=tuple(
            k for k in live if compiled[k].edge and not compiled[k].node_output and not compiled[k].reduce_channels
        ),
        reduce=reduce_[0] if reduce_ else None,
        other=tuple(k for k in live if compiled[k].node_output and compiled[k].out_rows != walk),
    )


def block_shape(channels: int) -> tuple[int, int]:
    """``(nodes per block, threads per block)`` of role 1: as many whole nodes of ``channels``
    threads as fit ``WORKBENCH_CUDA_TPB`` (default 128) threads, at least one."""
    npb = max(1, unrolled.block_size() // channels)
    return npb, npb * channels


def fused_layout(compiled: Sequence[Any], dtype: str, channels: int) -> PassLayout | None:
    """The layout of the fused launch, or None when the pass launches its outputs one by one.

    Role 1 is fused when each of its outputs runs unrolled on its own and their union fits:
    float32, the union's terms, accumulators and distinct operand components pass
    :func:`~workbench.kernels.numba.gpu.unrolled.use_unrolled`; float64 (two registers a value),
    it reads at most :data:`~workbench.kernels.numba.gpu.unrolled.MAX_PART_SLOTS_F64` components.
    Role 2 joins it in float32 when its outputs run unrolled; float64 launches them apart, since
    one kernel holding both roles spills more (paper config, double backward: 268 B against 192 B
    for role 1 alone, and none for role 2 alone)."""
    lay = layout(compiled)
    if lay is None or channels < 1 or channels > MAX_CHANNELS:
        return None
    role1 = [compiled[k] for k in _role1(lay)]
    if lay.reduce is not None:
        width = compiled[lay.reduce].out_off.shape[0] * (8 if dtype == "float64" else 4)
        if channels > MAX_REDUCE_CHANNELS or block_shape(channels)[1] * width > MAX_SHARED_BYTES:
            return None
    if not all(unrolled.unroll(c, dtype, split=False) for c in role1):
        return None
    slots = len({key for c in role1 for key in _slot_keys(c.table)})
    if dtype == "float64":
        if slots > unrolled.MAX_PART_SLOTS_F64:
            return None
        return replace(lay, other=())
    if not unrolled.use_unrolled(sum(c.num_terms for c in role1), sum(c.accumulators for c in role1), slots, 4):
        return None
    if not all(unrolled.unroll(compiled[k], dtype, split=False) for k in lay.other):
        return replace(lay, other=())
    return lay


def _role1(lay: PassLayout) -> tuple[int, ...]:
    return lay.walked + lay.edge + ((lay.reduce,) if lay.reduce is not None else ())


def _slot_keys(table: TermTable) -> list[tuple[int, int, int, int]]:
    return [
        (int(a), int(k), int(o), int(s))
        for a, k, o, s in zip(table.slot_arr, table.slot_rows, table.slot_off, table.slot_cs)
    ]


class _Slots:
    """One variable per distinct operand component of a role, loaded once per edge."""

    def __init__(self, prefix: str, index: Index):
        self.prefix, self.index = prefix, index
        self.names: dict[tuple[int, int, int, int], str] = {}

    def of(self, table: TermTable, ind: str) -> tuple[list[str], list[str]]:
        """The variables of ``table``'s slots, and the loads of those not loaded before (placed
        just before the table's sums, which shortens the live ranges of the later tables' operands)."""
        names, loads = [], []
        for key in _slot_keys(table):
            if key not in self.names:
                self.names[key] = f"{self.prefix}{len(self.names)}"
                a, k, off, cs = key
                loads.append(f"{ind}{self.names[key]} = x{a}[{EDGE_ROW_VARS[k]}, {self.index(off, cs)}]")
            names.append(self.names[key])
        return names, loads


def kernel_source(
    tables: Sequence[TermTable], lay: PassLayout, dtype: str, channels: int, npb: int | None = None
) -> str:
    """Python source of the fused pass kernel for ``tables`` (one per output of the op, in its
    order) for ``npb`` nodes of ``channels`` channels per block (default :func:`block_shape`;
    the shared buffers are sized by them)."""
    npb = block_shape(channels)[0] if npb is None else npb
    consts = Definitions(dtype)
    index = Index()
    outs = ", ".join(f"out{k}" for k in range(len(tables)))
    xs = ", ".join(f"x{i}" for i in range(8))
    src = [
        f"def kernel({xs}, sender, receiver, w_ptr, w_perm, o_ptr, o_perm, C, B1, {outs}):",
        "tid = cuda.threadIdx.x",
        "go = C > 0",
    ]
    if lay.reduce is not None:
        red_k = tables[lay.reduce].out_off.shape[0]
        dt = dtype_name(dtype)
        src += [
            f"red = cuda.shared.array(({npb * channels}, {red_k}), {dt})",
            f"cnt = cuda.shared.array({npb}, numba.int64)",
        ]
    body = _walk_body(tables, lay, npb, consts, index, dtype)
    src += ["if cuda.blockIdx.x < B1:"] + [IND + line for line in body]
    if lay.other:
        src += ["else:"] + [IND + line for line in _other_body(tables, lay, consts, index, dtype)]
    return _module(src, consts, index)


def _walk_body(
    tables: Sequence[TermTable], lay: PassLayout, npb: int, consts: Definitions, index: Index, dtype: str
) -> list[str]:
    """Role 1: whole nodes per block, walking the ``walk`` segments; node outputs carried over
    the walk, per-edge outputs stored (channelwise) or summed over the node's threads."""
    i2 = IND * 2
    slots = _Slots("v", index)
    body = [
        "ln = tid // C",
        "c = tid - ln * C",
        f"n = cuda.blockIdx.x * {npb} + ln",
        "N = w_ptr.shape[0] - 1",
        "start = 0",
        "count = 0",
        "if n < N:",
        f"{IND}start = w_ptr[n]",
        f"{IND}count = w_ptr[n + 1] - start",
        "nu = u64(n)",
        "eu = u64(0)",
        "@CHANNELS@",
    ]
    if lay.reduce is not None:  # the block walks to its longest segment: every thread meets the barriers
        body += ["if c == 0:", f"{IND}cnt[ln] = count", "cuda.syncthreads()", "L = cnt[0]"]
        body += [f"for b in range(1, {npb}):", f"{IND}L = max(L, cnt[b])"]
    else:
        body.append("L = count")
    decl, loop, stores = _carried(tables, lay.walked, slots, i2, IND, consts, index, dtype)
    body += decl
    for k in lay.edge:
        t = tables[k]
        names, loads = slots.of(t, i2)
        decl, lines, exprs = sums(t, dtype, i2, consts, names=names, tag=f"a{k}", source=True)
        stored = [f"{i2}out{k}[eu, {index(t.out_off[o], t.out_cs[o])}] = {e}" for o, e in exprs.items()]
        loop += loads + decl + lines + stored
    reduce_tail: list[str] = []
    if lay.reduce is not None:
        lines, reduce_tail = _reduced(tables[lay.reduce], lay.reduce, slots, consts, index, dtype)
        loop += lines
    body += ["for j in range(L):", f"{IND}if j < count:"] + edge_rows(i2, "w_perm[start + j]")
    body += loop + reduce_tail
    if stores:
        body += ["if n < N:"] + stores
    return body


def _reduced(
    t: TermTable, k: int, slots: _Slots, consts: Definitions, index: Index, dtype: str
) -> tuple[list[str], list[str]]:
    """The channel-summed output ``k`` of role 1: ``(lines in the walk, after each edge)``. Each
    thread stores its partials in shared memory; then the node's first ``K`` threads each sum
    one component over the ``C`` channel partials, ascending."""
    i2, i3, i4 = IND * 2, IND * 3, IND * 4
    names, loads = slots.of(t, i2)
    decl, lines, exprs = sums(t, dtype, i2, consts, names=names, tag=f"a{k}", source=True)
    comp = {o: j for j, o in enumerate(sorted(exprs))}
    loop = loads + decl + lines + [f"{i2}red[tid, {comp[o]}] = {e}" for o, e in exprs.items()]
    tail = [
        f"{IND}cuda.syncthreads()",
        f"{IND}if j < count:",
        f"{i2}for q in range(c, {t.out_off.shape[0]}, C):",
        f"{i3}t = red[ln * C, q]",
        f"{i3}for i in range(1, C):",
        f"{i4}t += red[ln * C + i, q]",
        f"{i3}out{k}[eu, u64(q) + U{int(t.out_off[0])}] = t",
        f"{IND}cuda.syncthreads()",
    ]
    index.offsets.add(int(t.out_off[0]))
    return loop, tail


def _other_body(
    tables: Sequence[TermTable], lay: PassLayout, consts: Definitions, index: Index, dtype: str
) -> list[str]:
    """Role 2: node outputs of the other rows, thread per (node, channel)."""
    slots = _Slots("w", index)
    body = [
        "gid = (cuda.blockIdx.x - B1) * cuda.blockDim.x + tid",
        "if gid >= (o_ptr.shape[0] - 1) * C:",
        f"{IND}return",
        "n = gid // C",
        "c = gid - n * C",
        "nu = u64(n)",
        "@CHANNELS@",
    ]
    decl, loop, stores = _carried(tables, lay.other, slots, IND, "", consts, index, dtype)
    body += decl + ["for p in range(o_ptr[n], o_ptr[n + 1]):"] + edge_rows(IND, "o_perm[p]")
    return body + loop + stores


def _module(src: list[str], consts: Definitions, index: Index) -> str:
    """The definitions, offsets and the kernel ``src``, with the per-thread channel offsets of
    every role (once the strides are known) at each ``@CHANNELS@``."""
    chan = index.channel_lines()
    lines = []
    for line in src:
        if line.strip() == "@CHANNELS@":
            lead = line[: len(line) - len(line.lstrip())]
            lines += [lead + c for c in chan]
        else:
            lines.append(line)
    kernel = "\n".join([lines[0]] + [IND + line for line in lines[1:]]) + "\n"
    return "\n".join(consts.lines() + index.globals()) + "\n\n\n" + kernel


def _carried(
    tables: Sequence[TermTable],
    ks: Sequence[int],
    slots: _Slots,
    ind: str,
    store_ind: str,
    consts: Definitions,
    index: Index,
    dtype: str,
) -> tuple[list[str], list[str], list[str]]:
    """Node outputs ``ks`` summed over a walk: ``(declarations before the loop, loop lines at
    ``ind``, stores after it at ``store_ind``)``."""
    decls: list[str] = []
    loop: list[str] = []
    stores: list[str] = []
    for k in ks:
        t = tables[k]
        names, loads = slots.of(t, ind)
        decl, lines, exprs = sums(t, dtype, ind, consts, decl_ind="", names=names, tag=f"a{k}", source=True)
        decls += decl
        loop += loads + lines
        stores += [f"{store_ind}out{k}[nu, {index(t.out_off[o], t.out_cs[o])}] = {e}" for o, e in exprs.items()]
    return decls, loop, stores


@cache
def _kernel(tables: tuple[TermTable, ...], lay: PassLayout, dtype: str, channels: int, npb: int) -> Any:
    return unrolled._compile(kernel_source(tables, lay, dtype, channels, npb))


def plan(
    compiled: Sequence[Any],
    arrays: list,
    sender: Any,
    receiver: Any,
    csr: Callable[[str], tuple[Any, Any]],
    channels: int,
    outs: Sequence[Any],
) -> tuple | None:
    """``(kernel, blocks, threads_per_block, args, fused)`` of the fused pass, where ``fused``
    are the indices of the outputs it computes (the caller launches the others one by one), or
    None when nothing is fused (:func:`fused_layout`). ``csr(rows)`` gives the ``(ptr, perm)``
    segments of ``"sender"`` or ``"receiver"``."""
    if sender.shape[0] == 0:
        return None
    lay = fused_layout(compiled, str(np.dtype(outs[0].dtype)), channels)
    if lay is None:
        return None
    w_ptr, w_perm = csr(lay.walk)
    o_ptr, o_perm = csr(lay.other_rows) if lay.other else (w_ptr, w_perm)
    npb, tpb = block_shape(channels)
    b1 = -(-(w_ptr.shape[0] - 1) // npb)
    b2 = -(-(o_ptr.shape[0] - 1) * channels // tpb) if lay.other else 0
    if b1 + b2 == 0:
        return None
    kernel = _kernel(tuple(c.table for c in compiled), lay, str(np.dtype(outs[0].dtype)), channels, npb)
    args = (*arrays, sender, receiver, w_ptr, w_perm, o_ptr, o_perm, channels, b1, *outs)
    return kernel, b1 + b2, tpb, args, _role1(lay) + lay.other


def launch(planned: tuple | None, stream: Any = 0) -> tuple[int, ...]:
    """Launch the fused pass ``planned`` (:func:`plan`'s answer) on ``stream``; the indices of
    the outputs it computed (none when it does not apply)."""
    if planned is None:
        return ()
    kernel, blocks, tpb, args, fused = planned
    kernel[blocks, tpb, stream](*args)
    return fused
