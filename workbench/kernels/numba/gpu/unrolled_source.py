"""Python source of the unrolled kernels of :mod:`~workbench.kernels.numba.gpu.unrolled`: the
signature, thread indexing, operand loads and stores of the three kernel shapes (atom, node,
edge) around the sums of :mod:`~workbench.kernels.numba.gpu.unrolled_sums`.

Element indices are unsigned (:class:`Index`), so numba emits no negative-index wraparound and
each offset folds into its load. The source is a module body without imports; the module
header (numba, ``cuda``, ``polynomial``, ``f32``, ``u64``) is added where it is compiled.
"""

from __future__ import annotations

from workbench.kernels.descriptor.tables import TermTable
from workbench.kernels.numba.gpu.unrolled_sums import Definitions, dtype_name, sums

__all__ = [
    "ATOM_ROW_VARS",
    "EDGE_ROW_VARS",
    "THREADS_PER_BLOCK",
    "Index",
    "atom_head",
    "atom_lines",
    "edge_rows",
    "kernel_source",
]

#: no shared memory, so the block size only sets the granularity; ptxas picks the registers
THREADS_PER_BLOCK = 128
IND = "    "
#: the variables holding an edge operand's row, by row code: the edge, its sender, its receiver
EDGE_ROW_VARS = {0: "eu", 1: "su", 2: "ru"}
#: the variables holding an atom operand's row, by row code: the atom, its species
ATOM_ROW_VARS = {0: "bu", 1: "zu"}


class Index:
    """Unsigned element indices: ``x[row, cu3 + U128]`` with ``cu3 = u64(c * 3)`` computed once
    per thread and the offset a typed ``uint64`` global, so numba emits no negative-index
    wraparound and the offset folds into the load's immediate (one load per component, no
    64-bit index arithmetic per slot)."""

    def __init__(self):
        self.offsets: set[int] = set()
        self.strides: set[int] = set()
        self.views: dict[str, str] = {}

    def row(self, array: str, row: str) -> str:
        """The 1-D view ``array[row]``, taken once per thread (:meth:`view_lines`): a load from
        it is one index for numba to type and lower, where ``array[row, i]`` is a tuple of two
        (at 128x0e+128x1o+128x2e a fused double backward reads ~9,000 components)."""
        name = f"{array}_{row}"
        self.views[name] = f"{name} = {array}[{row}]"
        return name

    def view_lines(self) -> list[str]:
        return [self.views[k] for k in sorted(self.views)]

    def __call__(self, off: int, cs: int) -> str:
        off, cs = int(off), int(cs)
        self.offsets.add(off)
        if cs == 0:
            return f"U{off}"
        self.strides.add(cs)
        return f"cu{cs} + U{off}"

    def globals(self) -> list[str]:
        return [f"U{off} = np.uint64({off})" for off in sorted(self.offsets)]

    def channel_lines(self, c: str = "c") -> list[str]:
        return [f"cu{cs} = u64({c})" if cs == 1 else f"cu{cs} = u64({c} * {cs})" for cs in sorted(self.strides)]


def edge_rows(ind: str, edge: str) -> list[str]:
    """The lines of a segment walk's step: the edge ``edge`` and its rows as unsigned indices."""
    return [f"{ind}e = {edge}", f"{ind}eu = u64(e)", f"{ind}su = u64(sender[e])", f"{ind}ru = u64(receiver[e])"]


def _grid_head(params: str, rows: str, per_row: str, row: str, col: str, unsigned: list[str]) -> list[str]:
    """The signature and first lines of a kernel of one thread per (row, column): ``rows`` rows
    of ``per_row`` threads, the thread's ``row`` and ``col``, then the ``unsigned`` lines."""
    return [
        f"def kernel({params}):",
        "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
        f"if gid >= {rows} * {per_row}:",
        "    return",
        f"{row} = gid // {per_row}",
        f"{col} = gid - {row} * {per_row}",
        *unsigned,
    ]


def atom_head(outs: str) -> list[str]:
    """The signature and first lines of an atom kernel writing ``outs`` (its output arguments)."""
    args = ", ".join(f"x{i}" for i in range(10))
    return _grid_head(
        f"{args}, species, C, {outs}", "species.shape[0]", "C", "b", "c", ["bu = u64(b)", "zu = u64(species[b])"]
    )


