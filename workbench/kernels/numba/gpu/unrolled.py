r"""Unrolled numba-CUDA kernels generated per term table (paper §4.2: CG-sparse, unrolled, fused).

The table-driven kernels (:mod:`~workbench.kernels.numba.gpu.atom`, :mod:`~workbench.kernels.numba.gpu.edge`)
walk the term table at run time and keep operand components in shared memory, so every term
costs ~3 dependent shared loads and its index arithmetic. Here the table is turned into
straight-line code instead, with common factors taken out. An atom kernel (the contraction,
thousands of terms) calls its sums as one generated numba intrinsic
(:func:`~workbench.kernels.numba.gpu.unrolled_sums.sums`, :mod:`~workbench.kernels.numba.gpu.poly_ir`):

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
output (:func:`~workbench.kernels.numba.gpu.unrolled_sums.program`); the intrinsic lowers it straight to LLVM ``fmul``/``fma`` with the
coefficients as immediates. Compile time is about 0.5 ms per term on one core (5 ms while
numba typed every term). A message kernel (at most ~2,000 terms) writes the same sums out as
numba source (:func:`~workbench.kernels.numba.gpu.unrolled_sums.sums` with ``source=True``: ``acc[0] = cuda.fma(m0, cuda.fma(v40, K3, ...), acc[0])``
in ``if go:`` blocks), whose blocks keep NVVM from sharing products across them and so keep
registers lower. Either way a term costs about one fused multiply-add (the paper contraction's
forward: about 1 SASS instruction per term, against 3.0 for the term-by-term code of the first
version). Three kernel shapes mirror the table-driven ones:

* ``atom``: thread per (atom, channel); species operands are read at the atom's species row;
  a species output (weight gradient) is written as one partial row per atom, summed per
  species by :mod:`~workbench.kernels.numba.gpu.segment` (deterministic, no atomics);
* ``node``: thread per (node, channel) walking the node's CSR segment of edges, accumulators
  kept in registers over the whole segment; one store per component, no atomics;
* ``edge``: thread per (edge, channel), or for a channel-summed output (the gradient of the
  spherical harmonics) ``G`` threads per edge, each summing a strided subset of channels; the
  ``G`` partials are added in shared memory in a fixed order by the edge's first thread.

A thread's registers bound how many terms one kernel can hold, so :func:`use_unrolled` keeps
the table-driven kernel above ``WORKBENCH_UNROLL_MAX_TERMS`` (default :data:`DEFAULT_MAX_TERMS`)
or when ``WORKBENCH_CUDA_KERNELS=table``, and :func:`unrolled_parts` splits larger polynomials
(:mod:`~workbench.kernels.numba.gpu.atom_pass` runs the parts of a pass in one launch). Each
generated source (which encodes the whole table) is written to a module under
:func:`source_dir` and compiled with numba's on-disk cache, so it compiles once per machine.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any

from workbench.kernels.descriptor.tables import TermTable
from workbench.kernels.numba.generated import load_module
from workbench.kernels.numba.gpu.unrolled_source import (
    ATOM_ROW_VARS,
    EDGE_ROW_VARS,
    THREADS_PER_BLOCK,
    Index,
    atom_head,
    atom_lines,
    edge_rows,
    kernel_source,
)
from workbench.kernels.numba.gpu.unrolled_sums import Definitions, dtype_name, program, sums
from workbench.kernels.options import kernel_options, numba_simulator

__all__ = [
    "ATOM_ROW_VARS",
    "DEFAULT_MAX_TERMS",
    "EDGE_ROW_VARS",
    "GENERATED_PREFIX",
    "MAX_PARTS",
    "MAX_PARTS_F64",
    "MAX_PART_SLOTS_F64",
    "MAX_WEIGHT_PARTS_F64",
    "SPLIT_FULL_SLOTS",
    "SPLIT_PART_TERMS",
    "SPLIT_PART_TERMS_F64",
    "SPLIT_WEIGHT_TERMS_F64",
    "THREADS_PER_BLOCK",
    "Definitions",
    "Index",
    "atom_head",
    "atom_lines",
    "block_size",
    "dtype_name",
    "edge_rows",
    "get_unrolled_kernel",
    "kernel_source",
    "live_slots",
    "program",
    "sums",
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
#: per thread (the budget for float64 is 256 B); d(d(out)) (4 components of ~1235 terms) in 10 runs of terms
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
cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


def block_size() -> int:
    """Threads per block of the generated kernels: ``WORKBENCH_CUDA_TPB``, default
    :data:`THREADS_PER_BLOCK`."""
    return kernel_options().threads_per_block or THREADS_PER_BLOCK


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
    :data:`~workbench.kernels.numba.gpu.atom_pass.FUSED_SCALE`)."""
    options = kernel_options()
    if options.cuda_kernels != "auto":
        return options.cuda_kernels == "unrolled"
    live = (slots + accumulators) * itemsize // 4
    budget = options.unroll_max_terms or DEFAULT_MAX_TERMS
    return unroll_cost(num_terms, accumulators, itemsize) <= budget * scale and live <= MAX_LIVE_REGISTERS


def live_slots(compiled: Any) -> int:
    """Operand components :func:`use_unrolled` counts as live. A message kernel (edge rows)
    loads an edge's components and consumes them in its few hundred terms, so ptxas keeps only
    part of them live: half are counted (128x0e+128x1o+128x2e, float64, forced unrolled: the
    backward's d(x), 104 components and 9 accumulators, takes 96 registers; the double
    backward's d(d(out)), 84 and 71, spills 1.6 KB). An atom kernel's components are used all
    through its thousands of terms and count whole."""
    return compiled.num_slots // 2 if compiled.edge else compiled.num_slots


