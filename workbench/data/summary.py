"""Per-family summary of a sizes array, as rows and as a printable table."""

from __future__ import annotations

import numpy as np

from workbench.data.chemical_families import FAMILY_NAMES


def summarize(sizes: np.ndarray, labelled: np.ndarray | None = None, stress: np.ndarray | None = None) -> list[dict]:
    """One row per family present (Table-3 order, then others), plus a ``total`` row; with
    ``labelled`` (``stress``), the count of graphs with energy and forces (a stress label)."""
    names = [f for f in FAMILY_NAMES if np.any(sizes["family"] == f)]
    names += sorted(set(sizes["family"].tolist()) - set(names))
    rows = []
    for name in names + ["total"]:
        sel = np.ones(sizes.size, bool) if name == "total" else sizes["family"] == name
        s = sizes[sel]
        row = {
            "family": name,
            "graphs": int(s.size),
            "share": s.size / max(sizes.size, 1),
            "atoms_min": int(s["atoms"].min()),
            "atoms_mean": float(s["atoms"].mean()),
            "atoms_max": int(s["atoms"].max()),
            "edges_mean": float(s["edges"].mean()),
            "edges_per_atom": float(s["edges"].sum() / max(s["atoms"].sum(), 1)),
        }
        if labelled is not None:
            row["labelled"] = int(np.count_nonzero(labelled[sel]))
        if stress is not None:
            row["stress"] = int(np.count_nonzero(stress[sel]))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of :func:`summarize` rows."""
    cols = [
        ("family", "family", "{:<15}"),
        ("graphs", "graphs", "{:>7}"),
        ("share", "share", "{:>7.1%}"),
        ("atoms_min", "atoms min", "{:>9}"),
        ("atoms_mean", "mean", "{:>7.1f}"),
        ("atoms_max", "max", "{:>5}"),
        ("edges_mean", "edges mean", "{:>10.0f}"),
        ("edges_per_atom", "edges/atom", "{:>10.1f}"),
    ]
    if rows and "labelled" in rows[0]:
        cols.append(("labelled", "labelled", "{:>8}"))
    if rows and "stress" in rows[0]:
        cols.append(("stress", "stress", "{:>6}"))
    head = " ".join((f"{t:<15}" if k == "family" else f"{t:>{len(fmt.format(rows[0][k]))}}") for k, t, fmt in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["family"] == "total":
            lines.append("-" * len(head))
        lines.append(" ".join(fmt.format(r[k]) for k, _, fmt in cols))
    return "\n".join(lines)
