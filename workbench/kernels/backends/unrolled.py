r"""Unrolled numba-CUDA kernels generated per term table (paper §4.2: CG-sparse, unrolled, fused).

The table-driven kernels (:mod:`~workbench.kernels.backends.cuda`, :mod:`~workbench.kernels.backends.edge_cuda`)
walk the term table at run time and keep operand components in shared memory, so every term
costs ~3 dependent shared loads and its index arithmetic. Here the table is turned into
straight-line code instead, with common factors taken out. An atom kernel (the contraction,
thousands of terms) calls its sums as one generated numba intrinsic (:func:`_sums`,
:mod:`~workbench.kernels.backends.poly_ir`):

.. code-block:: python

    P = polynomial("eNp9lU...", "float32")   # the sums, as a program
    Z = (np.float32(0.0),) * 4                # zeroed accumulators
    def kernel(x0, ..., out):
        v0 = x0_bu[cu16 + U0]                 # x0_bu = x0[bu] once; each component: one load, a register
        ...
        acc = Z
        acc = P(acc, ((v0, ..., v15), ...))   # every term: one call that numba types once
        out_bu[cu1 + U0] = acc[0]             # written once per output component

The program builds monomial prefixes :math:`x_i x_j` once and a multivariate Horner form per
output (:func:`_program`); the intrinsic lowers it straight to LLVM ``fmul``/``fma`` with the
coefficients as immediates. Compile time is about 0.5 ms per term on one core (5 ms while
numba typed every term). A message kernel (at most ~2,000 terms) writes the same sums out as
numba source (:func:`_sums_source`: ``acc[0] = cuda.fma(m0, cuda.fma(v40, K3, ...), acc[0])``
in ``if go:`` blocks), whose blocks keep NVVM from sharing products across them and so keep
registers lower. Either way a term costs about one fused multiply-add (the paper contraction's
forward: about 1 SASS instruction per term, against 3.0 for the term-by-term code of the first
version). Three kernel shapes mirror the table-driven ones:

* ``atom``: thread per (atom, channel); species operands are read at the atom's species row;
  a species output (weight gradient) is written as one partial row per atom, summed per
  species by :mod:`~workbench.kernels.backends.segment` (deterministic, no atomics);
* ``node``: thread per (node, channel) walking the node's CSR segment of edges, accumulators
  kept in registers over the whole segment; one store per component, no atomics;
* ``edge``: thread per (edge, channel), or for a channel-summed output (the gradient of the
  spherical harmonics) ``G`` threads per edge, each summing a strided subset of channels; the
  ``G`` partials are added in shared memory in a fixed order by the edge's first thread.

A thread's registers bound how many terms one kernel can hold, so :func:`use_unrolled` keeps
the table-driven kernel above ``WORKBENCH_UNROLL_MAX_TERMS`` (default :data:`DEFAULT_MAX_TERMS`)
or when ``WORKBENCH_CUDA_KERNELS=table``, and :func:`unrolled_parts` splits larger polynomials
(:mod:`~workbench.kernels.backends.atom_pass` runs the parts of a pass in one launch). Each
generated source (which encodes the whole table) is written to a module under
:func:`source_dir` and compiled with numba's on-disk cache, so it compiles once per machine.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from functools import cache
from typing import Any

from workbench.kernels.backends.device import cudasim_enabled
from workbench.kernels.backends.generated import load_module
from workbench.kernels.backends.poly_ir import Program, call_source
from workbench.kernels.descriptor.tables import TermTable

__all__ = [
    "ATOM_ROW_VARS",
    "DEFAULT_MAX_TERMS",
    "MAX_PARTS",
    "MAX_PARTS_F64",
    "MAX_PART_SLOTS_F64",
    "MAX_WEIGHT_PARTS_F64",
    "SPLIT_FULL_SLOTS",
    "SPLIT_PART_TERMS",
    "SPLIT_PART_TERMS_F64",
    "SPLIT_WEIGHT_TERMS_F64",
    "atom_head",
    "atom_lines",
    "block_size",
    "get_unrolled_kernel",
    "kernel_source",
    "live_slots",
    "unroll",
    "unroll_cost",
    "unrolled_parts",
    "use_unrolled",
]

#: largest :func:`unroll_cost` unrolled in one kernel. At the paper configuration (sm_90, one
#: core) float32 unrolls every kernel but the double backward's d(x) (9053 terms: 2.8 KB of
#: spills and 106 s to compile as one kernel) and d(W) (4940 terms into 81 accumulators: 236 B
#: of spills, 88 s), which are split (below); the others compile without spills. float64
#: (twice the registers) unrolls the channelwise TP in one kernel each; its contraction kernels
#: (whole, the 4940-term ones spill 5-8 KB) are split or stay on tables (below).
DEFAULT_MAX_TERMS = 8000
#: float32 polynomials that fail :func:`use_unrolled` are split into parts of about this many
#: terms (:func:`unrolled_parts`). Calibrated on sm_90 with ptxas at the paper configuration,
#: double backward d(x) (9053 terms, 115 operand components): 2 parts of 4241 / 4812 spill
#: 1.5-2 KB, 4 parts (largest 2844) 256 B in one part, 5 parts (1492-1996) none; d(W) in 3
#: parts: none, 128-255 registers
SPLIT_PART_TERMS = 2000
#: the float32 part size is scaled by SPLIT_FULL_SLOTS / (operand components) above this many:
#: 128x0e+128x1o+128x2e's double backward d(x) (187 components) in parts of up to ~2250 terms
#: (one per component) spilled 8-48 B in 5 of 16 parts, including one of 1827 terms
SPLIT_FULL_SLOTS = 120
#: at most this many launches for one output (compile time grows with the parts' terms anyway)
MAX_PARTS = 32
#: float64 (operands in register pairs): parts of about 650 terms reading at most 100 operand
#: components. Calibrated with ptxas at the paper configuration: the forward in 4 parts, the
#: backward's d(x) in 8, its d(W) in 3 and the double backward's d(W) in 8 compile without
#: spills (in 9 parts, two of the latter spill 16 B); the double backward's d(x) in 16 parts,
#: one per component (413-697 terms, at most 85 operand components), of which 5 spill 12-76 B
#: per thread (issue 17 allows float64 256 B); d(d(out)) (4 components of ~1235 terms) in 10 runs of terms
#: (:meth:`CompiledPolynomial.split_terms`). 128x0e+128x1o+128x2e: the forward in 14 runs and
#: d(d(out)) in 30; its d(x)s need more than 100 components per run and are grouped by weight
#: component instead (below)
SPLIT_PART_TERMS_F64 = 650
MAX_PARTS_F64 = 64
MAX_PART_SLOTS_F64 = 100
#: float64 parts grouped by weight component (:meth:`CompiledPolynomial.split_operand`), where
#: runs of one component read too many weights. Each part reads ~30-57 components but shares its
#: x monomials across all output components, so its size sets the spills. Calibrated with ptxas
#: on 128x0e+128x1o+128x2e: the backward's d(x) (16,080 terms) spills at most 200 B per thread
#: in parts of 550-650 terms; the double backward's d(x) (30,420) 1 KB at 650, 416 B at 600,
#: 104 B at 550 (76 parts) and none at 450 (94 parts)
SPLIT_WEIGHT_TERMS_F64 = 550
MAX_WEIGHT_PARTS_F64 = 96
#: a thread's live operand components and accumulators, in 32-bit registers, must not exceed
#: this (of 255): at 200, the float64 TP double backward's d(d(out)) (accumulators carried over
#: the segment) takes 254 registers without spills; it spilled 736 B when each edge's sums were
#: added to a second set of accumulators
MAX_LIVE_REGISTERS = 200
ACCUMULATOR_WEIGHT = 32
#: no shared memory, so the block size only sets the granularity; ptxas picks the registers
THREADS_PER_BLOCK = 128
cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


def block_size() -> int:
    """Threads per block of the generated kernels: ``WORKBENCH_CUDA_TPB``, default
    :data:`THREADS_PER_BLOCK`."""
    return int(os.environ.get("WORKBENCH_CUDA_TPB", THREADS_PER_BLOCK))


def unroll_cost(num_terms: int, accumulators: int = 0, itemsize: int = 4) -> float:
    """Terms weighted by register pressure: every output component a kernel accumulates stays
    live in a register, so a weight gradient (81 accumulators at the paper configuration)
    spills at fewer terms than an input gradient (16); a float64 value takes two registers."""
    return num_terms * (1.0 + accumulators / ACCUMULATOR_WEIGHT) * itemsize / 4


def use_unrolled(num_terms: int, accumulators: int = 0, slots: int = 0, itemsize: int = 4, scale: float = 1.0) -> bool:
    """Whether to launch the generated kernel for a polynomial of ``num_terms`` terms over
    ``slots`` operand components into ``accumulators`` output components, in values of
    ``itemsize`` bytes: when :func:`unroll_cost` is at most ``WORKBENCH_UNROLL_MAX_TERMS``
    (default :data:`DEFAULT_MAX_TERMS`) and the values a thread keeps live (slots and
    accumulators, in 32-bit registers) stay within :data:`MAX_LIVE_REGISTERS`. ``scale``
    shrinks the budget (a part of a fused pass,
    :data:`~workbench.kernels.backends.atom_pass.FUSED_SCALE`)."""
    mode = os.environ.get("WORKBENCH_CUDA_KERNELS", "auto")
    if mode not in ("auto", "table", "unrolled"):
        raise ValueError(f"WORKBENCH_CUDA_KERNELS must be auto, table or unrolled, got {mode!r}")
    if mode != "auto":
        return mode == "unrolled"
    live = (slots + accumulators) * itemsize // 4
    budget = float(os.environ.get("WORKBENCH_UNROLL_MAX_TERMS", DEFAULT_MAX_TERMS))
    return unroll_cost(num_terms, accumulators, itemsize) <= budget * scale and live <= MAX_LIVE_REGISTERS


def live_slots(compiled: Any) -> int:
    """Operand components :func:`use_unrolled` counts as live. A message kernel (edge rows)
    loads an edge's components and consumes them in its few hundred terms, so ptxas keeps only
    part of them live: half are counted (128x0e+128x1o+128x2e, float64, forced unrolled: the
    backward's d(x), 104 components and 9 accumulators, takes 96 registers; the double
    backward's d(d(out)), 84 and 71, spills 1.6 KB). An atom kernel's components are used all
    through its thousands of terms and count whole."""
    return compiled.num_slots // 2 if compiled.edge else compiled.num_slots


def unrolled_parts(compiled: Any, dtype: str, split: bool = True, scale: float = 1.0) -> list[TermTable] | None:
    """The term tables to generate kernels for, or None for the table-driven kernel.

    One table when the polynomial passes :func:`use_unrolled`. A polynomial that does not (with
    ``split``) is split by output components into the fewest ``k >= ceil(terms / part size)``
    groups balanced by terms whose parts all fit (part size :data:`SPLIT_PART_TERMS`, at most :data:`MAX_PARTS` parts;
    float64: :data:`SPLIT_PART_TERMS_F64`, :data:`MAX_PARTS_F64`), one generated kernel
    (launch) each, all writing the same output, when every part fits: float32 parts pass
    :func:`use_unrolled`; float64 parts, whose operands take two registers each, read at most
    :data:`MAX_PART_SLOTS_F64` operand components; message-kernel parts (each walks the edges
    again) pass :func:`use_unrolled` with their operands counted as :func:`live_slots` does.
    ``WORKBENCH_UNROLL_PARTS=k`` forces ``k`` parts (``1``: no automatic split). Where the
    components are too coarse, an atom polynomial's terms are cut into runs instead
    (:meth:`CompiledPolynomial.split_terms`, the same part size; ``WORKBENCH_UNROLL_TERMS=n``
    forces runs of ``n`` terms), and where a run still reads too many operand components, into
    groups by weight component (:meth:`CompiledPolynomial.split_operand`: 128x0e+128x1o+128x2e's
    float64 d(x)s, whose runs read up to 108 components, read at most 57;
    ``WORKBENCH_UNROLL_WEIGHT_GROUPS=n`` forces parts of about ``n`` terms). ``scale``: the
    float32 budget of :func:`use_unrolled` (and the part size) times this."""
    mode = os.environ.get("WORKBENCH_CUDA_KERNELS", "auto")
    forced = os.environ.get("WORKBENCH_UNROLL_PARTS")
    if forced and split and mode != "table" and int(forced) > 1:
        return compiled.split(int(forced))
    forced_terms = os.environ.get("WORKBENCH_UNROLL_TERMS")
    if forced_terms and split and mode != "table" and not compiled.edge:
        return compiled.split_terms(int(forced_terms))
    weights = [a for a, o in enumerate(compiled.poly.operands) if o.rows == "species"]
    forced_groups = os.environ.get("WORKBENCH_UNROLL_WEIGHT_GROUPS")
    if forced_groups and split and mode != "table" and weights:
        return compiled.split_operand(int(forced_groups), weights[0])
    itemsize = 8 if dtype == "float64" else 4
    if itemsize == 8:
        scale = 1.0
    if use_unrolled(compiled.num_terms, compiled.accumulators, live_slots(compiled), itemsize, scale):
        return [compiled.table]
    if not split or forced or mode != "auto":
        return None
    size, most = (SPLIT_PART_TERMS_F64, MAX_PARTS_F64) if itemsize == 8 else (SPLIT_PART_TERMS, MAX_PARTS)
    if itemsize == 4 and compiled.num_slots > SPLIT_FULL_SLOTS:  # more operands live per term: smaller parts
        size = size * SPLIT_FULL_SLOTS // compiled.num_slots
    size = int(size * scale)

    def fits(p: TermTable) -> bool:
        if p.num_terms > size * 5 // 4:  # components too coarse to balance: a part stays too large
            return False
        accumulators = len(set(p.t_out.tolist()))
        if compiled.edge:  # operands counted as live_slots counts them
            return use_unrolled(p.num_terms, accumulators, p.num_slots // 2, itemsize)
        if itemsize == 8:
            return p.num_slots <= MAX_PART_SLOTS_F64
        return use_unrolled(p.num_terms, accumulators, p.num_slots, itemsize, scale)

    for k in range(max(2, -(-compiled.num_terms // size)), most + 1):
        parts = compiled.split(k)
        if len(parts) < k:  # fewer output components than parts
            break
        if all(fits(p) for p in parts):
            return parts
    if compiled.edge:  # message kernels store each component once (no term split)
        return None
    # components too coarse: cut their terms into runs (a later run adds to the first)
    parts = compiled.split_terms(size)
    if len(parts) <= most and all(fits(p) for p in parts):
        return parts
    # a component's runs still read most of the weights: group the terms by weight component
    if weights:
        wsize, wmost = (SPLIT_WEIGHT_TERMS_F64, MAX_WEIGHT_PARTS_F64) if itemsize == 8 else (size, most)
        parts = compiled.split_operand(wsize, weights[0])
        if len(parts) <= wmost and all(fits(p) for p in parts):
            return parts
    return None


def unroll(compiled: Any, dtype: str, split: bool = True) -> bool:
    """Whether ``compiled`` runs as generated kernels in ``dtype`` (:func:`unrolled_parts`)."""
    return unrolled_parts(compiled, dtype, split) is not None


def _const(value: float, dtype: str) -> str:
    return repr(float(value)) if dtype == "float64" else f"f32({float(value)!r})"


def _scalar(dtype: str) -> str:
    """The numpy scalar type of ``dtype`` in a generated module (a typed global)."""
    return "np.float64" if dtype == "float64" else "np.float32"


CHUNK = 16  # terms per fused multiply-add chain
LINES_PER_BLOCK = 8  # prefix products per ``if go:`` block (:func:`_sums_source`)
TERMS_PER_BLOCK = 64  # terms per ``if go:`` block


class _Definitions:
    """The module-level definitions of one generated kernel: each table's polynomial
    (``P = polynomial(...)``, :mod:`~workbench.kernels.backends.poly_ir`) and its zeroed
    accumulators, or the coefficients ``K0, K1, ...`` of source sums (:func:`_sums_source`):
    typed globals that numba freezes as constants."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.defs: list[str] = []
        self.names: dict[float, str] = {}

    def define(self, name: str, expr: str) -> str:
        """A module-level definition ``name = expr``; returns ``name``."""
        self.defs.append(f"{name} = {expr}")
        return name

    def __call__(self, value: float) -> str:
        """The global ``K<n>`` holding the coefficient ``value`` (:func:`_sums_source`): numba
        freezes it as a typed constant, which types faster than a ``f32(...)`` call per term."""
        value = float(value)
        if value not in self.names:
            self.names[value] = self.define(f"K{len(self.names)}", _const(value, self.dtype))
        return self.names[value]

    def lines(self) -> list[str]:
        return list(self.defs)


class _Grouped:
    """The terms of a table grouped for a multivariate Horner form (:func:`_program`,
    :func:`_sums_source`): operands ranked by how often their components occur as factors,
    ``top[m][o]`` the ``(coefficient, factors by rank)`` of output ``o``'s terms whose monomial
    in the first operand is ``m``."""

    def __init__(self, table: TermTable):
        mons = table.monomials()
        arrays = [int(a) for a in table.slot_arr]
        count: dict[int, int] = {}
        for _, _, slots in mons:
            for q in slots:
                count[arrays[q]] = count.get(arrays[q], 0) + 1
        self.rank = sorted(count, key=lambda a: (-count[a], a))
        self.outs = sorted({o for o, _, _ in mons})
        self.slot = {o: k for k, o in enumerate(self.outs)}
        self.top: dict[tuple[int, ...], dict[int, list]] = {}
        for o, coef, slots in mons:
            key = tuple(tuple(q for q in slots if arrays[q] == a) for a in self.rank)
            self.top.setdefault(key[0] if key else (), {}).setdefault(o, []).append((coef, key))

    def chain(self, terms: list[tuple[float, tuple]], level: int, tail: Any, emit: Any) -> Any:
        """``tail`` plus the sum of ``terms`` (their factors of ``rank[level:]``), built with
        ``emit`` (``const``, ``product``, ``mul``, ``add``, ``fma``)."""
        if level == len(self.rank):
            k = emit.const(sum(c for c, _ in terms))
            return k if tail is None else emit.add(tail, k)
        groups: dict[tuple[int, ...], list] = {}
        for c, key in terms:
            groups.setdefault(key[level], []).append((c, key))
        for mono_, sub in groups.items():
            if not mono_:
                tail = self.chain(sub, level + 1, tail, emit)
                continue
            f = emit.product(mono_)
            inner = (
                emit.const(sum(c for c, _ in sub))
                if level + 1 == len(self.rank)
                else self.chain(sub, level + 1, None, emit)
            )
            tail = emit.mul(f, inner) if tail is None else emit.fma(f, inner, tail)
        return tail


class _SourceEmit:
    """:meth:`_Grouped.chain` as numba source text."""

    def __init__(self, v: Sequence[str], consts: _Definitions):
        self.v, self.const = v, consts

    def product(self, mono_: tuple[int, ...]) -> str:
        return " * ".join(self.v[q] for q in mono_)

    def mul(self, f: str, x: str) -> str:
        return f"{f} * {x}"

    def add(self, t: str, k: str) -> str:
        return f"({t} + {k})"

    def fma(self, f: str, x: str, t: str) -> str:
        return f"cuda.fma({f}, {x}, {t})"


class _ProgramEmit:
    """:meth:`_Grouped.chain` as :class:`~workbench.kernels.backends.poly_ir.Program` operations."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.const, self.mul, self.add, self.fma = prog.const, prog.mul, prog.add, prog.fma
        self.products: dict[tuple[int, ...], int] = {}

    def product(self, mono_: tuple[int, ...]) -> int:
        """``v[q0] * v[q1] * ...`` left to right, each prefix built once."""
        if len(mono_) == 1:
            return self.prog.v(mono_[0])
        if mono_ not in self.products:
            self.products[mono_] = self.prog.mul(self.product(mono_[:-1]), self.prog.v(mono_[-1]))
        return self.products[mono_]


def _program(table: TermTable) -> tuple[Program, list[int]]:
    r"""The sums of ``table`` as a :class:`~workbench.kernels.backends.poly_ir.Program` (inputs:
    the slots, then one accumulator per output component), and the output components in
    accumulator order.

    Operands are ranked by how often their components occur as factors (for the contraction:
    :math:`x`, then the cotangent, then the weights). Terms are grouped by their monomial in the
    first operand, :math:`m = x_i x_j \cdots`, built once from its two-factor prefix and shared
    by every output; inside a group, factors of the next operand are taken out the same way,
    and so on (a multivariate Horner form):

    .. math::

        a_o \leftarrow \mathrm{fma}\Big(m,\; \mathrm{fma}\big(\bar y_p,\;
        \mathrm{fma}(W_1, \alpha_1, \mathrm{fma}(W_2, \alpha_2, \ldots)), \ldots\big),\; a_o\Big)

    so a term costs about one fused multiply-add with its coefficient as an immediate, and an
    outer group one more. An output's terms of one monomial go in chunks of :data:`CHUNK`, each
    chunk one nested chain added to the accumulator."""
    g = _Grouped(table)
    prog = Program(table.num_slots, len(g.outs))
    emit = _ProgramEmit(prog)
    for mono_ in sorted(g.top):  # the two-factor prefixes first (ptxas then schedules with fewer registers)
        if len(mono_) >= 2:
            emit.product(mono_[:2])
    acc = [prog.acc(k) for k in range(len(g.outs))]
    for mono_ in sorted(g.top):
        m = emit.product(mono_) if mono_ else None
        for o, terms in sorted(g.top[mono_].items()):
            k = g.slot[o]
            if mono_ and len(g.rank) == 1:  # the monomial is the whole term
                acc[k] = prog.fma(m, prog.const(sum(c for c, _ in terms)), acc[k])
                continue
            for i in range(0, len(terms), CHUNK):
                chunk = terms[i : i + CHUNK]
                acc[k] = (
                    prog.fma(m, g.chain(chunk, 1, None, emit), acc[k])
                    if m is not None
                    else g.chain(chunk, 1, acc[k], emit)
                )
    prog.outputs = acc
    return prog, g.outs


def _sums(
    table: TermTable,
    dtype: str,
    ind: str,
    consts: _Definitions,
    decl_ind: str | None = None,
    names: Sequence[str] | None = None,
    tag: str = "",
) -> tuple[list[str], list[str], dict[int, str]]:
    """``(declarations, lines, exprs)``: the accumulators' declaration (zeroed; at ``decl_ind``,
    default ``ind``, so that a loop can carry them), the line adding every term to them, and per
    output component the expression holding it. ``names``: the variable holding each slot
    (default ``v{q}``); ``tag`` prefixes the local names, so that several tables can share one
    kernel body.

    The sums (:func:`_program`) are one call of a generated intrinsic
    (:func:`~workbench.kernels.backends.poly_ir.polynomial`) on tuples of the accumulators and
    the operand components, so numba types one call instead of every term."""
    prog, outs = _program(table)
    v = list(names) if names is not None else [f"v{q}" for q in range(table.num_slots)]
    fn = consts.define(f"{tag}P", f'polynomial("{prog.encode()}", "{dtype}")')
    zeros = consts.define(f"{tag}Z", f"({_scalar(dtype)}(0.0),) * {len(outs)}")  # a global: numba freezes it
    di = ind if decl_ind is None else decl_ind
    decl = [f"{di}{tag}acc = {zeros}"]
    lines = [f"{ind}{tag}acc = {call_source(fn, f'{tag}acc', v)}"]
    return decl, lines, {o: f"{tag}acc[{k}]" for k, o in enumerate(outs)}


def _sums_source(
    table: TermTable,
    dtype: str,
    ind: str,
    consts: _Definitions,
    decl_ind: str | None = None,
    names: Sequence[str] | None = None,
    tag: str = "",
) -> tuple[list[str], list[str], dict[int, str]]:
    r"""As :func:`_sums`, but the terms written out as numba source, for the message kernels
    (node, edge, :mod:`~workbench.kernels.backends.edge_pass`): ``(declarations, lines, exprs)``:
    the accumulators' declarations (zeroed; at ``decl_ind``,
    default ``ind``, so that a loop can carry them), the lines accumulating every output component
    into them, and per component the expression holding it. ``names``: the variable holding each
    slot (default ``v{q}``); ``tag`` prefixes the local names, so that several tables can share
    one kernel body.

    Operands are ranked by how often their components occur as factors (for the contraction:
    :math:`x`, then the cotangent, then the weights). Terms are grouped by their monomial in the
    first operand, :math:`m = x_i x_j \cdots`, built once from its prefix (one multiplication)
    and shared by every output; inside a group, factors of the next operand are taken out the
    same way, and so on (a multivariate Horner form):

    .. math::

        a_o \leftarrow \mathrm{fma}\Big(m,\; \mathrm{fma}\big(\bar y_p,\;
        \mathrm{fma}(W_1, \alpha_1, \mathrm{fma}(W_2, \alpha_2, \ldots)), \ldots\big),\; a_o\Big)

    so a term costs about one fused multiply-add with its coefficient as an immediate, and an
    outer group one more. Written as nested ``cuda.fma`` calls (one typed call per term, where
    ``a * b + c`` is two binary operations for numba to type) with the coefficients as globals
    (:class:`_Definitions`), which halves compile time.

    Accumulators live in a small local array (constant indices: LLVM keeps them in registers)
    so that no Python variable is redefined block after block, and the groups of one
    two-factor prefix share an ``if go:`` block (``go`` is always true): numba's SSA and
    liveness passes are superlinear in the size of a basic block, and the blocks keep compile
    time linear in the terms. A monomial is built and used in one block, which also keeps
    products from staying live across blocks: the same sums as one polynomial intrinsic, where
    NVVM merges every repeated product, spilled 288 B in the fused TP double backward at
    128x0e+128x1o+128x2e (float32) and 1.7 KB at the paper config (float64), where this source
    spills none and 132 B. Message kernels hold at most ~2,000 terms, so numba's typing of each
    term costs seconds, not minutes."""
    v = list(names) if names is not None else [f"v{q}" for q in range(table.num_slots)]
    g = _Grouped(table)
    emit = _SourceEmit(v, consts)
    rank, outs, slot, top = g.rank, g.outs, g.slot, g.top

    def chain(terms: list[tuple[float, tuple]], level: int, tail: str | None) -> str:
        return g.chain(terms, level, tail, emit)

    prefixes = sorted({mono_[:2] for mono_ in top if len(mono_) >= 2})
    pre = {t: k for k, t in enumerate(prefixes)}
    di = ind if decl_ind is None else decl_ind
    decl = [f"{di}{tag}acc = cuda.local.array({len(outs)}, {_dtype_name(dtype)})"]
    decl += [f"{di}{tag}acc[{k}] = {_const(0.0, dtype)}" for k in range(len(outs))]
    blocks: list[str] = []
    if prefixes:
        decl.append(f"{di}{tag}pre = cuda.local.array({len(prefixes)}, {_dtype_name(dtype)})")
        for i in range(0, len(prefixes), LINES_PER_BLOCK):
            blocks.append(f"{ind}if go:")
            blocks += [
                f"{ind}    {tag}pre[{pre[t]}] = {v[t[0]]} * {v[t[1]]}" for t in prefixes[i : i + LINES_PER_BLOCK]
            ]
    made = 0
    block: list[str] = []
    weight = 0
    local: dict[tuple[int, ...], str] = {}
    for mono_ in sorted(top):
        for o, terms in sorted(top[mono_].items()):
            a = f"{tag}acc[{slot[o]}]"
            for i in range(0, len(terms), CHUNK):
                if weight >= TERMS_PER_BLOCK:  # close the block; monomials are rebuilt in the next one
                    blocks += [f"{ind}if go:"] + [f"{ind}    {line}" for line in block]
                    block, weight, local = [], 0, {}
                if len(mono_) >= 2 and mono_ not in local:
                    local[mono_] = f"{tag}m{made}"  # defined once, used in this block only
                    made += 1
                    block.append(
                        f"{local[mono_]} = {tag}pre[{pre[mono_[:2]]}]" + "".join(f" * {v[q]}" for q in mono_[2:])
                    )
                m = local[mono_] if len(mono_) >= 2 else (v[mono_[0]] if mono_ else None)
                if mono_ and len(rank) == 1:  # the monomial is the whole term
                    block.append(f"{a} = cuda.fma({m}, {consts(sum(c for c, _ in terms))}, {a})")
                    weight += 1
                    break
                chunk = terms[i : i + CHUNK]
                block.append(
                    f"{a} = cuda.fma({m}, {chain(chunk, 1, None)}, {a})" if m else f"{a} = {chain(chunk, 1, a)}"
                )
                weight += len(chunk)
    if block:
        blocks += [f"{ind}if go:"] + [f"{ind}    {line}" for line in block]
    return decl, blocks, {o: f"{tag}acc[{slot[o]}]" for o in outs}


class _Index:
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


#: the variables holding an edge operand's row, by row code: the edge, its sender, its receiver
EDGE_ROW_VARS = {0: "eu", 1: "su", 2: "ru"}


def edge_rows(ind: str, edge: str) -> list[str]:
    """The lines of a segment walk's step: the edge ``edge`` and its rows as unsigned indices."""
    return [f"{ind}e = {edge}", f"{ind}eu = u64(e)", f"{ind}su = u64(sender[e])", f"{ind}ru = u64(receiver[e])"]


