r"""Static resource report of the CUDA kernels: compile every kernel a training step launches to
PTX for a target GPU and ask ``ptxas`` what it costs, with no GPU needed.

The CUDA simulator checks what the kernels compute, not that they compile: it runs them as
Python, so an untyped construct or a float64 constant leaking into a float32 kernel passes it.
This module compiles the same kernels with numba-cuda's NVVM (``cuda.compile_ptx``, which needs
the NVVM and NVRTC libraries but no driver), assembles the PTX with ``ptxas -v`` when it is
found, and reports per kernel: registers per thread, spill stores and loads, shared memory,
stack frame, and the theoretical occupancy these imply on the target.

.. code-block:: text

    workbench kernels resources --cc 9.0            # paper config: launched and table kernels, both dtypes
    workbench kernels resources --variant unrolled  # every kernel unrolled (slow to compile)

"The kernels a training step launches" are the forward op and the derivative ops that force
training builds from it (:func:`training_ops`): the first derivative to every operand, and
its derivative with the cotangents that force training actually passes.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from workbench.bench.table import Column, render, write_json
from workbench.kernels.launches import launches, training_ops
from workbench.kernels.numba.gpu.toolkit import assembled, find_nvdisasm, find_ptxas
from workbench.kernels.options import overridden
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = [
    "KernelResources",
    "find_nvdisasm",
    "find_ptxas",
    "format_table",
    "kernel_resources",
    "launches_per_pass",
    "main",
    "occupancy",
    "paper_ops",
    "sass_counts",
    "term_loop_sass",
    "training_ops",
]

#: per-SM limits used for the occupancy estimate, by compute capability (Hopper, Ampere)
SM_LIMITS = {
    (9, 0): {"registers": 65536, "threads": 2048, "blocks": 32, "smem": 228 * 1024},
    (8, 0): {"registers": 65536, "threads": 2048, "blocks": 32, "smem": 164 * 1024},
}


@dataclass
class KernelResources:
    """What ``ptxas`` reports for one kernel (``None`` where ptxas was not found)."""

    op: str
    output: str
    variant: str
    dtype: str
    terms: int
    slots: int
    threads_per_block: int
    ptx_lines: int
    compile_s: float
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared_bytes: int | None = None
    stack_bytes: int | None = None
    occupancy: float | None = None
    family: str = ""
    mode: str = ""  # the variant asked for: auto (what the dispatcher launches), table or unrolled
    kernel: str = ""  # launch shape: atom, atom partial, species sum, node, edge, edge reduce
    sass_instructions: int | None = None  # SASS instructions of the kernel (nvdisasm), padding NOPs excluded
    sass_fp: int | None = None  # of which floating-point arithmetic (F/D/H FMA, MUL, ADD)
    sass_per_term: float | None = None  # unrolled: instructions / terms; table: the term loop's, per term

    def finish(self) -> None:
        # straight-line code: its size over its terms; a table kernel: its term loop (term_loop_sass)
        if self.sass_instructions is not None and self.terms and self.variant == "unrolled":
            self.sass_per_term = round(self.sass_instructions / self.terms, 2)


#: one SASS instruction line of nvdisasm: ``/*0080*/  @!P0 FFMA R4, R5, R6, R7 ;``
_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\b")
#: floating-point arithmetic opcodes (fp32, fp64, fp16x2)
FP_OPCODES = frozenset(
    {"FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2", "DFMA", "DMUL", "DADD", "HFMA2", "HMUL2", "HADD2"}
)


def sass_counts(listing: str) -> tuple[int, int]:
    """``(instructions, floating-point instructions)`` of an nvdisasm listing (padding NOPs excluded)."""
    ops = [m.group(1) for m in _SASS.finditer(listing)]
    ops = [o for o in ops if o != "NOP"]
    return len(ops), sum(o in FP_OPCODES for o in ops)


#: a label line of nvdisasm (``.L_x_12:``) and a branch to one
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")


def term_loop_sass(listing: str, degree: int) -> float | None:
    """SASS instructions per term of a table kernel's term loop, from an nvdisasm listing.

    The term loop is the loop (a backward branch) with the most shared-memory loads: each term
    reads its ``degree`` factors from the shared operand buffer (``LDS``), so the loop body
    covers ``LDS / degree`` terms however far LLVM unrolled it. Includes the branch that stores
    an output component when the table moves to the next one (taken once per component)."""
    labels, ops = {}, []
    for line in listing.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = _SASS.search(line)
        if m and m.group(1) != "NOP":
            ops.append((m.group(1), line))
    best = None
    for k, (_, line) in enumerate(ops):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), k + 1) <= k:
            body = ops[labels[m.group(1)] : k + 1]
            lds = sum(op == "LDS" for op, _ in body)
            if lds and (best is None or lds > best[0]):
                best = (lds, len(body))
    if best is None or degree < 1:
        return None
    return round(best[1] / (best[0] / degree), 1)


_REG = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas(ptx: str, cc: tuple[int, int], ptxas: str, nvdisasm: str | None = None, degree: int = 0) -> dict:
    with assembled(ptx, cc, ptxas, verbose=True) as (cubin, log):
        sass = loop = None
        if nvdisasm:
            dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, timeout=600)
            if dis.returncode != 0:
                raise RuntimeError(f"nvdisasm failed ({nvdisasm}): {dis.stderr.strip()[-2000:]}")
            sass = sass_counts(dis.stdout)
            loop = term_loop_sass(dis.stdout, degree) if degree else None
    reg, smem, stack = _REG.search(log), _SMEM.search(log), _STACK.search(log)
    out = {
        "registers": int(reg.group(1)) if reg else 0,
        "shared_bytes": int(smem.group(1)) if smem else 0,
        "stack_bytes": int(stack.group(1)) if stack else 0,
        "spill_stores": int(stack.group(2)) if stack else 0,
        "spill_loads": int(stack.group(3)) if stack else 0,
    }
    if sass is not None:
        out["sass_instructions"], out["sass_fp"] = sass
        if loop is not None:
            out["sass_per_term"] = loop
    return out


def occupancy(registers: int, shared_bytes: int, threads_per_block: int, cc: tuple[int, int] = (9, 0)) -> float:
    """Theoretical occupancy (resident warps / maximum warps per SM) for one kernel.

    Registers are allocated per warp in units of 256; shared memory per block."""
    lim = SM_LIMITS.get(tuple(cc), SM_LIMITS[(9, 0)])
    warps_per_block = -(-threads_per_block // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = lim["registers"] // (regs_per_warp * warps_per_block)
    by_smem = lim["smem"] // shared_bytes if shared_bytes else lim["blocks"]
    by_threads = lim["threads"] // (warps_per_block * 32)
    blocks = min(by_regs, by_smem, by_threads, lim["blocks"])
    return blocks * warps_per_block * 32 / lim["threads"]


def kernel_resources(
    ops: Sequence[tuple[str, object]],
    dtype: str,
    variant: str = "auto",
    cc: tuple[int, int] = (9, 0),
    ptxas: str | None = "auto",
    channels: int = 128,
    progress: bool = False,
    family: str = "",
) -> list[KernelResources]:
    """Compile every kernel of ``ops`` (``(label, PolyOp or EdgePolyOp)``) to PTX for ``cc``
    and, with ``ptxas``, assemble it and read off its resources.

    ``variant``: ``"auto"`` (the kernel the dispatcher launches, see
    :func:`workbench.kernels.numba.gpu.unrolled.use_unrolled`), ``"table"`` or ``"unrolled"`` (forced)."""
    import numba
    from numba import cuda

    if ptxas == "auto":
        ptxas = find_ptxas()
    nvdisasm = find_nvdisasm() if ptxas else None
    rows: list[KernelResources] = []
    with overridden(cuda_kernels=variant):
        for label, op in ops:
            for launch in launches(op, dtype, channels):
                if launch.plan is None:
                    continue
                kernel, _, tpb, args = launch.plan
                sig = tuple(numba.typeof(a) for a in args)
                t0 = time.perf_counter()
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
                dt = time.perf_counter() - t0
                r = KernelResources(
                    family=family,
                    op=label,
                    output=launch.output,
                    variant=launch.variant,
                    dtype=dtype,
                    terms=launch.terms,
                    slots=launch.slots,
                    threads_per_block=tpb,
                    ptx_lines=ptx.count("\n"),
                    compile_s=round(dt, 2),
                    kernel=launch.kernel,
                    mode=variant,
                )
                if ptxas:
                    for k, v in _ptxas(ptx, cc, ptxas, nvdisasm, launch.degree).items():
                        setattr(r, k, v)
                    r.occupancy = round(occupancy(r.registers, r.shared_bytes, tpb, cc), 3)
                r.finish()
                rows.append(r)
                if progress:
                    print(
                        f"  {label:16s} {launch.output:14s} {launch.variant:8s} {dtype}: {launch.terms} terms, "
                        f"compiled in {dt:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    return rows


def paper_ops(
    families: Sequence[str] = ("symmetric_contraction", "channelwise_tp"),
    hidden: str = "128x0e+128x1o",
    max_ell: int = 3,
    correlation: int = 3,
    num_elements: int = 4,
) -> dict[str, list[tuple[str, object]]]:
    """The ops of the paper configuration: ``products[0]``'s symmetric contraction and
    ``interactions[1]``'s channelwise message op, each with its training derivatives."""
    import torch

    from workbench.kernels.acceleration import accelerate
    from workbench.kernels.e3nn.tp import channelwise_tp_op
    from workbench.kernels.tools.models import random_scaleshift_mace

    z = [1, 6, 7, 8, 9, 16, 17, 15][:num_elements]
    model = random_scaleshift_mace(hidden, max_ell, correlation, z, 16.0, torch.float64, "cpu", perturb=0.0)
    model = accelerate(model, backend=DEFAULT_BACKEND)
    unknown = set(families) - {"symmetric_contraction", "channelwise_tp"}
    if unknown:
        raise ValueError(f"unknown op(s) {sorted(unknown)}; choose from symmetric_contraction, channelwise_tp")
    res = {}
    if "symmetric_contraction" in families:
        res["symmetric_contraction"] = training_ops(model.products[0].symmetric_contractions.op)
    if "channelwise_tp" in families:
        res["channelwise_tp"] = training_ops(channelwise_tp_op(model.interactions[1].conv_tp)[0])
    return res


