"""Large prepared datasets for throughput benchmarks, tiled from a small one.

``tile_prepared(src, out, n)`` writes ``n`` graphs straight into the prepared format
(:mod:`workbench.data.store`): graph ``i`` is labelled graph ``i mod m`` of ``src`` with every
coordinate moved by up to ``jitter`` Å, so no two stored graphs are identical. Index records
(atoms, edges, connected atoms, energy, forces) are copied from the source graph: a jitter of
1e-3 Å changes the neighbour count only for pairs that close to the cutoff. These datasets
measure memory, start-up and data-loading throughput at scale. They are not physics: the
benchmark that uses them says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from workbench.data.shards import SHARDS, Graph, shard_name, write_shard
from workbench.data.store import FORMAT, FORMAT_VERSION, MANIFEST, SKIPPED, GraphStore, new_index_arrays


def _reusable(out: Path, tiled: dict) -> bool:
    """True when ``out`` already holds this complete tiling; raise when it holds anything else."""
    manifest = out / MANIFEST
    if not manifest.exists():
        return False
    data = json.loads(manifest.read_text())
    if data.get("complete") and data.get("tiled", {}) == tiled:
        return data.get("version") == FORMAT_VERSION  # an older format is tiled again in place
    raise ValueError(f"{out}: holds another dataset; remove it or choose another directory")


def _jittered(graphs: list[Graph], pick: np.ndarray, rng: np.random.Generator, jitter: float) -> list[Graph]:
    """Copies of ``graphs[k]`` for ``k`` in ``pick``, each coordinate moved uniformly by up to ``jitter`` Å."""
    return [
        replace(graphs[k], positions=graphs[k].positions + rng.uniform(-jitter, jitter, graphs[k].positions.shape))
        for k in pick
    ]


def _tiled_manifest(src: GraphStore, shards: list[dict], n: int, tiled: dict) -> dict:
    """The manifest of a finished tiling: ``src``'s settings and families, one pseudo-source."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "complete": True,
        "settings": src.manifest["settings"],
        "cutoff": src.cutoff,
        "sources": [{"path": str(src.path), "size": 0, "mtime_ns": 0}],
        "families": list(src.families),
        "elements": list(src.elements),
        "shards": shards,
        "n_graphs": n,
        "n_skipped": 0,
        "seconds": 0.0,
        "tiled": tiled,
    }


def tile_prepared(
    src: GraphStore,
    out: str | os.PathLike,
    n: int,
    *,
    seed: int = 0,
    jitter: float = 1e-3,
    shard_size: int = 4096,
    progress: bool = True,
) -> GraphStore:
    """Write ``n`` jittered copies of ``src``'s labelled graphs to ``out`` (reused when complete)."""
    from workbench.progress import bar as progress_bar

    out = Path(out)
    tiled = {"from": str(src.path), "n": n, "seed": seed, "jitter": jitter}
    if _reusable(out, tiled):
        return GraphStore(out)
    rows = src.select()
    if rows.size == 0:
        raise ValueError(f"{src.path}: no labelled graphs to tile")
    graphs = [src.graph(int(r)) for r in rows]
    counts = np.concatenate([c for _, c in src.element_counts(rows)])
    rng = np.random.default_rng(seed)
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    index, all_counts, origin = new_index_arrays(out, n, counts.shape[1])
    names = []
    bar = progress_bar(total=n, unit="graph", desc="tile", disable=not progress)
    for code, start in enumerate(range(0, n, shard_size)):
        pick = np.arange(start, min(start + shard_size, n)) % rows.size
        name = shard_name(0, code)
        names.append(write_shard(out / SHARDS / name, _jittered(graphs, pick, rng, jitter)))
        sl = slice(start, start + pick.size)
        index[sl] = src.records(rows[pick])
        index["shard"][sl] = code
        index["row"][sl] = np.arange(pick.size)
        all_counts[sl] = counts[pick]
        origin["source"][sl] = 0
        origin["frame"][sl] = rows[pick]
        bar.update(pick.size)
    bar.close()
    for arr in (index, all_counts, origin):
        arr.flush()
    del index, all_counts, origin
    (out / SKIPPED).write_text("")
    (out / MANIFEST).write_text(json.dumps(_tiled_manifest(src, names, n, tiled), indent=1) + "\n")
    return GraphStore(out)
