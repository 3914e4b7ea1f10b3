"""Fine-tuning views for notebook 04: what a foundation model file holds, how the new data and the
replay pack together per GPU, and the errors before and after per head and family."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence

import numpy as np

from workbench.train.replay_options import PT_HEAD

__all__ = ["errors_by_head_html", "foundation_summary", "replay_layout_figure"]


def foundation_summary(path: str | os.PathLike, trust: bool = False) -> str:
    """A few lines: the file's heads, elements, architecture and E0s."""
    from ase.data import chemical_symbols

    from workbench.train.foundation import load_foundation

    found = load_foundation(path, trust=trust)
    arch = ", ".join(f"{k} {v}" for k, v in found.architecture().items())
    e0s = ", ".join(f"{chemical_symbols[z]} {e:.3f}" for z, e in found.e0s.items())
    return (
        f"{found.path}\n"
        f"heads: {', '.join(found.heads)} (fine-tuning starts from {found.head})\n"
        f"elements ({len(found.zs)}): {' '.join(chemical_symbols[z] for z in found.zs)}\n"
        f"architecture: {arch}\n"
        f"E0s (eV): {e0s}"
    )


def replay_layout_figure(data, capacity: float, num_replicas: int = 2, seed: int = 0, algorithm: str = "paper"):
    """The first step's bins per GPU when the new graphs and the replayed ones are packed together,
    coloured by head (``data``: :class:`~workbench.train.data.TrainData` of a multihead run)."""
    from workbench.packing import BinPackingBatchSampler
    from workbench.viz.layout import bin_layout_figure, rectangles_from_batches

    if not data.heads:
        raise ValueError("replay_layout_figure: the data of a multihead run (multihead_finetuning: true)")
    width = f"U{max(len(h) for h in data.heads)}"  # head names are up to 64 characters
    sizes = np.zeros(len(data.train_atoms), dtype=[("atoms", np.int64), ("family", width)])
    sizes["atoms"] = data.train_atoms
    sizes["family"] = np.asarray(data.heads, dtype=width)[data.train_heads]
    first = []
    for rank in range(num_replicas):
        sampler = BinPackingBatchSampler(
            data.train_atoms, capacity=capacity, num_replicas=num_replicas, rank=rank, seed=seed, algorithm=algorithm
        )
        first.append(np.asarray(next(iter(sampler)), dtype=np.int64))
    new = ", ".join(h for h in data.heads if h != PT_HEAD)
    title = f"Step 0 per GPU: new data ({new}) and replay ({PT_HEAD}) in one {algorithm} packing"
    return bin_layout_figure([(algorithm, rectangles_from_batches(first, sizes))], capacity=capacity, title=title)


def errors_by_head_html(
    foundation: str | os.PathLike, tuned: str | os.PathLike, sets: dict[str, str], heads: Sequence[str]
) -> str:
    """Force and energy MAE per family of each structure set (``{label: file}``): the foundation
    as it is, then the fine-tuned model through each of ``heads``."""
    from workbench.train.evaluation import evaluate_file

    columns = [("foundation", foundation, None)] + [(f"fine-tuned, {h}", tuned, h) for h in heads]
    rows = []
    for label, path in sets.items():
        results = [evaluate_file(model, path, head=head) for _, model, head in columns]
        for family in sorted(results[0]["families"]):
            cells = [r["families"][family] for r in results]
            rows.append((label, family, cells[0]["graphs"], cells))
    head = "".join(f"<th>{html.escape(name)}<br>F / E MAE</th>" for name, _, _ in columns)
    body = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{html.escape(family)}</td><td>{graphs}</td>"
        + "".join(f"<td>{c['f_mae_mev_a']:.1f} / {c['e_mae_mev_atom']:.1f}</td>" for c in cells)
        + "</tr>"
        for label, family, graphs, cells in rows
    )
    return (
        "<table><caption style='text-align:left;font-weight:600'>Errors before and after fine-tuning "
        "(meV/Å / meV/atom)</caption>"
        f"<tr><th>set</th><th>config_type</th><th>graphs</th>{head}</tr>{body}</table>"
    )
