r"""The numba loops of the CPU path (:mod:`~workbench.kernels.backends.cpu`): loading a row's
vector registers, the vector-program interpreter, storing and reducing outputs, and the
row-pass drivers.

The drivers (:func:`drivers`) are instantiated per body in a generated module: the interpreter
(:func:`interpret`), or a program compiled to straight-line code
(:mod:`~workbench.kernels.backends.cpu_unrolled`). numba cannot cache a function that takes
another jitted function as an argument, and the body must be inlined to be vectorised with the
rest. Every index is unsigned where it can be: numba checks a signed index for negative values
element by element, which stops LLVM from vectorising the channel loops.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from numba import njit

from workbench.kernels.descriptor.program import ADD_AXPY, ADD_K, ADD_MUL, SET_AXPY, SET_K, SET_MUL

__all__ = ["FASTMATH", "LANES", "coefficients_by_row", "drivers", "interpret", "load_vectors", "store", "sum_pieces", "zero_accumulators"]

#: LLVM may fuse a multiply and an add (one rounding); nothing is reassociated
FASTMATH = {"contract"}


@njit(cache=True, inline="always")
def _copy(R, j, a, r, base, C):
    # unsigned indices: no negative-index wraparound per element, so the loop vectorises
    j, r, base = np.uint64(j), np.uint64(r), np.uint64(base)
    for c in range(np.uint64(C)):
        R[j, c] = a[r, base + c]


@njit(cache=True, inline="always")
def _load(R, j, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, src, r, base, C):
    """``R[j, :] = a{src}[r, base:base + C]``, branching on ``src`` around whole loops: an
    array picked by a function call would be a new view (a reference count per load)."""
    if src == 0:
        _copy(R, j, a0, r, base, C)
    elif src == 1:
        _copy(R, j, a1, r, base, C)
    elif src == 2:
        _copy(R, j, a2, r, base, C)
    elif src == 3:
        _copy(R, j, a3, r, base, C)
    elif src == 4:
        _copy(R, j, a4, r, base, C)
    elif src == 5:
        _copy(R, j, a5, r, base, C)
    elif src == 6:
        _copy(R, j, a6, r, base, C)
    elif src == 7:
        _copy(R, j, a7, r, base, C)
    elif src == 8:
        _copy(R, j, a8, r, base, C)
    else:
        _copy(R, j, a9, r, base, C)


#: lanes of the blocked channel sum (a fixed order, whatever SIMD width the CPU has)
LANES = 8


@njit(cache=True, inline="always")
def _channel_sum(R, j, C):
    """``Σ_c R[j, c]`` as :data:`LANES` interleaved partial sums added in a fixed order: the
    same bits on every machine, and no chain of ``C`` dependent additions."""
    t = np.zeros(LANES, dtype=R.dtype)
    full = np.uint64(C - C % LANES)
    for c0 in range(np.uint64(0), full, np.uint64(LANES)):
        for lane in range(np.uint64(LANES)):
            t[lane] += R[j, c0 + lane]
    for c in range(full, np.uint64(C)):
        t[c - full] += R[j, c]
    total = t[0]
    for lane in range(1, LANES):
        total += t[lane]
    return total


@njit(cache=True, inline="always", fastmath=FASTMATH)
def _put(out, R, j, row, off, cs, C):
    j, row, off = np.uint64(j), np.uint64(row), np.uint64(off)
    if cs == 0:  # summed over channels
        out[row, off] = _channel_sum(R, j, C)
    elif cs == 1:
        for c in range(np.uint64(C)):
            out[row, off + c] = R[j, c]
    else:
        ucs = np.uint64(cs)
        for c in range(np.uint64(C)):
            out[row, off + c * ucs] = R[j, c]


@njit(cache=True, inline="always")
def _row_of(code, row, idx1, idx2):
    if code == 1:
        return idx1[row]
    elif code == 2:
        return idx2[row]
    return row


@njit(cache=True, inline="always", fastmath=FASTMATH)
def interpret(R, K, ins, C):
    """Run the instructions ``ins`` on the flat registers ``R`` (``C`` channels each)."""
    _execute(R.reshape((R.shape[0] // C, C)), K, ins, C)


@njit(cache=True, inline="always", fastmath=FASTMATH)
def _execute(R, K, ins, C):
    n = np.uint64(C)  # unsigned indices throughout: the channel loops vectorise
    for i in range(ins.shape[0]):
        op = ins[i, 0]
        d = np.uint64(ins[i, 1])
        a = np.uint64(ins[i, 2])
        b = np.uint64(ins[i, 3])
        k = K[ins[i, 4]]
        if op == SET_MUL:
            for c in range(n):
                R[d, c] = k * R[a, c] * R[b, c]
        elif op == ADD_MUL:
            for c in range(n):
                R[d, c] += k * R[a, c] * R[b, c]
        elif op == SET_AXPY:
            for c in range(n):
                R[d, c] = k * R[a, c]
        elif op == ADD_AXPY:
            for c in range(n):
                R[d, c] += k * R[a, c]
        elif op == SET_K:
            for c in range(n):
                R[d, c] = k
        elif op == ADD_K:
            for c in range(n):
                R[d, c] += k


@njit(cache=True, inline="always", fastmath=FASTMATH)
def store(R, V, o0, o1, o2, o3, row, seg, acc_out, acc_off, acc_cs, acc_seg, C):
    """Accumulators of the given kind (per segment ``seg`` = 1, per row 0) to row ``row``."""
    for j in range(acc_out.shape[0]):
        if acc_seg[j] != seg:
            continue
        k = acc_out[j]
        if k == 0:
            _put(o0, R, V + j, row, acc_off[j], acc_cs[j], C)
        elif k == 1:
            _put(o1, R, V + j, row, acc_off[j], acc_cs[j], C)
        elif k == 2:
            _put(o2, R, V + j, row, acc_off[j], acc_cs[j], C)
        else:
            _put(o3, R, V + j, row, acc_off[j], acc_cs[j], C)


@njit(cache=True, inline="always")
def zero_accumulators(R, V, acc_seg, seg):
    for j in range(acc_seg.shape[0]):
        if acc_seg[j] == seg:
            r = np.uint64(V + j)
            for c in range(np.uint64(R.shape[1])):
                R[r, c] = 0.0


@njit(cache=True, inline="always")
def load_vectors(R, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, row, vec_arr, vec_code, vec_base, vec_const, const, C):
    """Vector registers of kind ``const`` (1: loaded once per segment) from input row ``row``."""
    for j in range(vec_arr.shape[0]):
        if vec_const[j] == const:
            _load(R, j, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, vec_arr[j], _row_of(vec_code[j], row, idx1, idx2), vec_base[j], C)


# The row-pass drivers, instantiated per body (the interpreter, or a generated program) in a
# generated module (:func:`drivers`): numba cannot cache a function that takes another jitted
# function as an argument, and the body must be inlined to be vectorised with the rest.
_DRIVERS = """
@njit(cache=True, fastmath=FASTMATH)
def segment(s, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg,
            vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, o0, o1, o2, o3):
    V = vec_arr.shape[0]
    varying = K_rows.shape[0] > 1
    flat = np.empty(nreg * C, dtype=o0.dtype)
    R = flat.reshape((nreg, C))
    zero_accumulators(R, V, acc_seg, 1)
    p0 = seg_ptr[s]
    p1 = seg_ptr[s + 1]
    if p1 > p0:
        load_vectors(R, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_perm[p0], vec_arr, vec_code, vec_base, vec_const, 1, C)
    for p in range(p0, p1):
        row = seg_perm[p]
        load_vectors(R, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, row, vec_arr, vec_code, vec_base, vec_const, 0, C)
        zero_accumulators(R, V, acc_seg, 0)
        body(flat, K_rows[row if varying else 0], ins, C)
        store(R, V, o0, o1, o2, o3, row, 0, acc_out, acc_off, acc_cs, acc_seg, C)
    store(R, V, o0, o1, o2, o3, seg_row[s], 1, acc_out, acc_off, acc_cs, acc_seg, C)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def run_parallel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg,
                 vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, o0, o1, o2, o3):
    for s in prange(seg_ptr.shape[0] - 1):
        segment(np.int64(s), a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg,
                vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, o0, o1, o2, o3)


