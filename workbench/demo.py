"""``workbench demo``: the main job on the embedded dataset.

Today it loads the embedded mixture (generating it if it is missing), prints
the per-family summary and, when the packer is installed, compares packings of
the dataset for 2 ranks. Later stages (training, report) hook in here.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def run_demo(path: str | None = None, cutoff: float = 4.5, num_replicas: int = 2, capacity: int = 3072) -> dict:
    from workbench.data.embedded import EMBEDDED_N, EMBEDDED_PATH, EMBEDDED_SEED, load_embedded
    from workbench.data.sizes import graph_sizes
    from workbench.data.summary import format_table, summarize

    target = path or EMBEDDED_PATH
    t0 = time.perf_counter()
    try:
        structures = load_embedded(target)
    except FileNotFoundError:
        from workbench.data.io import write_structures
        from workbench.data.mixture import make_mixture

        print(f"{target} missing: generating make_mixture(n={EMBEDDED_N}, seed={EMBEDDED_SEED}) ...")
        structures = make_mixture(n=EMBEDDED_N, seed=EMBEDDED_SEED, progress=True)
        write_structures(target, structures)
    print(f"loaded {len(structures)} structures from {target} in {time.perf_counter() - t0:.1f} s\n")
    sizes = graph_sizes(structures, cutoff=cutoff)
    labelled = np.array([bool(a.info.get("labelled", True)) for a in structures])
    print(f"Embedded Table-3 mixture (edges at {cutoff} Å cutoff, periodic images included)")
    print(format_table(summarize(sizes, labelled)))
    result = {"n_structures": len(structures), "sizes": sizes}
    try:
        from workbench.packing import pack
    except ImportError:
        return result
    print(f"\nPacking for {num_replicas} ranks, capacity {capacity} atoms")
    print(f"{'algorithm':<14} {'batches':>8} {'bins/LB':>8} {'padding':>8} {'imb max':>8} {'imb mean':>9}")
    for algo in ("fixed-count", "dynamic", "paper"):
        m = pack(sizes["atoms"], capacity=capacity, num_replicas=num_replicas, algorithm=algo, seed=0).metrics()
        print(f"{algo:<14} {m['n_bins']:>8} {m['n_bins'] / m['lower_bound_bins']:>8.3f} {m['padding_fraction']:>8.1%} "
              f"{m['step_imbalance_max']:>8.2f} {m['step_imbalance_mean']:>9.3f}")
        result[algo] = m
    return result


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded dataset")
    p.add_argument("--path", help="structure file (default: the embedded dataset)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--capacity", type=int, default=3072)
    p.set_defaults(func=lambda a: (run_demo(a.path, num_replicas=a.replicas, capacity=a.capacity), 0)[1])
