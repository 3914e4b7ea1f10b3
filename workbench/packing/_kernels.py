"""Small numba kernels shared by the packers: stable counting sorts, bin ids to CSR, step leveling."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def counting_argsort(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Stable argsort of integer ``keys`` in ``[0, n_keys)``: O(N + n_keys)."""
    counts = np.zeros(n_keys + 1, dtype=np.int64)
    for i in range(keys.shape[0]):
        counts[keys[i] + 1] += 1
    for k in range(1, n_keys + 1):
        counts[k] += counts[k - 1]
    out = np.empty(keys.shape[0], dtype=np.int64)
    for i in range(keys.shape[0]):
        k = keys[i]
        out[counts[k]] = i
        counts[k] += 1
    return out


def argsort_desc(costs: np.ndarray) -> np.ndarray:
    """Stable descending argsort (equal costs keep index order); counting sort for small integers."""
    costs = np.asarray(costs)
    if costs.size and np.issubdtype(costs.dtype, np.integer) and costs.min() >= 0 and costs.max() < 1 << 22:
        top = int(costs.max())
        return counting_argsort((top - costs).astype(np.int64), top + 1)
    return np.argsort(-costs.astype(np.float64), kind="stable").astype(np.int64)


@njit(cache=True)
def csr_from_assign(assign: np.ndarray, n_bins: int) -> tuple:
    """Bin id per graph -> (flat, offsets); graphs keep index order inside a bin."""
    offsets = np.zeros(n_bins + 1, dtype=np.int64)
    for i in range(assign.shape[0]):
        offsets[assign[i] + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    pos = offsets[:-1].copy()
    flat = np.empty(assign.shape[0], dtype=np.int64)
    for i in range(assign.shape[0]):
        b = assign[i]
        flat[pos[b]] = i
        pos[b] += 1
    return flat, offsets


@njit(cache=True)
def sift_down(hload: np.ndarray, hrank: np.ndarray, r: int) -> None:
    """Restore the min-heap of rank loads (ties by rank id) after the root's load grew."""
    i = 0
    while True:
        a = 2 * i + 1
        if a >= r:
            break
        c = a
        if a + 1 < r and (hload[a + 1] < hload[a] or (hload[a + 1] == hload[a] and hrank[a + 1] < hrank[a])):
            c = a + 1
        if hload[c] < hload[i] or (hload[c] == hload[i] and hrank[c] < hrank[i]):
            hload[i], hload[c] = hload[c], hload[i]
            hrank[i], hrank[c] = hrank[c], hrank[i]
            i = c
        else:
            break


@njit(cache=True)
def _lpt_into(items: np.ndarray, sizes: np.ndarray, r: int, out_bin: np.ndarray, out_load: np.ndarray) -> None:
    """LPT: ``items`` (sorted by size, descending) into ``r`` bins; the first ``r`` seed bins 0..r-1."""
    hload = np.empty(r)
    hrank = np.empty(r, dtype=np.int64)
    for k in range(r):
        out_bin[k] = k
        out_load[k] = sizes[items[k]]
    o = np.argsort(out_load[:r], kind="mergesort")
    for q in range(r):
        hload[q] = out_load[o[q]]
        hrank[q] = o[q]
    for k in range(r, items.shape[0]):
        j = hrank[0]
        out_bin[k] = j
        hload[0] += sizes[items[k]]
        out_load[j] = hload[0]
        sift_down(hload, hrank, r)


@njit(cache=True)
def level_steps(
    flat: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, loads: np.ndarray, r: int, cap: float, tol: float
) -> int:
    """Re-balance, in place, every step whose max/mean load exceeds ``tol``.

    ``loads`` are the batch loads in layout order (updated in place). The graphs
    of an offending step's ``r`` batches are re-dealt by LPT (largest first to the
    least-loaded batch). A step is rewritten only if that lowers its maximum load
    and keeps every batch within ``cap``. Returns the number of steps rewritten.
    """
    n_steps = (offsets.shape[0] - 1) // r
    changed = 0
    for s in range(n_steps):
        tot = 0.0
        mx = 0.0
        for j in range(r):
            tot += loads[s * r + j]
            if loads[s * r + j] > mx:
                mx = loads[s * r + j]
        if tot <= 0.0 or mx <= tol * tot / r:
            continue
        lo, hi = offsets[s * r], offsets[s * r + r]
        items = flat[lo:hi].copy()
        if items.shape[0] < r:
            continue
        keys = np.empty(items.shape[0])
        for k in range(items.shape[0]):
            keys[k] = -sizes[items[k]]
        items = items[np.argsort(keys, kind="mergesort")]
        out_bin = np.empty(items.shape[0], dtype=np.int64)
        out_load = np.zeros(r)
        _lpt_into(items, sizes, r, out_bin, out_load)
        new_max = out_load.max()
        if new_max > cap or new_max >= mx:
            continue
        counts = np.zeros(r + 1, dtype=np.int64)
        for k in range(items.shape[0]):
            counts[out_bin[k] + 1] += 1
        for j in range(r):
            counts[j + 1] += counts[j]
        for j in range(r):
            offsets[s * r + j + 1] = lo + counts[j + 1]
            loads[s * r + j] = out_load[j]
        for k in range(items.shape[0]):
            j = out_bin[k]
            flat[lo + counts[j]] = items[k]
            counts[j] += 1
        changed += 1
    return changed