def _weight_operands(compiled: Any) -> list[int]:
    """The positions of ``compiled``'s species operands (the weights)."""
    return [a for a, o in enumerate(compiled.poly.operands) if o.rows == "species"]


def _forced_parts(compiled: Any, split: bool, mode: str) -> list[TermTable] | None:
    """The parts an environment variable forces (``WORKBENCH_UNROLL_PARTS`` above 1,
    ``WORKBENCH_UNROLL_TERMS`` for an atom polynomial, ``WORKBENCH_UNROLL_WEIGHT_GROUPS`` for one
    with weights), or None."""
    if not split or mode == "table":
        return None
    options = kernel_options()
    if options.unroll_parts and options.unroll_parts > 1:
        return compiled.split(options.unroll_parts)
    if options.unroll_terms and not compiled.edge:
        return compiled.split_terms(options.unroll_terms)
    weights = _weight_operands(compiled)
    if options.unroll_weight_groups and weights:
        return compiled.split_operand(options.unroll_weight_groups, weights[0])
    return None


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
    mode = kernel_options().cuda_kernels
    forced = _forced_parts(compiled, split, mode)
    if forced is not None:
        return forced
    itemsize = 8 if dtype == "float64" else 4
    if itemsize == 8:
        scale = 1.0
    if use_unrolled(compiled.num_terms, compiled.accumulators, live_slots(compiled), itemsize, scale):
        return [compiled.table]
    if not split or kernel_options().unroll_parts is not None or mode != "auto":
        return None
    return _split_parts(compiled, itemsize, scale)


def _fits(p: TermTable, compiled: Any, size: int, itemsize: int, scale: float) -> bool:
    """Whether the part ``p`` of ``compiled`` runs as one generated kernel (:func:`unrolled_parts`)."""
    if p.num_terms > size * 5 // 4:  # components too coarse to balance: a part stays too large
        return False
    accumulators = len(set(p.t_out.tolist()))
    if compiled.edge:  # operands counted as live_slots counts them
        return use_unrolled(p.num_terms, accumulators, p.num_slots // 2, itemsize)
    if itemsize == 8:
        return p.num_slots <= MAX_PART_SLOTS_F64
    return use_unrolled(p.num_terms, accumulators, p.num_slots, itemsize, scale)


def _split_parts(compiled: Any, itemsize: int, scale: float) -> list[TermTable] | None:
    """The automatic split of :func:`unrolled_parts`: by output components, then (atom
    polynomials) runs of terms, then groups by weight component; None when no split fits."""
    size, most = (SPLIT_PART_TERMS_F64, MAX_PARTS_F64) if itemsize == 8 else (SPLIT_PART_TERMS, MAX_PARTS)
    if itemsize == 4 and compiled.num_slots > SPLIT_FULL_SLOTS:  # more operands live per term: smaller parts
        size = size * SPLIT_FULL_SLOTS // compiled.num_slots
    size = int(size * scale)

    def fits(p: TermTable) -> bool:
        return _fits(p, compiled, size, itemsize, scale)

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
    weights = _weight_operands(compiled)
    if weights:
        wsize, wmost = (SPLIT_WEIGHT_TERMS_F64, MAX_WEIGHT_PARTS_F64) if itemsize == 8 else (size, most)
        parts = compiled.split_operand(wsize, weights[0])
        if len(parts) <= wmost and all(fits(p) for p in parts):
            return parts
    return None


def unroll(compiled: Any, dtype: str, split: bool = True) -> bool:
    """Whether ``compiled`` runs as generated kernels in ``dtype`` (:func:`unrolled_parts`)."""
    return unrolled_parts(compiled, dtype, split) is not None


_HEADER = """# generated by workbench.kernels.unrolled from a term table; safe to delete
import numba
import numpy as np
from numba import cuda

from workbench.kernels.numba.gpu.poly_ir import polynomial

f32 = numba.float32
u64 = numba.uint64


"""


#: module name prefix of the generated kernels (precompile recognises them by it)
GENERATED_PREFIX = "workbench_unrolled"


@cache
def _compile(source: str) -> Any:
    """The kernel of ``source``, written once to a module file so that numba can cache its
    machine code on disk (``cache=True``): a configuration compiles once per machine, not once
    per process. Under the simulator (or ``WORKBENCH_KERNEL_DISK_CACHE=0``) it is built in memory."""
    global cuda  # a module global: the simulator swaps the kernel's global ``cuda`` for its fake
    from numba import cuda

    digest = hashlib.sha1(source.encode()).hexdigest()[:20]
    name = f"{GENERATED_PREFIX}_{digest}"
    if numba_simulator() or not kernel_options().cache:
        namespace: dict = {}
        exec(compile(_HEADER + source, f"<{name}>", "exec"), namespace)
        return cuda.jit(namespace["kernel"])
    text = _HEADER + source.replace("\ndef kernel(", "\n@cuda.jit(cache=True)\ndef kernel(", 1)
    return load_module(text, GENERATED_PREFIX).kernel


@cache
def get_unrolled_kernel(table: TermTable, shape: str, dtype: str, **options: Any) -> Any:
    """The compiled unrolled kernel for ``table`` (``shape``, ``dtype`` and the keyword
    ``options`` as for :func:`kernel_source`, which owns them): cached per table object, so a
    launch does not regenerate the source (tables from another process, e.g. unpickled, share
    the compiled kernel through the per-source cache)."""
    return _compile(kernel_source(table, shape, dtype, **options))