@njit(cache=True, fastmath=FASTMATH)
def run_serial(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg,
               vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, o0, o1, o2, o3):
    for s in range(seg_ptr.shape[0] - 1):
        segment(np.int64(s), a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, idx1, idx2, seg_ptr, seg_perm, seg_row, C, nreg,
                vec_arr, vec_code, vec_base, vec_const, K_rows, ins, acc_out, acc_off, acc_cs, acc_seg, o0, o1, o2, o3)
"""


@njit(cache=True, fastmath=FASTMATH)
def coefficients_by_row(S, k_reg, k_coef, k_fac, nk):
    """``K[row, k_reg[t]] += k_coef[t] * S[f1, row] * S[f2, row] * S[f3, row]`` over the terms
    ``t``, vectorised over rows; ``S`` ``[scalars + 1, rows]`` (last row ones)."""
    n = S.shape[1]
    Kt = np.zeros((nk, n), dtype=S.dtype)
    for t in range(k_reg.shape[0]):
        r = np.uint64(k_reg[t])
        f0, f1, f2 = np.uint64(k_fac[t, 0]), np.uint64(k_fac[t, 1]), np.uint64(k_fac[t, 2])
        coef = k_coef[t]
        for i in range(np.uint64(n)):
            Kt[r, i] += coef * S[f0, i] * S[f1, i] * S[f2, i]
    K = np.empty((n, nk), dtype=S.dtype)
    for i in range(n):
        for k in range(nk):
            K[i, k] = Kt[k, i]
    return K


def _version() -> str:
    """Digest of the sources a generated driver module compiles in: numba's cache follows a
    function's own file only, so a change here must give the drivers a new module."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    h = hashlib.sha1()
    for name in ("cpu_loops.py", "cpu_unrolled.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def drivers(body: str | None) -> tuple[Any, Any]:
    """``(run_parallel, run_serial)`` over ``body``: the source of a generated
    ``body(R, K, ins, C)`` (:mod:`~workbench.kernels.backends.cpu_unrolled`), or None for the
    interpreter."""
    from workbench.kernels.backends.generated import load_module

    head = (f"# generated by workbench.kernels.backends.cpu_loops (version {_version()}); safe to delete\n"
            "import numba\nimport numpy as np\nfrom numba import njit, prange\n"
            "from workbench.kernels.backends.cpu_loops import FASTMATH, interpret, load_vectors, store, zero_accumulators\n\nf32 = numba.float32\n\n")
    if body is None:
        text = head + "body = interpret\n" + _DRIVERS
    else:
        text = head + body.replace("def body(", '@njit(cache=True, fastmath=FASTMATH, inline="always")\ndef body(', 1) + "\n" + _DRIVERS
    module = load_module(text, "workbench_cpu")
    return module.run_parallel, module.run_serial


@njit(cache=True)
def sum_pieces(partial, piece_ptr, out):
    """``out[z] = Σ partial[piece_ptr[z] : piece_ptr[z+1]]``, pieces added in order (zeros for none)."""
    for z in range(out.shape[0]):
        acc = np.zeros(out.shape[1], dtype=out.dtype)
        for p in range(piece_ptr[z], piece_ptr[z + 1]):
            acc += partial[p]
        out[z] = acc
