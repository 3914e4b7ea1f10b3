r"""A vector program's accumulators in groups that fit the vector registers, one channel loop each.

A fused row pass (:mod:`~workbench.kernels.numba.cpu.fused`) runs its program as one loop over
the channels, every operand register loaded at the top and every accumulator live to the end.
MACE's radial-weight and spherical-harmonic gradient at 128x0e+128x1o reads 54 operand
registers into 26 accumulators: about 80 live vectors against AVX-512's 32 vector registers,
so 254 of the loop's 543 instructions (8 channels an iteration) spilled or reloaded.

Here the accumulators are split into groups, each run as its own channel loop that loads only
the operands it reads (from L1 after the first group: a row's operands were just read) and
holds at most :data:`REGISTERS` operands and accumulators:

.. code-block:: python

    for c in range(128):          # group 0: accumulators s0 .. s5
        v0 = a0[r1, 0 + c]
        ...
        acc[0 + c] = s0
    for c in range(128):          # group 1: s6 .. s11, with the temporaries they read
        ...

A group carries every instruction its accumulators depend on, in program order, so each
accumulator sees the same operations in the same order as in the single loop; a temporary two
groups read is computed in both. Results agree with the single loop to rounding: LLVM may
contract a multiply and an add into an FMA in one loop and not in the other (float32, largest
difference 1.2e-7 of the largest value), and they do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np

from workbench.kernels.descriptor.program import ADD_AXPY, ADD_K, ADD_MUL, SET_AXPY, SET_MUL, VectorProgram
from workbench.kernels.options import kernel_options

__all__ = ["REGISTERS", "accumulator_groups", "group_instructions", "limit", "operands_read"]

#: operands plus accumulators a group holds at most. On the pass above (1 thread, float32,
#: 23,750 edges) every limit from 12 to 40 ran in 55-64 ms against 71 ms for the single loop,
#: and the kernel's stack accesses fell from 522 to 161
REGISTERS = 32
_READS_A = (SET_MUL, ADD_MUL, SET_AXPY, ADD_AXPY)
_READS_B = (SET_MUL, ADD_MUL)
_READS_D = (ADD_MUL, ADD_AXPY, ADD_K)


def _dependencies(program: VectorProgram) -> list[list[int]]:
    """Per instruction, the earlier instructions whose values it reads (its SSA inputs)."""
    V = program.num_vectors
    last: dict[int, int] = {}
    deps = []
    for i, (op, d, a, b, _k) in enumerate(program.ins.tolist()):
        reads = [r for r, used in ((a, op in _READS_A), (b, op in _READS_B), (d, op in _READS_D)) if used]
        deps.append([last[r] for r in reads if r >= V and r in last])
        last[d] = i
    return deps


def group_instructions(
    program: VectorProgram, accumulators: list[int], deps: list[list[int]] | None = None
) -> np.ndarray:
    """The rows of ``program.ins`` that the ``accumulators`` (indices ``0 .. A - 1``) depend on,
    in program order (``deps``: the program's dependencies, if already found)."""
    V = program.num_vectors
    targets = {V + j for j in accumulators}
    deps = _dependencies(program) if deps is None else deps
    need = {i for i, d in enumerate(program.ins[:, 1].tolist()) if d in targets}
    stack = list(need)
    while stack:
        for j in deps[stack.pop()]:
            if j not in need:
                need.add(j)
                stack.append(j)
    return program.ins[sorted(need)]


def operands_read(program: VectorProgram, ins: np.ndarray) -> set[int]:
    """The operand registers (``< V``) that instructions ``ins`` read."""
    V = program.num_vectors
    used = set()
    for op, _d, a, b, _k in ins.tolist():
        used.update(r for r, on in ((a, op in _READS_A), (b, op in _READS_B)) if on and r < V)
    return used


def _reads_accumulators(program: VectorProgram) -> bool:
    """Whether an instruction takes an accumulator as an operand: then a group would need another
    group's partial sums, and the program stays one loop (no program of ours does)."""
    V, A = program.num_vectors, program.num_accumulators
    for op, _d, a, b, _k in program.ins.tolist():
        if any(V <= r < V + A for r, on in ((a, op in _READS_A), (b, op in _READS_B)) if on):
            return True
    return False


def limit() -> int:
    """The group limit in effect: ``WORKBENCH_CPU_REGISTERS`` (``KernelOptions.cpu_registers``),
    else :data:`REGISTERS`."""
    return kernel_options().cpu_registers or REGISTERS


def accumulator_groups(program: VectorProgram, registers: int | None = None) -> list[list[int]]:
    """The accumulators in consecutive groups, each grown while its operands plus accumulators
    stay within ``registers`` (default :func:`limit`; a group holds at least one
    accumulator). One group: the program fits as it is."""
    registers = limit() if registers is None else registers
    A = program.num_accumulators
    if A == 0 or program.num_vectors + A <= registers or _reads_accumulators(program):
        return [list(range(A))]
    deps = _dependencies(program)
    reads = [operands_read(program, group_instructions(program, [j], deps)) for j in range(A)]
    groups: list[list[int]] = []
    current: list[int] = []
    operands: set[int] = set()
    for j in range(A):
        union = operands | reads[j]
        if current and len(union) + len(current) + 1 > registers:
            groups.append(current)
            current, union = [], set(reads[j])
        current.append(j)
        operands = union
    groups.append(current)
    return groups
