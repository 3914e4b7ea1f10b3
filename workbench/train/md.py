r"""``workbench md MODEL --structure FILE``: validate a trained model by molecular dynamics.

The check every MLIP user runs after training: does the model conserve energy in NVE (a model
with rough or non-conservative forces heats up), and how fast does it run? The model file (a
mace-torch model, such as the ``model.model`` that ``workbench train`` exports) is loaded without
running code from it (:mod:`workbench.train.model_file`; ``--trust-model`` for others), wrapped
in mace-torch's own ``MACECalculator``, its hot ops are swapped for the workbench kernels
(the default backend, :data:`~workbench.kernels.registry.DEFAULT_BACKEND`) and ASE integrates:

* ``nve``: velocity Verlet;
* ``nvt``: Langevin at ``temperature`` (friction ``0.01 / fs``).

Velocities start from a Maxwell-Boltzmann distribution at ``temperature`` (seeded), with the
centre-of-mass motion removed (except for a single atom, whose only motion it is: it starts at
exactly ``temperature``). Graphs of a structure far from the origin are built centred
(:mod:`workbench.data.neighbour_frame`); the trajectory keeps the structure's own coordinates.
The summary gives the total-energy drift per atom per ps (the slope of a least-squares line
through :math:`E_{tot}(t)`, meaningful in NVE), the largest excursion of :math:`E_{tot}` from its
start, the temperature, and the speed in ns/day and ms/step (first step, which compiles, excluded).

The starting frame gets the checks training data gets (``workbench.data.io.validate_structure``:
no atoms closer than 0.5 Å, ...), and its elements must be the model's. A run whose temperature
exceeds ``10 x temperature + 1000 K`` (:func:`temperature_limit`) or whose energy goes non-finite
stops with :class:`MDRunaway`: the timestep is too long for the model, or the model is unsound.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workbench.cli_args import Options, add_command, option_values
from workbench.kernels.registry import BACKENDS, DEFAULT_BACKEND
from workbench.train.md_calculator import RADIAL_CHOICES, load_calculator

__all__ = ["ENSEMBLES", "MDResult", "MDRunaway", "energy_drift", "load_calculator", "run_md", "temperature_limit"]

ENSEMBLES = ("nve", "nvt")
LANGEVIN_FRICTION_PER_FS = 0.01
#: a run stops when its temperature exceeds RUNAWAY_FACTOR x the target + RUNAWAY_FLOOR_K
RUNAWAY_FACTOR = 10.0
RUNAWAY_FLOOR_K = 1000.0


@dataclass
class MDResult:
    """What :func:`run_md` measured (energies in eV, times in ps)."""

    model: str
    structure: str
    backend: str
    ensemble: str
    atoms: int
    steps: int
    timestep_fs: float
    time_ps: list[float] = field(repr=False)
    total_energy: list[float] = field(repr=False)
    potential_energy: list[float] = field(repr=False)
    temperature_k: list[float] = field(repr=False)
    drift_ev_atom_ps: float = 0.0
    max_excursion_ev_atom: float = 0.0
    ns_per_day: float = 0.0
    ms_per_step: float = 0.0
    trajectory: str | None = None

    def summary(self) -> str:
        return (
            f"{self.ensemble.upper()} {self.steps} steps of {self.timestep_fs:g} fs, {self.atoms} atoms, backend {self.backend}: "
            f"energy drift {self.drift_ev_atom_ps:+.3e} eV/atom/ps, max |E - E0| {self.max_excursion_ev_atom:.3e} eV/atom, "
            f"T {np.mean(self.temperature_k):.0f} K (mean); {self.ns_per_day:.3f} ns/day ({self.ms_per_step:.1f} ms/step)"
        )


def energy_drift(time_ps: np.ndarray, total: np.ndarray, atoms: int) -> tuple[float, float]:
    """``(slope, max excursion)`` of the total energy per atom: eV/atom/ps from a least-squares
    line, and :math:`\\max_t |E(t) - E(0)|` in eV/atom."""
    t, e = np.asarray(time_ps, dtype=float), np.asarray(total, dtype=float) / atoms
    slope = float(np.polyfit(t, e, 1)[0]) if t.size >= 2 and np.ptp(t) > 0 else 0.0
    return slope, float(np.max(np.abs(e - e[0]))) if e.size else 0.0


def _check_elements(atoms, calc, model: str | os.PathLike) -> None:
    """Every element of ``atoms`` must be one the model was trained on."""
    from ase.data import chemical_symbols

    known = {int(z) for z in calc.models[0].atomic_numbers}
    missing = sorted({int(z) for z in atoms.numbers} - known)
    if missing:
        names = ", ".join(f"{chemical_symbols[z]} (Z={z})" for z in missing)
        has = ", ".join(chemical_symbols[z] for z in sorted(known))
        raise ValueError(f"{model}: the model has no element {names} of the structure; it knows {has}")


def _read_structure(path, index: int):
    """The starting frame, through the checks training data gets (finite coordinates, real
    elements, no atoms closer than ``workbench.data.io.MIN_DISTANCE``)."""
    import ase
    import ase.io

    from workbench.data.io import validate_structure

    if isinstance(path, ase.Atoms):
        atoms = path.copy()
        validate_structure(atoms, require_labels=False)
        atoms.calc = None
        return atoms
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such structure file")
    try:
        atoms = ase.io.read(p, index=index)
    except Exception as exc:
        raise ValueError(f"{p}: cannot read frame {index}: {type(exc).__name__}: {exc}") from None
    validate_structure(atoms, path=p, frame=index, require_labels=False)
    atoms.calc = None
    return atoms


def _check_md_args(ensemble: str, steps: int, timestep_fs: float, temperature: float, write_every: int) -> None:
    if ensemble not in ENSEMBLES:
        raise ValueError(f"ensemble {ensemble!r}: choose one of {', '.join(ENSEMBLES)}")
    for option, value, unit in (("--timestep", timestep_fs, "fs"), ("--temperature", temperature, "K")):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{option} {value:g}: must be a finite number of {unit} > 0")
    for option, value in (("--steps", steps), ("--write-every", write_every)):
        if value < 1:
            raise ValueError(f"{option} {value}: must be >= 1")


def temperature_limit(target_k: float) -> float:
    """K: above this the run is stopped as unstable (:data:`RUNAWAY_FACTOR` times the target plus
    :data:`RUNAWAY_FLOOR_K`): NVE of a sound model at a sane timestep stays within a few times
    its start, far below; a timestep too long for the model heats it by orders of magnitude."""
    return RUNAWAY_FACTOR * target_k + RUNAWAY_FLOOR_K


def _thermalise(atoms, temperature: float, seed: int) -> None:
    """Maxwell-Boltzmann velocities at ``temperature`` (seeded), no centre-of-mass motion, no
    rotation for a molecule (a periodic cell has no rotation to remove). A single atom keeps its
    velocity: its only motion is the centre of mass's, and ASE's rescaling of what is left after
    removing it divides by zero (a NaN temperature); it starts at exactly ``temperature``."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary, ZeroRotation

    single = len(atoms) == 1  # its kinetic energy is set to 3/2 k_B T: one draw of 3 dof scatters widely
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=np.random.default_rng(seed), force_temp=single)
    if single:
        return
    Stationary(atoms)
    if not atoms.pbc.any():
        ZeroRotation(atoms)


