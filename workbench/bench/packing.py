"""``workbench bench packing``: every algorithm against the anchors, at the paper's scale.

Measured on one core (our kernels are serial numba/numpy). Rows:

* time to pack, best of ``repeats``, as process CPU time (robust to other jobs
  sharing the machine) and wall time, after a warm-up so numba compilation is
  not counted,
* ``n_bins / lower bound`` (L1 bound rounded up to a multiple of R),
* padding fraction, step imbalance (max and mean of per-step max/mean load),
* estimated epoch time (straggler cost model) relative to ``fixed-count``,
* pair repeat fraction between epochs 0 and 1 (randomness; 1.0 = identical),
* for the algorithms that respect the capacity, what fixed-shape batches add in an epoch
  (``TrainConfig.fixed_shapes``): ghost atoms and edges as a share of the real ones, padded to
  one shape and to the ladder of ``TrainConfig.edge_bucket_step``, and the ladder's shapes in use.

Plus: the real ``torch_geometric.loader.DynamicBatchSampler`` on a subset (it
slices its index list once per batch, so it is quadratic in practice), checked
batch-for-batch against our ``"dynamic"``; the embedded dataset at 4 replicas;
and a capacity x replicas sweep for the notebooks.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from workbench.bench.table import Column, render, write_json
from workbench.limits import DEFAULT_CAPACITY
from workbench.packing.api import ALGORITHMS, pack
from workbench.packing.cost import CostModel
from workbench.packing.shapes import DEFAULT_EDGE_STEP, fixed_shape, padding_cost, shape_ladder

#: rows with options, per algorithm: (label, options); every other registered algorithm gets one
#: row with its defaults. The first fixed-count row is the reference of ``epoch vs fixed``.
OPTION_ROWS: dict[str, tuple[tuple[str, dict], ...]] = {
    "fixed-count": (
        ("fixed-count (6/batch)", {"graphs_per_batch": 6}),
        ("fixed-count (8/batch)", {"graphs_per_batch": 8}),
    ),
    "lpt": (("lpt (6/rank)", {"graphs_per_batch": 6}),),
    "paper": (
        ("paper", {}),
        ("paper, no step leveling", {"level_steps": False}),
        ("paper, emptier-first", {"order": "emptier-first"}),
    ),
    "shuffled-paper": (("shuffled-paper (ours)", {}),),
}


def variants() -> list[tuple[str, str, dict]]:
    """``(label, algorithm, options)`` of the main table: every algorithm in
    :data:`~workbench.packing.api.ALGORITHMS`, in its order, with its rows of :data:`OPTION_ROWS`."""
    stale = set(OPTION_ROWS) - set(ALGORITHMS)
    if stale:
        raise KeyError(f"OPTION_ROWS names unregistered algorithm(s) {sorted(stale)}")
    return [(label, name, opts) for name in ALGORITHMS for label, opts in OPTION_ROWS.get(name, ((name, {}),))]


SWEEP_CAPACITIES = (800, 1024, 1536, 2048, 3072, 4096)
SWEEP_REPLICAS = (16, 64, 256, 740)


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """``workbench.data.synthetic_sizes`` when available, else a documented local stand-in."""
    try:
        from workbench.data import synthetic_sizes

        return synthetic_sizes(n, seed=seed), "workbench.data.synthetic_sizes"
    except (ImportError, FileNotFoundError, KeyError) as exc:
        from workbench.data.chemical_families import family_counts, sample_natoms

        rng = np.random.default_rng(seed)
        parts = [sample_natoms(k, v, rng) for k, v in family_counts(n).items() if v]
        atoms = np.concatenate(parts)[rng.permutation(n)]
        sizes = np.zeros(n, dtype=[("atoms", np.int64), ("edges", np.int64)])
        sizes["atoms"] = atoms
        sizes["edges"] = np.rint(atoms * rng.uniform(20, 60, size=n)).astype(np.int64)
        return sizes, f"local stand-in (Table-3 atoms, edges = atoms x U(20, 60)); synthetic_sizes failed: {exc}"


def real_sizes(path: str | None = None) -> tuple[np.ndarray | None, str]:
    """Sizes of the embedded dataset (or a sizes file); ``(None, reason)`` when unavailable."""
    from workbench.packing.cli import load_sizes

    try:
        if path is None:
            from workbench.data import EMBEDDED_PATH

            path = str(EMBEDDED_PATH)
        return load_sizes(path), str(path)
    except (ImportError, OSError, ValueError, KeyError) as exc:
        return None, f"skipped: {exc}"


def _warm_up() -> None:
    rng = np.random.default_rng(0)
    c = rng.integers(1, 100, size=500)
    for _, algo, opts in variants():
        pack(c, 300, 4, algorithm=algo, **opts).metrics()
        pack(c.astype(np.float64) + 0.5, 300, 4, algorithm=algo, **opts)


def table_rows(
    sizes: np.ndarray,
    capacity: float,
    replicas: int,
    seed: int = 0,
    repeats: int = 1,
    cost_model: CostModel | None = None,
) -> list[dict]:
    """Run every variant on ``sizes`` (structured: atoms, edges) and return one metrics dict each."""
    rows = []
    for label, algo, opts in variants():
        best, best_cpu, p = np.inf, np.inf, None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            p = pack(sizes, capacity, replicas, algorithm=algo, seed=seed, cost_model=cost_model, **opts)
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
        m = p.metrics()
        m.update(label=label, options=opts, time_to_pack_s=best, cpu_time_to_pack_s=best_cpu)
        m["fixed_shapes"] = fixed_shape_cost(p, sizes, capacity) if ALGORITHMS[algo].respects_capacity else None
        rows.append(m)
    ref = next(r for r in rows if r["algorithm"] == "fixed-count")["est_epoch_seconds"]
    for r in rows:
        r["epoch_time_vs_fixed_count"] = r["est_epoch_seconds"] / ref
    return rows


def fixed_shape_cost(p, sizes: np.ndarray, capacity: float, step: float = DEFAULT_EDGE_STEP) -> dict:
    """What padding the batches of packing ``p`` to fixed shapes (``TrainConfig.fixed_shapes``,
    :mod:`workbench.packing.shapes`) adds in one epoch: to the one shape that holds every bin
    (``one``), and to the ladder of ``step`` (``ladder``, ``TrainConfig.edge_bucket_step``)."""
    atoms, edges = np.asarray(sizes["atoms"], dtype=np.int64), np.asarray(sizes["edges"], dtype=np.int64)
    top = fixed_shape(atoms, edges, int(capacity))
    starts = p.offsets[:-1]
    bin_atoms, bin_edges = np.add.reduceat(atoms[p.flat], starts), np.add.reduceat(edges[p.flat], starts)
    return {
        "shape": top.as_dict(),
        "step": step,
        "one": padding_cost(bin_atoms, bin_edges, top),
        "ladder": padding_cost(bin_atoms, bin_edges, shape_ladder(top, step)),
    }


def _padded(row: dict, how: str, what: str) -> str:
    cost = row.get("fixed_shapes")
    return "n/a" if cost is None else f"{cost[how][what]:.4f}" if what != "shapes_used" else str(cost[how][what])


def _frac(x: float) -> str:
    return f"{x:.4f}" if x == 0 or x >= 1e-3 else f"{x:.1e}"


def format_table(rows: list[dict], title: str) -> str:
    """The main table, as Markdown."""
    columns = [
        Column("algorithm", "label"),
        Column("pack s (cpu)", "cpu_time_to_pack_s", ".3f"),
        Column("pack s (wall)", "time_to_pack_s", ".3f"),
        Column("bins/LB", "bins_over_lb", ".4f"),
        Column("padding", "padding_fraction", ".4f"),
        Column("imb max", "step_imbalance_max", ".4f"),
        Column("imb mean", "step_imbalance_mean", ".4f"),
        Column("epoch vs fixed", "epoch_time_vs_fixed_count", ".3f"),
        Column("pair repeat", lambda r: _frac(r["pair_repeat_fraction"])),
        Column("fixed: +atoms", lambda r: _padded(r, "ladder", "atoms_added")),
        Column("+edges, one shape", lambda r: _padded(r, "one", "edges_added")),
        Column("+edges, ladder", lambda r: _padded(r, "ladder", "edges_added")),
        Column("shapes", lambda r: _padded(r, "ladder", "shapes_used")),
    ]
    return render(rows, columns, title=title, markdown=True)


class _SizeOnly:
    """Minimal dataset for PyG's sampler: ``dataset[i].num_nodes``."""

    class _Item:
        __slots__ = ("num_edges", "num_nodes")

    def __init__(self, atoms: np.ndarray) -> None:
        self._items = []
        for a in atoms.tolist():
            it = self._Item()
            it.num_nodes = a
            it.num_edges = 0
            self._items.append(it)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int):
        return self._items[i]


