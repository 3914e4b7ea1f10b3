"""The Table-3 mixture: many labelled structures of the eight families, interleaved.

``make_mixture(n, seed)`` is deterministic for the same arguments: the same structures on
any CPU (labels within the dataset card's tolerances), the same bytes on the same machine: every structure comes from :func:`generate` with its own seed, and the
interleaving permutation from ``np.random.default_rng(seed)``; ``workers`` only changes
where structures are computed, never what they are or their order.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from ase import Atoms

from workbench.data.chemical_families import BY_NAME, family_counts
from workbench.data.synth.generators import generate

# Rough relative cost per structure, used only to start expensive jobs first (load balance).
_COST = {"al_hcl": 1000.0, "tmd": 30.0, "zeolite": 20.0, "liquid_water": 15.0, "cuni": 5.0}


def _init_worker() -> None:
    # One OpenMP thread per process: tblite results then do not depend on thread count.
    os.environ["OMP_NUM_THREADS"] = "1"


def _build(job: tuple[tuple[str, int, int], str | None]) -> Atoms:
    (name, index, seed), calc = job
    return generate(name, index, seed, calculator=calc)


def mixture_tasks(n: int = 2000, seed: int = 0, families=None) -> list[tuple[str, int, int]]:
    """The (family, index, seed) of every structure of the mixture, in its final order."""
    if families is not None and not isinstance(families, (dict, list, tuple)):
        raise TypeError(f"families must be None, a list of names or a dict name->count, got {type(families).__name__}")
    if families is not None and len(families) == 0:
        raise ValueError(f"families is empty; choose from {', '.join(BY_NAME)}")
    for name in families or ():
        if name not in BY_NAME:
            raise KeyError(f"unknown family {name!r}; choose from {', '.join(BY_NAME)}")
    counts = family_counts(n, families)
    tasks = [(name, i, int(seed)) for name, c in counts.items() for i in range(c)]
    order = np.random.default_rng(seed).permutation(len(tasks))
    return [tasks[k] for k in order]


def make_mixture(
    n: int = 2000,
    seed: int = 0,
    families=None,
    progress: bool = False,
    workers: int = 1,
    calculators: dict[str, str | None] | None = None,
) -> list[Atoms]:
    """Build the labelled mixture of Table-3 families.

    Args:
        n: number of structures (ignored when ``families`` is a dict of counts).
        seed: dataset seed; structure i of family f is ``generate(f, i, seed)``.
        families: None (all eight, Table-3 proportions), a list of names (renormalised
            proportions) or a dict {name: count}.
        progress: show a tqdm progress bar.
        workers: processes to build with (1: in this process). Does not change the result.
        calculators: per-family override of ``labels.CALCULATOR``, e.g.
            ``{"tmd": "gfn1-xtb"}`` (labels TMD at ~10 s/structure) or ``{"mptrj": None}``.

    Returns:
        list of ``ase.Atoms`` in a deterministic interleaved order, each with
        ``info["config_type"]``, ``info["REF_energy"]`` (eV) and ``arrays["REF_forces"]``
        ((n_atoms, 3) eV/Å) unless its family is unlabelled (``info["labelled"] is False``).
    """
    tasks = mixture_tasks(n, seed, families)
    calculators = dict(calculators or {})
    for name in calculators:
        if name not in BY_NAME:
            raise KeyError(f"unknown family {name!r} in calculators; choose from {', '.join(BY_NAME)}")
    jobs = [(t, calculators.get(t[0], "default")) for t in tasks]
    bar = None
    if progress:
        from workbench.progress import bar as progress_bar

        bar = progress_bar(total=len(tasks), desc="structures", unit="graph")
    out: list[Atoms | None] = [None] * len(tasks)
    if workers <= 1 or len(tasks) < 2:
        for k in range(len(jobs)):
            out[k] = _build(jobs[k])
            if bar is not None:
                bar.update(1)
    else:
        import multiprocessing as mp

        # expensive first, so no worker is left alone with a long job at the end
        order = sorted(range(len(tasks)), key=lambda k: -_COST.get(tasks[k][0], 1.0))
        ctx = mp.get_context("spawn")  # fresh interpreters: OMP_NUM_THREADS set before tblite loads
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker) as pool:
            results = pool.map(_build, [jobs[k] for k in order], chunksize=1)
            for k, atoms in zip(order, results):
                out[k] = atoms
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return out  # type: ignore[return-value]