def _integrator(atoms, ensemble: str, timestep_fs: float, temperature: float, seed: int):
    """Velocity Verlet for ``nve``; Langevin at ``temperature`` for ``nvt`` (its own seeded stream;
    a single atom's centre of mass is thermostatted too, it has no other motion)."""
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    dt = timestep_fs * units.fs
    if ensemble == "nve":
        return VelocityVerlet(atoms, timestep=dt)
    return Langevin(
        atoms,
        timestep=dt,
        temperature_K=temperature,
        friction=LANGEVIN_FRICTION_PER_FS / units.fs,
        rng=np.random.default_rng(seed + 1),
        **({"fixcm": False} if len(atoms) == 1 else {}),  # fixing the only atom's motion divides by N - 1 = 0
    )


def _output_path(path: str | os.PathLike | None, option: str) -> Path | None:
    """``path`` when its folder exists or can be made; a ``ValueError`` naming it otherwise
    (checked before the run, so a long run is not lost to a typo)."""
    if not path:
        return None
    path = Path(path)
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{option} {path}: {blocking} is a file, not a folder")
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot make its folder ({exc.strerror or exc})") from None
    return path


def _fresh_trajectory(trajectory: str | os.PathLike | None) -> Path | None:
    """The trajectory path, its directory made and an old file removed (frames are appended)."""
    path = _output_path(trajectory, "--trajectory")
    if path is not None:
        path.unlink(missing_ok=True)
    return path


class MDRunaway(ValueError):
    """The temperature left :func:`temperature_limit` or an energy went non-finite."""