def compare_pyg(atoms: np.ndarray, capacity: int, shuffled_n: int = 50_000) -> dict:
    """The real PyG ``DynamicBatchSampler`` against our ``dynamic``.

    Unshuffled on all graphs: the batches must be identical, and both are timed.
    Shuffled (what users run) on the first ``shuffled_n`` graphs: PyG slices its
    index list once per batch, so its time grows quadratically; timed only.
    """
    try:
        from torch_geometric.loader import DynamicBatchSampler
    except ImportError as exc:
        return {"skipped": f"torch_geometric not installed ({exc}); pip install -e '.[dev]'"}
    import torch

    from workbench.packing.baselines import dynamic
    from workbench.packing.core import assign_to_csr

    ds = _SizeOnly(atoms)
    t0 = time.perf_counter()
    # list(sampler) would call len(), which PyG leaves undefined; iterate instead.
    theirs = list(iter(DynamicBatchSampler(ds, max_num=int(capacity), mode="node", shuffle=False)))
    t_pyg = time.perf_counter() - t0
    t0 = time.perf_counter()
    assign, n_bins = dynamic(atoms, capacity, np.random.default_rng(0), shuffle=False)
    flat, offsets = assign_to_csr(assign, n_bins)
    t_ours = time.perf_counter() - t0
    same = (
        n_bins == len(theirs)
        and np.array_equal(flat, np.concatenate([np.asarray(b) for b in theirs]))
        and np.array_equal(np.diff(offsets), [len(b) for b in theirs])
    )
    lb = int(np.ceil(atoms.sum() / capacity))
    small = _SizeOnly(atoms[:shuffled_n])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    n_shuf = sum(1 for _ in iter(DynamicBatchSampler(small, max_num=int(capacity), mode="node", shuffle=True)))
    t_shuf = time.perf_counter() - t0
    t0 = time.perf_counter()
    dynamic(atoms[:shuffled_n], capacity, np.random.default_rng(0), shuffle=True)
    t_shuf_ours = time.perf_counter() - t0
    return {
        "n_graphs": int(atoms.size),
        "unshuffled_pyg_seconds": t_pyg,
        "unshuffled_ours_seconds": t_ours,
        "pyg_batches": len(theirs),
        "ours_batches": int(n_bins),
        "identical_batches": bool(same),
        "pyg_bins_over_l1": len(theirs) / lb,
        "shuffled_n": int(min(shuffled_n, atoms.size)),
        "shuffled_pyg_seconds": t_shuf,
        "shuffled_pyg_batches": n_shuf,
        "shuffled_ours_seconds": t_shuf_ours,
    }