def format_table(rows: Sequence[KernelResources]) -> str:
    """The per-kernel table, then the launches per pass of each op (one op instance)."""
    columns = [  # None, where ptxas was not found, shows as -
        Column("op", "family", width=21, align="<"),
        Column("pass", "op", width=16, align="<"),
        Column("output", lambda r: r.output[:10], width=10, align="<"),
        Column("kernel", "kernel", width=12, align="<"),
        Column("variant", "variant", width=8, align="<"),
        Column("dtype", "dtype", width=7, align="<"),
        Column("terms", "terms", "d", 6),
        Column("SASS", "sass_instructions", width=6),
        Column("FP", "sass_fp", width=6),
        Column("/term", "sass_per_term", ".1f", 6),
        Column("regs", "registers", width=5),
        Column("spill B", lambda r: None if r.spill_stores is None else r.spill_stores + r.spill_loads, "d", 8),
        Column("smem B", "shared_bytes", width=7),
        Column("occ.", "occupancy", ".2f", 5),
        Column("compile", lambda r: f"{r.compile_s:7.1f}s", width=8),
    ]
    lines = [render(rows, columns)]
    per_pass = launches_per_pass(rows)
    if per_pass:
        lines += [
            "",
            "launches per pass (one op instance; a training step runs forward, backward and double backward):",
        ]
        lines += [
            f"  {fam} [{variant}, {dtype}]: " + ", ".join(f"{p} {n}" for p, n in passes.items())
            for (fam, variant, dtype), passes in per_pass.items()
        ]
    return "\n".join(lines)