class _Recorder:
    """Called by ASE after every step (and at step 0): energies, temperature, a wall-clock stamp,
    and every ``write_every``-th frame to the trajectory."""

    def __init__(self, atoms, dyn, timestep_fs: float, traj_path: Path | None, write_every: int, progress_bar):
        from ase import units

        self.atoms, self.dyn, self.timestep_fs = atoms, dyn, timestep_fs
        self.limit_k = float("inf")  # run_md sets temperature_limit(target)
        self.traj_path, self.write_every, self.progress_bar = traj_path, write_every, progress_bar
        self.kinetic_per_kelvin = 1.5 * len(atoms) * units.kB  # equipartition: E_kin = 3/2 N k_B T
        self.rec: dict[str, list[float]] = {"t": [], "etot": [], "epot": [], "T": []}
        self.stamps: list[float] = []

    def __call__(self) -> None:
        import ase.io

        atoms, dyn, rec = self.atoms, self.dyn, self.rec
        epot = float(atoms.get_potential_energy())
        ekin = float(atoms.get_kinetic_energy())
        rec["t"].append(dyn.nsteps * self.timestep_fs / 1000.0)
        rec["epot"].append(epot)
        rec["etot"].append(epot + ekin)
        rec["T"].append(ekin / self.kinetic_per_kelvin)
        self._check_runaway(epot, rec["T"][-1])
        if self.traj_path is not None and dyn.nsteps % self.write_every == 0:
            ase.io.write(self.traj_path, atoms, format="extxyz", append=True)
        self.stamps.append(time.perf_counter())
        if dyn.nsteps:
            self.progress_bar.update(1)

    def _check_runaway(self, epot: float, kelvin: float) -> None:
        if math.isfinite(epot) and kelvin <= self.limit_k:  # also False for a NaN temperature
            return
        if self.dyn.nsteps == 0 and not math.isfinite(kelvin):  # no step taken: not the timestep's fault
            raise MDRunaway(
                f"md: the starting velocities give a temperature of {kelvin} K before any step, so no timestep "
                "will help; check the structure's masses (ase.Atoms.get_masses())"
            )
        what = f"the temperature reached {kelvin:.3g} K" if math.isfinite(epot) else f"the energy became {epot}"
        raise MDRunaway(
            f"md: {what} at step {self.dyn.nsteps} (limit {self.limit_k:g} K: {RUNAWAY_FACTOR:g} x --temperature "
            f"+ {RUNAWAY_FLOOR_K:g} K); the dynamics is unstable: try a smaller --timestep than {self.timestep_fs:g} fs"
        )

    def seconds_per_step(self) -> float:
        """Median wall time of a step, the first (which compiles) left out when there are others."""
        stamps = self.stamps
        timed = np.diff(stamps[1:]) if len(stamps) > 2 else np.diff(stamps)
        return float(np.median(timed)) if timed.size else float("nan")


def _run_recorded(atoms, dyn, steps, timestep_fs, traj_path, write_every, temperature, desc) -> _Recorder:
    """Run ``steps`` steps of ``dyn``, recorded (and written) by a :class:`_Recorder`, with a progress
    bar named ``desc`` (None: no bar)."""
    from workbench.progress import bar

    progress_bar = bar(total=steps, desc=desc, unit="step", disable=desc is None)
    recorder = _Recorder(atoms, dyn, timestep_fs, traj_path, write_every, progress_bar)
    recorder.limit_k = temperature_limit(temperature)
    dyn.attach(recorder, interval=1)  # ASE calls it at step 0 too
    try:
        dyn.run(steps)
    finally:
        progress_bar.close()
    return recorder


