"""The eight chemical families of the paper's Table 3, and how many atoms each graph has.

This table is the single source of truth shared by the structure generators
(:mod:`workbench.data.synth.generators`) and the size-only sampler
(:func:`workbench.data.synthetic_sizes`): both draw atom counts through
:func:`sample_natoms`, so the synthetic 2.65M-graph study and the embedded
dataset have the same size distribution per family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Family:
    """One row of Table 3 (HPDC'25, §5.1.1).

    ``paper_count`` is the number of graphs in the paper's 2.65M mixture;
    ``atoms_min``/``atoms_max`` the range of vertex counts it reports.
    """

    name: str
    paper_count: int
    atoms_min: int
    atoms_max: int
    periodic: bool
    description: str


# Order is the order of Table 3 by size of contribution; names are the extxyz ``config_type``.
FAMILIES: tuple[Family, ...] = (
    Family("mptrj", 1_580_312, 1, 444, True, "MPtrj-like inorganic crystals"),
    Family("water_clusters", 460_000, 9, 75, False, "gas-phase water clusters (H2O)n, n = 3..25"),
    Family("tmd", 219_627, 16, 96, True, "transition-metal dichalcogenide (MoS2-type) slabs"),
    Family("liquid_water", 190_267, 768, 768, True, "periodic liquid water, 256 molecules"),
    Family("zeolite", 99_770, 203, 408, True, "zeolite-like silica frameworks with pore water"),
    Family("cuni", 74_335, 492, 500, True, "CuNi fcc alloys with vacancies"),
    Family("hea", 25_628, 36, 48, True, "high-entropy fcc alloys"),
    Family("al_hcl", 884, 281, 281, True, "Al3+ in aqueous HCl, periodic box"),
)

FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
PAPER_TOTAL: int = sum(f.paper_count for f in FAMILIES)


def family(name: str) -> Family:
    """Look up a family by name with an error that lists the valid names."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; choose from {', '.join(FAMILY_NAMES)}") from None


def proportions() -> dict[str, float]:
    """Fraction of each family in the paper's mixture (Table 3 counts / 2,650,823)."""
    return {f.name: f.paper_count / PAPER_TOTAL for f in FAMILIES}


def family_counts(n: int, families: dict[str, int] | list[str] | tuple[str, ...] | None = None) -> dict[str, int]:
    """Split ``n`` graphs across families.

    ``families`` may be ``None`` (all eight, Table-3 proportions), a list of names
    (those families only, Table-3 proportions renormalised) or a dict of explicit
    counts (then ``n`` is ignored). Rounding uses the largest-remainder method so
    the counts sum to ``n`` exactly; every selected family with a non-zero
    proportion gets at least one graph when ``n`` allows it.
    """
    if isinstance(families, dict):
        out = {}
        for name, count in families.items():
            family(name)
            if int(count) < 0:
                raise ValueError(f"family {name!r}: count must be >= 0, got {count}")
            out[name] = int(count)
        return out
    names = list(FAMILY_NAMES if families is None else families)
    for name in names:
        family(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    weights = np.array([BY_NAME[k].paper_count for k in names], dtype=float)
    exact = n * weights / weights.sum()
    counts = np.floor(exact).astype(int)
    if n >= len(names):
        counts = np.maximum(counts, 1)
    rest = n - counts.sum()
    # Largest remainder relative to what each family already has (after the minimum of one).
    order = np.argsort(-(exact - counts), kind="stable")
    if rest < 0:  # the minimum of one over-allocated: take back from the most over-served
        order = order[::-1]
    i = 0
    while rest != 0:
        j = order[i % len(names)]
        if rest > 0:
            counts[j] += 1
            rest -= 1
        elif counts[j] > 1:
            counts[j] -= 1
            rest += 1
        i += 1
    return dict(zip(names, counts.tolist()))


def sample_natoms(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` atom counts for family ``name``; always inside the Table-3 range.

    The shapes within each range are our modelling choice (the paper gives only
    the range): MPtrj is log-normal around 24 atoms, as the Materials Project is
    dominated by small unit cells; water clusters have 3..25 whole molecules;
    CuNi is a 500-atom fcc cell with 0..8 vacancies; the others are uniform.
    """
    f = family(name)
    if name == "mptrj":
        x = np.exp(rng.normal(np.log(24.0), 0.85, size=n))
        out = np.clip(np.rint(x), f.atoms_min, f.atoms_max)
    elif name == "water_clusters":
        out = 3 * rng.integers(3, 26, size=n)
    elif name in ("liquid_water", "al_hcl"):
        out = np.full(n, f.atoms_min)
    else:
        out = rng.integers(f.atoms_min, f.atoms_max + 1, size=n)
    return out.astype(np.int64)
