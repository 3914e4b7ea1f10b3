"""The ASE calculator ``workbench md`` integrates with: mace-torch's ``MACECalculator``, the
model's hot ops on the chosen kernel backend, and graphs built where the neighbour list can
afford them (:mod:`workbench.data.neighbour_frame`)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

from workbench.kernels.registry import DEFAULT_BACKEND, get_backend

__all__ = ["RADIAL_CHOICES", "STRESS_PROPERTIES", "load_calculator"]

#: how the calculator evaluates a model's radial networks: ``"table"``
#: (:func:`~workbench.kernels.mace.radial.tabulate_radial`) or ``"mlp"`` (the networks themselves)
RADIAL_CHOICES: tuple[str, ...] = ("table", "mlp")


@functools.cache
def _calculator_class() -> type:
    """``MACECalculator`` whose graph of a structure far from the origin is built centred; defined
    on first use (importing mace costs seconds, the CLI's ``--help`` should not)."""
    from ase.calculators.calculator import all_changes
    from mace.calculators import MACECalculator

    from workbench.data.neighbour_frame import centred_atoms

    class CentredMACECalculator(MACECalculator):
        # Only the graph moves: ASE's own atoms (and the trajectory) keep the user's coordinates.
        def _atoms_to_batch(self, atoms):
            with _skin_neighbours(self):
                return super()._atoms_to_batch(centred_atoms(atoms))

        def calculate(self, atoms=None, properties=None, system_changes=all_changes):
            # mace computes the stress at every call; an MD integrator asks for forces only, and
            # ASE calls again for a stress it does not hold
            if properties is None or set(properties) & STRESS_PROPERTIES:
                return super().calculate(atoms, properties, system_changes)
            hooks = [m.register_forward_pre_hook(_without_stress, with_kwargs=True) for m in self.models]
            try:
                return super().calculate(atoms, properties, system_changes)
            finally:
                for hook in hooks:
                    hook.remove()

    return CentredMACECalculator


#: the properties that need the stress (the virials' derivative): without them a call skips it
STRESS_PROPERTIES = frozenset({"stress", "stresses", "virials"})


def _without_stress(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: the model's call without the stress (0.97x the step at 1,536 atoms)."""
    return args, {**kwargs, "compute_stress": False}


#: one graph build at a time swaps mace's neighbour search (calculators in several threads)
_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _skin_neighbours(calc):
    """mace's graph builder searches neighbours through the calculator's own
    :class:`~workbench.data.neighbour_skin.SkinNeighbourList` (kept across steps) for the block."""
    import mace.data.atomic_data as atomic_data

    from workbench.data.neighbour_skin import SkinNeighbourList

    neighbours = calc.__dict__.setdefault("neighbour_list", SkinNeighbourList())
    with _SWAP_LOCK:
        search = atomic_data.get_neighborhood  # mace's, or what wraps it (never a kept list)
        neighbours.search = search.search if isinstance(search, SkinNeighbourList) else search
        atomic_data.get_neighborhood = neighbours
        try:
            yield
        finally:
            atomic_data.get_neighborhood = search


def load_calculator(
    model: str | os.PathLike,
    backend: str = DEFAULT_BACKEND,
    device: str = "cpu",
    dtype: str | None = None,
    trust_model: bool = False,
    head: str | None = None,
    keep_memory: bool = False,
    radial: str | None = None,
):
    """mace-torch's ``MACECalculator`` for ``model`` with its hot ops on ``backend``. The file is
    loaded without running code from it (:mod:`workbench.train.model_file`) unless ``trust_model``.

    The backend is applied whatever the file holds: a file saved after ``accelerate()`` runs
    mace's e3nn modules again under ``backend="e3nn"``, so what runs is what the summary names.
    ``head``: the head of a multihead model to run (:func:`~workbench.train.heads.select_head`).
    ``keep_memory`` (on the CPU): keep freed memory in the process for the next step
    (:func:`~workbench.train.heap.keep_freed_memory`: fewer page faults, 0.78x the step at 1,536
    atoms). Process-wide and never undone: right for a process that runs one MD (``workbench md``
    sets it), not for one that also runs other large work.

    ``radial`` (:data:`RADIAL_CHOICES`): ``"table"`` evaluates each interaction's radial network
    from a table of it (:func:`~workbench.kernels.mace.radial.tabulate_radial`: forces within
    1e-10 of the network's in float64, 0.86x the MD step at 1,536 atoms); ``"mlp"`` runs the
    networks. Default: ``"table"`` with the numba backend on the CPU, ``"mlp"`` otherwise (the
    tables are CPU kernels; the e3nn backend is the reference). The report of what was tabulated
    is ``calc.radial_report`` (one dict per model). Models run in ``eval()`` mode, and with a
    compiled backend on the CPU, e3nn's linears as one product per irrep dimension
    (:func:`~workbench.kernels.mace.adapter.use_companions`).

    A call computes the stress only when ASE asks for it (:data:`STRESS_PROPERTIES`): an MD
    integrator asks for forces, and mace's own calculator computes the stress at every call
    (0.97x the step at 1,536 atoms without it). ASE calls again for a stress it does not hold.

    Neighbours are searched with a skin and the list is kept across calls while no atom moved
    more than half of it (``calc.neighbour_list``, a
    :class:`~workbench.data.neighbour_skin.SkinNeighbourList`: mace's edges, 14 ms against 44 ms
    per step at 1,536 water atoms)."""
    if radial is not None and radial not in RADIAL_CHOICES:
        raise ValueError(f"radial={radial!r}; the choices are {', '.join(RADIAL_CHOICES)}")
    from workbench.train.model_file import check_device, load_model

    check_device(device)
    from workbench.train.heads import select_head

    if keep_memory and str(device) == "cpu":
        from workbench.train.heap import keep_freed_memory

        keep_freed_memory()

    loaded = select_head(load_model(model, trust=trust_model, map_location="cpu"), head, model)[1]
    if dtype is None:
        dtype = str(next(loaded.parameters()).dtype).replace("torch.", "")
    calc = _calculator_class()(models=loaded, device=str(device), default_dtype=dtype)
    calc.models = [_for_md(m, backend, device) for m in calc.models]
    calc.radial_report = _radial(calc.models, radial, backend, device)
    return calc


def _for_md(model, backend: str, device: str):
    """``model`` on ``backend`` in ``eval()``, with the companions' linears where they were measured
    faster (a compiled backend on the CPU)."""
    from workbench.kernels import accelerate

    model = accelerate(model, backend=backend).eval()
    if get_backend(backend).compiled and str(device) == "cpu":
        from workbench.kernels.mace.adapter import use_companions

        use_companions(model, backend)
    return model


def _radial(models: list, radial: str | None, backend: str, device: str) -> list[dict[str, str]]:
    """Tabulate the models' radial networks where ``radial`` (or its default) says so."""
    if radial is None:
        radial = "table" if get_backend(backend).compiled and str(device) == "cpu" else "mlp"
    if radial == "mlp":
        return [{} for _ in models]
    if str(device) != "cpu":
        raise ValueError(f"radial='table' runs on the CPU only, not on {device!r}; use radial='mlp'")
    from workbench.kernels.mace.radial import tabulate_radial

    return [tabulate_radial(m) for m in models]