def sweep(sizes: np.ndarray, seed: int = 0, capacities=SWEEP_CAPACITIES, replicas=SWEEP_REPLICAS) -> list[dict]:
    """Capacity x replicas grid for ``paper`` and the ``dynamic`` anchor (no randomness metric)."""
    out = []
    for cap in capacities:
        for r in replicas:
            for algo in ("paper", "dynamic"):
                t0 = time.perf_counter()
                p = pack(sizes, cap, r, algorithm=algo, seed=seed)
                m = p.metrics(randomness=False)
                m["time_to_pack_s"] = time.perf_counter() - t0
                out.append(m)
    return out


def format_sweep(rows: list[dict]) -> str:
    """The capacity x replicas sweep, paper against dynamic, as Markdown."""
    by = {(r["capacity"], r["num_replicas"], r["algorithm"]): r for r in rows}
    cells = [
        {
            "capacity": f"{cap:g}",
            "replicas": rep,
            "paper": by[(cap, rep, "paper")],
            "dynamic": by[(cap, rep, "dynamic")],
        }
        for cap, rep in sorted({(r["capacity"], r["num_replicas"]) for r in rows})
    ]
    columns = [Column("capacity", "capacity"), Column("replicas", "replicas")]
    for algo in ("paper", "dynamic"):
        columns += [
            Column(f"{algo} bins/LB", lambda c, a=algo: c[a]["bins_over_lb"], ".4f"),
            Column(f"{algo} imb max", lambda c, a=algo: c[a]["step_imbalance_max"], ".4f"),
        ]
    return render(cells, columns, title="capacity x replicas sweep (bins/LB, imbalance max)", markdown=True)