#: the variables holding an atom operand's row, by row code: the atom, its species
ATOM_ROW_VARS = {0: "bu", 1: "zu"}


def atom_head(outs: str) -> list[str]:
    """The signature and first lines of an atom kernel writing ``outs`` (its output arguments)."""
    args = ", ".join(f"x{i}" for i in range(10))
    return [
        f"def kernel({args}, species, C, {outs}):",
        "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
        "if gid >= species.shape[0] * C:",
        "    return",
        "b = gid // C",
        "c = gid - b * C",
        "bu = u64(b)",
        "zu = u64(species[b])",
    ]


def atom_lines(
    table: TermTable, dtype: str, consts: _Definitions, index: _Index, out: str = "out", tag: str = ""
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
    decl, sums, exprs = _sums(table, dtype, "", consts, names=names, tag=tag)
    lines += decl + sums
    row = index.row(out, "bu")
    for o, expr in exprs.items():
        op = "+=" if o in table.add_to else "="
        lines.append(f"{row}[{index(table.out_off[o], table.out_cs[o])}] {op} {expr}")
    return lines


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
    :mod:`~workbench.kernels.backends.segment` sums), ``"node"`` or ``"edge"`` (arrays ``x0..x7``
    with rows edge / sender / receiver; ``reduce_channels``: a channel-summed output, reduced in
    shared memory by the ``G`` threads of an edge in a fixed order, so ``tpb``, the block size
    the kernel is launched with, sizes that buffer; ``group``, when given, fixes ``G`` at compile
    time so that the channel stride is an immediate and the sum of the ``G`` partials is straight
    code). Accumulators that a loop carries (over the node's edges, over the thread's channels)
    are zeroed once, before the loop."""
    consts = _Definitions(dtype)
    index = _Index()
    body: list[str] = []
    ind = "    "
    i2 = ind * 2
    if shape == "atom":
        head = atom_head("out")
    elif shape in ("node", "edge"):
        args = ", ".join(f"x{i}" for i in range(8))
        rows = EDGE_ROW_VARS
        if shape == "node":
            head = [
                f"def kernel({args}, sender, receiver, seg_ptr, seg_perm, C, out):",
                "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                "if gid >= (seg_ptr.shape[0] - 1) * C:",
                "    return",
                "n = gid // C",
                "c = gid - n * C",
                "nu = u64(n)",
            ]
        elif reduce_channels:
            # no early return: every thread of the block reaches the barrier
            head = [
                f"def kernel({args}, sender, receiver, G, C, out):",
                f"red = cuda.shared.array(({tpb}, {max(table.out_off.shape[0], 1)}), {_dtype_name(dtype)})",
                "tid = cuda.threadIdx.x",
                "gid = cuda.blockIdx.x * cuda.blockDim.x + tid",
                "valid = gid < sender.shape[0] * G",
                "e = gid // G",
                "g = gid - e * G",
                "eu = u64(e)",
            ]
        else:
            head = [
                f"def kernel({args}, sender, receiver, G, C, out):",
                "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                "if gid >= sender.shape[0] * G:",
                "    return",
                "e = gid // G",
                "c = gid - e * G",
                "eu = u64(e)",
                "su = u64(sender[e])",
                "ru = u64(receiver[e])",
            ]
    else:
        raise ValueError(f"unknown kernel shape {shape!r}")

    def loads(prefix: str) -> list[str]:
        return [
            f"{prefix}v{q} = x{a}[{rows[int(k)]}, {index(off, cs)}]"
            for q, (a, k, off, cs) in enumerate(zip(table.slot_arr, table.slot_rows, table.slot_off, table.slot_cs))
        ]

    if shape != "atom":
        body.append("go = C > 0")  # the ``if go:`` blocks of _sums_source
    if table.add_to and shape != "atom":
        raise ValueError("only atom kernels take a term split (add_to)")
    if shape == "atom":
        body += atom_lines(table, dtype, consts, index)
    elif shape == "node":
        # accumulators carried over the node's edges, stored once at the end
        decl, lines, exprs = _sums_source(table, dtype, ind, consts, decl_ind="")
        body += decl
        body += ["for p in range(seg_ptr[n], seg_ptr[n + 1]):", *edge_rows(ind, "seg_perm[p]")]
        body += loads(ind) + lines
        for o, expr in exprs.items():
            idx = index(table.out_off[o], table.out_cs[o])
            # a channel-summed node output is not used in training; it keeps an atomic sum
            body.append(f"cuda.atomic.add(out, (nu, {idx}), {expr})" if reduce_channels else f"out[nu, {idx}] = {expr}")
    elif reduce_channels:
        # accumulators carried over this thread's channels, then a fixed-order sum of the G
        # partials of the edge in shared memory (deterministic, no atomics)
        decl, lines, exprs = _sums_source(table, dtype, i2, consts, decl_ind=ind)
        slots = {o: k for k, o in enumerate(exprs)}
        body += ["if valid:", f"{ind}su = u64(sender[e])", f"{ind}ru = u64(receiver[e])"]
        body += decl
        body.append(f"{ind}for c in range(g, C, {group if group else 'G'}):")
        body += ["@CHANNELS@"] + loads(i2) + lines
        body += [f"{ind}red[tid, {k}] = {exprs[o]}" for o, k in slots.items()]
        body += ["cuda.syncthreads()", "if valid and g == 0:"]
        for o, k in slots.items():
            if group:  # the same left-to-right order as the loop below, unrolled
                total = " + ".join([f"red[tid, {k}]"] + [f"red[tid + {j}, {k}]" for j in range(1, group)])
                body.append(f"{ind}out[eu, {index(table.out_off[o], 0)}] = {total}")
                continue
            body += [
                f"{ind}t{o} = red[tid, {k}]",
                f"{ind}for j in range(1, G):",
                f"{i2}t{o} += red[tid + j, {k}]",
                f"{ind}out[eu, {index(table.out_off[o], 0)}] = t{o}",
            ]
    else:  # edge, channelwise output: G == C, one channel per thread
        decl, lines, exprs = _sums_source(table, dtype, "", consts)
        body += loads("") + decl + lines
        for o, expr in exprs.items():
            body.append(f"out[eu, {index(table.out_off[o], table.out_cs[o])}] = {expr}")
    # the per-thread channel offsets, once the strides the loads and stores use are known
    chan = index.channel_lines() + index.view_lines()
    if "@CHANNELS@" in body:
        k = body.index("@CHANNELS@")
        body[k : k + 1] = [f"{i2}{line}" for line in chan]
    else:
        body[0:0] = chan
    kernel = "\n".join([head[0]] + [ind + line for line in head[1:] + body]) + "\n"
    return "\n".join(consts.lines() + index.globals()) + "\n\n\n" + kernel


def _dtype_name(dtype: str) -> str:
    return "numba.float64" if dtype == "float64" else "f32"


_HEADER = """# generated by workbench.kernels.unrolled from a term table; safe to delete
import numba
import numpy as np
from numba import cuda

