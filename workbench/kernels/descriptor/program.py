r"""Vector programs: sparse polynomials factored into straight-line code over channel vectors.

A :class:`~workbench.kernels.descriptor.SparsePolynomial` is the same polynomial in every
channel. Evaluated per row (an atom, an edge) with all :math:`C` channels at once, each operand
component becomes a vector of length :math:`C` (a *register*), and the polynomial a short
program of vector instructions whose inner loop runs over contiguous channels, which a compiler
turns into SIMD:

.. code-block:: text

    r104 = x3 * x7                   # shared prefix x_3 x_7 of several x monomials
    r105 = r104 * x9                 # monomial x_3 x_7 x_9, built once for every output
    r106 = K12 * W40                 # Horner: the sum over the weights that multiply it ...
    r106 += K13 * W41
    acc0 += r105 * r106              # ... times the monomial, into output component 0

The factoring is a multivariate Horner form (as in :mod:`workbench.kernels.numba.gpu.unrolled`
on the GPU): operands are ranked by how often their components occur as factors, terms are
grouped by their monomial in the first operand (built once from a shared two-factor prefix and
reused by every output), and inside a group by the next operand, and so on.

Operands broadcast over channels (zero channel stride: e.g. an edge's spherical harmonics ``Y``) are
*scalars* per row: their factors move into the instruction's coefficient, a small scalar
program evaluated once per row (:attr:`VectorProgram.k_terms`), so ``Σ_j C_ij Y_j h_i R_k``
costs one vector instruction per ``(i, k)`` and not one per ``(i, j, k)``.

Several polynomials over the same operands (the outputs of one derivative pass) share one
program: their common monomials are built once. Instructions, with ``k`` a coefficient
register and vectors indexed by channel:

==========  =======================
``SET_MUL``  ``r[d] = k * r[a] * r[b]``
``ADD_MUL``  ``r[d] += k * r[a] * r[b]``
``SET_AXPY`` ``r[d] = k * r[a]``
``ADD_AXPY`` ``r[d] += k * r[a]``
``SET_K``    ``r[d] = k``
``ADD_K``    ``r[d] += k``
==========  =======================

Registers ``0 .. V-1`` hold the vector operand components (loaded per row), then one
accumulator per output component (zeroed by the kernel, only ever added to, so a kernel may
sum a program over several rows, e.g. all edges of a receiver), then temporaries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from workbench.kernels.descriptor.polynomial import Operand, SparsePolynomial
from workbench.kernels.descriptor.tables import rows_property

__all__ = ["INSTRUCTIONS", "VectorProgram", "vector_program"]

SET_MUL, ADD_MUL, SET_AXPY, ADD_AXPY, SET_K, ADD_K = range(6)
#: instruction names by opcode
INSTRUCTIONS: tuple[str, ...] = ("SET_MUL", "ADD_MUL", "SET_AXPY", "ADD_AXPY", "SET_K", "ADD_K")
#: floating-point operations per channel of each opcode (a fused multiply-add counts 2)
_FLOPS = (2, 3, 1, 2, 0, 1)
#: scalar factors a coefficient term may carry (the contraction and the tensor product have at most 2)
MAX_SCALAR_FACTORS = 3


@dataclass(frozen=True, eq=False)
class VectorProgram:
    """Straight-line vector code of one or more sparse polynomials (see the module docstring).

    Attributes
    ----------
    operands : the polynomials' common operand list
    outputs : the output operand of each polynomial
    vec_operand, vec_comp : ``[V]`` operand and component held by vector register ``j``
    sca_operand, sca_comp : ``[S]`` operand and component of scalar ``s``; scalar ``S`` is 1
    num_registers : vector registers a row needs (operands, accumulators, temporaries)
    k_terms : ``[T, 5]`` float64 rows ``(register, coefficient, s1, s2, s3)``:
        ``k[register] += coefficient * s[s1] * s[s2] * s[s3]``, evaluated per row
    num_k : coefficient registers
    ins : ``[N, 5]`` int64 rows ``(opcode, d, a, b, k)``
    acc_output, acc_comp : ``[A]`` output polynomial and component of accumulator ``j``
        (register ``V + j``)
    """

    operands: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    vec_operand: np.ndarray
    vec_comp: np.ndarray
    sca_operand: np.ndarray
    sca_comp: np.ndarray
    num_registers: int
    k_terms: np.ndarray = field(repr=False)
    num_k: int
    ins: np.ndarray = field(repr=False)
    acc_output: np.ndarray
    acc_comp: np.ndarray
    num_terms: int = 0

    num_vectors = rows_property("vec_operand")
    num_scalars = rows_property("sca_operand")
    num_accumulators = rows_property("acc_output")
    num_instructions = rows_property("ins")

    def flops_per_channel(self) -> int:
        """Floating-point operations the vector instructions execute per (row, channel)."""
        return int(sum(_FLOPS[int(op)] for op in self.ins[:, 0])) if self.num_instructions else 0

    def counts(self) -> dict[str, int]:
        """Instructions per opcode name."""
        ops = self.ins[:, 0].tolist() if self.num_instructions else []
        return {name: ops.count(code) for code, name in enumerate(INSTRUCTIONS) if code in ops}

    def evaluate_numpy(self, values: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Reference interpreter for tests: ``values[a]`` is operand ``a`` as ``[size, C]``
        (broadcast operands ``[size]``); returns each output as ``[size, C]``."""
        C = next((v.shape[1] for v in values if v is not None and v.ndim == 2), 1)
        R = np.zeros((self.num_registers, C))
        for j, (a, i) in enumerate(zip(self.vec_operand, self.vec_comp)):
            R[j] = values[a][i]
        s = np.array([values[a][i] for a, i in zip(self.sca_operand, self.sca_comp)] + [1.0])
        K = np.zeros(self.num_k)
        for r, c, s1, s2, s3 in self.k_terms:
            K[int(r)] += c * s[int(s1)] * s[int(s2)] * s[int(s3)]
        for op, d, a, b, k in self.ins:
            val = {
                SET_MUL: K[k] * R[a] * R[b],
                ADD_MUL: R[d] + K[k] * R[a] * R[b],
                SET_AXPY: K[k] * R[a],
                ADD_AXPY: R[d] + K[k] * R[a],
                SET_K: np.full(C, K[k]),
                ADD_K: R[d] + K[k],
            }[int(op)]
            R[d] = val
        outs = [np.zeros((o.size, C)) for o in self.outputs]
        V = self.num_vectors
        for j, (p, o) in enumerate(zip(self.acc_output, self.acc_comp)):
            outs[p][o] = R[V + j]
        return outs


