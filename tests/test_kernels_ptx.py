"""The CUDA kernels compile for a real GPU: every kernel a force-training step launches, built
to PTX for sm_90 (H100) by numba-cuda's NVVM and assembled by ptxas, with no GPU.

The simulator tests check what the kernels compute but run them as Python, so they cannot see
a construct that does not compile for the device, a float64 constant leaking into a float32
kernel, or register spills. These tests can.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from cli_fixtures import run_workbench
from kernel_fixtures import build_model

from workbench.bench.resources import (
    find_nvdisasm,
    find_ptxas,
    kernel_resources,
    occupancy,
    sass_counts,
    term_loop_sass,
    training_ops,
)
from workbench.kernels import accelerate
from workbench.kernels.e3nn.tp import channelwise_tp_op
from workbench.kernels.numba.gpu import unrolled


@pytest.fixture(scope="module")
def small_ops():
    torch.manual_seed(0)
    model = accelerate(build_model("ScaleShiftMACE", "4x0e+4x1o", 2, 2, 3))
    sc = model.products[0].symmetric_contractions.op
    tp, _ = channelwise_tp_op(model.interactions[1].conv_tp)
    return {"symmetric_contraction": training_ops(sc), "channelwise_tp": training_ops(tp)}


def test_ptxas_and_nvdisasm_are_installed():
    # the dev extra installs the nvidia-cuda-nvcc and -nvdisasm wheels; without them the resource checks would be vacuous
    assert find_ptxas() is not None and find_nvdisasm() is not None


def test_sass_counts_read_nvdisasm_listings():
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 FFMA R4, R5, R6, R7 ;
        /*0020*/                   DFMA.RM R8, R10, R12, R14 ;
        /*0030*/                   FSETP.GT.AND P0, PT, R4, RZ, PT ;
        /*0040*/                   FMUL.FTZ R2, R3, 0.5 ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
        /*0070*/                   NOP;
    """
    assert sass_counts(listing) == (7, 3)  # padding NOP dropped; FFMA, DFMA, FMUL are arithmetic, FSETP is not


def test_term_loop_sass_divides_the_loop_by_its_terms():
    listing = """
        /*0000*/                   MOV R1, RZ ;
        .L_x_3:
        /*0010*/                   LDS R4, [R2] ;
        /*0020*/                   LDS R5, [R2+0x4] ;
        /*0030*/                   FMUL R6, R4, R5 ;
        /*0040*/                   LDS R4, [R2+0x8] ;
        /*0050*/                   LDS R5, [R2+0xc] ;
        /*0060*/                   FFMA R7, R4, R5, R6 ;
        /*0070*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0080*/               @P0 BRA `(.L_x_3) ;
        .L_x_4:
        /*0090*/                   STS [R3], R7 ;
        /*00a0*/               @P1 BRA `(.L_x_4) ;
        /*00b0*/                   EXIT ;
    """
    # 8 instructions, 4 shared loads of degree-2 terms: 2 terms per iteration; the store loop has no LDS
    assert term_loop_sass(listing, 2) == 4.0
    assert term_loop_sass(listing.replace("LDS", "LDG"), 2) is None