from workbench.kernels.backends.poly_ir import polynomial

f32 = numba.float32
u64 = numba.uint64


"""


#: module name prefix of the generated kernels (precompile recognises them by it)
GENERATED_PREFIX = "workbench_unrolled"


@cache
def _compile(source: str) -> Any:
    """The kernel of ``source``, written once to a module file so that numba can cache its
    machine code on disk (``cache=True``): a configuration compiles once per machine, not once
    per process. Under the simulator (or ``WORKBENCH_CACHE=0``) it is built in memory."""
    global cuda  # a module global: the simulator swaps the kernel's global ``cuda`` for its fake
    from numba import cuda

    digest = hashlib.sha1(source.encode()).hexdigest()[:20]
    name = f"{GENERATED_PREFIX}_{digest}"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or cudasim_enabled() or os.environ.get("WORKBENCH_CACHE") == "0":
        namespace: dict = {}
        exec(compile(_HEADER + source, f"<{name}>", "exec"), namespace)
        return cuda.jit(namespace["kernel"])
    text = _HEADER + source.replace("\ndef kernel(", "\n@cuda.jit(cache=True)\ndef kernel(", 1)
    return load_module(text, GENERATED_PREFIX).kernel


@cache
def get_unrolled_kernel(
    table: TermTable,
    shape: str,
    dtype: str,
    *,
    reduce_channels: bool = False,
    tpb: int = THREADS_PER_BLOCK,
    group: int = 0,
) -> Any:
    """The compiled unrolled kernel for ``table``: cached per table object, so a launch does not
    regenerate the source (tables from another process, e.g. unpickled, share the compiled
    kernel through the per-source cache)."""
    return _compile(kernel_source(table, shape, dtype, reduce_channels=reduce_channels, tpb=tpb, group=group))
