r"""A polynomial's arithmetic as one numba intrinsic: LLVM IR built directly, not typed term by term.

A generated kernel (:mod:`~workbench.kernels.numba.gpu.unrolled`) loads its operand components
into registers, evaluates the sums of its term table, and stores them. Written as Python source,
every term is a handful of numba IR instructions that numba types, analyses and lowers one by
one: ~95% of the compile time (4 ms per term on one core, against ~0.5 ms in NVVM). Here the
sums are a :class:`Program`, a straight-line list of multiplies, adds and fused multiply-adds
over value ids, and the kernel source calls it as one function:

.. code-block:: python

    P0 = polynomial("eJzt...", "float32")    # the program, encoded in the generated module
    ...
    acc = P0(acc, ((v0, ..., v15), ..., (v96,)))  # returns the new accumulators

The intrinsic's lowering emits the program as ``fmul``/``fadd``/``llvm.fma`` on the tuple's
elements, so numba sees one call, and NVVM gets the same instructions the Python source gave
it. The operands come in tuples of at most :data:`CHUNK` (CPython builds a longer tuple
display through a list, which numba's bytecode pass mishandles when a function has several).
Under the CUDA simulator the program runs as generated Python instead (same order of
operations, in the operands' precision).

Values are numbered: ``[0, S)`` the operand components ``v``, ``[S, S + A)`` the accumulators
on entry, then one per constant and per operation, in order.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

__all__ = ["CHUNK", "Program", "call_source", "polynomial"]

MUL, ADD, FMA, CONST = 0, 1, 2, 3
#: operand components per tuple of a call's source (CPython builds a tuple display of over 30 through a list)
CHUNK = 16


class Program:
    """A straight-line program over ``num_inputs`` operand components and ``num_acc``
    accumulators; ``outputs`` are the value ids of the accumulators on exit."""

    def __init__(self, num_inputs: int, num_acc: int):
        self.num_inputs = num_inputs
        self.num_acc = num_acc
        self.ops: list[tuple[int, int, int, int]] = []
        self.coefs: list[float] = []
        self._consts: dict[float, int] = {}
        self.outputs = [num_inputs + k for k in range(num_acc)]

    def _new(self, op: tuple[int, int, int, int]) -> int:
        self.ops.append(op)
        return self.num_inputs + self.num_acc + len(self.ops) - 1

    def v(self, q: int) -> int:
        return q

    def acc(self, k: int) -> int:
        return self.num_inputs + k

    def const(self, value: float) -> int:
        value = float(value)
        if value not in self._consts:
            self.coefs.append(value)
            self._consts[value] = self._new((CONST, len(self.coefs) - 1, 0, 0))
        return self._consts[value]

    def mul(self, a: int, b: int) -> int:
        return self._new((MUL, a, b, 0))

    def add(self, a: int, b: int) -> int:
        return self._new((ADD, a, b, 0))

    def fma(self, a: int, b: int, c: int) -> int:
        """``a * b + c``, rounded once."""
        return self._new((FMA, a, b, c))

    @property
    def num_values(self) -> int:
        return self.num_inputs + self.num_acc + len(self.ops)

    def encode(self) -> str:
        """The program as one ASCII string (zlib + base64) for a generated module's source."""
        head = np.array([self.num_inputs, self.num_acc, len(self.ops), len(self.coefs)], dtype=np.int64)
        ops = np.asarray(self.ops, dtype=np.int32).reshape(-1, 4)
        raw = (
            head.tobytes()
            + ops.tobytes()
            + np.asarray(self.coefs, dtype=np.float64).tobytes()
            + np.asarray(self.outputs, dtype=np.int32).tobytes()
        )
        return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")

    @classmethod
    def decode(cls, code: str) -> Program:
        raw = zlib.decompress(base64.b64decode(code))
        s, a, n, k = (int(x) for x in np.frombuffer(raw[:32], dtype=np.int64))
        p = cls(s, a)
        at = 32
        p.ops = [
            tuple(int(x) for x in row) for row in np.frombuffer(raw[at : at + 16 * n], dtype=np.int32).reshape(n, 4)
        ]
        at += 16 * n
        p.coefs = [float(x) for x in np.frombuffer(raw[at : at + 8 * k], dtype=np.float64)]
        at += 8 * k
        p.outputs = [int(x) for x in np.frombuffer(raw[at:], dtype=np.int32)]
        return p

    def python_source(self, name: str = "poly") -> str:
        """The program as a Python function ``name(acc, chunks)`` (for the simulator and tests):
        ``chunks`` a tuple of tuples holding the operand components in order."""
        s, a = self.num_inputs, self.num_acc

        def ref(i: int) -> str:
            return f"v[{i}]" if i < s else (f"acc[{i - s}]" if i < s + a else f"t{i}")

        lines = [f"def {name}(acc, chunks):", "    v = sum(chunks, ())"]
        for j, (op, x, y, z) in enumerate(self.ops):
            t = f"t{s + a + j}"
            if op == CONST:
                lines.append(f"    {t} = K[{x}]")
            elif op == MUL:
                lines.append(f"    {t} = {ref(x)} * {ref(y)}")
            elif op == ADD:
                lines.append(f"    {t} = {ref(x)} + {ref(y)}")
            else:
                lines.append(f"    {t} = fma({ref(x)}, {ref(y)}, {ref(z)})")
        lines.append("    return (" + "".join(f"{ref(o)}, " for o in self.outputs) + ")")
        return "\n".join(lines) + "\n"

    def evaluate(self, acc: Any, v: Any, dtype: str = "float64") -> tuple:
        """Run the program in Python, in ``dtype`` (the reference for tests)."""
        fn = _python_function(self, np.dtype(dtype).type)
        return fn(tuple(acc), (tuple(v),))


