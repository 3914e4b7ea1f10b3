"""The anchors a user would otherwise pick, with the same interface as the paper's packer.

Each function returns ``(assign, n_bins)`` in the natural order of its method;
:func:`workbench.packing.api.pack` turns that into the rank/step layout.

* ``fixed_count`` - PyG's default: ``graphs_per_batch`` graphs per batch, indices
  shuffled every epoch and split across ranks as ``DistributedSampler`` does.
  Sizes are ignored, so the capacity bound does not apply.
* ``dynamic`` - PyG's ``DynamicBatchSampler(mode="node", shuffle=True)``: walk the
  shuffled indices and close a batch when the next graph would push it past
  ``max_num`` (= capacity). Greedy next-fit.
* ``ffd`` - first-fit decreasing: largest graph first, each into the lowest-id
  bin with room (segment tree over bin remaining capacity, O(N log N)).
* ``lpt`` - fairchem's balanced batch sampler: a shuffled global batch of
  ``graphs_per_batch * R`` graphs per step is partitioned across the ``R`` ranks
  by longest-processing-time first (largest graph to the least-loaded rank).
  Like fixed-count it fixes graph counts, not sizes, so capacity is not enforced.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from workbench.packing._kernels import argsort_desc, sift_down


def fixed_count(
    costs: np.ndarray, num_replicas: int, rng: np.random.Generator, graphs_per_batch: int = 8
) -> tuple[np.ndarray, int]:
    """Shuffled indices cut into ``ceil(N/k)`` batches (rounded up to a multiple of ``R``).

    ``DistributedSampler`` pads by repeating samples; to keep every graph exactly
    once we instead spread the ``N`` graphs over the rounded-up batch count, so
    batch sizes differ by at most one.
    """
    n = costs.shape[0]
    n_bins = -(-n // graphs_per_batch)
    n_bins = min(-(-n_bins // num_replicas) * num_replicas, (n // num_replicas) * num_replicas)
    perm = rng.permutation(n)
    # Graph at position p of the permutation goes to batch floor(p * n_bins / n).
    assign = np.empty(n, dtype=np.int64)
    assign[perm] = (np.arange(n, dtype=np.int64) * n_bins) // n
    return assign, n_bins


@njit(cache=True)
def _next_fit(order: np.ndarray, sizes: np.ndarray, cap: float, assign: np.ndarray) -> int:
    b = 0
    cur = 0.0
    for k in range(order.shape[0]):
        s = sizes[order[k]]
        if cur + s > cap and cur > 0.0:
            b += 1
            cur = 0.0
        assign[order[k]] = b
        cur += s
    return b + 1 if order.shape[0] > 0 else 0


def dynamic(
    costs: np.ndarray, capacity: float, rng: np.random.Generator, shuffle: bool = True
) -> tuple[np.ndarray, int]:
    """Next-fit over a shuffled order, as ``torch_geometric.loader.DynamicBatchSampler``."""
    n = costs.shape[0]
    order = rng.permutation(n) if shuffle else np.arange(n)
    assign = np.empty(n, dtype=np.int64)
    n_bins = _next_fit(order.astype(np.int64), costs.astype(np.float64), float(capacity), assign)
    return assign, n_bins


@njit(cache=True)
def _first_fit(order: np.ndarray, sizes: np.ndarray, cap: float, assign: np.ndarray, max_bins: int) -> int:
    n = order.shape[0]
    size = 1
    while size < max(min(n, max_bins), 1):
        size *= 2
    tree = np.full(2 * size, cap)  # max remaining capacity in each subtree
    used = 0
    for k in range(n):
        s = sizes[order[k]]
        node = 1
        while node < size:  # descend to the leftmost leaf with room
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        b = node - size
        assign[order[k]] = b
        if b + 1 > used:
            used = b + 1
        tree[node] -= s
        node //= 2
        while node >= 1:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return used


def ffd(costs: np.ndarray, capacity: float) -> tuple[np.ndarray, int]:
    """First-fit decreasing (stable descending order)."""
    sizes = costs.astype(np.float64)
    order = argsort_desc(costs)
    assign = np.empty(costs.shape[0], dtype=np.int64)
    # First fit never leaves two bins at most half full, so it uses < 2*sum/C + 1 bins.
    max_bins = int(2 * np.ceil(sizes.sum() / capacity)) + 2
    return assign, _first_fit(order, sizes, float(capacity), assign, max_bins)


@njit(cache=True)
def _lpt_steps(perm: np.ndarray, sizes: np.ndarray, starts: np.ndarray, r: int, assign: np.ndarray) -> None:
    hload = np.zeros(r)  # binary min-heap of rank loads (ties: lower rank first)
    hrank = np.zeros(r, dtype=np.int64)
    for s in range(starts.shape[0] - 1):
        chunk = perm[starts[s] : starts[s + 1]]
        keys = np.empty(chunk.shape[0])
        for k in range(chunk.shape[0]):
            keys[k] = -sizes[chunk[k]]
        chunk = chunk[np.argsort(keys, kind="mergesort")]
        # The first R graphs seed ranks 0..R-1 (no rank is left empty, even with zero
        # costs); a sorted array is a valid heap.
        first = np.zeros(r)
        for k in range(r):
            assign[chunk[k]] = s * r + k
            first[k] = sizes[chunk[k]]
        o = np.argsort(first, kind="mergesort")
        for q in range(r):
            hload[q] = first[o[q]]
            hrank[q] = o[q]
        for k in range(r, chunk.shape[0]):
            # The heap root is the least-loaded rank.
            j = hrank[0]
            assign[chunk[k]] = s * r + j
            hload[0] += sizes[chunk[k]]
            sift_down(hload, hrank, r)


def lpt(
    costs: np.ndarray, num_replicas: int, rng: np.random.Generator, graphs_per_batch: int = 8
) -> tuple[np.ndarray, int]:
    """Shuffled global batches of ``graphs_per_batch * R`` graphs, each split over ranks by LPT."""
    n = costs.shape[0]
    r = num_replicas
    steps = max(1, min(-(-n // (graphs_per_batch * r)), n // r))
    starts = (np.arange(steps + 1, dtype=np.int64) * n) // steps
    perm = rng.permutation(n).astype(np.int64)
    assign = np.empty(n, dtype=np.int64)
    _lpt_steps(perm, costs.astype(np.float64), starts, r, assign)
    return assign, steps * r
