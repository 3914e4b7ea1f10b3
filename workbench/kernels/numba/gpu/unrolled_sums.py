r"""The sums of a term table as generated code, for the unrolled kernels of
:mod:`~workbench.kernels.numba.gpu.unrolled`.

Both forms group the terms the same way (:class:`Grouped`: a multivariate Horner form with
common factors taken out) and differ in what they emit:

* :func:`sums`: one call of a generated polynomial intrinsic
  (:func:`~workbench.kernels.numba.gpu.poly_ir.polynomial`, the program built by :func:`program`),
  which numba types once however many terms it holds: the atom kernels;
* ``sums(..., source=True)`` (:func:`_source_sums`): the terms written out as nested
  ``cuda.fma`` calls in ``if go:`` blocks, which keep NVVM from sharing products across blocks
  and so keep registers lower: the message kernels (node, edge and the fused passes of
  :mod:`~workbench.kernels.numba.gpu.edge_pass`).

Coefficients and polynomials become module-level definitions of the generated module
(:class:`Definitions`), typed globals that numba freezes as constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.kernels.descriptor.tables import TermTable
from workbench.kernels.numba.gpu.poly_ir import Program, call_source

__all__ = ["CHUNK", "LINES_PER_BLOCK", "TERMS_PER_BLOCK", "Definitions", "Grouped", "dtype_name", "program", "sums"]

CHUNK = 16  # terms per fused multiply-add chain
LINES_PER_BLOCK = 8  # prefix products per ``if go:`` block (:func:`_source_sums`)
TERMS_PER_BLOCK = 64  # terms per ``if go:`` block


def _const(value: float, dtype: str) -> str:
    return repr(float(value)) if dtype == "float64" else f"f32({float(value)!r})"


def _scalar(dtype: str) -> str:
    """The numpy scalar type of ``dtype`` in a generated module (a typed global)."""
    return "np.float64" if dtype == "float64" else "np.float32"


def dtype_name(dtype: str) -> str:
    """The numba type of ``dtype`` in a generated module (``f32`` is defined by its header)."""
    return "numba.float64" if dtype == "float64" else "f32"


class Definitions:
    """The module-level definitions of one generated kernel: each table's polynomial
    (``P = polynomial(...)``, :mod:`~workbench.kernels.numba.gpu.poly_ir`) and its zeroed
    accumulators, or the coefficients ``K0, K1, ...`` of source sums (:func:`_source_sums`):
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
        """The global ``K<n>`` holding the coefficient ``value`` (:func:`_source_sums`): numba
        freezes it as a typed constant, which types faster than a ``f32(...)`` call per term."""
        value = float(value)
        if value not in self.names:
            self.names[value] = self.define(f"K{len(self.names)}", _const(value, self.dtype))
        return self.names[value]

    def lines(self) -> list[str]:
        return list(self.defs)