class _Builder:
    """Emits the instructions of :func:`vector_program` (register allocation, coefficients)."""

    def __init__(self, num_vectors: int, num_accumulators: int, num_scalars: int):
        self.ins: list[tuple[int, int, int, int, int]] = []
        self.top = num_vectors + num_accumulators
        self.free: list[int] = []
        self.written: set[int] = set(range(num_vectors, num_vectors + num_accumulators))
        self.one = num_scalars  # the scalar slot that holds 1
        self.k_rows: list[tuple[int, float, int, int, int]] = []
        self.k_of: dict[tuple, int] = {}

    def temp(self) -> int:
        r = self.free.pop() if self.free else self._grow()
        self.written.discard(r)
        return r

    def _grow(self) -> int:
        self.top += 1
        return self.top - 1

    def release(self, r: int | None) -> None:
        if r is not None:
            self.free.append(r)

    def coef(self, terms: Sequence[tuple[float, tuple[int, ...]]]) -> int:
        """Coefficient register holding ``Σ c * Π scalars`` (equal sums share a register)."""
        merged: dict[tuple[int, ...], float] = defaultdict(float)
        for c, sc in terms:
            merged[tuple(sorted(sc))] += c
        key = tuple(sorted(merged.items()))
        if key not in self.k_of:
            r = len(self.k_of)
            for sc, c in key:
                if len(sc) > MAX_SCALAR_FACTORS:
                    raise ValueError(
                        f"a term has {len(sc)} broadcast factors; the vector program takes at most {MAX_SCALAR_FACTORS}"
                    )
                pad = list(sc) + [self.one] * (MAX_SCALAR_FACTORS - len(sc))
                self.k_rows.append((r, c, *pad))
            self.k_of[key] = r
        return self.k_of[key]

    def _emit(self, set_op: int, d: int, a: int, b: int, k: int) -> None:
        op = set_op + 1 if d in self.written else set_op
        self.written.add(d)
        self.ins.append((op, d, a, b, k))

    def mul(self, d: int, a: int, b: int, k: int) -> None:
        self._emit(SET_MUL, d, a, b, k)

    def axpy(self, d: int, a: int, k: int) -> None:
        self._emit(SET_AXPY, d, a, 0, k)

    def const(self, d: int, k: int) -> None:
        self._emit(SET_K, d, 0, 0, k)

    def product(self, regs: Sequence[int], prefix: dict | None = None) -> tuple[int, int | None]:
        """A register holding the product of ``regs`` (``len >= 1``) and the temporary to release
        afterwards (None when it is an operand register or the cached prefix). ``prefix`` caches
        the two-factor prefix across consecutive calls."""
        if len(regs) == 1:
            return regs[0], None
        one = self.coef([(1.0, ())])
        head = tuple(regs[:2])
        if prefix is not None and prefix.get("key") == head:
            pre = prefix["reg"]
        else:
            if prefix is not None and "reg" in prefix:
                self.release(prefix.pop("reg"))
            pre = self.temp()
            self.mul(pre, head[0], head[1], one)
            if prefix is not None:
                prefix.update(key=head, reg=pre)
        if len(regs) == 2:
            return pre, (None if prefix is not None else pre)
        r = self.temp()
        self.mul(r, pre, regs[2], one)
        for q in regs[3:]:
            self.written.discard(r)  # r = r * q replaces r: a SET, where _emit would add to it
            self.mul(r, r, q, one)
        if prefix is None:
            self.release(pre)
        return r, r


