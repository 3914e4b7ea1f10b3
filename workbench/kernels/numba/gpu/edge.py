r"""numba-CUDA kernels for edge (message-passing) sparse polynomials: gather, CG-sparse
product and scatter-sum fused in one launch per output, no per-edge intermediate in global memory.
(A backward pass whose outputs all run unrolled is one launch for all of them instead:
:mod:`~workbench.kernels.numba.gpu.edge_pass`.)

Two kernels, chosen by the rows of the output polynomial:

* **node kernel** (output scatter-summed into sender or receiver nodes: the forward message
  :math:`M_r = \sum_{e \to r} \ldots`, the gradient to the node features): one thread per
  (node, channel), consecutive threads take consecutive channels of one node. The thread walks
  the node's CSR segment of incident edges (edges sorted by receiver or sender once per forward
  pass, on the device, and reused by every backward launch), gathers the used operand
  components of each edge into its row of a shared-memory buffer, runs the term table and sums
  into an accumulator row that also lives in shared memory; the node row is written once at
  the end. No atomics, deterministic, and the ``[num_edges, irreps_mid]`` message tensor that
  e3nn materialises never exists.
* **edge kernel** (outputs per edge: gradients to the radial weights and, summed over channels,
  to the spherical harmonics): one thread per (edge, channel) for channelwise outputs (each
  element owned by one thread). A channel-broadcast output (zero cstride) is a reduction over
  channels: ``G`` threads share an edge (``G <= 8``, one block), each sums a strided subset of
  channels in a shared accumulator row, and the edge's first thread adds the ``G`` rows in a
  fixed order: no atomics, the same bits on every run.

Term tables are read by every thread of a warp at the same address (broadcast) exactly as in
:mod:`workbench.kernels.numba.gpu.atom`; shared rows are padded to an odd length so that a warp reading
the same slot hits 32 different banks. Kernels are compiled once per (buffer sizes, threads per
block, dtype) and cached; under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on numpy
arrays.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from workbench.kernels.numba.gather import _device, cuda_edge_loader, cuda_split, cuda_term
from workbench.kernels.numba.gpu import unrolled
from workbench.kernels.numba.gpu.device import threads_per_block

__all__ = ["get_edge_kernel", "get_node_kernel", "launch", "plans", "reduce_group", "writes_every_element"]

cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


def _odd(n: int) -> int:
    return n if n % 2 == 1 else n + 1


def reduce_group(C: int, tpb: int = 128) -> int:
    """Threads sharing one edge for a channel-reduced output: the largest of 8, 4, 2, 1 dividing
    both ``C`` and the block size (an edge's threads must sit in one block for the reduction)."""
    for g in (8, 4, 2):
        if C % g == 0 and tpb % g == 0:
            return g
    return 1


def _setup(buffer_len: int, out_len: int, dtype: str) -> tuple:
    """``(numba dtype, shared row length, slot loader, thread split, term product)`` of an edge kernel."""
    import numba

    nb_dtype = numba.float64 if dtype == "float64" else numba.float32
    return nb_dtype, _odd(buffer_len + out_len), cuda_edge_loader(), cuda_split(), cuda_term()


@cache
def get_node_kernel(buffer_len: int, out_len: int, tpb: int, dtype: str, reduce_channels: bool = False) -> Any:
    """Thread per (node, channel) walking the node's CSR segment; accumulators in shared memory.
    ``reduce_channels`` (a channel-summed node output, which training never launches) is fixed at
    compile time, so the atomic add it needs is absent from every other node kernel."""
    global cuda
    from numba import cuda

    nb_dtype, SP, load, split, term = _setup(buffer_len, out_len, dtype)
    # accumulators start after the slots (and the constant 1)
    return _node_kernel(nb_dtype, SP, tpb, bool(reduce_channels), buffer_len, load, split, term)


def _node_kernel(nb_dtype: Any, SP: int, TPB: int, REDUCE: bool, A0: int, load: Any, split: Any, term: Any) -> Any:
    """The node kernel with its compile-time constants (:func:`get_node_kernel`) as closure variables."""

    def edge_poly_node_kernel(
        a0, a1, a2, a3, a4, a5, a6, a7,
        sender, receiver, seg_ptr, seg_perm, C,
        slot_arr, slot_rows, slot_off, slot_cs,
        t_out, t_fac, t_coef,
        out, out_off, out_cs,
    ):  # fmt: skip
        v = cuda.shared.array((TPB, SP), nb_dtype)
        tid = cuda.threadIdx.x
        gid = cuda.blockIdx.x * cuda.blockDim.x + tid
        N = seg_ptr.shape[0] - 1
        if gid >= N * C:
            return
        n, c = split(gid, C)
        S = slot_arr.shape[0]
        O = out_off.shape[0]
        zero = nb_dtype(0.0)  # typed zero: a bare 0.0 would make float32 kernels accumulate in float64
        for o in range(O):
            v[tid, A0 + o] = zero
        v[tid, S] = 1.0
        T = t_out.shape[0]
        for p in range(seg_ptr[n], seg_ptr[n + 1]):
            e = seg_perm[p]
            s = sender[e]
            r = receiver[e]
            load(v, tid, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_rows, slot_off, slot_cs)
            for t in range(T):  # accumulators live in shared memory: no run-length flush needed
                v[tid, A0 + t_out[t]] += term(v, tid, t_coef, t_fac, t)
        for o in range(O):
            if REDUCE:
                cuda.atomic.add(out, (n, out_off[o] + c * out_cs[o]), v[tid, A0 + o])
            else:
                out[n, out_off[o] + c * out_cs[o]] = v[tid, A0 + o]

    return cuda.jit(edge_poly_node_kernel)


@cache
def _cuda_channel_terms() -> Any:
    """Device function adding the terms of channel ``c`` of edge ``e`` to the output: each run of
    terms of one output component summed in a register, then added to the edge's accumulator row
    in shared memory (``reduce_channels``: a channel-summed output) or to the output element."""
    term = cuda_term()

    def channel_terms(v, tid, out, e, c, A0, zero, t_out, t_fac, t_coef, out_off, out_cs, reduce_channels):
        cur = t_out[0]
        acc = zero
        for t in range(t_out.shape[0]):
            o = t_out[t]
            if o != cur:
                if reduce_channels:
                    v[tid, A0 + cur] += acc
                else:
                    out[e, out_off[cur] + c * out_cs[cur]] += acc
                acc = zero
                cur = o
            acc += term(v, tid, t_coef, t_fac, t)
        if reduce_channels:
            v[tid, A0 + cur] += acc
        else:
            out[e, out_off[cur] + c * out_cs[cur]] += acc

    return _device(channel_terms)


@cache
def get_edge_kernel(buffer_len: int, out_len: int, tpb: int, dtype: str) -> Any:
    """Thread per (edge, channel) or, for a channel-reduced output, per (edge, channel group)."""
    global cuda
    from numba import cuda

    nb_dtype, SP, load, split, _ = _setup(buffer_len, out_len, dtype)
    return _edge_kernel(nb_dtype, SP, tpb, buffer_len, load, split, _cuda_channel_terms())


def _edge_kernel(nb_dtype: Any, SP: int, TPB: int, A0: int, load: Any, split: Any, channel_terms: Any) -> Any:
    """The edge kernel with its compile-time constants (:func:`get_edge_kernel`) as closure variables."""

    def edge_poly_edge_kernel(
        a0, a1, a2, a3, a4, a5, a6, a7,
        sender, receiver, G, C,
        slot_arr, slot_rows, slot_off, slot_cs,
        t_out, t_fac, t_coef,
        out, out_off, out_cs, reduce_channels,
    ):  # fmt: skip
        v = cuda.shared.array((TPB, SP), nb_dtype)
        tid = cuda.threadIdx.x
        gid = cuda.blockIdx.x * cuda.blockDim.x + tid
        E = sender.shape[0]
        valid = gid < E * G  # no early return: the channel reduction below has a barrier
        e, g = split(gid, G)
        O = out_off.shape[0]
        zero = nb_dtype(0.0)  # typed zero: a bare 0.0 would make float32 kernels accumulate in float64
        if valid:
            s = sender[e]
            r = receiver[e]
            S = slot_arr.shape[0]
            if reduce_channels:
                for o in range(O):
                    v[tid, A0 + o] = zero
            v[tid, S] = 1.0
            for c in range(g, C, G):  # strided: consecutive threads read consecutive channels
                load(v, tid, a0, a1, a2, a3, a4, a5, a6, a7, e, s, r, c, slot_arr, slot_rows, slot_off, slot_cs)
                channel_terms(v, tid, out, e, c, A0, zero, t_out, t_fac, t_coef, out_off, out_cs, reduce_channels)
        if reduce_channels:
            # the edge's G partials, added in a fixed order by its first thread: deterministic
            cuda.syncthreads()
            if valid and g == 0:
                for o in range(O):
                    total = v[tid, A0 + o]
                    for j in range(1, G):
                        total += v[tid + j, A0 + o]
                    out[e, out_off[o]] = total

    return cuda.jit(edge_poly_edge_kernel)


def plans(
    compiled: Any,
    arrays: list,
    sender: Any,
    receiver: Any,
    seg: tuple | None,
    channels: int,
    out: Any,
    host: bool = False,
) -> list[tuple]:
    """``[(kernel, blocks, threads_per_block, args)]`` for one compiled edge polynomial
    (:class:`~workbench.kernels.numba.compiled.CompiledPolynomial`), empty when there is
    nothing to do: the unrolled kernel, or one per group of output components where the
    polynomial is too large for one (:func:`~workbench.kernels.numba.gpu.unrolled.unrolled_parts`;
    each part walks the edges again and stores its own components), or the table-driven kernel.

    ``arrays``: the 8 operand arrays (dummies where unused) as numba device arrays (numpy under
    the simulator or for PTX compilation); ``seg``: ``(seg_ptr, seg_perm)`` CSR for node outputs,
    ``None`` for edge outputs; ``out``: the output, zero-initialised unless
    :func:`writes_every_element`; ``host``: table arguments as
    host arrays (for PTX compilation).
    """
    if compiled.num_terms == 0 or sender.shape[0] == 0:
        return []
    dtype = str(np.dtype(out.dtype))
    reduce_ = compiled.reduce_channels
    parts = unrolled.unrolled_parts(compiled, dtype)
    out_len = compiled.out_size if (compiled.node_output or reduce_) else 0
    buffer_len = compiled.num_slots + 1
    if parts is not None:
        tpb = unrolled.block_size()
    else:
        tpb = threads_per_block(_odd(buffer_len + out_len), np.dtype(out.dtype).itemsize)
    if compiled.node_output:
        n, rows = (seg[0].shape[0] - 1) * channels, (seg[0], seg[1])
    else:
        # thread per (edge, channel), or G threads per edge for a channel-summed output
        G = reduce_group(channels, tpb) if reduce_ else channels
        n, rows = sender.shape[0] * G, (G,)
    if n == 0:
        return []
    blocks = (n + tpb - 1) // tpb
    head = (*arrays, sender, receiver, *rows, channels)
    if parts is not None:
        shape = "node" if compiled.node_output else "edge"
        group = G if reduce_ and not compiled.node_output else 0
        args = (*head, out)
        kernels = [
            unrolled.get_unrolled_kernel(t, shape, dtype, reduce_channels=reduce_, tpb=tpb, group=group) for t in parts
        ]
        return [(kernel, blocks, tpb, args) for kernel in kernels]
    tables = compiled.host_tables(dtype) if host else compiled.device_tables(dtype)
    if compiled.node_output:
        kernel = get_node_kernel(buffer_len, out_len, tpb, dtype, reduce_)
        return [(kernel, blocks, tpb, (*head, *tables[:7], out, tables[7], tables[8]))]
    kernel = get_edge_kernel(buffer_len, out_len, tpb, dtype)
    return [(kernel, blocks, tpb, (*head, *tables[:7], out, tables[7], tables[8], reduce_))]


def writes_every_element(compiled: Any, dtype: str) -> bool:
    """Whether the kernels :func:`plans` picks store every element of its output (the unrolled
    kernels, every component reached by a term, not the atomic channel-summed node output), so
    the output needs no zero fill."""
    return (
        unrolled.unroll(compiled, dtype)
        and compiled.covers_output
        and not (compiled.node_output and compiled.reduce_channels)
    )


def launch(
    compiled: Any, arrays: list, sender: Any, receiver: Any, seg: tuple | None, channels: int, out: Any, stream: Any = 0
) -> None:
    """Launch one compiled edge polynomial on ``stream`` (see :func:`plans`)."""
    for kernel, blocks, tpb, args in plans(compiled, arrays, sender, receiver, seg, channels, out):
        kernel[blocks, tpb, stream](*args)