def call_source(fn: str, acc: str, names: list[str]) -> str:
    """Source of the call ``fn(acc, ((v0, ...), ...))`` on the operand variables ``names``."""
    chunks = ["(" + "".join(f"{x}, " for x in names[i : i + CHUNK]) + ")" for i in range(0, len(names), CHUNK)]
    if len(chunks) > 30:
        raise ValueError(f"polynomial: {len(names)} operand components exceed {30 * CHUNK}")
    return f"{fn}({acc}, (" + "".join(f"{c}, " for c in chunks) + "))"


def _python_function(program: Program, scalar: type) -> Any:
    def fma(x, y, z):  # as the simulator's cuda.fma: a product and a sum in the operands' precision
        return x * y + z

    namespace = {"K": [scalar(c) for c in program.coefs], "fma": fma}
    exec(compile(program.python_source(), "<workbench polynomial>", "exec"), namespace)
    return namespace["poly"]


def polynomial(code: str, dtype: str) -> Any:
    """The callable ``P(acc, v) -> acc`` for an encoded :class:`Program`, in ``dtype``: a numba
    CUDA intrinsic, or a Python function under the simulator."""
    from workbench.kernels.numba.gpu.device import cudasim_enabled

    program = Program.decode(code)
    scalar = np.float64 if dtype == "float64" else np.float32
    if cudasim_enabled():
        return _python_function(program, scalar)
    return _intrinsic(program, scalar)


def _intrinsic(program: Program, scalar: type, intrinsic: Any = None) -> Any:
    """The intrinsic for ``program``; ``intrinsic``: the decorator (default numba-CUDA's; tests
    lower the same code for the CPU target with ``numba.core.extending.intrinsic``)."""
    from llvmlite import ir
    from numba import types

    if intrinsic is None:
        from numba.cuda.extending import intrinsic

    nb = types.float64 if scalar is np.float64 else types.float32
    lltype = ir.DoubleType() if scalar is np.float64 else ir.FloatType()
    s, a = program.num_inputs, program.num_acc
    coefs = [float(scalar(c)) for c in program.coefs]  # rounded to the kernel's precision once
    ops, outputs = program.ops, program.outputs

    @intrinsic
    def poly(typingctx, acc, v):
        if not (isinstance(acc, types.UniTuple) and acc.count == a and acc.dtype == nb):
            raise TypeError(f"polynomial: accumulators must be a tuple of {a} {nb}, got {acc}")
        chunks = [
            t.count if isinstance(t, types.UniTuple) and t.dtype == nb else -1
            for t in (v.types if isinstance(v, types.BaseTuple) else ())
        ]
        if min(chunks, default=-1) < 0 or sum(chunks) != s:
            raise TypeError(f"polynomial: operands must be a tuple of tuples of {s} {nb} in all, got {v}")

        def codegen(context, builder, sig, args):
            acc_v, v_v = args
            vals: list = [None] * program.num_values
            i = 0
            for j, n in enumerate(chunks):
                part = builder.extract_value(v_v, j)
                for q in range(n):
                    vals[i] = builder.extract_value(part, q)
                    i += 1
            for k in range(a):
                vals[s + k] = builder.extract_value(acc_v, k)
            base = s + a
            for j, (op, x, y, z) in enumerate(ops):
                if op == CONST:
                    r = ir.Constant(lltype, coefs[x])
                elif op == MUL:
                    r = builder.fmul(vals[x], vals[y])
                elif op == ADD:
                    r = builder.fadd(vals[x], vals[y])
                else:
                    r = builder.fma(vals[x], vals[y], vals[z])
                vals[base + j] = r
            return context.make_tuple(builder, sig.return_type, [vals[o] for o in outputs])

        return acc(acc, v), codegen

    return poly