def _broadcast(operands: Sequence[Operand]) -> list[bool]:
    """Per operand, whether it is broadcast over channels (zero channel stride: a scalar per
    component) rather than channelwise (a vector per component); one of the two in every component."""
    broadcast = []
    for op in operands:
        zero = [cs == 0 for cs in op.cstrides]
        if any(zero) and not all(zero):
            raise ValueError(f"operand {op.name}: channelwise in some components and broadcast in others")
        broadcast.append(bool(zero) and all(zero))
    return broadcast


class _Horner:
    """The factoring of :func:`vector_program`: registers of the used factors (vector operand
    components, scalars, accumulators), the vector operands ranked by how often they occur as
    factors, and the multivariate Horner form emitted through a :class:`_Builder`."""

    def __init__(self, polys: Sequence[SparsePolynomial], broadcast: list[bool]):
        self.broadcast = broadcast
        used = sorted({f for p in polys for _, fs in p.terms for f in fs})
        self.vec = [f for f in used if not broadcast[f[0]]]
        self.sca = [f for f in used if broadcast[f[0]]]
        self.vreg = {f: j for j, f in enumerate(self.vec)}
        self.sreg = {f: j for j, f in enumerate(self.sca)}
        self.accs = sorted({(p_i, o) for p_i, p in enumerate(polys) for o, _ in p.terms})
        V = len(self.vec)
        self.acc_reg = {key: V + j for j, key in enumerate(self.accs)}
        count: dict[int, int] = defaultdict(int)
        for p in polys:
            for _, fs in p.terms:
                for a, _ in fs:
                    if not broadcast[a]:
                        count[a] += 1
        self.rank = sorted(count, key=lambda a: (-count[a], a))
        self.b = _Builder(V, len(self.accs), len(self.sca))

    def split(self, fs) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """A term's factors as ``(vector registers per ranked operand, scalar registers)``."""
        key = tuple(tuple(self.vreg[f] for f in fs if f[0] == a) for a in self.rank)
        return key, tuple(self.sreg[f] for f in fs if self.broadcast[f[0]])

    def rest_is_empty(self, group, level: int) -> bool:
        return all(not any(key[lv] for lv in range(level, len(self.rank))) for _, key, _ in group)

    def add_group(self, target: int, mono: tuple[int, ...], group: list, level: int, prefix: dict | None) -> None:
        """``target += Π mono * (Σ over group of the factors from rank[level:])``."""
        b = self.b
        if not mono:
            if self.rest_is_empty(group, level):
                b._emit(SET_K, target, 0, 0, b.coef([(c, sc) for c, _, sc in group]))
            else:
                self.emit(target, group, level)
            return
        if self.rest_is_empty(group, level):
            k = b.coef([(c, sc) for c, _, sc in group])
            if len(mono) == 2 and prefix is None:
                b.mul(target, mono[0], mono[1], k)
                return
            m, tmp = b.product(mono, prefix)
            b.axpy(target, m, k)
            b.release(tmp)
            return
        m, tmp = b.product(mono, prefix)
        deeper = {tuple(f for lv in range(level, len(self.rank)) for f in key[lv]) for _, key, _ in group}
        if len(deeper) == 1 and len(next(iter(deeper))) == 1:  # one more factor, the same in every term
            b.mul(target, m, next(iter(deeper))[0], b.coef([(c, sc) for c, _, sc in group]))
        else:
            t = b.temp()
            self.emit(t, group, level)
            b.mul(target, m, t, b.coef([(1.0, ())]))
            b.release(t)
        b.release(tmp)

    def emit(self, target: int, group: list, level: int) -> None:
        """``target (+)= Σ over group`` of the factors from rank[level:] (Horner, recursively)."""
        groups: dict[tuple[int, ...], list] = defaultdict(list)
        for item in group:
            groups[item[1][level]].append(item)
        for mono in sorted(groups):
            self.add_group(target, mono, groups[mono], level + 1, None)

    def run(self, polys: Sequence[SparsePolynomial]) -> None:
        """Emit every term of ``polys``, grouped by its monomial in the first ranked operand."""
        top: dict[tuple[int, ...], dict[tuple[int, int], list]] = defaultdict(lambda: defaultdict(list))
        for p_i, p in enumerate(polys):
            for (o, fs), c in p.terms.items():
                key, sc = self.split(fs)
                top[key[0] if key else ()][(p_i, o)].append((c, key, sc))
        prefix: dict = {}
        for mono in sorted(top):  # sorted: monomials with a common prefix are consecutive
            # a monomial of the first operand is built once and serves every output
            m, tmp = self.b.product(mono, prefix) if len(mono) >= 2 else (None, None)
            for acc_key, group in sorted(top[mono].items()):
                self.add_group(self.acc_reg[acc_key], mono if m is None else (m,), group, 1, None)
            self.b.release(tmp)


