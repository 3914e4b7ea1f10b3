"""The capacity grid: exact ``pack(...).metrics()`` over capacities x GPU counts x algorithms.

At the paper's scale (2.65M graphs) one :func:`workbench.packing.pack` call takes 0.3-1.6 s
on one core, too slow for a slider; :func:`precompute_grid` computes every point once and
writes one ``.npz`` with the fingerprint of the sizes and of this package's code, and
:class:`workbench.viz.capacity.CapacityStudy` reads it. Nothing is interpolated.

Baseline: ``fixed-count`` (PyG's default). It and the other algorithms that take a graph count
(``takes_graphs_per_batch`` in the registry) get ``round(capacity / mean atoms)`` graphs per
batch, i.e. the same mean atoms per batch as the packers, so all have about the same number
of steps and differ only in how sizes are spread.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from workbench.packing.api import ALGORITHMS, pack
from workbench.packing.metrics import step_imbalance

GRID_CAPACITIES: tuple[int, ...] = (800, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096)
GRID_GPUS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 740, 1024)
GRID_ALGORITHMS: tuple[str, ...] = tuple(ALGORITHMS)
BASELINE = "fixed-count"
METRICS: tuple[str, ...] = (
    "n_bins",
    "n_steps",
    "lower_bound_bins",
    "bins_over_lb",
    "padding_fraction",
    "max_load",
    "over_capacity_batches",
    "step_imbalance_max",
    "step_imbalance_mean",
    "graphs_per_batch_mean",
    "est_epoch_seconds",
    "pack_seconds",
)
#: Which steps of every grid point keep their layout: the first, the middle and the least balanced one.
LAYOUT_STEPS: tuple[str, ...] = ("first", "middle", "worst")
LAYOUT_RANKS = 8


def sizes_fingerprint(sizes: np.ndarray) -> str:
    """SHA-1 of the atoms, edges and family columns: a grid is used only for the exact sizes it was made on."""
    h = hashlib.sha1()
    for name in ("atoms", "edges", "family"):
        if name in (sizes.dtype.names or ()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(sizes[name]).tobytes())
    return h.hexdigest()


#: the probe :func:`packing_behaviour` packs: graphs, capacities (atoms) and GPU counts
PROBE_GRAPHS, PROBE_CAPACITIES, PROBE_GPUS = 3000, (800, 1536), (2, 8)


def packing_behaviour(algorithms: Sequence[str], seed: int = 0) -> str:
    """SHA-1 of what ``algorithms`` do: their packings (every bin's graphs, in order) of a fixed
    synthetic probe at two capacities and two GPU counts. A precomputed grid stays current while
    this is unchanged, whatever edits the packing code gets; it goes stale when the packers would
    really give other results."""
    from workbench.data.sizes import synthetic_sizes

    sizes = synthetic_sizes(PROBE_GRAPHS, seed=0)
    h = hashlib.sha1()
    for algorithm in algorithms:
        for capacity in PROBE_CAPACITIES:
            for gpus in PROBE_GPUS:
                p = pack(sizes, capacity, gpus, algorithm, seed, **_options(sizes, capacity, algorithm))
                h.update(f"{algorithm}|{capacity}|{gpus}|".encode())
                h.update(np.ascontiguousarray(p.flat, dtype=np.int64).tobytes())
                h.update(np.ascontiguousarray(p.offsets, dtype=np.int64).tobytes())
    return h.hexdigest()


def baseline_graphs_per_batch(sizes: np.ndarray, capacity: float) -> int:
    """Graphs per batch of the fixed-count baseline: same mean atoms per batch as a full bin."""
    return max(1, round(float(capacity) / float(np.mean(sizes["atoms"]))))


def _options(sizes: np.ndarray, capacity: float, algorithm: str) -> dict:
    if ALGORITHMS[algorithm].takes_graphs_per_batch:
        return {"graphs_per_batch": baseline_graphs_per_batch(sizes, capacity)}
    return {}


def _step_indices(packing) -> dict[str, int]:
    imb = step_imbalance(packing.loads(), packing.num_replicas)
    return {"first": 0, "middle": packing.n_steps // 2, "worst": int(np.argmax(imb))}


def compute_point(
    sizes: np.ndarray, capacity: float, num_gpus: int, algorithm: str, seed: int = 0, layout_ranks: int = LAYOUT_RANKS
) -> dict:
    """Pack once and return the metrics plus the layouts of the first/middle/worst step.

    ``metrics`` are exactly ``pack(...).metrics(randomness=False)``;
    ``layouts[kind] = (step, [graph indices of rank 0, rank 1, ...])`` for the
    first ``layout_ranks`` ranks.
    """
    t0 = time.perf_counter()
    p = pack(sizes, capacity, num_gpus, algorithm, seed, **_options(sizes, capacity, algorithm))
    m = p.metrics(randomness=False)
    layouts = {}
    for kind, s in _step_indices(p).items():
        b = [
            p.flat[p.offsets[s * p.num_replicas + r] : p.offsets[s * p.num_replicas + r + 1]]
            for r in range(min(layout_ranks, p.num_replicas))
        ]
        layouts[kind] = (s, b)
    return {
        "metrics": {k: float(m[k]) for k in METRICS},
        "layouts": layouts,
        "seconds": time.perf_counter() - t0,
        "options": _options(sizes, capacity, algorithm),
    }


def precompute_grid(
    sizes: np.ndarray,
    out: str | Path,
    capacities: Sequence[int] = GRID_CAPACITIES,
    gpus: Sequence[int] = GRID_GPUS,
    algorithms: Sequence[str] = GRID_ALGORITHMS,
    seed: int = 0,
    description: str = "",
    echo=print,
) -> Path:
    """Compute every grid point with :func:`compute_point` and write one compressed ``.npz``."""
    shape = (len(capacities), len(gpus), len(algorithms))
    metrics = np.full(shape + (len(METRICS),), np.nan)
    steps = np.zeros(shape + (len(LAYOUT_STEPS),), np.int64)
    lay_offsets, lay_flat, lay_ranks = [0], [], []
    t_start = time.perf_counter()
    for i, c in enumerate(capacities):
        for j, r in enumerate(gpus):
            for k, a in enumerate(algorithms):
                pt = compute_point(sizes, c, r, a, seed)
                metrics[i, j, k] = [pt["metrics"][m] for m in METRICS]
                for q, kind in enumerate(LAYOUT_STEPS):
                    s, batches = pt["layouts"][kind]
                    steps[i, j, k, q] = s
                    lay_ranks.append(len(batches))
                    for b in batches:
                        lay_flat.append(b.astype(np.uint32))
                        lay_offsets.append(lay_offsets[-1] + b.size)
            echo(f"capacity {c}, {r} GPUs done ({time.perf_counter() - t_start:.0f} s)")
    meta = {
        "n": int(sizes.size),
        "seed": int(seed),
        "sizes_sha1": sizes_fingerprint(sizes),
        "packing_behaviour": packing_behaviour(algorithms, seed),
        "capacities": list(map(int, capacities)),
        "gpus": list(map(int, gpus)),
        "algorithms": list(algorithms),
        "metrics": list(METRICS),
        "layout_steps": list(LAYOUT_STEPS),
        "layout_ranks": LAYOUT_RANKS,
        "baseline": BASELINE,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.perf_counter() - t_start, 1),
        "description": description,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out,
        meta=np.array(json.dumps(meta)),
        metrics=metrics,
        steps=steps,
        layout_ranks=np.array(lay_ranks, np.int16),
        layout_offsets=np.array(lay_offsets, np.int64),
        layout_flat=np.concatenate(lay_flat) if lay_flat else np.zeros(0, np.uint32),
    )
    return out
