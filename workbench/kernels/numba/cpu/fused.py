r"""Fused CPU row passes: one numba kernel per :class:`~workbench.kernels.numba.cpu.passes.RowPass`, with
everything the interpreter looks up per row written out as constants.

The interpreter (:mod:`~workbench.kernels.numba.cpu.loops`) and its generated body
(:mod:`~workbench.kernels.numba.cpu.unrolled`) share one driver for every pass: per row it
picks each register's array through an ``if`` chain, copies the register into a scratch row,
reads the row's coefficients from a table built before the pass, and chooses each output's
layout at run time. At few channels (NequIP's 16, where a row's program is 4 to 50 instructions)
that bookkeeping is the pass: a 4-instruction pass over 11,050 edges took 0.53 ms, the same
work written by hand 0.04 ms. Here a pass is its own kernel:

.. code-block:: python

    acc = np.empty(A * 16)                       # accumulators, once per chunk of segments
    for s in range(lo, hi):                      # segments (a receiver's edges, ...); chunks of
                                                 # them are spread over the threads
        for c in range(16):
            acc[0 + c] = zero                      # summed over the segment's rows
        for p in range(seg_ptr[s], seg_ptr[s + 1]):
            row = seg_perm[p]
            r1 = idx1[row]                         # the sender
            y1 = a1[row, 1]                        # broadcast scalars (spherical harmonics) ...
            k0 = f32(0.4886) * y1                  # ... into the row's coefficients, inline
            for c in range(16):                    # one vectorised loop, C a literal
                v0 = a0[r1, 0 + c]                 # operands read in place
                v1 = a2[row, 16 + c]
                s0 = acc[0 + c]
                s0 = s0 + k0 * v0 * v1             # the program, in SSA form
                acc[0 + c] = s0
        for c in range(16):
            o0[seg_row[s], 0 + c * 3] = acc[0 + c]  # outputs in their own layout

The arithmetic is the program's, in its order, with the interpreter's rules
(``fastmath={"contract"}``, channel sums as :data:`~workbench.kernels.numba.cpu.loops.LANES`
partial sums in a fixed order), so results do not depend on the thread count. They equal the
interpreter's to rounding, not to the bit: values the interpreter rounds through memory (a
coefficient's terms, a temporary that is set and then added to) stay in registers here, where
LLVM may fuse a multiply and the next add. Kernels are
written under the kernel cache and compiled with numba's on-disk cache: once per pass shape,
channel count and dtype on a machine. Compiling is numba's typing and lowering, per statement
of the body and whatever the channel count: about a second for a NequIP pass of 4 to 50
instructions, 11 s for MACE's 239-instruction radial-weight gradient on the CPU of 2026-12-03
(4.5-6.6 s, in register groups, on that of 2026-12-05; compiled once: the
parallel driver calls it by address, :mod:`~workbench.kernels.numba.cpu.segments`). :func:`use_fused`
decides where: programs short enough to compile in seconds, at every channel count. At 16
channels fusing removes the per-row bookkeeping; at 128 it keeps the program's registers
out of memory (the interpreter loads and stores every register of every instruction): the
paper configuration's edge passes ran 1.5-3x faster fused, its MD step 0.73-0.85x and its
train step 0.81-0.88x the interpreter's time (water-96 to -1536, float32, 2 threads).

A program whose operands and accumulators outnumber the vector registers runs as several
channel loops, each over a group of its accumulators (:mod:`~workbench.kernels.numba.cpu.groups`,
``WORKBENCH_CPU_REGISTERS``): the single loop of MACE's 239-instruction pass spilled on half
its instructions.

One operand of a pass may be read from a table of polynomials in each row's scalar instead of an
array (:class:`TableRead`: a radial network's table at the edge lengths). Each row evaluates it
once into a scratch row in cache, and the pass dots that operand's cotangent with the slopes
instead of storing it (:mod:`~workbench.kernels.tabulated_edge`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from workbench.kernels.numba.cpu.groups import accumulator_groups, group_instructions, limit, operands_read
from workbench.kernels.numba.cpu.loops import LANES
from workbench.kernels.numba.cpu.segments import Segments
from workbench.kernels.numba.cpu.unrolled import constant_coefficients, instruction_lines, literal
from workbench.kernels.options import kernel_options

__all__ = ["FUSED_MAX_INSTRUCTIONS", "FusedPass", "TableRead", "fused_pass", "use_fused"]

#: ``cpu_kernels="auto"`` fuses passes of at most this many instructions: bigger programs (the
#: contraction's 500 to 6,000) would compile for minutes, and stay on the interpreter
FUSED_MAX_INSTRUCTIONS = 256
#: the same for a node pass with the per-edge outputs merged in
#: (:func:`~workbench.kernels.numba.cpu.passes.plan`): it reads the ``[E, J]`` radial weights once
#: instead of twice (MACE's: 345 instructions, where the two passes were 91 and 239 and fused
#: anyway). ``WORKBENCH_CPU_UNROLL_MAX`` replaces this limit too
FUSED_MAX_MERGED = 400
_ROW = {0: "row", 1: "r1", 2: "r2"}


def use_fused(program: Any, options: Any = None, merged: bool = False) -> bool:
    """Whether a pass of ``program`` runs as a fused kernel, at any channel count: always with
    ``WORKBENCH_CPU_KERNELS=fused``, never with ``interpreter`` or ``generated``, and with the
    default ``auto`` for at most :data:`FUSED_MAX_INSTRUCTIONS` instructions
    (``WORKBENCH_CPU_UNROLL_MAX`` overrides).
    ``options``: the :class:`~workbench.kernels.options.KernelOptions` in effect, if read already."""
    options = options or kernel_options()
    if options.cpu_kernels in ("interpreter", "generated"):
        return False
    if options.cpu_kernels == "fused":
        return True
    most = options.cpu_unroll_max or (FUSED_MAX_MERGED if merged else FUSED_MAX_INSTRUCTIONS)
    return program.num_instructions <= most


@dataclass(frozen=True)
class TableRead:
    r"""A pass operand read from a table of polynomials in each row's scalar, not from an array.

    Kernel array ``array`` holds coefficients ``[N, 8, J]`` instead of the ``[rows, J]`` operand;
    a row's interval ``tk[row]`` and centred coordinate ``ts[row]`` give each column ``b`` as
    :math:`\sum_p c_{k p b}\, s^p` (Horner, :mod:`workbench.kernels.radial_table`). The per-row
    output ``slope_output`` (a program output; -1: none), the cotangent of that operand, is not
    stored: it is dotted with the slopes, :math:`\sum_b \bar w_b\, dR_b/ds`, into ``dr[row]``.
    So neither the ``[rows, J]`` operand nor its cotangent goes through memory."""

    array: int
    width: int
    slope_output: int = -1


class FusedPass:
    """A row pass's fused kernel, ``run_segments(lo, hi, ...)`` over segments ``lo .. hi - 1``: it
    takes the arrays :attr:`arrays` (indices into the pass's 10 kernel arrays), the row indices
    :attr:`indices` (``1``: ``idx1``, ``2``: ``idx2``), ``seg_ptr, seg_perm, seg_row`` and the
    outputs :attr:`outputs`; :class:`~workbench.kernels.numba.cpu.segments.Segments` runs it."""

    def __init__(
        self,
        module: Any,
        arrays: tuple[int, ...],
        indices: tuple[int, ...],
        outputs: tuple[int, ...],
        table: TableRead | None = None,
    ):
        self.module, self.arrays, self.indices, self.outputs = module, arrays, indices, outputs
        self.table = table
        extra = 2 if table is not None else 0
        self.segments = Segments(module.run_segments, len(arrays) + len(indices) + extra)

    def run(self, parallel: bool, arrays, idx1, idx2, segments, outs, rows: tuple = ()) -> None:
        """``rows``: with a :class:`TableRead`, ``(tk, ts)`` and, with a slope output, ``dr``."""
        args = [arrays[a] for a in self.arrays] + [idx1 if i == 1 else idx2 for i in self.indices]
        args += list(rows[:2]) + list(segments) + [outs[q] for q in self.outputs] + list(rows[2:])
        (self.segments.parallel if parallel else self.segments.serial)(*args)


def _signature(rp: Any, table: TableRead | None = None) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    slope = table.slope_output if table is not None else -1
    read = {table.array} if slope >= 0 else set()  # the slopes need the coefficients, read or not
    arrays = tuple(sorted({int(a) for a in rp.vec_arr} | {int(a) for a in rp.sca_arr} | read))
    codes = {int(c) for c in rp.vec_code} | {int(c) for c in rp.sca_code}
    indices = tuple(i for i in (1, 2) if i in codes)
    return arrays, indices, tuple(sorted({int(q) for q in rp.acc_out} - {slope}))


def _coefficient_lines(rp: Any, cast: str) -> tuple[list[str], list[str]]:
    """Per-row lines reading the broadcast scalars and building the coefficients, and the name (or
    literal) of each coefficient register."""
    prog = rp.program
    S = prog.num_scalars
    if S == 0:
        return [], constant_coefficients(prog, cast)
    terms: dict[int, list[str]] = {}
    for reg, coef, *factors in prog.k_terms.tolist():
        names = [f"y{int(f)}" for f in factors if int(f) != S]
        terms.setdefault(int(reg), []).append(" * ".join([literal(coef, cast), *names]))
    lines = [
        f"y{j} = a{int(a)}[{_ROW[int(code)]}, {int(off)}]"
        for j, (a, code, off) in enumerate(zip(rp.sca_arr, rp.sca_code, rp.sca_off))
    ]
    lines += [f"k{k} = " + " + ".join(terms.get(k, [literal(0.0, cast)])) for k in range(prog.num_k)]
    return lines, [f"k{k}" for k in range(prog.num_k)]


def _lane_sum(target: str, first: int, C: int, ind: str) -> list[str]:
    """``target = `` the sum of ``acc[first : first + C]`` as :data:`LANES` partial sums, fixed order."""
    full = C - C % LANES
    lines = [f"{ind}for lane in range({LANES}):", f"{ind}    lanes[lane] = zero"]
    if full:
        lines += [f"{ind}for c0 in range(0, {full}, {LANES}):", f"{ind}    for lane in range({LANES}):"]
        lines.append(f"{ind}        lanes[lane] += acc[{first} + c0 + lane]")
    lines += [f"{ind}lanes[{c - full}] += acc[{first + c}]" for c in range(full, C)]
    lines.append(f"{ind}{target} = lanes[0]")
    lines += [f"{ind}{target} += lanes[{lane}]" for lane in range(1, LANES)]
    return lines


def _store_lines(rp: Any, C: int, per_segment: bool, target_row: str, ind: str, skip: int = -1) -> list[str]:
    """Store the accumulators of one kind (per segment or per row) into their outputs (but
    program output ``skip``)."""
    lines = []
    for j, (q, off, cs, seg) in enumerate(zip(rp.acc_out, rp.acc_off, rp.acc_cs, rp.acc_seg)):
        if bool(seg) != per_segment or q == skip:
            continue
        if cs == 0:
            lines += _lane_sum("total", j * C, C, ind)
            lines.append(f"{ind}o{int(q)}[{target_row}, {int(off)}] = total")
        else:
            lines.append(f"{ind}for c in range({C}):")
            lines.append(f"{ind}    o{int(q)}[{target_row}, {int(off)} + c * {int(cs)}] = acc[{j * C} + c]")
    return lines


def _table_value(array: int, column: str) -> str:
    """The tabulated operand's value at ``column`` of this row's interval ``tq``, coordinate ``sq``."""
    w = [f"a{array}[tq, {p}, {column}]" for p in range(8)]
    expr = w[7]
    for p in range(6, -1, -1):
        expr = f"({expr}) * sq + {w[p]}"
    return expr


def _table_slope(array: int, column: str, cast: str) -> str:
    """``dR/ds`` of the tabulated operand at ``column`` (Horner over ``p c_p``, constants in the dtype)."""
    w = [f"{literal(float(p), cast)} * a{array}[tq, {p}, {column}]" for p in range(8)]
    expr = w[7]
    for p in range(6, 1, -1):
        expr = f"({expr}) * sq + {w[p]}"
    return f"({expr}) * sq + a{array}[tq, 1, {column}]"


def _table_lines(rp: Any, table: TableRead, cast: str, ind: str) -> list[str]:
    """A row's tabulated operand evaluated once into ``wrow`` (in cache), where the pass reads it:
    its channel loops read ``wrow`` as they would read the operand's row. A pass that also dots
    the operand's cotangent with the slopes gets them in ``srow`` from the same coefficient loads."""
    lines = [f"{ind}tq = tk[row]", f"{ind}sq = ts[row]"]
    if table.array not in rp.vec_arr:
        return lines
    lines += [f"{ind}for b in range({table.width}):", f"{ind}    wrow[b] = {_table_value(table.array, 'b')}"]
    if table.slope_output >= 0:
        lines.append(f"{ind}    srow[b] = {_table_slope(table.array, 'b', cast)}")
    return lines


def _slope_dot_lines(rp: Any, C: int, table: TableRead, cast: str, ind: str) -> list[str]:
    """``dr[row] = sum_b acc_b dR_b/ds`` over the slope output's accumulators: per channel in one
    vector loop, then over the channels as :data:`LANES` partial sums in a fixed order."""
    dots = rp.program.num_accumulators * C  # a scratch slot after the accumulators
    lines = [f"{ind}for c in range({C}):", f"{ind}    x = zero"]
    for j, (q, off, cs) in enumerate(zip(rp.acc_out, rp.acc_off, rp.acc_cs)):
        if q == table.slope_output:
            column = f"{int(off)} + c * {int(cs)}"
            slope = f"srow[{column}]" if table.array in rp.vec_arr else _table_slope(table.array, column, cast)
            lines.append(f"{ind}    x = x + acc[{j * C} + c] * ({slope})")
    lines.append(f"{ind}    acc[{dots} + c] = x")
    return lines + _lane_sum("total", dots, C, ind) + [f"{ind}dr[row] = total"]


def _row_lines(rp: Any, C: int, cast: str, indices: tuple[int, ...], ind: str, table: TableRead | None) -> list[str]:
    """One row: its indices (those of :func:`_signature`), coefficients and the program over its
    channels."""
    lines = [f"{ind}row = seg_perm[p]"] + [f"{ind}r{i} = idx{i}[row]" for i in indices]
    if table is not None:
        lines += _table_lines(rp, table, cast, ind)
    coef_lines, kname = _coefficient_lines(rp, cast)
    lines += [ind + line for line in coef_lines]
    for group in accumulator_groups(rp.program):
        lines += _channel_loop(rp, group, C, kname, ind, table) if group else []
    if table is not None and table.slope_output >= 0:
        lines += _slope_dot_lines(rp, C, table, cast, ind)
    return lines + _store_lines(rp, C, False, "row", ind, table.slope_output if table is not None else -1)


def _channel_loop(rp: Any, group: list[int], C: int, kname: list[str], ind: str, table: TableRead | None) -> list[str]:
    """One loop over the channels computing accumulators ``group`` (:mod:`~workbench.kernels.numba.cpu.groups`):
    the operands they read, their instructions, and their values into ``acc``."""
    prog = rp.program
    V = prog.num_vectors
    sub = dataclasses.replace(prog, ins=group_instructions(prog, group))
    reads = operands_read(prog, sub.ins)
    lines, inner = [f"{ind}for c in range({C}):"], ind + "    "
    name: dict[int, str] = {j: f"v{j}" for j in range(V)}
    for j, (a, code, base) in enumerate(zip(rp.vec_arr, rp.vec_code, rp.vec_base)):
        if j not in reads:
            continue
        if table is not None and a == table.array:
            lines.append(f"{inner}v{j} = wrow[{int(base)} + c]")
        else:
            lines.append(f"{inner}v{j} = a{int(a)}[{_ROW[int(code)]}, {int(base)} + c]")
    for j in group:
        name[V + j] = f"s{j}"
        lines.append(f"{inner}s{j} = acc[{j * C} + c]" if rp.acc_seg[j] else f"{inner}s{j} = zero")
    lines += [inner + line for line in instruction_lines(sub, name, kname.__getitem__)]
    return lines + [f"{inner}acc[{j * C} + c] = {name[V + j]}" for j in group]


def kernel_source(rp: Any, channels: int, dtype: str, table: TableRead | None = None) -> str:
    """Source of ``run_segments`` (segments ``lo .. hi - 1``) for ``rp`` at ``channels`` in
    ``dtype``; ``table``: an operand read from a table (:class:`TableRead`)."""
    arrays, indices, outputs = _signature(rp, table)
    C = channels
    cast = "" if dtype == "float64" else "f32"
    args = [f"a{a}" for a in arrays] + [f"idx{i}" for i in indices] + (["tk", "ts"] if table is not None else [])
    args += ["seg_ptr", "seg_perm", "seg_row"] + [f"o{q}" for q in outputs]
    args = ", ".join(args + (["dr"] if table is not None and table.slope_output >= 0 else []))
    acc_size = (max(rp.program.num_accumulators, 1) + (table is not None)) * C
    zeroed = [j for j, seg in enumerate(rp.acc_seg) if seg]  # summed over the segment: zeroed per segment
    body = [
        *[line for j in zeroed for line in (f"    for c in range({C}):", f"        acc[{j * C} + c] = zero")],
        "    for p in range(seg_ptr[s], seg_ptr[s + 1]):",
        *_row_lines(rp, C, cast, indices, "        ", table),
        "    q = seg_row[s]",
        *_store_lines(rp, C, True, "q", "    "),
    ]
    body = [line for line in body if line.strip()]
    return "\n".join(
        ["@njit(cache=True, fastmath=FASTMATH, nogil=True)", f"def run_segments(lo, hi, {args}):"]
        + [f"    acc = np.empty({acc_size}, dtype=np.{dtype})", f"    lanes = np.empty({LANES}, dtype=np.{dtype})"]
        + ([f"    wrow = np.empty({table.width}, dtype=np.{dtype})"] if table is not None else [])
        + ([f"    srow = np.empty({table.width}, dtype=np.{dtype})"] if table is not None else [])
        + [f"    zero = {literal(0.0, cast)}", "    for s in range(lo, hi):"]
        + ["    " + line for line in body]
        + [""]
    )


@cache
def _module(source: str) -> Any:
    from workbench.kernels.numba.cpu.loops import _version
    from workbench.kernels.numba.generated import load_module

    head = (
        f"# generated by workbench.kernels.numba.cpu.fused (version {_version()}); safe to delete\n"
        "import numba\nimport numpy as np\nfrom numba import njit\n"
        "from workbench.kernels.numba.cpu.loops import FASTMATH\n\nf32 = numba.float32\n\n\n"
    )
    return load_module(head + source, "workbench_fused")


def fused_pass(rp: Any, channels: int, dtype: str, table: TableRead | None = None) -> FusedPass:
    """The fused kernels of ``rp`` (generated, written and imported once per process)."""
    cached = rp.__dict__.setdefault("_fused", {})
    key = (channels, dtype, limit(), table)
    if key not in cached:
        arrays, indices, outputs = _signature(rp, table)
        module = _module(kernel_source(rp, channels, dtype, table))
        cached[key] = FusedPass(module, arrays, indices, outputs, table)
    return cached[key]
