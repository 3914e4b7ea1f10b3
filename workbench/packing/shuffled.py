"""``"shuffled-paper"``: Algorithm 1 with its randomness restored, epoch by epoch.

The paper (§7) names the limitation of its packer: it "sacrifices randomness".
Sorting by size is deterministic, so every epoch gets the very same batches.

Observation: Algorithm 1 deals the size-sorted graphs cyclically, so one pass
over the ``B`` active bins hands each bin one graph from a *row* of about ``B``
consecutive graphs of near-equal size. Which graph of the row a bin receives
barely matters for packing quality, but it decides batch composition.

Method. Take the stable descending order ``o`` and, every epoch, draw a random
offset ``u ~ U{0..w-1}`` and shuffle ``o`` within the windows
``[k*w - u, (k+1)*w - u)`` (``w`` = the initial bin count ``B0`` by default), then
run Algorithm 1 unchanged on that order. Two graphs ``i, j`` that share a bin in
epoch ``e`` land in independently random positions of their windows in epoch
``e+1``, so they meet again with probability about ``1/B`` (a window spans about
``B`` bins): a few percent at most even for small datasets, ~1e-5 at the paper's
scale. Graph sizes inside a window differ little, so bin count and padding stay
close to the deterministic packer. The random offset moves window boundaries so
graphs at a boundary do not always meet the same neighbours.

Everything is drawn from ``numpy.random.default_rng([seed, epoch])``: all ranks
compute the same packing with no communication.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from workbench.packing._kernels import argsort_desc
from workbench.packing.paper import paper_bins


@njit(cache=True)
def _window_shuffle(order: np.ndarray, u: np.ndarray, window: int, offset: int) -> None:
    """Fisher-Yates shuffle of ``order`` inside each window, in place, driven by ``u`` in [0, 1)."""
    n = order.shape[0]
    start = 0
    end = window - offset if offset > 0 else window
    while start < n:
        if end > n:
            end = n
        for i in range(start, end - 1):
            j = i + int(u[i] * (end - i))
            if j >= end:
                j = end - 1
            t = order[i]
            order[i] = order[j]
            order[j] = t
        start = end
        end = start + window


def shuffled_paper_bins(
    costs: np.ndarray,
    capacity: float,
    num_replicas: int,
    rng: np.random.Generator,
    window: int | None = None,
    order: str = "fuller-first",
) -> tuple[np.ndarray, int]:
    """Algorithm 1 on a window-shuffled size order; returns ``(assign, n_bins)``."""
    costs = np.asarray(costs)
    sizes = costs.astype(np.float64)
    n = sizes.shape[0]
    if window is None:
        lb = max(1, int(np.ceil(sizes.sum() / capacity)))
        window = -(-lb // num_replicas) * num_replicas
    window = max(1, int(window))
    graph_order = argsort_desc(costs)
    offset = int(rng.integers(window))
    _window_shuffle(graph_order, rng.random(n), window, offset)
    return paper_bins(costs, capacity, num_replicas, order=order, graph_order=graph_order)
