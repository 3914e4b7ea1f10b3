"""The vectorised CPU path: vector programs against their polynomials, the numba row passes
against a reference evaluation, determinism across runs and thread counts."""

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from kernel_fixtures import build_model

import workbench  # noqa: F401
from workbench.kernels import Operand, SparsePolynomial
from workbench.kernels.descriptor.program import INSTRUCTIONS, vector_program
from workbench.kernels.numba.cpu import passes as cpu
from workbench.kernels.numba.dispatch import cpu_plan
from workbench.kernels.ops import EdgeGraph, PolyOp


def _reference(poly: SparsePolynomial, values: list[np.ndarray]) -> np.ndarray:
    """``poly`` per channel: ``values[a]`` is ``[size, C]`` or ``[size]`` (broadcast)."""
    C = next(v.shape[1] for v in values if v.ndim == 2)
    return np.stack([poly.evaluate_numpy([v[:, c] if v.ndim == 2 else v for v in values]) for c in range(C)], axis=1)


def _mace_ops():
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, 2)
    from workbench.kernels import accelerate

    accelerate(model, backend="numba")
    sc = model.products[0].symmetric_contractions.op
    tp = model.interactions[1].conv_tp.channelwise_op()[0]
    out = {}
    for name, op in (("contraction", sc), ("channelwise_tp", tp)):
        n = len(op.operands)
        d1 = op.derivative((True,) * n)
        d2 = d1.derivative((True,) * n + (False,) * (len(d1.operands) - n), (True,) * len(d1.outputs))
        out[name] = (op, d1, d2)
    return out


MACE_OPS = None


def mace_ops():
    global MACE_OPS
    if MACE_OPS is None:
        MACE_OPS = _mace_ops()
    return MACE_OPS