@pytest.mark.parametrize("variant", ["unrolled", "table"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_training_kernels_compile_for_sm90(small_ops, variant, dtype, monkeypatch):
    from numba import cuda

    captured: list[str] = []
    real = cuda.compile_ptx

    def keep(*args, **kwargs):
        ptx, resty = real(*args, **kwargs)
        captured.append(ptx)
        return ptx, resty

    monkeypatch.setattr(cuda, "compile_ptx", keep)
    rows = []
    for family, ops in small_ops.items():
        rows += kernel_resources(ops, dtype, variant, cc=(9, 0), family=family)
    # the contraction unrolled in float32: one launch per pass (the backward's and double
    # backward's outputs in one atom pass each), plus the per-species sum of each weight
    # gradient; otherwise one per output (1 + 2 + 3) and the sums; and the forces' backward
    # (d(x) alone: the forces need no weight gradient), one launch. The TP: one launch per pass
    # unrolled (float64: the double backward's receiver output apart), 1 + 3 + 4 on tables
    tp = {("unrolled", "float32"): 3, ("unrolled", "float64"): 4}.get((variant, dtype), 8)
    fused = variant == "unrolled" and dtype == "float32"  # float64 passes launch their parts apart
    assert len(rows) == len(captured) == (3 if fused else 6) + 2 + 1 + tp
    assert {r.variant for r in rows} == {variant, "segment"}
    assert [r.kernel == "pass" for r in rows if r.family == "channelwise_tp"].count(True) == (2 if tp < 8 else 0)
    assert [r.kernel == "atom pass" for r in rows].count(True) == (2 if fused else 0)
    assert [r.kernel for r in rows if r.variant == "segment"] == ["species sum"] * 2
    for r, ptx in zip(rows, captured):
        assert ".target sm_90" in ptx and ".entry" in ptx, (r.family, r.op, r.output)
        if dtype == "float32":
            # no float64 arithmetic or conversion: a bare Python float in a kernel would promote
            assert not re.search(r"\.f64\b", ptx), (r.family, r.op, r.output, re.findall(r".*\.f64.*", ptx)[:3])
        # deterministic: no kernel a training step launches adds with atomics
        assert not re.search(r"\b(atom|red)\.", ptx), (
            r.family,
            r.op,
            r.output,
            re.findall(r".*\b(?:atom|red)\..*", ptx)[:3],
        )
        assert r.registers is not None and 0 < r.registers <= 255
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert 0 < r.occupancy <= 1
        assert r.sass_instructions > 0 and 0 < r.sass_fp < r.sass_instructions, r
        if r.variant == "unrolled":
            assert r.sass_per_term == pytest.approx(r.sass_instructions / r.terms, abs=0.01)
        if r.variant == "table" and r.kernel.startswith("atom"):
            # the lean term loop: 16-bit tables and unsigned indices (the first version: ~187 per term)
            assert r.sass_per_term is not None and r.sass_per_term < 100, r
        if r.variant == "unrolled" and r.kernel not in ("edge reduce", "pass"):
            assert r.shared_bytes == 0  # operands and accumulators live in registers
        elif r.variant != "segment":
            assert r.shared_bytes > 0  # table kernels stage slots; the channel reduction stages partials


def test_occupancy_model():
    # H100: 64 K registers and 2048 threads per SM
    assert occupancy(32, 0, 128) == 1.0
    assert occupancy(64, 0, 128) == 0.5
    assert occupancy(255, 0, 128) == pytest.approx(0.125)  # 256 regs/thread after rounding: 2 blocks
    assert occupancy(32, 100 * 1024, 128) == pytest.approx(2 * 128 / 2048)  # shared memory bound


def test_unrolled_switch(monkeypatch):
    monkeypatch.delenv("WORKBENCH_CUDA_KERNELS", raising=False)
    monkeypatch.delenv("WORKBENCH_UNROLL_MAX_TERMS", raising=False)
    assert unrolled.use_unrolled(unrolled.DEFAULT_MAX_TERMS)
    assert not unrolled.use_unrolled(unrolled.DEFAULT_MAX_TERMS + 1)
    # weighted by accumulators: the paper contraction's backward d(x) (4940 terms, 16 outputs) is
    # unrolled, the double backward's d(W) (4940 terms into 81 weight components) is not
    assert unrolled.use_unrolled(4940, 16, 101) and unrolled.use_unrolled(1909, 81, 20)
    assert not unrolled.use_unrolled(4940, 81, 36) and not unrolled.use_unrolled(9053, 16, 115)
    # float64 takes twice the registers: the contraction's forward stays on tables, the TP's is unrolled
    assert not unrolled.use_unrolled(1909, 4, 97, itemsize=8) and unrolled.use_unrolled(86, 40, 30, itemsize=8)
    monkeypatch.setenv("WORKBENCH_UNROLL_MAX_TERMS", "10")
    assert not unrolled.use_unrolled(11)
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "unrolled")
    assert unrolled.use_unrolled(10**6)
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "table")
    assert not unrolled.use_unrolled(1)
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "fast")
    with pytest.raises(ValueError, match="WORKBENCH_CUDA_KERNELS"):
        unrolled.use_unrolled(1)