def vector_program(polys: Sequence[SparsePolynomial]) -> VectorProgram:
    """The :class:`VectorProgram` evaluating every polynomial of ``polys`` (one operand list).

    Each operand must be channelwise in every component (a vector per component) or broadcast
    in every component (a scalar per component)."""
    if not polys:
        raise ValueError("no polynomials")
    operands = polys[0].operands
    if any(p.operands != operands for p in polys):
        raise ValueError("the polynomials of one program must share their operand list")
    h = _Horner(polys, _broadcast(operands))
    h.run(polys)
    b = h.b
    k = np.array(b.k_rows, dtype=np.float64).reshape(-1, 2 + MAX_SCALAR_FACTORS)
    ins = np.array(b.ins, dtype=np.int64).reshape(-1, 5)
    return VectorProgram(
        operands=tuple(operands),
        outputs=tuple(p.output for p in polys),
        vec_operand=np.array([a for a, _ in h.vec], dtype=np.int64),
        vec_comp=np.array([i for _, i in h.vec], dtype=np.int64),
        sca_operand=np.array([a for a, _ in h.sca], dtype=np.int64),
        sca_comp=np.array([i for _, i in h.sca], dtype=np.int64),
        num_registers=b.top,
        k_terms=k,
        num_k=len(b.k_of),
        ins=ins,
        acc_output=np.array([p for p, _ in h.accs], dtype=np.int64),
        acc_comp=np.array([o for _, o in h.accs], dtype=np.int64),
        num_terms=sum(p.num_terms for p in polys),
    )