def launches_per_pass(rows: Sequence[KernelResources]) -> dict[tuple[str, str, str], dict[str, int]]:
    """``{(family, mode, dtype): {pass: launches}}`` (the segment sums count with their pass)."""
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for r in rows:
        passes = out.setdefault((r.family, r.mode, r.dtype), {})
        passes[r.op] = passes.get(r.op, 0) + 1
    return out


def _meta(args: argparse.Namespace, cc: tuple[int, int], ptxas: str | None, channels: int) -> dict:
    """What the JSON records about the toolchain and the configuration."""
    import numba

    paper = args.hidden == "128x0e+128x1o" and args.max_ell == 3 and args.correlation == 3
    meta = {
        "cc": list(cc),
        "ptxas": ptxas,
        numba.__name__: numba.__version__,
        "machine": platform.node(),
        "config": f"{'paper: ' if paper else ''}{args.hidden}, max_ell {args.max_ell}, "
        f"correlation {args.correlation}, 4 elements, {channels} channels",
    }
    try:
        from importlib.metadata import version

        meta["numba_cuda"] = version("numba-cuda")
    except Exception:
        pass
    return meta


def main(args: argparse.Namespace) -> int:
    """``workbench kernels resources``: the table, and the JSON at ``--json``."""
    from e3nn import o3

    cc = tuple(int(v) for v in args.cc.split("."))
    ptxas = find_ptxas()
    if ptxas is None:
        print(
            "note: ptxas not found (install the nvidia-cuda-nvcc wheel or set PTXAS): PTX only, no resource counts",
            file=sys.stderr,
        )
    variants = ("auto", "table") if args.variant == "both" else (args.variant,)
    dtypes = ("float32", "float64") if args.dtype == "both" else (args.dtype,)
    wanted = [o.strip() for o in args.ops.split(",") if o.strip()]
    channels = o3.Irreps(args.hidden)[0].mul
    all_ops = paper_ops(wanted, hidden=args.hidden, max_ell=args.max_ell, correlation=args.correlation)
    rows = []
    for name in wanted:
        for variant in variants:
            for dtype in dtypes:
                rows += kernel_resources(
                    all_ops[name], dtype, variant, cc, ptxas, progress=True, family=name, channels=channels
                )
    print(format_table(rows))
    if args.json:
        path = write_json(
            args.json.format(cc=f"{cc[0]}{cc[1]}"),
            {"meta": _meta(args, cc, ptxas, channels), "kernels": [asdict(r) for r in rows]},
        )
        print(f"wrote {path}")
    return 0