class Grouped:
    """The terms of a table grouped for a multivariate Horner form (:func:`program`,
    :func:`_source_sums`): operands ranked by how often their components occur as factors,
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
    """:meth:`Grouped.chain` as numba source text."""

    def __init__(self, v: Sequence[str], consts: Definitions):
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
    """:meth:`Grouped.chain` as :class:`~workbench.kernels.numba.gpu.poly_ir.Program` operations."""

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


def program(table: TermTable) -> tuple[Program, list[int]]:
    r"""The sums of ``table`` as a :class:`~workbench.kernels.numba.gpu.poly_ir.Program` (inputs:
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
    g = Grouped(table)
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


def sums(
    table: TermTable,
    dtype: str,
    ind: str,
    consts: Definitions,
    decl_ind: str | None = None,
    names: Sequence[str] | None = None,
    tag: str = "",
    source: bool = False,
) -> tuple[list[str], list[str], dict[int, str]]:
    """``(declarations, lines, exprs)``: the accumulators' declarations (zeroed; at ``decl_ind``,
    default ``ind``, so that a loop can carry them), the lines adding every term to them, and per
    output component the expression holding it. ``names``: the variable holding each slot
    (default ``v{q}``); ``tag`` prefixes the local names, so that several tables can share one
    kernel body.

    The sums (:func:`program`) are one call of a generated intrinsic
    (:func:`~workbench.kernels.numba.gpu.poly_ir.polynomial`) on tuples of the accumulators and
    the operand components, so numba types one call instead of every term; with ``source``,
    the terms written out as numba source instead (:func:`_source_sums`: the message kernels)."""
    v = list(names) if names is not None else [f"v{q}" for q in range(table.num_slots)]
    di = ind if decl_ind is None else decl_ind
    return (_source_sums if source else _intrinsic_sums)(table, dtype, ind, di, consts, v, tag)


def _intrinsic_sums(
    table: TermTable, dtype: str, ind: str, di: str, consts: Definitions, v: list[str], tag: str
) -> tuple[list[str], list[str], dict[int, str]]:
    """:func:`sums` as one call of a generated intrinsic."""
    prog, outs = program(table)
    fn = consts.define(f"{tag}P", f'polynomial("{prog.encode()}", "{dtype}")')
    zeros = consts.define(f"{tag}Z", f"({_scalar(dtype)}(0.0),) * {len(outs)}")  # a global: numba freezes it
    decl = [f"{di}{tag}acc = {zeros}"]
    lines = [f"{ind}{tag}acc = {call_source(fn, f'{tag}acc', v)}"]
    return decl, lines, {o: f"{tag}acc[{k}]" for k, o in enumerate(outs)}


class _Blocks:
    """The ``if go:`` blocks of :func:`_source_sums`, filled line by line: a block closes after
    :data:`TERMS_PER_BLOCK` terms, and the monomials it built (``m0, m1, ...``, each defined once)
    are rebuilt in the next one, so that no product stays live across blocks."""

    def __init__(self, ind: str, tag: str, v: Sequence[str], pre: dict[tuple[int, ...], int]):
        self.ind, self.tag, self.v, self.pre = ind, tag, v, pre
        self.lines: list[str] = []
        self.block: list[str] = []
        self.weight = 0
        self.local: dict[tuple[int, ...], str] = {}
        self.made = 0

    def open(self) -> None:
        """Close the current block if it holds enough terms."""
        if self.weight >= TERMS_PER_BLOCK:
            self.close()
            self.block, self.weight, self.local = [], 0, {}

    def close(self) -> None:
        self.lines += [f"{self.ind}if go:"] + [f"{self.ind}    {line}" for line in self.block]

    def monomial(self, mono_: tuple[int, ...]) -> str | None:
        """The variable holding the monomial ``mono_`` in this block (built from its two-factor
        prefix on first use), the operand itself for one factor, None for none."""
        if len(mono_) >= 2 and mono_ not in self.local:
            self.local[mono_] = f"{self.tag}m{self.made}"  # defined once, used in this block only
            self.made += 1
            rest = "".join(f" * {self.v[q]}" for q in mono_[2:])
            self.block.append(f"{self.local[mono_]} = {self.tag}pre[{self.pre[mono_[:2]]}]{rest}")
        return self.local[mono_] if len(mono_) >= 2 else (self.v[mono_[0]] if mono_ else None)

    def add(self, line: str, terms: int) -> None:
        self.block.append(line)
        self.weight += terms


def _term_blocks(g: Grouped, emit: _SourceEmit, consts: Definitions, blocks: _Blocks) -> None:
    """Add every term of ``g`` to its accumulator: per monomial and output, chunks of
    :data:`CHUNK` terms, each one nested chain (:meth:`Grouped.chain`)."""
    for mono_ in sorted(g.top):
        for o, terms in sorted(g.top[mono_].items()):
            a = f"{blocks.tag}acc[{g.slot[o]}]"
            for i in range(0, len(terms), CHUNK):
                blocks.open()
                m = blocks.monomial(mono_)
                if mono_ and len(g.rank) == 1:  # the monomial is the whole term
                    blocks.add(f"{a} = cuda.fma({m}, {consts(sum(c for c, _ in terms))}, {a})", 1)
                    break
                chunk = terms[i : i + CHUNK]
                chain = g.chain(chunk, 1, None if m else a, emit)
                blocks.add(f"{a} = cuda.fma({m}, {chain}, {a})" if m else f"{a} = {chain}", len(chunk))
    if blocks.block:
        blocks.close()


def _source_sums(
    table: TermTable, dtype: str, ind: str, di: str, consts: Definitions, v: list[str], tag: str
) -> tuple[list[str], list[str], dict[int, str]]:
    r""":func:`sums` written out as numba source, for the message kernels (node, edge,
    :mod:`~workbench.kernels.numba.gpu.edge_pass`).

    The terms are grouped as in :func:`program` (a multivariate Horner form: a term costs about
    one fused multiply-add), each monomial of the first operand built from its two-factor prefix
    (one multiplication). Written as nested ``cuda.fma`` calls (one typed call per term, where
    ``a * b + c`` is two binary operations for numba to type) with the coefficients as globals
    (:class:`Definitions`), which halves compile time.

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
    g = Grouped(table)
    prefixes = sorted({mono_[:2] for mono_ in g.top if len(mono_) >= 2})
    pre = {t: k for k, t in enumerate(prefixes)}
    decl = [f"{di}{tag}acc = cuda.local.array({len(g.outs)}, {dtype_name(dtype)})"]
    decl += [f"{di}{tag}acc[{k}] = {_const(0.0, dtype)}" for k in range(len(g.outs))]
    blocks = _Blocks(ind, tag, v, pre)
    if prefixes:
        decl.append(f"{di}{tag}pre = cuda.local.array({len(prefixes)}, {dtype_name(dtype)})")
        for i in range(0, len(prefixes), LINES_PER_BLOCK):
            blocks.lines.append(f"{ind}if go:")
            blocks.lines += [
                f"{ind}    {tag}pre[{pre[t]}] = {v[t[0]]} * {v[t[1]]}" for t in prefixes[i : i + LINES_PER_BLOCK]
            ]
    _term_blocks(g, _SourceEmit(v, consts), consts, blocks)
    return decl, blocks.lines, {o: f"{tag}acc[{g.slot[o]}]" for o in g.outs}