def run_md(
    model: str | os.PathLike,
    structure: Any,
    steps: int = 1000,
    ensemble: str = "nve",
    temperature: float = 300.0,
    timestep_fs: float = 0.5,
    backend: str = DEFAULT_BACKEND,
    index: int = 0,
    trajectory: str | os.PathLike | None = None,
    write_every: int = 10,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    progress: bool = True,
    trust_model: bool = False,
    head: str | None = None,
    keep_memory: bool = False,
    radial: str | None = None,
) -> MDResult:
    """Integrate ``steps`` steps of ``ensemble`` MD of ``structure`` (an ``ase.Atoms``, or a file
    and its frame ``index``) with the model; write every ``write_every``-th frame to ``trajectory`` (extxyz) when given.
    Raises :class:`MDRunaway` when the temperature exceeds :func:`temperature_limit` of ``temperature``.
    ``keep_memory`` (``workbench md`` sets it) and ``radial``: those of
    :func:`~workbench.train.md_calculator.load_calculator`."""
    _check_md_args(ensemble, steps, timestep_fs, temperature, write_every)
    traj_path = _output_path(trajectory, "--trajectory")
    atoms = _read_structure(structure, index)
    options = {"device": device, "dtype": dtype, "trust_model": trust_model, "head": head, "radial": radial}
    atoms.calc = load_calculator(model, backend=backend, keep_memory=keep_memory, **options)
    _check_elements(atoms, atoms.calc, model)
    _thermalise(atoms, temperature, seed)
    dyn = _integrator(atoms, ensemble, timestep_fs, temperature, seed)
    traj_path = _fresh_trajectory(traj_path)
    recorder = _run_recorded(
        atoms, dyn, steps, timestep_fs, traj_path, write_every, temperature, f"md {ensemble}" if progress else None
    )
    rec, n = recorder.rec, len(atoms)
    drift, excursion = energy_drift(np.array(rec["t"]), np.array(rec["etot"]), n)
    per_step = recorder.seconds_per_step()
    return MDResult(
        model=str(model),
        structure=str(structure) if isinstance(structure, (str, os.PathLike)) else atoms.get_chemical_formula(),
        backend=backend,
        ensemble=ensemble,
        atoms=n,
        steps=steps,
        timestep_fs=timestep_fs,
        time_ps=rec["t"],
        total_energy=rec["etot"],
        potential_energy=rec["epot"],
        temperature_k=rec["T"],
        drift_ev_atom_ps=drift,
        max_excursion_ev_atom=excursion,
        ns_per_day=timestep_fs * 1e-6 / per_step * 86400.0,
        ms_per_step=1e3 * per_step,
        trajectory=str(traj_path) if traj_path else None,
    )


def write_result(result: MDResult, path: str | os.PathLike) -> None:
    """The result as JSON (curves included)."""
    Path(path).write_text(json.dumps(asdict(result), indent=1) + "\n")


def _cli(args: Any) -> int:
    """molecular dynamics with a mace model (NVE energy drift, ns/day) on the workbench kernels"""

    _output_path(args.json, "--json")
    names = (
        "steps",
        "ensemble",
        "temperature",
        "backend",
        "index",
        "trajectory",
        "write_every",
        "seed",
        "dtype",
        "radial",
    )
    result = run_md(
        args.model,
        args.structure,
        timestep_fs=args.timestep,
        progress=True,
        keep_memory=True,  # one MD in this process: each step reuses the last one's memory
        **option_values(args, *names, "trust_model", "head"),
    )
    print(result.summary())
    if result.trajectory:
        print(f"trajectory: {result.trajectory}")
    if args.json:
        write_result(result, args.json)
        print(f"wrote {args.json}")
    return 0


#: ``workbench md``'s options (the kernel backends' registry is light: no torch)
_OPTIONS: Options = {
    "model": {"help": "a mace-torch model file (e.g. runs/<name>/model.model)"},
    "--structure": {"required": True, "help": "starting structure (any file ASE reads; frame --index)"},
    "--index": {"type": int, "default": 0, "help": "frame of --structure (default: %(default)s)"},
    "--steps": {"type": int, "default": 1000, "help": "MD steps (default: %(default)s)"},
    "--ensemble": {"default": "nve", "choices": ENSEMBLES},
    "--temperature": {"type": float, "default": 300.0, "help": "K, initial velocities and NVT (default: %(default)s)"},
    "--timestep": {"type": float, "default": 0.5, "help": "fs (default: %(default)s)"},
    "--backend": {
        "default": DEFAULT_BACKEND,
        "choices": [n for n, b in BACKENDS.items() if b.kind != "convert"],  # swapped in place, in the calculator
        "help": "kernels for the model's hot ops (default: %(default)s)",
    },
    "--dtype": {"choices": ["float32", "float64"], "help": "default: the model's own"},
    "--radial": {
        "choices": RADIAL_CHOICES,
        "help": "radial networks from a table (forces within 1e-10 in float64) or run as networks "
        "(default: table with the numba backend on the CPU, mlp otherwise)",
    },
    "--trajectory": {"help": "write frames here (extxyz)"},
    "--write-every": {"type": int, "default": 10, "help": "frames between trajectory writes (default: %(default)s)"},
    "--seed": {"type": int, "default": 0, "help": "initial velocities (default: %(default)s)"},
    "--json": {"help": "also write the energies, drift and speed as JSON here"},
    "--head": {"help": "the head of a multihead model to run (default: its only head that is not pt_head)"},
}


def register(sub) -> None:
    from workbench.train.cli import add_trust_model_arg

    add_trust_model_arg(add_command(sub, "md", _OPTIONS, _cli))
