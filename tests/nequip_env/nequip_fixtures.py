"""NequIP models and inputs for the parity tests: random periodic cells, molecules, batches.

Runs in the NequIP venv (``make test-nequip``): nequip 0.19 and e3nn 0.6, no mace-torch.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import ase
import numpy as np
import torch
from lightning.pytorch import Callback

from workbench.bench.nequip_parity import outputs, rel  # noqa: F401 (the tests' parity measures)

SPECIES = ("H", "C", "O")


#: NequIP GNN and Allegro hyperparameters of the tests (small; ``kw`` of the builders override them)
NEQUIP = {"num_layers": 2, "l_max": 2, "num_features": 8, "radial_mlp_width": 16}
ALLEGRO = {
    "l_max": 2,
    "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 6},
    "num_layers": 2,
    "num_scalar_features": 16,
    "num_tensor_features": 4,
    "allegro_mlp_hidden_layers_width": 16,
}


def _build(builder: str, family: dict, dtype: str, seed: int, kw: dict) -> torch.nn.Module:
    from hydra.utils import get_method
    from nequip.utils.global_state import set_global_state

    set_global_state()
    common = {"seed": seed, "model_dtype": dtype, "r_max": 3.5, "avg_num_neighbors": 12.0}
    common.update(per_type_energy_scales=1.3, per_type_energy_shifts=-2.0)
    common["type_names"] = list(SPECIES[: kw.pop("num_types", 2)])
    with np.errstate(all="ignore"):
        return get_method(builder)(**{**common, **family, **kw})


def build_model(dtype: str = "float64", seed: int = 1, **kw) -> torch.nn.Module:
    """A NequIP GNN (nequip's own builder)."""
    return _build("nequip.model.NequIPGNNModel", NEQUIP, dtype, seed, kw)


def build_allegro(dtype: str = "float64", seed: int = 1, **kw) -> torch.nn.Module:
    """An Allegro model (nequip-allegro's own builder)."""
    return _build("allegro.model.AllegroModel", ALLEGRO, dtype, seed, kw)


def cell(rng: np.random.Generator, n: int, types: int, size: float = 5.0) -> ase.Atoms:
    """A random triclinic periodic cell, some atoms outside the home cell."""
    lattice = np.eye(3) * size + rng.uniform(-0.8, 0.8, (3, 3))
    frac = rng.uniform(-0.3, 1.3, (n, 3))  # beyond [0, 1): outside the home cell
    symbols = [SPECIES[i] for i in rng.integers(0, types, n)]
    return ase.Atoms(symbols, scaled_positions=None, positions=frac @ lattice, cell=lattice, pbc=True)


def molecule(rng: np.random.Generator, n: int, types: int) -> ase.Atoms:
    """A random non-periodic cluster with one atom far from the others (no edges)."""
    pos = rng.normal(0.0, 1.2, (n, 3))
    pos[-1] = (30.0, 0.0, 0.0)
    return ase.Atoms([SPECIES[i] for i in rng.integers(0, types, n)], positions=pos, pbc=False)


def batch(frames: list[ase.Atoms], model: torch.nn.Module, r_max: float = 3.5, shuffle_edges: int | None = None):
    """nequip's batched ``AtomicDataDict`` of ``frames`` for ``model``."""
    from workbench.kernels.nequip.graphs import atomic_data

    return atomic_data(frames, model.type_names, r_max, shuffle_edges)


def cu_dataset(path, n: int, seed: int = 0):
    """``n`` rattled fcc Cu cells of 3 to 32 atoms (supercells with vacancies), EMT-labelled, as extxyz."""
    import ase.io
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(n):
        reps = tuple(int(r) for r in rng.integers(1, 3, 3))
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
        del atoms[list(rng.choice(len(atoms), int(rng.integers(0, len(atoms) // 4 + 1)), replace=False))]
        atoms.positions += rng.normal(0.0, 0.08, atoms.positions.shape)
        atoms.calc = EMT()
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
        frames.append(atoms)
    ase.io.write(path, frames, format="extxyz")
    return path


def frame_key(atoms_or_positions) -> str:
    """A fingerprint of one structure's positions (float64, as nequip reads them)."""
    import hashlib

    pos = getattr(atoms_or_positions, "positions", atoms_or_positions)
    pos = np.round(np.asarray(pos, dtype=np.float64), 6) + 0.0  # +0.0: no negative zeros
    return hashlib.sha1(pos.tobytes()).hexdigest()[:16]


class RecordGraphs(Callback):
    """Lightning callback: each training step's graphs (``frame_key``) per rank, one JSON line each."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import json

        counts = batch["num_atoms"].tolist()
        pos = batch["pos"].detach().cpu().double().numpy()
        starts = np.cumsum([0, *counts])
        graphs = [frame_key(pos[a:b]) for a, b in itertools.pairwise(starts)]
        rec = {"rank": trainer.global_rank, "epoch": trainer.current_epoch, "step": batch_idx, "graphs": graphs}
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def mixed_frames(seed: int, types: int):
    rng = np.random.default_rng(seed)
    return [cell(rng, 9, types), molecule(rng, 6, types), cell(rng, 4, types, size=2.6)]


def parity_kernels(monkeypatch, on_default: bool) -> list | None:
    """The kernels of a parity test: the default CPU kernels when ``on_default`` (the list of
    fused passes that ran, :func:`default_cpu_kernels`), else the interpreter (None); the fused
    SiLU at every size either way (the test models are small)."""
    from workbench.kernels.e3nn import silu

    monkeypatch.setattr(silu, "MIN_ELEMENTS", {})
    return default_cpu_kernels(monkeypatch) if on_default else None


def default_cpu_kernels(monkeypatch) -> list:
    """Run the rest of the test on the package's default CPU kernels (the suites default to the
    interpreter, tests/conftest.py); the returned list records every fused pass that runs."""
    from fused_spy import spy_fused_runs

    monkeypatch.delenv("WORKBENCH_CPU_KERNELS", raising=False)
    return spy_fused_runs(monkeypatch)
