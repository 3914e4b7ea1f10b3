r"""The numba loops of the CPU path (:mod:`~workbench.kernels.numba.cpu.passes`): the row-pass drivers,
generated as source per body and compiled with numba's on-disk cache.

A row pass loads each row's vector registers, runs the vector program (the interpreter below,
or straight-line code from :mod:`~workbench.kernels.numba.cpu.unrolled`) and stores the
accumulators. Everything a row does is written out in one function, :func:`driver_source`:

* no helper function takes an array argument inside the row loop. numba counts references
  to every array passed to a call (an atomic increment and decrement each, on a cache line
  that both threads share), and picking one of ten operand arrays through a helper cost
  ~140 ns per register load, 25x the load itself. The choice of array is an ``if`` chain around
  whole channel loops instead;
* indices are unsigned where they can be: numba checks a signed index for negative values
  element by element, which stops LLVM from vectorising the channel loops;
* channel sums (outputs broadcast over channels) run as :data:`LANES` interleaved partial sums
  added in a fixed order.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from workbench.kernels.descriptor.program import ADD_AXPY, ADD_K, ADD_MUL, SET_AXPY, SET_K, SET_MUL
from workbench.kernels.numba.cpu.segments import Segments

__all__ = [
    "FASTMATH",
    "LANES",
    "NUM_ARRAYS",
    "NUM_OUTPUTS",
    "coefficients_by_row",
    "csr_by_counting",
    "driver_source",
    "drivers",
    "sum_pieces",
]

#: LLVM may fuse a multiply and an add (one rounding); nothing is reassociated
FASTMATH = {"contract"}
#: lanes of the blocked channel sum (a fixed order, whatever SIMD width the CPU has)
LANES = 8
#: operand arrays and output arrays a driver takes
NUM_ARRAYS = 10
NUM_OUTPUTS = 4

_ARGS = (
    ", ".join(f"a{i}" for i in range(NUM_ARRAYS)) + ", idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg, "
    "vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, "
    + ", ".join(f"o{i}" for i in range(NUM_OUTPUTS))
)


def _chain(selector: str, names: list[str], line: str, ind: str) -> list[str]:
    """``if selector == i: <line with X = names[i]>`` for every name (the last as ``else``)."""
    out = []
    for i, name in enumerate(names):
        head = "if" if i == 0 else ("else" if i == len(names) - 1 else "elif")
        out.append(f"{ind}{head} {selector} == {i}:" if head != "else" else f"{ind}else:")
        out.append(f"{ind}    {line.replace('X', name)}")
    return out


_INTERPRETER = {
    SET_MUL: "R[d, c] = k * R[a, c] * R[b, c]",
    ADD_MUL: "R[d, c] += k * R[a, c] * R[b, c]",
    SET_AXPY: "R[d, c] = k * R[a, c]",
    ADD_AXPY: "R[d, c] += k * R[a, c]",
    SET_K: "R[d, c] = k",
    ADD_K: "R[d, c] += k",
}


def _interpreter_lines(ind: str) -> list[str]:
    lines = [
        f"{ind}for i in range(ins.shape[0]):",
        f"{ind}    op = ins[i, 0]",
        f"{ind}    d = np.uint64(ins[i, 1])",
        f"{ind}    a = np.uint64(ins[i, 2])",
        f"{ind}    b = np.uint64(ins[i, 3])",
        f"{ind}    k = K_rows[krow, ins[i, 4]]",
    ]
    for n, (code, stmt) in enumerate(_INTERPRETER.items()):
        lines.append(f"{ind}    {'if' if n == 0 else 'elif'} op == {code}:")
        lines.append(f"{ind}        for c in range(n):")
        lines.append(f"{ind}            {stmt}")
    return lines


def _store_lines(target_row: str, seg: int, ind: str) -> list[str]:
    outs = [f"o{i}" for i in range(NUM_OUTPUTS)]
    lines = [
        f"{ind}for j in range(A):",
        f"{ind}    if acc_seg[j] != {seg}:",
        f"{ind}        continue",
        f"{ind}    jj = np.uint64(V + j)",
        f"{ind}    off = np.uint64(acc_off[j])",
        f"{ind}    cs = acc_cs[j]",
        f"{ind}    q = acc_out[j]",
        f"{ind}    if cs == 0:  # summed over channels: LANES interleaved partial sums, fixed order",
        f"{ind}        for lane in range(LANES):",
        f"{ind}            lanes[lane] = 0.0",
        f"{ind}        for c0 in range(np.uint64(0), full, np.uint64(LANES)):",
        f"{ind}            for lane in range(np.uint64(LANES)):",
        f"{ind}                lanes[lane] += R[jj, c0 + lane]",
        f"{ind}        for c in range(full, n):",
        f"{ind}            lanes[c - full] += R[jj, c]",
        f"{ind}        total = lanes[0]",
        f"{ind}        for lane in range(1, LANES):",
        f"{ind}            total += lanes[lane]",
    ]
    lines += _chain("q", outs, f"X[{target_row}, off] = total", ind + "        ")
    lines.append(f"{ind}    elif cs == 1:")
    lines += _chain("q", outs, f"for c in range(n): X[{target_row}, off + c] = R[jj, c]", ind + "        ")
    lines.append(f"{ind}    else:")
    lines.append(f"{ind}        ucs = np.uint64(cs)")
    for i, name in enumerate(outs):
        head = "if" if i == 0 else ("else" if i == len(outs) - 1 else "elif")
        lines.append(f"{ind}        {head} q == {i}:" if head != "else" else f"{ind}        else:")
        lines.append(f"{ind}            for c in range(n):")
        lines.append(f"{ind}                {name}[{target_row}, off + c * ucs] = R[jj, c]")
    return lines


def driver_source(body: list[str] | None) -> str:
    """Source of ``run_segments(lo, hi, ...)``, segments ``lo .. hi - 1`` with the program's body
    inlined: ``body`` the lines of a generated body (they read and write the flat registers ``F``
    and the coefficients ``K_rows[krow, k]``), or None for the interpreter."""
    arrays = [f"a{i}" for i in range(NUM_ARRAYS)]
    I2, I3 = " " * 12, " " * 16
    seg = [
        "@njit(cache=True, fastmath=FASTMATH, nogil=True)",
        f"def run_segments(lo, hi, {_ARGS}):",
        "    V = vec_arr.shape[0]",
        "    A = acc_out.shape[0]",
        "    n = np.uint64(C)",
        "    full = np.uint64(C - C % LANES)",
        "    varying = K_rows.shape[0] > 1",
        "    R = np.empty((nreg, C), dtype=o0.dtype)",
        "    F = R.reshape(nreg * C)",
        "    lanes = np.empty(LANES, dtype=o0.dtype)",
        "    for s in range(lo, hi):",
        "        for j in range(A):",
        "            if acc_seg[j] == 1:",
        "                jj = np.uint64(V + j)",
        "                for c in range(n):",
        "                    R[jj, c] = 0.0",
        "        p0 = seg_ptr[s]",
        "        for p in range(p0, seg_ptr[s + 1]):",
        "            row = seg_perm[p]",
        "            krow = row if varying else 0",
        "            for j in range(V):",
        "                if vec_const[j] == 1 and p != p0:  # the segment's own row: loaded once",
        "                    continue",
        "                code = vec_code[j]",
        "                r = np.uint64(row if code == 0 else (idx1[row] if code == 1 else idx2[row]))",
        "                jj = np.uint64(j)",
        "                base = np.uint64(vec_base[j])",
        "                src = vec_arr[j]",
    ]
    seg += _chain("src", arrays, "for c in range(n): R[jj, c] = X[r, base + c]", I3)
    seg += [
        "            for j in range(A):",
        "                if acc_seg[j] == 0:",
        "                    jj = np.uint64(V + j)",
        "                    for c in range(n):",
        "                        R[jj, c] = 0.0",
    ]
    seg += _interpreter_lines(I2) if body is None else [I2 + line for line in body]
    seg += _store_lines("row", 0, I2)
    seg += _store_lines("seg_row[s]", 1, "        ")
    return "\n".join(seg) + "\n"


def _version() -> str:
    """Digest of the sources a generated driver module is made from: numba's cache follows a
    function's own file only, so a change here must give the drivers a new module."""
    here = Path(__file__).parent
    h = hashlib.sha1()
    for name in ("loops.py", "unrolled.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


@cache
def _drivers(body: tuple[str, ...] | None) -> Segments:
    from workbench.kernels.numba.generated import load_module

    head = (
        f"# generated by workbench.kernels.numba.cpu.loops (version {_version()}); safe to delete\n"
        "import numba\nimport numpy as np\nfrom numba import njit\n"
        "from workbench.kernels.numba.cpu.loops import FASTMATH, LANES\n\nf32 = numba.float32\n\n\n"
    )
    module = load_module(head + driver_source(None if body is None else list(body)), "workbench_cpu")
    return Segments(module.run_segments, NUM_ARRAYS + 2)  # after the arrays: idx1, idx2, seg_ptr


def drivers(body: list[str] | None) -> tuple[Any, Any]:
    """``(parallel, serial)``: the row-pass kernel with ``body`` (generated lines, or None: the
    interpreter) over every segment, on numba's threads or on the calling one
    (:class:`~workbench.kernels.numba.cpu.segments.Segments`)."""
    segments = _drivers(None if body is None else tuple(body))
    return segments.parallel, segments.serial


@njit(cache=True, fastmath=FASTMATH)
def _coefficients_by_register(S, k_reg, k_coef, k_fac, nk):
    n = S.shape[1]
    Kt = np.zeros((nk, n), dtype=S.dtype)
    for t in range(k_reg.shape[0]):
        r = np.uint64(k_reg[t])
        f0, f1, f2 = np.uint64(k_fac[t, 0]), np.uint64(k_fac[t, 1]), np.uint64(k_fac[t, 2])
        coef = k_coef[t]
        for i in range(np.uint64(n)):
            Kt[r, i] += coef * S[f0, i] * S[f1, i] * S[f2, i]
    return Kt


def coefficients_by_row(S: np.ndarray, k_reg: np.ndarray, k_coef: np.ndarray, k_fac: np.ndarray, nk: int) -> np.ndarray:
    """``K[row, k_reg[t]] += k_coef[t] * S[f1, row] * S[f2, row] * S[f3, row]`` over the terms
    ``t``, vectorised over rows; ``S`` ``[scalars + 1, rows]`` (last row ones). Summed per
    register ``[nk, rows]`` and transposed by numpy's blocked copy: an element-wise transpose
    loop took 10x the sums (1.35 of 1.48 ms at 11,050 rows and 34 registers)."""
    return np.ascontiguousarray(_coefficients_by_register(S, k_reg, k_coef, k_fac, nk).T)


@njit(cache=True)
def sum_pieces(partial, piece_ptr, out):
    """``out[z] = Σ partial[piece_ptr[z] : piece_ptr[z+1]]``, pieces added in order (zeros for none)."""
    for z in range(out.shape[0]):
        acc = np.zeros(out.shape[1], dtype=out.dtype)
        for p in range(piece_ptr[z], piece_ptr[z + 1]):
            acc += partial[p]
        out[z] = acc


@njit(cache=True)
def csr_by_counting(idx, num_rows):
    """``(ptr [num_rows + 1], perm)``: the positions of ``idx`` grouped by value, ascending within
    a group (a stable counting sort, O(n)); values outside ``[0, num_rows)`` go before (negative)
    or after (too large) every group, in no group."""
    start = np.zeros(num_rows + 3, dtype=np.int64)
    for v in idx:
        b = 0 if v < 0 else (v + 1 if v < num_rows else num_rows + 1)
        start[b + 1] += 1
    for b in range(num_rows + 2):
        start[b + 1] += start[b]
    ptr = start[1 : num_rows + 2].copy()
    perm = np.empty(idx.shape[0], dtype=np.int64)
    for i in range(idx.shape[0]):
        v = idx[i]
        b = 0 if v < 0 else (v + 1 if v < num_rows else num_rows + 1)
        perm[start[b]] = i
        start[b] += 1
    return ptr, perm
