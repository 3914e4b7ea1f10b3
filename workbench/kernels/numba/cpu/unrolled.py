r"""Generated CPU code: a :class:`~workbench.kernels.descriptor.program.VectorProgram` as straight-line
numba source, one channel loop that LLVM vectorises.

The interpreter of :mod:`~workbench.kernels.numba.cpu.loops` runs each instruction as its own loop
over the channels, so every temporary goes through memory (three loads and a store per
instruction and SIMD lane group). Here the whole program is one loop body over a channel
``c``:

.. code-block:: python

    k3 = K_rows[krow, 3]                     # coefficients that vary by row (broadcast factors)
    for c in range(128):                     # C is a literal: offsets are constants
        v0 = F[0 + c]                        # operand components, loaded once (F: flat registers)
        ...
        t0 = v3 * v7                         # monomial prefixes and Horner partial sums:
        t1 = t0 * v9                         #   registers, never stored
        s0 = s0 + 0.2041241452 * t1 * v40    # accumulators
        ...
        F[6656 + c] = s0                     # stored once per row

Every offset into ``F`` is a constant, so LLVM proves that no store overlaps a later load and
vectorises the loop (``fastmath={"contract"}``: multiplies and adds fuse into FMAs; nothing is
reassociated) without run-time alias checks. Coefficients that do not vary by row are literals.

Opt-in (:func:`use_generated`): the row loads and the radial weights' memory traffic, not
the instructions, bound most passes, so the interpreter is the default. The body is inlined
into the row-pass drivers of :func:`workbench.kernels.numba.cpu.loops.driver_source`, written under ``$WORKBENCH_CACHE_DIR/kernels`` and
compiled with numba's on-disk cache, so a configuration compiles once per machine.
"""

from __future__ import annotations

import numpy as np

from workbench.kernels.descriptor.program import ADD_AXPY, ADD_K, ADD_MUL, SET_AXPY, SET_K, SET_MUL, VectorProgram
from workbench.kernels.options import kernel_options

__all__ = [
    "DEFAULT_MAX_INSTRUCTIONS",
    "body_source",
    "constant_coefficients",
    "instruction_lines",
    "literal",
    "use_generated",
]

#: largest program (instructions) ``WORKBENCH_CPU_KERNELS=generated`` compiles to straight-line code
DEFAULT_MAX_INSTRUCTIONS = 1000
#: the value each opcode writes to register ``d``: ``{d}`` its old value, ``{k}`` the
#: coefficient, ``{a}``, ``{b}`` the operand registers (unused ones are absent from the program)
_EXPRESSIONS = {
    SET_MUL: "{k} * {a} * {b}",
    ADD_MUL: "{d} + {k} * {a} * {b}",
    SET_AXPY: "{k} * {a}",
    ADD_AXPY: "{d} + {k} * {a}",
    SET_K: "{k}",
    ADD_K: "{d} + {k}",
}


def use_generated(program: VectorProgram) -> bool:
    """Whether ``program`` runs as generated code. Opt-in (``WORKBENCH_CPU_KERNELS=generated``),
    for programs of at most ``WORKBENCH_CPU_UNROLL_MAX`` instructions: measured on the paper
    configuration (fp32, 2 cores), the channelwise TP's passes run 10-20% faster generated, but
    the contraction's forward runs 2x slower (its ~100 live vectors spill) and its 6161-
    instruction backward took 208 s to compile; the default interpreter is within 20% of the
    generated code everywhere and compiles once for every program."""
    options = kernel_options()
    return options.cpu_kernels == "generated" and program.num_instructions <= (
        options.cpu_unroll_max or DEFAULT_MAX_INSTRUCTIONS
    )


def body_source(program: VectorProgram, channels: int, dtype: str, per_segment: np.ndarray) -> list[str]:
    """Lines running ``program`` on one row, for :func:`~workbench.kernels.numba.cpu.loops.driver_source`:
    registers in the flat ``F`` (register ``j``, channel ``c`` at ``j * channels + c``), row
    coefficients ``K_rows[krow, k]``. Accumulator ``j`` is added to (``per_segment[j]``) or
    overwritten."""
    C = channels
    V = program.num_vectors
    cast = "" if dtype == "float64" else "f32"
    varying = program.num_scalars > 0
    kname = (lambda k: f"k{k}") if varying else constant_coefficients(program, cast).__getitem__
    lines = [f"k{k} = K_rows[krow, {k}]" for k in range(program.num_k)] if varying else []
    lines.append(f"for c in range({C}):")
    ind = "    "
    name: dict[int, str] = {}
    for j in range(V):
        lines.append(f"{ind}v{j} = F[{j * C} + c]")
        name[j] = f"v{j}"
    A = program.num_accumulators
    zero = f"{cast}(0.0)" if cast else "0.0"
    for j in range(A):
        r = V + j
        name[r] = f"s{j}"  # not a{j}: the drivers' operand arrays are a0..a9
        lines.append(f"{ind}s{j} = F[{r * C} + c]" if per_segment[j] else f"{ind}s{j} = {zero}")
    lines += [ind + line for line in instruction_lines(program, name, kname)]
    for j in range(A):
        lines.append(f"{ind}F[{(V + j) * C} + c] = s{j}")
    return lines


def literal(value: float, cast: str) -> str:
    """``value`` as a source literal, wrapped in ``cast`` (``"f32"``: a float32 constant) if any."""
    return f"{cast}({float(value)!r})" if cast else repr(float(value))


def constant_coefficients(program: VectorProgram, cast: str) -> list[str]:
    """The literal of each coefficient register of a program without broadcast scalars: its
    terms summed in float64, rounded once."""
    consts = np.zeros(max(program.num_k, 1))
    for r, coef, *_ in program.k_terms.tolist():
        consts[int(r)] += coef
    return [literal(v, cast) for v in consts]


def instruction_lines(program: VectorProgram, name: dict[int, str], kname) -> list[str]:
    """The program's instructions as assignments in SSA form (one channel): ``name`` maps the
    operand and accumulator registers to their local names (updated as registers are written),
    ``kname(k)`` gives coefficient ``k``'s name or literal."""
    V, A = program.num_vectors, program.num_accumulators
    lines, fresh = [], 0
    for op, d, a, b, k in program.ins.tolist():
        if d >= V + A and op in (SET_MUL, SET_AXPY, SET_K):
            target = f"t{fresh}"  # a temporary: a new local for every write keeps the code in SSA form
            fresh += 1
        else:
            target = name[d]
        if op not in _EXPRESSIONS:
            raise ValueError(f"unknown opcode {op}")
        lines.append(f"{target} = " + _EXPRESSIONS[op].format(d=name.get(d), k=kname(k), a=name.get(a), b=name.get(b)))
        name[d] = target
    return lines