def test_split_parts_partition_the_terms(small_ops, monkeypatch):
    """WORKBENCH_UNROLL_PARTS splits a polynomial over its output components: the parts' terms
    partition the whole, by disjoint components, balanced by terms."""
    monkeypatch.delenv("WORKBENCH_CUDA_KERNELS", raising=False)
    monkeypatch.delenv("WORKBENCH_UNROLL_PARTS", raising=False)
    comp = small_ops["symmetric_contraction"][1][1].compiled[0]  # backward d(x)

    def terms(t):  # slots renumbered per table: compare by what a slot reads
        where = list(zip(t.slot_arr.tolist(), t.slot_rows.tolist(), t.slot_off.tolist(), t.slot_cs.tolist()))
        return [(o, c, tuple(sorted(where[q] for q in slots))) for o, c, slots in t.monomials()]

    whole = sorted(terms(comp.table))
    assert unrolled.unrolled_parts(comp, "float32") == [comp.table]
    for k in (2, 3):
        monkeypatch.setenv("WORKBENCH_UNROLL_PARTS", str(k))
        parts = unrolled.unrolled_parts(comp, "float32")
        assert len(parts) == k
        assert sorted(m for t in parts for m in terms(t)) == whole
        outs = [set(t.t_out.tolist()) for t in parts]
        assert all(not (a & b) for i, a in enumerate(outs) for b in outs[i + 1 :])  # disjoint components
        sizes = [t.num_terms for t in parts]
        assert max(sizes) <= 2 * comp.num_terms / k  # balanced by terms
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "table")  # the table kind is never split
    assert unrolled.unrolled_parts(comp, "float32") is None


def test_weight_groups_partition_the_terms(small_ops, monkeypatch):
    """WORKBENCH_UNROLL_WEIGHT_GROUPS=n splits a contraction polynomial into parts of at most n
    terms that keep a weight component's terms together (cut only where one component has more
    than n), across output components; a part adds into exactly the components an earlier part
    stored. Message polynomials (no weights) are not grouped."""
    monkeypatch.delenv("WORKBENCH_CUDA_KERNELS", raising=False)
    monkeypatch.delenv("WORKBENCH_UNROLL_PARTS", raising=False)
    monkeypatch.delenv("WORKBENCH_UNROLL_TERMS", raising=False)
    comp = small_ops["symmetric_contraction"][1][1].compiled[0]  # backward d(x): operands x, W, grad_out
    assert [o.rows for o in comp.poly.operands].count("species") == 1
    w_array = comp.array_ids[[o.rows for o in comp.poly.operands].index("species")]

    def reads(t):
        return list(zip(t.slot_arr.tolist(), t.slot_rows.tolist(), t.slot_off.tolist(), t.slot_cs.tolist()))

    def terms(t):  # slots renumbered per table: compare by what a slot reads
        where = reads(t)
        return [(o, c, tuple(sorted(where[q] for q in slots))) for o, c, slots in t.monomials()]

    def weight_reads(t):  # {weight component read: terms reading it}
        count: dict = {}
        for _, _, slots in terms(t):
            for r in slots:
                if r[0] == w_array:
                    count[r] = count.get(r, 0) + 1
        return count

    whole = sorted(terms(comp.table))
    per_weight = weight_reads(comp.table)
    assert len(per_weight) > 4 and all(sum(r[0] == w_array for r in m[2]) == 1 for m in whole)  # one weight per term
    for n in (7, 30):
        monkeypatch.setenv("WORKBENCH_UNROLL_WEIGHT_GROUPS", str(n))
        parts = unrolled.unrolled_parts(comp, "float32")
        assert len(parts) >= comp.num_terms / n
        assert sorted(m for t in parts for m in terms(t)) == whole
        assert max(t.num_terms for t in parts) <= n
        stored: set[int] = set()
        for t in parts:
            mine = set(t.t_out.tolist())
            assert set(t.add_to) == mine & stored
            stored |= mine
        readers: dict = {}
        for k, t in enumerate(parts):
            for r in weight_reads(t):
                readers.setdefault(r, set()).add(k)
        assert all(len(readers[r]) == 1 for r, c in per_weight.items() if c <= n)  # groups kept whole
        assert max(len(weight_reads(t)) for t in parts) < len(per_weight)
    tp = small_ops["channelwise_tp"][1][1].compiled[0]
    monkeypatch.setenv("WORKBENCH_UNROLL_WEIGHT_GROUPS", "7")
    assert unrolled.unrolled_parts(tp, "float32") == [tp.table]


