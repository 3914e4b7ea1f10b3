"""Fused CPU row passes (:mod:`workbench.kernels.numba.cpu.fused`): each pass compiled to its
own kernel computes what the interpreter computes, at channel counts below, at and between
multiples of the lane count, in every derivative order; which passes ``auto`` fuses; the
counting-sort CSR the edge passes walk."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from fused_spy import spy_fused_runs
from test_kernels_channelwise import make_conv_tp, random_graph

import workbench  # noqa: F401
from workbench.kernels import Operand, SparsePolynomial
from workbench.kernels.e3nn.tp import channelwise_tp_op
from workbench.kernels.numba.cpu import fused as cpu_fused
from workbench.kernels.numba.cpu import groups as cpu_groups
from workbench.kernels.numba.cpu.loops import csr_by_counting
from workbench.kernels.numba.dispatch import cpu_plan
from workbench.kernels.ops import EdgeGraph, PolyOp


def _orders(op):
    """The op, its backward and its double backward (every operand needed)."""
    n = len(op.operands)
    d1 = op.derivative((True,) * n)
    d2 = d1.derivative((True,) * n + (False,) * (len(d1.operands) - n), (True,) * len(d1.outputs))
    return op, d1, d2


@pytest.fixture
def fused_runs(monkeypatch) -> list:
    """Every fused pass that runs (so a test cannot compare the interpreter with itself)."""
    return spy_fused_runs(monkeypatch)


def _inputs(op, rows: dict, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows[o.rows], o.width, generator=g, dtype=torch.float64) for o in op.operands]


@pytest.mark.parametrize("channels,max_ell,registers", [(3, 1, None), (13, 2, None), (13, 2, 6)])
def test_fused_edge_passes_equal_the_interpreter(monkeypatch, fused_runs, channels, max_ell, registers):
    """A message op: forward (receiver sums), backward (sender sums, per-edge and channel-summed
    outputs) and double backward, on a graph with a self-loop and an isolated node, at channel
    counts below and between multiples of the lane count; float64 to rounding, and (13
    channels) float32 within 1e-5 of float64. ``registers``: the accumulators split into groups
    of at most that many operands and accumulators (:mod:`~workbench.kernels.numba.cpu.groups`),
    one channel loop each."""
    if registers is not None:
        monkeypatch.setenv("WORKBENCH_CPU_REGISTERS", str(registers))
    op = channelwise_tp_op(make_conv_tp(f"{channels}x0e+{channels}x1o", max_ell))[0]
    N, E = 11, 150
    graph = EdgeGraph(random_graph(N, E, seed=channels), N)
    rows = {"edge": E, "sender": N, "receiver": N}
    for order, d in enumerate(_orders(op)):
        ts = _inputs(d, rows, seed=10 * channels + order)
        monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
        ref = d.evaluate(ts, graph=graph)
        ref32 = d.evaluate([t.float() for t in ts], graph=graph) if channels == 13 else ref
        monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "fused")
        fused_runs.clear()
        got = d.evaluate(ts, graph=graph)
        assert len(fused_runs) == len(cpu_plan(d, channels).passes)
        if registers is not None:  # the split is exercised
            assert max(len(cpu_groups.accumulator_groups(rp.program)) for _, rp in cpu_plan(d, channels).passes) > 1
        got32 = d.evaluate([t.float() for t in ts], graph=graph) if channels == 13 else got
        for comp, r, a, a32, r32 in zip(d.compiled, ref, got, got32, ref32):
            scale = float(r.abs().max())
            assert scale > 0 and not torch.isnan(a).any()
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13 * scale)
            assert float((a32.double() - r).abs().max()) <= 1e-5 * scale
            assert float((a32 - r32).abs().max()) <= 1e-5 * scale and a32.dtype == r32.dtype
            if comp.poly.output.rows in ("sender", "receiver"):
                assert not a[N - 1].any()  # the isolated node's row is written, with zeros


def test_fused_atom_passes_equal_the_interpreter(monkeypatch, fused_runs):
    """Atom rows in species pieces: a polynomial of strided atom features, per-species weights and
    a per-species scalar broadcast over channels, and its backward, whose weight gradients are
    summed over pieces of 1 to 16 atoms of each species (one species has no atom), the scalar's
    over the channels too."""
    C = 16
    x = Operand.channel_major("x", 4, C, "atom")
    w = Operand.component_major("w", 3, C, "species")
    b = Operand("b", 2, "species", (0, 1), (0, 0), 2)
    y = Operand.channel_major("y", 2, C, "atom")
    terms = [(0, [(0, 0), (1, 0)], 0.5), (0, [(0, 1), (0, 2), (1, 1)], 1.0), (1, [(0, 3), (1, 2), (2, 0)], -1.5)]
    terms += [(1, [(0, 0), (0, 1), (2, 1)], 0.25)]
    op = PolyOp((x, w, b), [SparsePolynomial.from_terms((x, w, b), y, terms)])
    species = torch.tensor([0] * 17 + [2] * 23)[torch.randperm(40, generator=torch.Generator().manual_seed(3))]
    for d in _orders(op)[:2]:
        ts = _inputs(d, {"atom": 40, "species": 3}, seed=len(d.outputs))
        monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
        ref = d.evaluate(ts, species, 3)
        monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "fused")
        fused_runs.clear()
        got = d.evaluate(ts, species, 3)
        assert fused_runs
        for r, a in zip(ref, got):
            assert float(r.abs().max()) > 0
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13 * float(r.abs().max()))
    assert [c.poly.output.rows for c in d.compiled] == ["atom", "species", "species"]  # x, w and b's gradients


_THREADS = textwrap.dedent("""
    import sys, hashlib, numba, torch
    sys.path.insert(0, "tests")
    from test_kernels_cpu_fused import _inputs, _orders
    from test_kernels_channelwise import make_conv_tp
    from workbench.kernels.e3nn.tp import channelwise_tp_op
    from workbench.kernels.ops import EdgeGraph
    numba.set_num_threads(int(sys.argv[1]))
    h = hashlib.sha1()
    g = EdgeGraph(torch.randint(0, 150, (2, 3000), generator=torch.Generator().manual_seed(2)), 150)
    for order, d in enumerate(_orders(channelwise_tp_op(make_conv_tp("3x0e+3x1o", 1))[0])):
        ts = [t.float() for t in _inputs(d, {"edge": 3000, "sender": 150, "receiver": 150}, order)]
        for t in d.evaluate(ts, graph=g):
            h.update(t.numpy().tobytes())
    print("DIGEST", h.hexdigest())