@pytest.mark.parametrize("name", ["contraction", "channelwise_tp"])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_vector_program_equals_its_polynomials(name, order):
    """The factored program (shared prefixes, Horner groups, broadcast factors in the
    coefficients) computes exactly the polynomials of every pass, all outputs at once."""
    op = mace_ops()[name][order]
    prog = vector_program([c.poly for c in op.compiled])
    rng = np.random.default_rng(order)
    C = 3
    values = [
        rng.standard_normal(o.size) if all(cs == 0 for cs in o.cstrides) else rng.standard_normal((o.size, C))
        for o in op.operands
    ]
    got = prog.evaluate_numpy(values)
    for p, g in zip([c.poly for c in op.compiled], got):
        ref = _reference(p, values)
        np.testing.assert_allclose(g, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    assert set(prog.counts()) <= set(INSTRUCTIONS)
    # factoring pays: fewer multiplications than the term-by-term form
    assert prog.flops_per_channel() < sum(p.flops_per_channel() for p in [c.poly for c in op.compiled])


@pytest.mark.parametrize("degree", [4, 5])
def test_vector_program_builds_long_monomials(degree):
    """Monomials of more than three factors of one operand (MACE's contraction at correlation 4
    and 5): every factor after the third multiplies the running product in place, which must
    replace it (an ADD_MUL there added the shorter product back in)."""
    rng = np.random.default_rng(degree)
    x = Operand.channel_major("x", 5, 3)
    w = Operand.component_major("w", 2, 3, rows="species")
    y = Operand.channel_major("y", 2, 3)
    terms = [
        (int(rng.integers(2)), [(0, int(i)) for i in rng.integers(5, size=degree)] + [(1, int(rng.integers(2)))], 1.0)
        for _ in range(12)
    ]
    p = SparsePolynomial.from_terms((x, w), y, terms)
    assert p.max_degree == degree + 1
    values = [rng.standard_normal((5, 3)), rng.standard_normal((2, 3))]
    (got,) = vector_program([p]).evaluate_numpy(values)
    np.testing.assert_allclose(got, _reference(p, values), rtol=1e-13)


def test_broadcast_factors_move_into_coefficients():
    """``Σ_j C_ij Y_j h_i R_k``: one vector instruction per (i, k), Y summed in the coefficient."""
    h = Operand("h", 2, "sender", (0, 1), (2, 2), 8)
    Y = Operand("Y", 3, "edge", (0, 1, 2), (0, 0, 0), 3)
    R = Operand("R", 1, "edge", (0,), (1,), 4)
    out = Operand("out", 1, "receiver", (0,), (1,), 4)
    terms = [(0, [(0, i), (1, j), (2, 0)], 1.0 + i + 10 * j) for i in range(2) for j in range(3)]
    prog = vector_program([SparsePolynomial.from_terms((h, Y, R), out, terms)])
    assert prog.num_scalars == 3 and prog.num_vectors == 3
    assert prog.num_instructions == 2  # h_0 R (k = Σ_j ...) and h_1 R
    assert prog.num_k == 2


def _random_inputs(op, rows: dict, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows[o.rows], o.width, generator=g, dtype=dtype) for o in op.operands]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_atom_passes_match_reference(dtype, order):
    """Atom rows, species pieces (weight gradients summed over a species), several outputs in
    one pass; 40 atoms of 3 species (one with no atom), so pieces hold 1..16 atoms."""
    op = mace_ops()["contraction"][order]
    species = torch.tensor([0] * 17 + [2] * 23)[torch.randperm(40, generator=torch.Generator().manual_seed(1))]
    rows = {"atom": 40, "species": 3}
    ts = _random_inputs(op, rows, dtype, order)
    outs = op.evaluate(ts, species, 3)
    vals64 = [t.double().numpy() for t in ts]
    for comp, got in zip(op.compiled, outs):
        p = comp.poly
        ref = np.zeros((rows[p.output.rows], p.output.width))
        for b in range(40):
            z = int(species[b])
            vals = [v[b if o.rows == "atom" else z] for o, v in zip(op.operands, vals64)]
            C = p.output.width // p.output.size
            row = np.zeros(p.output.width)
            for c in range(C):
                y = p.evaluate_numpy(
                    [v[np.array(o.offsets) + c * np.array(o.cstrides)] for o, v in zip(op.operands, vals)]
                )
                row[np.array(p.output.offsets) + c * np.array(p.output.cstrides)] = y
            ref[b if p.output.rows == "atom" else z] += row
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        assert not torch.isnan(got).any()
        np.testing.assert_allclose(got.double().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("order", [0, 1, 2])
def test_edge_passes_match_scatter_reference(order):
    """Receiver and sender scatter-sums, edge outputs and the channel-summed gradient of Y, on
    a graph with an isolated node, self-loops and repeated edges."""
    op = mace_ops()["channelwise_tp"][order]
    rng = np.random.default_rng(order)
    N = 9
    ei = rng.integers(0, N - 1, size=(2, 70))  # node N-1 has no edge
    ei[:, :3] = [[0, 1, 1], [0, 1, 1]]
    graph = EdgeGraph(torch.tensor(ei), N)
    rows = {"edge": 70, "sender": N, "receiver": N}
    ts = _random_inputs(op, rows, torch.float64, order)
    outs = op.evaluate(ts, graph=graph)
    vals = [t.numpy() for t in ts]
    for comp, got in zip(op.compiled, outs):
        p = comp.poly
        ref = np.zeros((rows[p.output.rows], p.output.width))
        for e in range(70):
            pick = {"edge": e, "sender": ei[0, e], "receiver": ei[1, e]}
            rv = [v[pick[o.rows]] for o, v in zip(op.operands, vals)]
            C = 8
            for c in range(C):
                y = p.evaluate_numpy(
                    [v[np.array(o.offsets) + c * np.array(o.cstrides)] for o, v in zip(op.operands, rv)]
                )
                np.add.at(ref[pick[p.output.rows]], np.array(p.output.offsets) + c * np.array(p.output.cstrides), y)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
        if p.output.rows in ("sender", "receiver"):
            assert not got[N - 1].any()  # the isolated node's row is written, with zeros


def test_species_pieces_are_fixed_by_the_species_alone():
    species = np.array([2, 0, 2, 2, 0] * 9)
    ptr, perm, piece_ptr = cpu.species_pieces(species, 4, size=4)
    assert list(piece_ptr) == [0, 5, 5, 12, 12]  # 18 atoms of 0 -> 5 pieces, none of 1, 27 of 2 -> 7
    assert np.all(np.diff(ptr) <= 4) and ptr[-1] == 45
    for z, (a, b) in enumerate(itertools.pairwise(piece_ptr)):
        members = perm[ptr[a] : ptr[b]]
        assert np.all(species[members] == z) and np.all(np.diff(members) > 0)
    with pytest.raises(ValueError, match="species index outside"):
        cpu.species_pieces(np.array([0, 5]), 3)


_DETERMINISM = textwrap.dedent("""
    import sys, hashlib, numba, torch
    sys.path.insert(0, "tests")
    from test_kernels_cpu import mace_ops, _random_inputs
    from workbench.kernels.ops import EdgeGraph
    numba.set_num_threads(int(sys.argv[1]))
    h = hashlib.sha1()
    ops = mace_ops()
    for op in ops["contraction"]:
        sp = torch.arange(300) % 3
        for t in op.evaluate(_random_inputs(op, {"atom": 300, "species": 3}, torch.float32, 5), sp, 3):
            h.update(t.numpy().tobytes())
    g = EdgeGraph(torch.randint(0, 150, (2, 3000), generator=torch.Generator().manual_seed(2)), 150)
    for op in ops["channelwise_tp"]:
        for t in op.evaluate(_random_inputs(op, {"edge": 3000, "sender": 150, "receiver": 150}, torch.float32, 6), graph=g):
            h.update(t.numpy().tobytes())
    print("DIGEST", h.hexdigest())
""")


def test_bits_identical_across_runs_and_thread_counts():
    """Every pass, float32 (where summation order shows), large enough to run in parallel: the
    same bits on 1 and 2 threads and run to run (no atomics, fixed summation order)."""
    digests = []
    for threads in ("2", "1", "2"):
        res = subprocess.run(
            [sys.executable, "-c", _DETERMINISM, threads],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        digests.append(res.stdout.split("DIGEST")[-1].strip())
    assert len(set(digests)) == 1, digests


def test_poison_reveals_an_unwritten_element(monkeypatch):
    """The guard the parity tests rely on: with WORKBENCH_KERNELS_POISON=1 a CPU output the
    kernels would skip is NaN, not stale memory."""
    x = Operand.channel_major("x", 2, 4)
    out = Operand.channel_major("y", 2, 4)
    p = SparsePolynomial.from_terms((x,), out, [(0, [(0, 0)], 2.0), (1, [(0, 1)], 3.0)])
    op = PolyOp((x,), [p])
    monkeypatch.setenv("WORKBENCH_KERNELS_POISON", "1")
    (y,) = op.evaluate([torch.ones(5, 8, dtype=torch.float64)], torch.zeros(5, dtype=torch.int64), 1)
    assert torch.equal(y, torch.tensor([[2.0, 3.0] * 4] * 5, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["generated", "fused"])
def test_generated_and_fused_code_equal_the_interpreter(monkeypatch, kind):
    """``WORKBENCH_CPU_KERNELS=generated`` compiles a program to one vectorised loop body and
    ``fused`` each row pass to its own kernel; both compute what the interpreter computes
    (float64, to rounding)."""
    from workbench.kernels.numba.cpu import fused as cpu_fused
    from workbench.kernels.numba.cpu import unrolled as cpu_unrolled

    op = mace_ops()["channelwise_tp"][0]
    graph = EdgeGraph(torch.randint(0, 12, (2, 90), generator=torch.Generator().manual_seed(4)), 12)
    ts = _random_inputs(op, {"edge": 90, "sender": 12, "receiver": 12}, torch.float64, 7)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
    (ref,) = op.evaluate(ts, graph=graph)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", kind)
    chosen = cpu_unrolled.use_generated if kind == "generated" else cpu_fused.use_fused
    assert all(chosen(rp.program) for _, rp in cpu_plan(op, 8).passes)
    (got,) = op.evaluate(ts, graph=graph)
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13 * float(ref.abs().max()))
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "fastest")
    with pytest.raises(ValueError, match="WORKBENCH_CPU_KERNELS must be one of auto, interpreter, generated, fused"):
        op.evaluate(ts, graph=graph)


def test_small_channel_passes_run_in_parallel(monkeypatch):
    """The serial threshold counts a row's own cost (``cpu.pass_work``): a 2-instruction pass at
    16 channels over 11,050 rows runs on the thread pool (the old rows x instructions x channels
    kept such passes serial, at half the speed), a 3-row pass on the calling thread."""
    x = Operand.channel_major("x", 2, 16)
    p = SparsePolynomial.from_terms((x,), Operand.channel_major("y", 2, 16), [(0, [(0, 0)], 2.0), (1, [(0, 1)], 3.0)])
    op = PolyOp((x,), [p])
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
    used = []
    original = cpu.RowPass.drivers

    def spy(self, dtype, channels):
        parallel, serial = original(self, dtype, channels)
        return (lambda *a: used.append("parallel") or parallel(*a)), (lambda *a: used.append("serial") or serial(*a))

    monkeypatch.setattr(cpu.RowPass, "drivers", spy)
    for rows, expected in ((11_050, "parallel"), (3, "serial")):
        used.clear()
        h = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        (y,) = op.evaluate([h], torch.zeros(rows, dtype=torch.int64), 1)
        assert used == [expected]
        torch.testing.assert_close(y, h * torch.tensor([2.0, 3.0]).repeat(16))