def atom_lines(
    table: TermTable, dtype: str, consts: Definitions, index: Index, out: str = "out", tag: str = ""
) -> list[str]:
    """The body lines of one atom polynomial: load its operand components, add its terms (one
    generated polynomial), store each output component of row ``bu`` of ``out`` once (a later run
    of a term split adds to what the first stored). ``tag`` prefixes the local names, so that
    several tables can follow one another in one kernel."""
    names = [f"{tag}v{q}" for q in range(table.num_slots)]
    lines = [
        f"{names[q]} = {index.row(f'x{a}', ATOM_ROW_VARS[int(k)])}[{index(off, cs)}]"
        for q, (a, k, off, cs) in enumerate(zip(table.slot_arr, table.slot_rows, table.slot_off, table.slot_cs))
    ]
    decl, sums_, exprs = sums(table, dtype, "", consts, names=names, tag=tag)
    lines += decl + sums_
    row = index.row(out, "bu")
    for o, expr in exprs.items():
        op = "+=" if o in table.add_to else "="
        lines.append(f"{row}[{index(table.out_off[o], table.out_cs[o])}] {op} {expr}")
    return lines


def _edge_args() -> str:
    return ", ".join(f"x{i}" for i in range(8))


def _node_head() -> list[str]:
    params = f"{_edge_args()}, sender, receiver, seg_ptr, seg_perm, C, out"
    return _grid_head(params, "(seg_ptr.shape[0] - 1)", "C", "n", "c", ["nu = u64(n)"])


def _reduce_head(table: TermTable, dtype: str, tpb: int) -> list[str]:
    # no early return: every thread of the block reaches the barrier
    return [
        f"def kernel({_edge_args()}, sender, receiver, G, C, out):",
        f"red = cuda.shared.array(({tpb}, {max(table.out_off.shape[0], 1)}), {dtype_name(dtype)})",
        "tid = cuda.threadIdx.x",
        "gid = cuda.blockIdx.x * cuda.blockDim.x + tid",
        "valid = gid < sender.shape[0] * G",
        "e = gid // G",
        "g = gid - e * G",
        "eu = u64(e)",
    ]


def _edge_head() -> list[str]:
    # G == C: one channel per thread
    params = f"{_edge_args()}, sender, receiver, G, C, out"
    return _grid_head(
        params, "sender.shape[0]", "G", "e", "c", ["eu = u64(e)", "su = u64(sender[e])", "ru = u64(receiver[e])"]
    )


def _edge_loads(table: TermTable, index: Index, prefix: str) -> list[str]:
    """One load per operand component of an edge, from the row of its row code."""
    return [
        f"{prefix}v{q} = x{a}[{EDGE_ROW_VARS[int(k)]}, {index(off, cs)}]"
        for q, (a, k, off, cs) in enumerate(zip(table.slot_arr, table.slot_rows, table.slot_off, table.slot_cs))
    ]


def _node_body(table: TermTable, dtype: str, consts: Definitions, index: Index, reduce_channels: bool) -> list[str]:
    """Accumulators carried over the node's edges, stored once at the end."""
    decl, lines, exprs = sums(table, dtype, IND, consts, decl_ind="", source=True)
    body = decl + ["for p in range(seg_ptr[n], seg_ptr[n + 1]):", *edge_rows(IND, "seg_perm[p]")]
    body += _edge_loads(table, index, IND) + lines
    for o, expr in exprs.items():
        idx = index(table.out_off[o], table.out_cs[o])
        # a channel-summed node output is not used in training; it keeps an atomic sum
        body.append(f"cuda.atomic.add(out, (nu, {idx}), {expr})" if reduce_channels else f"out[nu, {idx}] = {expr}")
    return body