""")


def test_fused_bits_identical_across_thread_counts():
    """Fused passes large enough to run on the thread pool, float32: the same bits on 1 and 2
    threads (segments in chunks, no atomics, channel sums in a fixed order)."""
    digests = []
    for threads in ("2", "1"):
        res = subprocess.run(
            [sys.executable, "-c", _THREADS, threads],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "WORKBENCH_CPU_KERNELS": "fused"},
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        digests.append(res.stdout.split("DIGEST")[-1].strip())
    assert len(set(digests)) == 1 and len(digests[0]) == 40, digests


def test_auto_fuses_short_programs_at_every_channel_count(monkeypatch):
    """``auto`` (the default) fuses passes of at most 256 instructions at any channel count (the
    message op of MACE's paper configuration, 239 instructions at 128 channels, included) and
    leaves longer ones on the interpreter; ``WORKBENCH_CPU_UNROLL_MAX`` moves the limit,
    ``interpreter`` and ``fused`` force."""
    paper = channelwise_tp_op(make_conv_tp("4x0e+4x1o", 3))[0]
    monkeypatch.setenv("WORKBENCH_CPU_MERGE_EDGES", "0")  # the weight gradient's own pass
    weights = cpu_plan(paper.derivative((True,) * len(paper.operands)), 16).passes
    short = max((rp.program for _, rp in weights), key=lambda p: p.num_instructions)
    assert short.num_instructions == 239
    wide = channelwise_tp_op(make_conv_tp("4x0e+4x1o+4x2e+4x3o", 3))[0]
    long = cpu_plan(wide, 16).passes[0][1].program
    assert long.num_instructions > cpu_fused.FUSED_MAX_INSTRUCTIONS == 256
    monkeypatch.delenv("WORKBENCH_CPU_KERNELS", raising=False)
    assert cpu_fused.use_fused(short) and not cpu_fused.use_fused(long)
    monkeypatch.setenv("WORKBENCH_CPU_UNROLL_MAX", str(short.num_instructions - 1))
    assert not cpu_fused.use_fused(short)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "fused")
    assert cpu_fused.use_fused(long)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
    assert not cpu_fused.use_fused(short)


def test_edge_outputs_merge_into_the_node_pass(monkeypatch, fused_runs):
    """The paper's second message op (``0e+1o`` features, ``l_max`` 3): its backward computes the
    feature gradient (sender sums), the harmonic gradient and the radial-weight gradient (per
    edge) in one fused sender pass of 345 instructions at 64 channels, so each ``[E, J]`` weight
    row is read once; with ``WORKBENCH_CPU_MERGE_EDGES=0``, on the interpreter, or below 64
    channels, they are two passes. Both give the interpreter's numbers (float64) on a graph with
    an isolated node."""
    op = channelwise_tp_op(make_conv_tp("64x0e+64x1o", 3))[0]
    back = op.derivative((True,) * len(op.operands))
    N, E = 13, 240
    graph = EdgeGraph(random_graph(N, E, seed=5), N)
    ts = _inputs(back, {"edge": E, "sender": N, "receiver": N}, seed=7)
    results = {}
    for kind, merge, want in (("interpreter", "1", ["sender", "edge"]), ("auto", "0", ["sender", "edge"])):
        monkeypatch.setenv("WORKBENCH_CPU_KERNELS", kind)
        monkeypatch.setenv("WORKBENCH_CPU_MERGE_EDGES", merge)
        assert [k for k, _ in cpu_plan(back, 64).passes] == want
        results[kind] = back.evaluate(ts, graph=graph)
    monkeypatch.delenv("WORKBENCH_CPU_MERGE_EDGES")
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "auto")
    narrow = channelwise_tp_op(make_conv_tp("16x0e+16x1o", 3))[0].derivative((True,) * 3)
    assert [k for k, _ in cpu_plan(narrow, 16).passes] == ["sender", "edge"]
    ((kind, merged),) = cpu_plan(back, 64).passes
    assert kind == "sender" and merged.merged and len(merged.outputs) == 3
    assert cpu_fused.FUSED_MAX_INSTRUCTIONS < merged.program.num_instructions <= cpu_fused.FUSED_MAX_MERGED
    fused_runs.clear()
    got = back.evaluate(ts, graph=graph)
    assert len(fused_runs) == 1
    for r, a, b in zip(results["interpreter"], got, results["auto"]):
        scale = float(r.abs().max())
        assert scale > 0
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13 * scale)
        torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-13 * scale)
    assert not got[0][N - 1].any()  # the isolated node's gradient row: zeros


def test_receiver_outputs_merge_too(monkeypatch, fused_runs):
    """Force training through a first interaction (its node features position-free): the double
    backward's outputs are the message cotangent's gradient (receiver sums) and the radial
    weights' (per edge), one fused receiver pass at 64 channels, equal to the interpreter."""
    op = channelwise_tp_op(make_conv_tp("64x0e", 2))[0]
    d1 = op.derivative((False, True, True))
    d2 = d1.derivative((False, False, True, True), (True,) * len(d1.outputs))
    assert sorted(c.poly.output.rows for c in d2.compiled) == ["edge", "receiver"]
    N, E = 9, 120
    graph = EdgeGraph(random_graph(N, E, seed=3), N)
    ts = _inputs(d2, {"edge": E, "sender": N, "receiver": N}, seed=11)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "interpreter")
    ref = d2.evaluate(ts, graph=graph)
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "auto")
    ((kind, merged),) = cpu_plan(d2, 64).passes
    assert kind == "receiver" and merged.merged
    fused_runs.clear()
    got = d2.evaluate(ts, graph=graph)
    assert len(fused_runs) == 1
    for r, a in zip(ref, got):
        scale = float(r.abs().max())
        assert scale > 0
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13 * scale)


