"""``workbench bench cpu --parts md``: an MD step as a user runs one, through an ASE calculator.

For each (model, system, dtype), one random model file (:func:`~workbench.kernels.tools.models.random_scaleshift_mace`)
runs through:

* ``e3nn`` - mace-torch's ``MACECalculator`` as it ships;
* ``numba`` - the same calculator with the workbench kernels (``workbench md``'s,
  :func:`~workbench.train.md_calculator.load_calculator`);
* every peer of :mod:`workbench.bench.peers` (Symmetrix-XL), converted by its own tool.

Each calculator's first call is timed alone (``cold_s``: compiling and loading included), then
the calls are interleaved (e3nn, numba, peers, e3nn, ...) on the same displaced positions, so
machine noise hits all, and the median of ``repeats`` is kept. Each row gives its agreement
with e3nn next to its time: the largest force difference relative to the largest e3nn force,
and the energy's relative difference. A peer that is missing or refuses the model gets a row
that says so.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from workbench.bench.peers import PEERS, PeerRefused
from workbench.bench.table import Column, render
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["CALCULATORS", "case_columns", "md_case", "md_lines"]

CALCULATORS = ("e3nn", DEFAULT_BACKEND, *PEERS)
DISPLACEMENT = 1e-3  # Å per repeat: every call computes anew


def _model_file(model: str, system: str, atoms, dtype: str, folder: Path) -> Path:
    """The random model of ``model`` over ``atoms``' elements and neighbour count, saved as mace saves one."""
    import torch

    from workbench.bench.workloads import MODELS, model_cutoff, model_elements
    from workbench.data.sizes import count_edges
    from workbench.kernels.tools.models import random_scaleshift_mace

    hidden, ell, corr = MODELS[model]
    zs = model_elements(model, atoms.numbers)
    r_max = model_cutoff(model)
    neighbours = count_edges(atoms, r_max) / len(atoms)
    path = folder / f"{model}-{system}-{dtype}.model"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        model_ = random_scaleshift_mace(hidden, ell, corr, zs, neighbours, getattr(torch, dtype), "cpu", r_max=r_max)
        torch.save(model_, path)
    return path


def _calculator(name: str, path: Path, dtype: str, folder: Path):
    """``(calculator, None)`` or ``(None, why not)``."""
    from workbench.bench import peers

    if name in ("e3nn", DEFAULT_BACKEND):
        from workbench.train.md_calculator import load_calculator

        return load_calculator(path, backend=name, dtype=dtype), None
    why = peers.missing(name)
    if why:
        return None, why
    try:
        return peers.calculator(name, peers.convert(name, path, folder), dtype), None
    except PeerRefused as exc:
        return None, f"refused: {exc}"


def _call(calc, atoms, positions: np.ndarray) -> tuple[float, float, np.ndarray]:
    """``(seconds, energy, forces)`` of one call at ``positions``."""
    a = atoms.copy()
    a.positions = positions
    a.calc = calc
    t0 = time.perf_counter()
    forces = a.get_forces()
    energy = a.get_potential_energy()
    return time.perf_counter() - t0, float(energy), np.asarray(forces)


def _agreement(ref: tuple, mine: tuple) -> dict[str, float]:
    f_scale = float(np.abs(ref[2]).max()) or 1.0
    return {
        "force_rel": float(np.abs(mine[2] - ref[2]).max() / f_scale),
        "energy_rel": abs(mine[1] - ref[1]) / max(abs(ref[1]), 1e-300),
    }


def md_case(
    model: str,
    system: str,
    dtype: str,
    repeats: int,
    folder: str | Path,
    calculators=CALCULATORS,
    keep_memory: bool = False,
) -> dict[str, Any]:
    """One row set of the module docstring for ``model`` on ``system`` (one structure) in
    ``dtype``, for ``calculators`` (e3nn, numba and the peers' names); ``keep_memory``: as
    :func:`~workbench.train.md_calculator.load_calculator`'s, for the whole process."""
    from workbench.bench.workloads import system_structures

    if keep_memory:  # once, before any calculator: every row runs under it
        from workbench.train.heap import keep_freed_memory

        keep_freed_memory()
    folder = Path(folder)
    structures = system_structures(system)
    if len(structures) != 1:
        raise ValueError(f"--systems {system}: the md part runs one structure (water-, crystal- or perovskite-<atoms>)")
    (atoms,) = structures
    path = _model_file(model, system, atoms, dtype, folder)
    case: dict[str, Any] = {"model": model, "system": system, "dtype": dtype, "atoms": len(atoms), "rows": {}}
    ready, first = {}, {}
    for name in calculators:
        t0 = time.perf_counter()
        calc, why = _calculator(name, path, dtype, folder)
        if calc is None:
            case["rows"][name] = {"skipped": why}
            continue
        first[name] = _call(calc, atoms, atoms.positions)
        case["rows"][name] = {"cold_s": time.perf_counter() - t0}
        ready[name] = calc
    times: dict[str, list[float]] = {name: [] for name in ready}
    rng = np.random.default_rng(0)
    for _ in range(repeats):
        positions = atoms.positions + rng.normal(0.0, DISPLACEMENT, atoms.positions.shape)
        for name, calc in ready.items():
            times[name].append(_call(calc, atoms, positions)[0])
    for name in ready:
        row = case["rows"][name]
        row["median_ms"] = 1e3 * statistics.median(times[name])
        if "e3nn" in first:
            row.update(_agreement(first["e3nn"], first[name]))
    base = case["rows"].get(DEFAULT_BACKEND, {}).get("median_ms")
    for row in case["rows"].values():
        if base and "median_ms" in row:
            row["vs_numba"] = row["median_ms"] / base
    return case


def case_columns() -> list[Column]:
    """The columns naming a case of the md and compiled parts: model, system, dtype, atoms."""
    return [
        Column("model", "model", width=6, align="<"),
        Column("system", "system", width=10, align="<"),
        Column("dtype", "dtype", width=8, align="<"),
        Column("atoms", "atoms", "d", 5),
    ]


def md_lines(cases: list[dict]) -> list[str]:
    """The ``md`` part as text: per case and calculator, the median, the ratio to ours, the
    agreement with e3nn and the cold start; a skipped or refused peer says why."""
    rows = []
    for c in cases:
        for name, r in c["rows"].items():
            rows.append({**{k: c[k] for k in ("model", "system", "dtype", "atoms")}, "calc": name, **r})
    columns = [
        *case_columns(),
        Column("calculator", "calc", width=10, align="<"),
        Column("ms", lambda r: r.get("median_ms"), ".1f", 8),
        Column("/ numba", lambda r: r.get("vs_numba"), ".2f", 7),
        Column("F vs e3nn", lambda r: r.get("force_rel"), ".1e", 9),
        Column("E vs e3nn", lambda r: r.get("energy_rel"), ".1e", 9),
        Column("cold s", lambda r: r.get("cold_s"), ".1f", 6),
        Column("", lambda r: r.get("skipped", ""), width=1, align="<"),
    ]
    title = "\nMD step through ASE calculators (energy + forces), interleaved medians"
    return [render(rows, columns, title=title, rule=False)]