def _reduce_body(table: TermTable, dtype: str, consts: Definitions, index: Index, group: int) -> list[str]:
    """Accumulators carried over this thread's channels, then a fixed-order sum of the ``G``
    partials of the edge in shared memory (deterministic, no atomics). ``@CHANNELS@`` marks
    where the per-thread channel offsets go."""
    i2 = IND * 2
    decl, lines, exprs = sums(table, dtype, i2, consts, decl_ind=IND, source=True)
    slots = {o: k for k, o in enumerate(exprs)}
    body = ["if valid:", f"{IND}su = u64(sender[e])", f"{IND}ru = u64(receiver[e])", *decl]
    body.append(f"{IND}for c in range(g, C, {group if group else 'G'}):")
    body += ["@CHANNELS@"] + _edge_loads(table, index, i2) + lines
    body += [f"{IND}red[tid, {k}] = {exprs[o]}" for o, k in slots.items()]
    body += ["cuda.syncthreads()", "if valid and g == 0:"]
    for o, k in slots.items():
        if group:  # the same left-to-right order as the loop below, unrolled
            total = " + ".join([f"red[tid, {k}]"] + [f"red[tid + {j}, {k}]" for j in range(1, group)])
            body.append(f"{IND}out[eu, {index(table.out_off[o], 0)}] = {total}")
            continue
        body += [
            f"{IND}t{o} = red[tid, {k}]",
            f"{IND}for j in range(1, G):",
            f"{i2}t{o} += red[tid + j, {k}]",
            f"{IND}out[eu, {index(table.out_off[o], 0)}] = t{o}",
        ]
    return body


def _edge_body(table: TermTable, dtype: str, consts: Definitions, index: Index) -> list[str]:
    """A channelwise edge output: ``G == C``, one channel per thread."""
    decl, lines, exprs = sums(table, dtype, "", consts, source=True)
    body = _edge_loads(table, index, "") + decl + lines
    for o, expr in exprs.items():
        body.append(f"out[eu, {index(table.out_off[o], table.out_cs[o])}] = {expr}")
    return body


def _module(head: list[str], body: list[str], consts: Definitions, index: Index) -> str:
    """The definitions, offsets and the kernel, with the per-thread channel offsets (once the
    strides the loads and stores use are known) at ``@CHANNELS@`` or first in the body."""
    chan = index.channel_lines() + index.view_lines()
    if "@CHANNELS@" in body:
        k = body.index("@CHANNELS@")
        body[k : k + 1] = [f"{IND * 2}{line}" for line in chan]
    else:
        body[0:0] = chan
    kernel = "\n".join([head[0]] + [IND + line for line in head[1:] + body]) + "\n"
    return "\n".join(consts.lines() + index.globals()) + "\n\n\n" + kernel


def kernel_source(
    table: TermTable,
    shape: str,
    dtype: str,
    *,
    reduce_channels: bool = False,
    tpb: int = THREADS_PER_BLOCK,
    group: int = 0,
) -> str:
    """Python source of the unrolled kernel ``kernel`` for ``table``.

    ``shape``: ``"atom"`` (arrays ``x0..x9``: 0-5 per atom, 6-9 per species; the output has one
    row per atom: a species output is written as per-atom partials that
    :mod:`~workbench.kernels.numba.gpu.segment` sums), ``"node"`` or ``"edge"`` (arrays ``x0..x7``
    with rows edge / sender / receiver; ``reduce_channels``: a channel-summed output, reduced in
    shared memory by the ``G`` threads of an edge in a fixed order, so ``tpb``, the block size
    the kernel is launched with, sizes that buffer; ``group``, when given, fixes ``G`` at compile
    time so that the channel stride is an immediate and the sum of the ``G`` partials is straight
    code). Accumulators that a loop carries (over the node's edges, over the thread's channels)
    are zeroed once, before the loop."""
    if shape not in ("atom", "node", "edge"):
        raise ValueError(f"unknown kernel shape {shape!r}")
    if table.add_to and shape != "atom":
        raise ValueError("only atom kernels take a term split (add_to)")
    consts = Definitions(dtype)
    index = Index()
    if shape == "atom":
        return _module(atom_head("out"), atom_lines(table, dtype, consts, index), consts, index)
    go = ["go = C > 0"]  # the ``if go:`` blocks of the source sums
    if shape == "node":
        head, body = _node_head(), go + _node_body(table, dtype, consts, index, reduce_channels)
    elif reduce_channels:
        head, body = _reduce_head(table, dtype, tpb), go + _reduce_body(table, dtype, consts, index, group)
    else:
        head, body = _edge_head(), go + _edge_body(table, dtype, consts, index)
    return _module(head, body, consts, index)
