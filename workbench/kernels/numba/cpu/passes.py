r"""CPU path: the :mod:`~workbench.kernels.descriptor.program` vector programs, run by numba with
the channel loop innermost (SIMD over channels).

Every pass of an op (forward, backward, double backward) is a few *row passes*. A row pass runs
one vector program per input row (an atom, an edge), summed over a *segment* of rows:

* atom ops: segments are pieces of at most :data:`PIECE` atoms of one species (the species
  CSR), so the weights' vector registers are loaded once per piece. Atom outputs are stored
  per atom; species outputs (weight gradients) are summed over the piece into one partial row,
  then the pieces of each species are added in order (:func:`sum_pieces`);
* edge ops, node outputs (messages to receivers, gradients scattered to senders): one segment
  per node, its CSR list of edges; the node's own operand rows are loaded once;
* edge ops, edge outputs (gradients of the radial weights and of the spherical harmonics):
  one segment per receiver (or sender: whichever end point's rows hold more of the vector
  operands, e.g. the message cotangent), whose rows are then loaded once, stored per edge (a channel-summed output is
  reduced over channels as :data:`LANES` interleaved partial sums, in a fixed order).

Coefficients that carry broadcast factors (e.g. an edge's spherical harmonics) are computed for every
row before the pass (:func:`row_coefficients`, vectorised over rows).

All the outputs of one pass with the same row shape share one program, so their common
monomials are built once and every operand row is read once. An edge op whose outputs are one
end point's sums and per-edge rows (a message op's backward: the feature gradient to senders,
the radial-weight and harmonic gradients per edge) runs them as one fused sender pass
(``WORKBENCH_CPU_MERGE_EDGES``; by default from :data:`MERGE_MIN_CHANNELS` channels): each
``[E, J]`` weight row is read once, not twice (MACE's paper configuration, MD at 1,536 atoms:
0.92x the step). Segments run in parallel
(``prange``, :mod:`~workbench.kernels.numba.cpu.segments`); no two segments write the same element, so there are no atomics, and sums run
in a fixed order: the same inputs give the same bits on every run and thread count.

Layout: a vector register is a contiguous run of ``C`` channels. Channelwise operands whose
components are not already contiguous (e3nn's ``[rows, C, 2l+1]`` irrep blocks) are copied to
component-major ``[rows, size * C]`` once per call (:func:`channels_last`); outputs are stored
in their own layout directly.

Arithmetic is IEEE with one exception: ``fastmath={"contract"}`` lets LLVM fuse a multiply
and an add into an FMA (one rounding instead of two); nothing is reassociated, and no order
depends on the thread count, so the bits depend only on the inputs and the machine's
instruction set. Index arithmetic is unsigned, which lets LLVM vectorise the channel loops
(a signed index costs a negative-index check per element). Small problems run on the calling thread
(:data:`SERIAL_WORK`), where waking numba's thread pool would cost more than the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from workbench.kernels.descriptor.program import VectorProgram, vector_program
from workbench.kernels.numba.cpu.columns import gather_columns
from workbench.kernels.numba.cpu.fused import TableRead, fused_pass, use_fused
from workbench.kernels.numba.cpu.loops import NUM_ARRAYS, coefficients_by_row, drivers, sum_pieces
from workbench.kernels.options import kernel_options

__all__ = [
    "NUM_ARRAYS",
    "PIECE",
    "ROW_WORK",
    "SERIAL_WORK",
    "CpuPlan",
    "RowPass",
    "channels_last",
    "pass_work",
    "plan",
    "run_atom",
    "run_edge",
    "run_pass",
    "species_pieces",
    "sum_pieces",
]


#: rows per segment where segments are free to choose (species pieces, runs of edges)
PIECE = 16
#: below this much work (:func:`pass_work`) a pass runs serially (``KernelOptions.cpu_serial_work``
#: overrides it): about 30 us on one core. Replayed passes of MACE (water, 24 to 96 atoms) and
#: NequIP (11,050 edges) ran in parallel in at most the serial time down to 0.01 ms, and whole
#: MD and train steps down to one water molecule were no slower in parallel
SERIAL_WORK = 100_000
#: a row's own cost (loading its registers, storing its outputs) in channel-instructions: a
#: 4-instruction pass over 11,050 edges at 16 channels took 50 ns a row, ~150 of them
ROW_WORK = 150
#: the channel count from which an edge op's per-edge outputs join its node pass
#: (:func:`plan`): MACE at 128 channels, MD 0.92-0.97x the step; NequIP at 32, 0.96-1.05x (noise);
#: at 16, 1.05x (its rows are short, and the sender walk costs more than the second read)
MERGE_MIN_CHANNELS = 64
#: how an operand row is found from an input row: the row itself, or through index 1 / 2
#: (atom ops: species; edge ops: sender, receiver)
ROW_SELF, ROW_IDX1, ROW_IDX2 = 0, 1, 2


@dataclass(frozen=True, eq=False)
class RowPass:
    """One vector program over the rows of a pass, and how to load and store it.

    ``vec_arr / vec_code / vec_base``: per vector register, its kernel array, row code
    (:data:`ROW_SELF`, ...) and the offset of its channel run (channel ``c`` at ``base + c``);
    ``vec_const``: loaded once per segment (its row is the segment's own row);
    ``sca_arr / sca_code / sca_off``: the broadcast scalars; per accumulator, its output
    (``acc_out``), element ``acc_off + c * acc_cs`` (``acc_cs == 0``: summed over channels) and
    whether it is stored per segment (``acc_seg``) or per row.
    """

    program: VectorProgram
    outputs: tuple[int, ...]  # the op's output index of each program output
    const_code: int  # the row code loaded once per segment (-1: none)
    vec_arr: np.ndarray
    vec_code: np.ndarray
    vec_base: np.ndarray
    vec_const: np.ndarray
    sca_arr: np.ndarray
    sca_code: np.ndarray
    sca_off: np.ndarray
    acc_out: np.ndarray
    acc_off: np.ndarray
    acc_cs: np.ndarray
    acc_seg: np.ndarray
    #: a node pass holding an op's per-edge outputs too (fused up to a larger program)
    merged: bool = False

    def fused(self, options: Any = None) -> bool:
        """Whether this pass runs as a fused kernel (:func:`~workbench.kernels.numba.cpu.fused.use_fused`)."""
        return use_fused(self.program, options, merged=self.merged)

    def drivers(self, dtype: str, channels: int) -> tuple[Any, Any]:
        """``(parallel, serial)`` row-pass drivers whose body runs the program on one row:
        generated straight-line code (:mod:`~workbench.kernels.numba.cpu.unrolled`) or the
        interpreter."""
        from workbench.kernels.numba.cpu import unrolled as cpu_unrolled

        if cpu_unrolled.use_generated(self.program):
            return drivers(cpu_unrolled.body_source(self.program, channels, dtype, self.acc_seg))
        return drivers(None)

    def coefficients(self, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(register, constant, broadcast factors)`` of every coefficient term, in ``dtype``
        (built once per dtype: a training step asks hundreds of times)."""
        cached = self.__dict__.setdefault("_coefficients", {})
        if dtype not in cached:
            k = self.program.k_terms
            cached[dtype] = (
                k[:, 0].astype(np.int64),
                k[:, 1].astype(dtype),
                np.ascontiguousarray(k[:, 2:]).astype(np.int64),
            )
        return cached[dtype]


def make_pass(
    polys: Sequence,
    outputs: Sequence[int],
    array_ids: Sequence[int],
    row_code: dict[str, int],
    channels: int,
    const_code: int,
    per_segment: Sequence[bool],
) -> RowPass:
    """The :class:`RowPass` of ``polys`` (outputs ``outputs`` of one op): ``array_ids[a]`` is
    operand ``a``'s kernel array, ``row_code`` maps an operand's rows to its row code, vector
    registers of ``const_code`` are loaded once per segment, ``per_segment[p]``: polynomial
    ``p`` is stored once per segment (else per row)."""
    prog = vector_program(polys)
    ops = prog.operands

    def base(a: int, i: int) -> int:
        op = ops[a]
        return op.offsets[i] if all(cs == 1 for cs in op.cstrides) else i * channels

    vec_code = np.array([row_code[ops[a].rows] for a in prog.vec_operand], dtype=np.int64)
    acc_out, acc_off, acc_cs, acc_seg = [], [], [], []
    for p, o in zip(prog.acc_output, prog.acc_comp):
        out = prog.outputs[p]
        acc_out.append(int(p))
        acc_off.append(out.offsets[o])
        acc_cs.append(out.cstrides[o])
        acc_seg.append(int(bool(per_segment[p])))
    return RowPass(
        program=prog,
        outputs=tuple(outputs),
        const_code=int(const_code),
        vec_arr=np.array([array_ids[a] for a in prog.vec_operand], dtype=np.int64),
        vec_code=vec_code,
        vec_base=np.array([base(a, i) for a, i in zip(prog.vec_operand, prog.vec_comp)], dtype=np.int64),
        vec_const=(vec_code == const_code).astype(np.int64),
        sca_arr=np.array([array_ids[a] for a in prog.sca_operand], dtype=np.int64),
        sca_code=np.array([row_code[ops[a].rows] for a in prog.sca_operand], dtype=np.int64),
        sca_off=np.array([ops[a].offsets[i] for a, i in zip(prog.sca_operand, prog.sca_comp)], dtype=np.int64),
        acc_out=np.array(acc_out, dtype=np.int64),
        acc_off=np.array(acc_off, dtype=np.int64),
        acc_cs=np.array(acc_cs, dtype=np.int64),
        acc_seg=np.array(acc_seg, dtype=np.int64),
    )


def channels_last(op, channels: int) -> np.ndarray | None:
    """Column order that makes operand ``op`` component-major (component ``i`` at columns
    ``i*C .. i*C+C-1``), or None when every component's channels are already contiguous (or it
    is broadcast over channels)."""
    if all(cs == 1 for cs in op.cstrides) or all(cs == 0 for cs in op.cstrides):
        return None
    c = np.arange(channels, dtype=np.int64)
    return np.concatenate([off + c * cs for off, cs in zip(op.offsets, op.cstrides)])


def row_coefficients(
    rp: RowPass, arrays: Sequence[np.ndarray], idx1: np.ndarray, idx2: np.ndarray, num_rows: int, dtype: str
) -> np.ndarray:
    """The coefficient registers of every input row, ``[num_rows, num_k]`` (``[1, num_k]``
    when the program has no broadcast operands): constants times the row's broadcast scalars."""
    k_reg, k_coef, k_fac = rp.coefficients(dtype)
    nk = max(rp.program.num_k, 1)
    if rp.program.num_scalars == 0:
        K = np.zeros((1, nk), dtype=dtype)
        np.add.at(K[0], k_reg, k_coef)
        return K
    rows = {ROW_IDX1: idx1, ROW_IDX2: idx2}
    S = np.ones((rp.program.num_scalars + 1, num_rows), dtype=dtype)
    for j, (aid, code, off) in enumerate(zip(rp.sca_arr, rp.sca_code, rp.sca_off)):
        column = arrays[aid][:, off]  # a row's own scalar: a strided copy, no index array
        S[j] = column if code == ROW_SELF else column[rows[int(code)]]
    return coefficients_by_row(S, k_reg, k_coef, k_fac, nk)


def pass_work(rows: int, instructions: int, channels: int) -> int:
    """A row pass's work in channel-instructions: ``rows * (instructions * channels + ROW_WORK)``."""
    return rows * (max(instructions, 1) * channels + ROW_WORK)


def run_pass(
    rp: RowPass,
    arrays: Sequence[np.ndarray],
    idx1: np.ndarray,
    idx2: np.ndarray,
    segments: tuple[np.ndarray, np.ndarray, np.ndarray],
    channels: int,
    outs: Sequence[np.ndarray],
    table: tuple[TableRead, tuple] | None = None,
) -> None:
    """Run ``rp`` over ``segments = (ptr, perm, row)``: ``arrays`` the 10 kernel arrays (operands
    in channels-last layout where :func:`channels_last` says so), ``idx1`` / ``idx2`` the row
    indices of row codes 1 / 2, ``outs`` the pass's output arrays (at most 4); ``table``: an
    operand read from a table and its row arrays (:meth:`~workbench.kernels.numba.cpu.tabulated.TableOperand.read`), fused kernels only."""
    prog = rp.program
    if prog.num_instructions == 0 and prog.num_accumulators == 0:
        return
    if len(outs) > 4:
        raise ValueError(f"a CPU row pass stores at most 4 outputs, got {len(outs)}")
    dtype = str(outs[0].dtype)
    outs = list(outs) + [outs[0]] * (4 - len(outs))
    ptr, perm, row = segments
    options = kernel_options()
    work = pass_work(int(perm.shape[0]), prog.num_instructions, channels)
    in_parallel = work >= (options.cpu_serial_work or SERIAL_WORK)
    if table is not None:
        fused_pass(rp, channels, dtype, table[0]).run(in_parallel, arrays, idx1, idx2, segments, outs, table[1])
        return
    if rp.fused(options):
        fused_pass(rp, channels, dtype).run(in_parallel, arrays, idx1, idx2, segments, outs)
        return
    K = row_coefficients(rp, arrays, idx1, idx2, int(perm.shape[0]), dtype)
    parallel, serial = rp.drivers(dtype, channels)
    (parallel if in_parallel else serial)(
        *arrays,
        idx1,
        idx2,
        ptr,
        perm,
        row,
        channels,
        prog.num_registers,
        rp.vec_arr,
        rp.vec_code,
        rp.vec_base,
        rp.vec_const,
        K,
        prog.ins,
        rp.acc_out,
        rp.acc_off,
        rp.acc_cs,
        rp.acc_seg,
        *outs,
    )


#: row codes of each operand's rows, per kind of op
_ROW_CODES = {"atom": ROW_SELF, "species": ROW_IDX1, "edge": ROW_SELF, "sender": ROW_IDX1, "receiver": ROW_IDX2}
#: the row pass of each output rows, the row code loaded once per segment, and whether the
#: output is stored per segment
_PASS_OF = {
    "atom": ("atom", ROW_IDX1, False),
    "species": ("atom", ROW_IDX1, True),
    "receiver": ("receiver", ROW_IDX2, True),
    "sender": ("sender", ROW_IDX1, True),
    "edge": ("edge", -1, False),
}


@dataclass(frozen=True, eq=False)
class CpuPlan:
    """The row passes of one op (``(kind, RowPass)``: ``"atom"``, ``"receiver"``, ``"sender"``
    or ``"edge"``) and, per operand, the column order that makes it channels-last (or None)."""

    passes: tuple[tuple[str, RowPass], ...]
    order: tuple[np.ndarray | None, ...]
    array_ids: tuple[int, ...]

    def instructions(self) -> int:
        return sum(rp.program.num_instructions for _, rp in self.passes)


def plan(polys: Sequence, array_ids: Sequence[int], channels: int) -> CpuPlan:
    """Group the outputs ``polys`` of one op (same operands) into row passes, one program each."""
    kinds: dict[str, list[int]] = {}
    for k, p in enumerate(polys):
        if p.num_terms:
            kinds.setdefault(_PASS_OF[p.output.rows][0], []).append(k)
    passes = []
    for kind, ks in kinds.items():
        const = _PASS_OF[polys[ks[0]].output.rows][1]
        if kind == "edge":  # walk the edges by the end point whose rows carry most of the vectors
            used = sorted({f for k in ks for _, fs in polys[k].terms for f in fs})
            ops = polys[ks[0]].operands
            count = {
                code: sum(1 for a, _ in used if ops[a].rows == rows and any(ops[a].cstrides))
                for code, rows in ((ROW_IDX1, "sender"), (ROW_IDX2, "receiver"))
            }
            const = max(count, key=lambda code: (count[code], code)) if max(count.values()) else -1
        per_seg = [_PASS_OF[polys[k].output.rows][2] for k in ks]
        passes.append((kind, make_pass([polys[k] for k in ks], ks, array_ids, _ROW_CODES, channels, const, per_seg)))
    order = tuple(channels_last(op, channels) for op in polys[0].operands)
    return CpuPlan(tuple(_merged_edge_outputs(passes, kinds, polys, array_ids, channels)), order, tuple(array_ids))


def _merged_edge_outputs(passes: list, kinds: dict, polys: Sequence, array_ids: Sequence[int], channels: int) -> list:
    """The per-edge outputs (radial-weight and harmonic gradients) computed in the pass that
    scatters to one end point (the node-feature gradient), when that one program is fused: every
    edge row (``[E, J]`` weights, their gradient) is then read once a backward instead of twice.
    The node pass walks its end point's edge lists; a per-edge output may be stored in any order."""
    options = kernel_options()
    nodes = [k for k in kinds if k in ("sender", "receiver")]
    wanted = channels >= MERGE_MIN_CHANNELS if options.cpu_merge_edges is None else options.cpu_merge_edges
    if not wanted or options.cpu_kernels in ("interpreter", "generated") or "edge" not in kinds or len(nodes) != 1:
        return passes
    ks = kinds[nodes[0]] + kinds["edge"]
    per_seg = [_PASS_OF[polys[k].output.rows][2] for k in ks]
    const = _PASS_OF[nodes[0]][1]
    merged = make_pass([polys[k] for k in ks], ks, array_ids, _ROW_CODES, channels, const, per_seg)
    merged = dataclasses.replace(merged, merged=True)
    if not merged.fused(options):
        return passes
    return [(kind, rp) for kind, rp in passes if kind not in ("edge", nodes[0])] + [(nodes[0], merged)]


def _host_arrays(cp: CpuPlan, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``arrays`` with each operand in its channels-last column order (:func:`gather_columns`:
    row-parallel, where torch's ``index_select`` along columns runs on one thread)."""
    arrays = list(arrays)
    for aid, order in zip(cp.array_ids, cp.order):
        if order is not None:
            arrays[aid] = gather_columns(np.ascontiguousarray(arrays[aid]), order)
    return arrays


@lru_cache(maxsize=32)
def _runs(n: int, size: int = PIECE) -> tuple[np.ndarray, np.ndarray]:
    """Segments of ``size`` consecutive rows: ``(ptr, perm)`` (kept: every step asks again; the
    kernels only read them)."""
    return np.minimum(np.arange(0, n + size, size, dtype=np.int64), n)[: -(-n // size) + 1], _arange(n)


@lru_cache(maxsize=32)
def _arange(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def species_pieces(
    species: np.ndarray, num_species: int, size: int = PIECE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Atoms grouped by species (ascending atom order), cut into pieces of at most ``size``:
    ``(seg_ptr [pieces + 1], perm [atoms], piece_ptr [num_species + 1])``; the pieces of species
    ``z`` are ``piece_ptr[z] .. piece_ptr[z+1] - 1``. Depends only on ``species``, so the sums
    over pieces are the same on every run and thread count."""
    perm = np.argsort(species, kind="stable").astype(np.int64)
    counts = np.bincount(species, minlength=num_species)[:num_species]
    if counts.sum() != species.shape[0]:
        raise ValueError(f"species index outside [0, {num_species})")
    per = -(-counts // size)
    piece_ptr = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    seg = [min(starts[z] + i * size, starts[z + 1]) for z in range(num_species) for i in range(per[z])]
    return np.array(seg + [species.shape[0]], dtype=np.int64), perm, piece_ptr


def run_atom(
    cp: CpuPlan,
    arrays: Sequence[np.ndarray],
    species: np.ndarray,
    num_species: int,
    channels: int,
    outs: Sequence[np.ndarray],
) -> None:
    """Evaluate an atom op's outputs ``outs`` (atom rows, or species rows summed over atoms)."""
    arrays = _host_arrays(cp, arrays)
    ptr, perm, piece_ptr = species_pieces(species, num_species)
    pieces = ptr.shape[0] - 1
    rows = np.arange(pieces, dtype=np.int64)
    for _, rp in cp.passes:
        targets, sums = [], []
        for p, k in enumerate(rp.outputs):
            if rp.program.outputs[p].rows == "species":
                part = np.zeros((pieces, outs[k].shape[1]), dtype=outs[k].dtype)
                targets.append(part)
                sums.append((part, outs[k]))
            else:
                targets.append(outs[k])
        run_pass(rp, arrays, species, species, (ptr, perm, rows), channels, targets)
        for part, out in sums:
            sum_pieces(part, piece_ptr, out)


def run_edge(
    cp: CpuPlan,
    arrays: Sequence[np.ndarray],
    sender: np.ndarray,
    receiver: np.ndarray,
    csr,
    num_nodes: int,
    channels: int,
    outs: Sequence[np.ndarray],
    table: Any = None,
) -> None:
    """Evaluate an edge op's outputs ``outs``; ``csr(rows)`` gives ``(ptr, perm)`` of the edges
    grouped by their ``"sender"`` or ``"receiver"`` node. ``table``: one operand read from a
    table (a :class:`~workbench.kernels.numba.cpu.tabulated.TableOperand`; its ``outs`` entry,
    if its cotangent is an output, is not written)."""
    arrays = _host_arrays(cp, arrays)
    if table is not None:
        arrays[table.array] = table.coeffs
    options = kernel_options()
    for kind, rp in cp.passes:
        # fused kernels load no row once per segment: per-edge outputs walk the edges in memory order
        if kind == "edge" and (rp.const_code == -1 or rp.fused(options)):
            ptr, perm = _runs(sender.shape[0])
            seg = (ptr, perm, perm)
        else:  # node outputs, or edge outputs walked by the end point whose rows are loaded once
            rows = kind if kind != "edge" else ("sender" if rp.const_code == ROW_IDX1 else "receiver")
            ptr, perm = csr(rows)
            seg = (ptr, perm, _arange(num_nodes))
        read = table.read(rp) if table is not None else None
        run_pass(rp, arrays, sender, receiver, seg, channels, [outs[k] for k in rp.outputs], read)