@pytest.mark.parametrize(
    "num_rows,size,low,high", [(256, 11_050, 0, 256), (7, 40, -2, 9), (1, 0, 0, 1), (5, 300, 0, 3)]
)
def test_counting_sort_csr_equals_a_stable_sort(num_rows, size, low, high):
    """The CPU's CSR (a counting sort) groups positions as a stable argsort does; values outside
    ``[0, num_rows)`` fall in no group."""
    idx = np.random.default_rng(size).integers(low, high, size=size)
    ptr, perm = csr_by_counting(idx, num_rows)
    ref = np.argsort(idx, kind="stable")
    ref_ptr = np.searchsorted(idx[ref], np.arange(num_rows + 1))
    np.testing.assert_array_equal(ptr, ref_ptr)
    np.testing.assert_array_equal(perm[ptr[0] : ptr[-1]], ref[ref_ptr[0] : ref_ptr[-1]])
    assert sorted(perm.tolist()) == list(range(size))


@pytest.mark.parametrize("registers", [4, 12, 32])
def test_accumulator_groups_compute_what_the_whole_program_computes(registers):
    """The message op's backward at 13 channels: the groups hold every accumulator once, in
    order; a group of two or more stays within the limit; each group's instructions alone give
    its accumulators the whole program's values, to the bit (numpy's reference interpreter)."""
    import dataclasses

    op = channelwise_tp_op(make_conv_tp("13x0e+13x1o", 2))[0]
    d1 = op.derivative((True,) * len(op.operands))
    rng = np.random.default_rng(registers)
    for _, rp in cpu_plan(d1, 13).passes:
        prog = rp.program
        vector = set(prog.vec_operand.tolist())
        values = [rng.normal(size=(o.size, 13) if a in vector else o.size) for a, o in enumerate(prog.operands)]
        whole = prog.evaluate_numpy(values)
        groups = cpu_groups.accumulator_groups(prog, registers)
        assert [j for g in groups for j in g] == list(range(prog.num_accumulators))
        assert (len(groups) > 1) == (prog.num_vectors + prog.num_accumulators > registers)
        for g in groups:
            ins = cpu_groups.group_instructions(prog, g)
            if len(g) > 1:
                assert len(cpu_groups.operands_read(prog, ins)) + len(g) <= registers
            part = dataclasses.replace(prog, ins=ins).evaluate_numpy(values)
            for j in g:
                out, comp = int(prog.acc_output[j]), int(prog.acc_comp[j])
                np.testing.assert_array_equal(part[out][comp], whole[out][comp])


def test_a_program_that_reads_an_accumulator_stays_one_loop():
    """An instruction that takes an accumulator as an operand would need another group's partial
    sums: such a program is never split."""
    import dataclasses

    op = channelwise_tp_op(make_conv_tp("13x0e+13x1o", 2))[0]
    d1 = op.derivative((True,) * len(op.operands))
    prog = max((rp.program for _, rp in cpu_plan(d1, 13).passes), key=lambda p: p.num_accumulators)
    assert len(cpu_groups.accumulator_groups(prog, 4)) > 1
    ins = prog.ins.copy()
    last = ins[-1]
    assert last[0] in (1, 0)  # a product: its ``a`` operand is read
    ins[-1, 2] = prog.num_vectors  # accumulator 0 as the operand
    reads = dataclasses.replace(prog, ins=ins)
    assert cpu_groups.accumulator_groups(reads, 4) == [list(range(prog.num_accumulators))]
