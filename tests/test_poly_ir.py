"""The polynomial program of the generated kernels: its encoding, its Python evaluation, and
its LLVM lowering (the same codegen the CUDA intrinsic runs, here for the CPU target)."""

import numpy as np
import pytest

from workbench.kernels.numba.gpu.poly_ir import CHUNK, Program, _intrinsic, call_source


def _random_program(rng, inputs: int, acc: int, ops: int) -> Program:
    p = Program(inputs, acc)
    vals = list(range(inputs)) + [p.acc(k) for k in range(acc)]
    for _ in range(ops):
        kind = rng.integers(4)
        a, b, c = (vals[int(i)] for i in rng.integers(len(vals), size=3))
        v = (
            p.const(rng.choice([0.5, -1.25, 0.2041241452, 3.0]))
            if kind == 0
            else p.mul(a, b)
            if kind == 1
            else p.add(a, b)
            if kind == 2
            else p.fma(a, b, c)
        )
        vals.append(v)
    p.outputs = [vals[-1 - k] for k in range(acc)]
    return p


def test_encode_decode_round_trip():
    rng = np.random.default_rng(0)
    p = _random_program(rng, 40, 5, 300)
    q = Program.decode(p.encode())
    assert (q.num_inputs, q.num_acc, q.ops, q.coefs, q.outputs) == (p.num_inputs, p.num_acc, p.ops, p.coefs, p.outputs)
    assert p.encode().isascii()


def test_evaluate_follows_the_program():
    p = Program(3, 2)
    x = p.mul(p.v(0), p.v(1))  # v0 v1
    y = p.fma(x, p.const(2.0), p.acc(0))  # acc0 + 2 v0 v1
    z = p.add(p.mul(p.v(2), p.const(-0.5)), p.acc(1))
    p.outputs = [y, z]
    assert p.evaluate([1.0, 10.0], [3.0, 4.0, 8.0]) == (1.0 + 24.0, 10.0 - 4.0)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_llvm_lowering_matches_python(dtype):
    """Operands past one chunk, constants rounded to the dtype, the accumulators carried in."""
    import numba
    from numba.core.extending import intrinsic

    rng = np.random.default_rng(1)
    p = _random_program(rng, CHUNK + 7, 3, 400)
    scalar = np.dtype(dtype).type
    poly = _intrinsic(p, scalar, intrinsic)
    names = [f"v[{i}]" for i in range(p.num_inputs)]
    src = f"def run(acc, v):\n    return {call_source('poly', 'acc', names)}\n"
    ns = {"poly": poly}
    exec(compile(src, "<test>", "exec"), ns)
    run = numba.njit(ns["run"])
    v = rng.uniform(0.5, 1.5, p.num_inputs).astype(dtype)
    acc = rng.standard_normal(3).astype(dtype)
    got = np.array(run(tuple(acc), v), dtype=np.float64)
    want = np.array(p.evaluate(acc, v, dtype), dtype=np.float64)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_intrinsic_rejects_wrong_shapes():
    import numba
    from numba.core.extending import intrinsic

    p = Program(2, 1)
    p.outputs = [p.fma(p.v(0), p.v(1), p.acc(0))]
    poly = _intrinsic(p, np.float64, intrinsic)

    @numba.njit
    def three(a, b, c):
        return poly((a,), ((a, b, c),))

    with pytest.raises(Exception, match="tuples of 2 float64"):
        three(1.0, 2.0, 3.0)