def test_generated_source_is_straight_line(small_ops):
    """Offsets are unsigned globals and no table is read. An atom kernel's sums are one
    generated polynomial whose program uses every term's coefficient exactly once and equals
    the term table evaluated directly (float64, random operands and accumulators); a message
    kernel's are source lines, each distinct coefficient a typed float32 global used once per
    term, the terms fused multiply-adds."""
    from workbench.kernels.numba.gpu.poly_ir import CONST, Program

    rng = np.random.default_rng(7)
    for op in (small_ops["channelwise_tp"][0][1], small_ops["symmetric_contraction"][1][1]):
        for comp in op.compiled:
            shape = "node" if comp.node_output else ("edge" if op.edge else "atom")
            src = unrolled.kernel_source(comp.table, shape, "float32", reduce_channels=comp.reduce_channels)
            compile(src, "<test>", "exec")
            consts, body = src.split("\ndef kernel(")
            offsets = re.findall(r"^U(\d+) = np\.uint64\((\d+)\)$", consts, flags=re.M)
            assert offsets and all(a == b for a, b in offsets)
            assert not re.search(r"x\d\[\w+, \d", body)  # no signed literal index (numba would wrap it around)
            assert "t_coef" not in body and "t_fac" not in body
            if shape != "atom":
                defs = dict(re.findall(r"^(K\d+) = f32\((.+)\)$", consts, flags=re.M))
                assert len(defs) + len(offsets) == len(
                    consts.strip().splitlines()
                )  # coefficients float32, offsets uint64
                assert sorted(float(v) for v in defs.values()) == sorted(
                    {float(np.float64(c)) for c in comp.table.coef64}
                )
                assert len(re.findall(r"\bK\d+\b", body)) == comp.num_terms and "cuda.fma(" in body
                if shape == "node":
                    assert "for p in range(seg_ptr[n], seg_ptr[n + 1]):" in body and "cuda.shared" not in body
                continue
            codes = re.findall(r'^P = polynomial\("([A-Za-z0-9+/=]+)", "float32"\)$', consts, flags=re.M)
            zeros = re.findall(r"^Z = \(np\.float32\(0\.0\),\) \* (\d+)$", consts, flags=re.M)
            assert len(codes) == 1 and zeros == [str(len(set(comp.table.t_out.tolist())))]
            assert len(offsets) + 2 == len(consts.strip().splitlines())  # offsets uint64, one polynomial, its zeros
            assert body.count("acc = P(acc, (") == 1
            prog = Program.decode(codes[0])
            const_ids = {prog.num_inputs + prog.num_acc + j for j, o in enumerate(prog.ops) if o[0] == CONST}
            uses = sum(x in const_ids for o in prog.ops if o[0] != CONST for x in o[1:3])
            assert uses == comp.num_terms
            assert sorted(prog.coefs) == sorted({float(c) for c in comp.table.coef64})
            v = rng.standard_normal(prog.num_inputs)
            acc = rng.standard_normal(prog.num_acc)
            want = acc.copy()
            outs = sorted({o for o, _, _ in comp.table.monomials()})
            for o, c, slots in comp.table.monomials():
                want[outs.index(o)] += c * np.prod(v[list(slots)])
            np.testing.assert_allclose(prog.evaluate(acc, v), want, rtol=1e-12, atol=1e-12)


def test_fused_pass_source_loads_each_component_once(small_ops, monkeypatch):
    """The TP backward and double backward are one kernel each: role 1 walks the sender segments
    (d(x) carried, d(W) stored per edge, d(Y) summed over the node's channel threads after a
    barrier), role 2 the receiver segments (d(d(out))); each distinct operand component is loaded
    once per edge and role."""
    from workbench.kernels.numba.gpu import edge_pass

    monkeypatch.delenv("WORKBENCH_CUDA_TPB", raising=False)
    ops = dict(small_ops["channelwise_tp"])
    assert edge_pass.layout(ops["forward"].compiled) is None  # one output: nothing to fuse
    for label, other in (("backward", ()), ("double backward", (3,))):
        comp = ops[label].compiled
        lay = edge_pass.fused_layout(comp, "float32", 4)
        assert (lay.walk, lay.walked, lay.edge, lay.reduce, lay.other) == ("sender", (0,), (2,), 1, other)
        src = edge_pass.kernel_source(tuple(c.table for c in comp), lay, "float32", 4)
        compile(src, "<test>", "exec")
        role1, _, role2 = src.partition("\n    else:\n")
        keys = {k for i in edge_pass._role1(lay) for k in edge_pass._slot_keys(comp[i].table)}
        assert len(re.findall(r"^ +v\d+ = x\d\[", role1, flags=re.M)) == len(keys)
        assert role1.count("cuda.syncthreads()") == 3 and "atomic" not in src
        assert "red = cuda.shared.array((128, 9), f32)" in src  # 32 nodes of 4 channels, 9 components of Y
        if other:
            keys2 = set(edge_pass._slot_keys(comp[3].table))
            assert len(re.findall(r"^ +w\d+ = x\d\[", role2, flags=re.M)) == len(keys2)
        else:
            assert not role2
    # float64 launches the receiver output apart; a channel-summed output needs a node per block
    assert edge_pass.fused_layout(ops["double backward"].compiled, "float64", 4).other == ()
    assert edge_pass.fused_layout(ops["backward"].compiled, "float32", 257) is None
    assert edge_pass.block_shape(4) == (32, 128) and edge_pass.block_shape(200) == (1, 200)
    # the d(Y) partials (128 threads x 9 components) must fit static shared memory
    monkeypatch.setattr(edge_pass, "MAX_SHARED_BYTES", 128 * 9 * 4 - 1)
    assert edge_pass.fused_layout(ops["backward"].compiled, "float32", 4) is None