def _one_core() -> None:
    """Pack on one core, as the targets are stated."""
    try:
        import numba

        numba.set_num_threads(1)
    except Exception:
        pass


def _real_table(
    result: dict, real_path: str | None, capacity: float, real_replicas: int, seed: int, repeats: int, echo
) -> None:
    real, where = real_sizes(real_path)
    if real is None:
        result["real"] = {"skipped": where}
        echo(f"embedded dataset: {where}")
        return
    rows = table_rows(real, capacity, real_replicas, seed, repeats=repeats)
    result["real"] = {"path": where, "rows": rows}
    title = f"embedded dataset {where}: {real.shape[0]:,} graphs, capacity {capacity:g}, {real_replicas} replicas"
    echo(format_table(rows, title))


def run(
    n: int = 2_650_000,
    capacity: float = DEFAULT_CAPACITY,
    replicas: int = 740,
    real_replicas: int = 4,
    seed: int = 0,
    real_path: str | None = None,
    pyg_n: int = 50_000,
    do_sweep: bool = True,
    repeats: int = 3,
    out: str | Path = "runs/bench/packing.json",
    echo: Callable[[str], object] = print,
) -> dict:
    """Run the whole benchmark, print tables, write JSON; returns the JSON dict."""
    _one_core()
    _warm_up()
    result: dict = {
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor(),
            "platform": platform.platform(),
        },
        "config": {"n": n, "capacity": capacity, "replicas": replicas, "seed": seed},
    }
    sizes, source = synthetic(n, seed)
    result["synthetic_source"] = source
    rows = table_rows(sizes, capacity, replicas, seed, repeats=repeats)
    result["synthetic"] = rows
    echo(f"synthetic sizes: {source}")
    echo(format_table(rows, f"{n:,} graphs, capacity {capacity:g}, {replicas} replicas"))
    pyg = compare_pyg(np.asarray(sizes["atoms"], dtype=np.int64), int(capacity), shuffled_n=pyg_n)
    result["pyg_dynamic_batch_sampler"] = pyg
    echo("real torch_geometric DynamicBatchSampler vs our 'dynamic': " + json.dumps(pyg, default=float))
    _real_table(result, real_path, capacity, real_replicas, seed, repeats, echo)
    if do_sweep:
        result["sweep"] = sweep(sizes, seed)
        echo(format_sweep(result["sweep"]))
    echo(f"wrote {write_json(out, result)}")
    return result