def test_cli_writes_report(tmp_path):
    out = tmp_path / "res.json"
    options = ("--ops", "channelwise_tp", "--variant", "table", "--dtype", "float32", "--json", out)
    res = run_workbench("kernels", "resources", *options)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["kernels"]
    assert report["meta"]["cc"] == [9, 0]
    assert [r["op"] for r in rows] == ["forward"] + ["backward"] * 3 + ["double backward"] * 4
    assert all(r["terms"] in (86, 172, 258) and r["registers"] > 0 for r in rows)  # paper config interactions[1]
    assert all(r["sass_instructions"] > 0 and r["sass_per_term"] > 0 for r in rows)  # table kernels: the term loop's
    assert "double backward" in res.stdout
    assert "channelwise_tp [table, float32]: forward 1, backward 3, double backward 4" in res.stdout


def test_float32_polynomials_too_large_to_unroll_are_split_automatically(small_ops, monkeypatch):
    """A float32 polynomial over the unroll budget runs as ceil(terms / SPLIT_PART_TERMS)
    generated kernels when every part fits; float64, the table kind and WORKBENCH_UNROLL_PARTS=1
    keep the table-driven kernel."""
    for var in ("WORKBENCH_CUDA_KERNELS", "WORKBENCH_UNROLL_PARTS", "WORKBENCH_UNROLL_MAX_TERMS"):
        monkeypatch.delenv(var, raising=False)
    comp = small_ops["symmetric_contraction"][1][1].compiled[0]  # backward d(x)
    n, acc = comp.num_terms, comp.accumulators
    monkeypatch.setenv("WORKBENCH_UNROLL_MAX_TERMS", str(0.9 * unrolled.unroll_cost(n, acc)))
    assert not unrolled.use_unrolled(n, acc, comp.num_slots)
    monkeypatch.setattr(unrolled, "SPLIT_PART_TERMS", -(-n // 3))
    parts = unrolled.unrolled_parts(comp, "float32")
    assert parts is not None and len(parts) == 3 and sum(p.num_terms for p in parts) == n
    monkeypatch.setattr(unrolled, "SPLIT_PART_TERMS_F64", -(-n // 2))
    parts64 = unrolled.unrolled_parts(comp, "float64")  # float64: its own part size, a bound on operand components
    assert parts64 is not None and len(parts64) == 2 and sum(p.num_terms for p in parts64) == n
    monkeypatch.setattr(unrolled, "MAX_PART_SLOTS_F64", max(p.num_slots for p in parts64) - 1)
    finer = unrolled.unrolled_parts(comp, "float64")  # the fewest parts that all fit: more of them
    assert finer is None or (len(finer) > 2 and all(p.num_slots < max(q.num_slots for q in parts64) for p in finer))
    monkeypatch.setattr(unrolled, "MAX_PART_SLOTS_F64", 0)
    assert unrolled.unrolled_parts(comp, "float64") is None
    assert unrolled.unrolled_parts(comp, "float32", split=False) is None  # edge kernels are never split
    monkeypatch.setattr(unrolled, "MAX_PARTS", 2)
    assert unrolled.unrolled_parts(comp, "float32") is None
    monkeypatch.setattr(unrolled, "MAX_PARTS", 4)
    monkeypatch.setenv("WORKBENCH_UNROLL_PARTS", "1")
    assert unrolled.unrolled_parts(comp, "float32") is None
    monkeypatch.setenv("WORKBENCH_UNROLL_PARTS", "0")
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "table")
    assert unrolled.unrolled_parts(comp, "float32") is None


#: issue 17's configurations: hidden irreps, max_ell, correlation
CONFIGS = {"paper": ("128x0e+128x1o", 3, 3), "128x2e": ("128x0e+128x1o+128x2e", 3, 3), "256": ("256x0e+256x1o", 3, 3)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_training_kernels_leave_the_table_path(config, monkeypatch):
    """Which kernel every training polynomial gets, at the three configurations (ptxas on the
    kernels these pick: benchmarks/results/kernel_resources_sm90*.json).

    float32: every contraction polynomial runs generated code, split by output components into
    parts of about SPLIT_PART_TERMS terms (fewer above SPLIT_FULL_SLOTS operand components) where
    it is too large for one kernel (paper: double backward d(x) 5 parts, d(W) 3; 128x2e:
    backward d(x) 15, d(W) 3, double backward d(x) 31, with components cut into runs of terms,
    d(W) 9, d(d(out)) 16), and the TP's backward and double backward are one fused launch each.
    float64: parts of about 650 terms reading at most 100 operand components (the paper's
    d(d(out)) in runs of terms; 128x2e's d(x)s, whose runs read more, in groups by weight
    component), and the TP's outputs one kernel each (128x2e's d(d(out)) in 2 parts): nothing
    stays on the table kernel."""
    from e3nn import o3

    from workbench.bench.resources import paper_ops
    from workbench.kernels.numba.gpu import edge_pass

    for var in ("WORKBENCH_CUDA_KERNELS", "WORKBENCH_UNROLL_PARTS", "WORKBENCH_UNROLL_MAX_TERMS", "WORKBENCH_CUDA_TPB"):
        monkeypatch.delenv(var, raising=False)
    hidden, max_ell, correlation = CONFIGS[config]
    channels = o3.Irreps(hidden)[0].mul
    fam = paper_ops(hidden=hidden, max_ell=max_ell, correlation=correlation)
    sc, tp = dict(fam["symmetric_contraction"]), dict(fam["channelwise_tp"])
    parts = {
        dt: {(label, c.output.name): unrolled.unrolled_parts(c, dt) for label, op in sc.items() for c in op.compiled}
        for dt in ("float32", "float64")
    }
    f32 = {k: len(v) for k, v in parts["float32"].items()}  # a None would raise: no float32 table kernel
    for k, v in parts["float32"].items():
        assert len(v) == 1 or max(p.num_terms for p in v) <= unrolled.SPLIT_PART_TERMS * 5 // 4, k
    for label in ("backward", "double backward"):  # one launch per TP pass
        op = tp[label]
        lay = edge_pass.fused_layout(op.compiled, "float32", channels)
        assert sorted(edge_pass._role1(lay) + lay.other) == list(range(len(op.compiled))), label
    tp64 = {
        (label, c.output.name): unrolled.unrolled_parts(c, "float64") for label, op in tp.items() for c in op.compiled
    }
    assert all(v is not None for v in tp64.values())
    tp64 = {k: len(v) for k, v in tp64.items() if len(v) > 1}
    table64 = {k for k, v in parts["float64"].items() if v is None}
    assert all(
        p.num_slots <= unrolled.MAX_PART_SLOTS_F64 for v in parts["float64"].values() if v and len(v) > 1 for p in v
    )
    order = [
        ("forward", "out"),
        ("backward", "d(x)"),
        ("backward", "d(W)"),
        ("double backward", "d(x)"),
        ("double backward", "d(W)"),
        ("double backward", "d(d(out))"),
    ]
    if config in ("paper", "256"):  # the same polynomials: the channel count is not in them
        assert [f32[k] for k in order] == [1, 1, 1, 5, 3, 1]
        assert [len(parts["float64"][k]) for k in order] == [4, 8, 3, 16, 8, 10]
        assert not table64 and not tp64
        assert any(p.add_to for p in parts["float64"][("double backward", "d(d(out))")])  # runs of terms
    else:
        assert [f32[k] for k in order] == [1, 15, 3, 31, 9, 16]
        assert not table64
        assert [len(parts["float64"][k]) for k in order] == [14, 38, 10, 76, 28, 30]
        for k in (("backward", "d(x)"), ("double backward", "d(x)")):  # by weight component
            ps = parts["float64"][k]
            assert max(p.num_slots for p in ps) < 60 and max(p.num_terms for p in ps) <= unrolled.SPLIT_WEIGHT_TERMS_F64
            assert all(p.add_to for p in ps[1:])
        assert tp64 == {("double backward", "d(d(out))"): 2}
