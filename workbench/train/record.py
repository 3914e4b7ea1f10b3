"""What a run directory says about the run itself: ``run.json`` and ``packing.npz``.

Rank 0 writes both when a run starts (and again on a resume), so a report or a monitor can
say what ran without the data or the model at hand:

* ``run.json``: ranks, device, dtype, sampler and capacity, the model's shape, the data
  (source, training and validation graphs, families), the package version and git commit,
  the start time;
* ``packing.npz``: epoch 0's packing of the training graphs (:meth:`Packing.save
  <workbench.packing.Packing.save>` fields) with each graph's family code and the family names.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from workbench.data.source import data_source
from workbench.train.rundir import RunDir


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The checked-out commit of the workbench source (``+dirty`` when modified), or None outside git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_record(run: RunDir, config, data, world: int, device, sampler) -> None:
    """Write ``run.json`` and ``packing.npz`` (rank 0, at start-up; atomically replaced)."""
    import workbench

    families = [str(f) for f in data.family_names]
    info = {
        "name": config.name,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": socket.gethostname(),
        "world_size": int(world),
        "device": str(device),
        "dtype": config.dtype,
        "backend": config.backend,
        "sampler": config.sampler,
        "capacity": config.capacity,
        "batch_size": config.batch_size,
        "loss": {
            "name": config.loss,
            **{k: getattr(config, k) for k in ("energy_weight", "forces_weight", "stress_weight", "virials_weight")},
        },
        "model": {
            "hidden_irreps": config.hidden_irreps,
            "max_ell": config.max_ell,
            "correlation": config.correlation,
            "num_interactions": config.num_interactions,
            "cutoff": config.cutoff,
        },
        "data": {
            "source": _source_label(config),
            "train_graphs": len(data.train_atoms),
            "valid_graphs": len(data.valid),
            "train_atoms": int(np.sum(data.train_atoms)),
            "train_with_stress": int(data.train_labels.get("stress", 0)),
            "families": families,
        },
        "workbench": workbench.__version__,
        "commit": git_commit(),
    }
    tmp = run.info.with_name(f".{run.info.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, run.info)
    packing = sampler.packing(0)
    tmp = run.packing.with_name(f".{run.packing.stem}.{os.getpid()}.tmp.npz")
    code = data.train_family if data.train_family is not None else np.zeros(len(data.train_atoms), np.int16)
    packing.save(
        tmp,
        family_code=code,
        family_names=np.array(families or ["graph"], dtype=str),
        train_edges=np.asarray(data.train_edges, dtype=np.int64),
    )
    os.replace(tmp, run.packing)


def _source_label(config) -> str:
    """The training data as the record names it; with ``heads``, each head's and the replay's."""
    if not config.heads:
        return data_source(config.dataset).label()
    names = [f"{h}: {data_source(spec['dataset']).label()}" for h, spec in config.heads.items()]
    return "; ".join([*names, f"pt_head: {data_source(config.pt_dataset).label()}"])


def read_run_record(run_dir: str | os.PathLike) -> dict:
    """``run.json`` as a dict (empty for a run written before it existed)."""
    path = RunDir(run_dir).info
    return json.loads(path.read_text()) if path.exists() else {}


def read_packing(run_dir: str | os.PathLike):
    """``(packing, sizes)`` from ``packing.npz``, or None: ``sizes`` has ``atoms``, ``edges`` and ``family``."""
    from workbench.packing import Packing

    path = RunDir(run_dir).packing
    if not path.exists():
        return None
    packing = Packing.load(path)
    with np.load(path, allow_pickle=False) as z:
        names = np.asarray(z["family_names"], dtype=str)
        family = names[z["family_code"].astype(np.int64)]
        edges = z["train_edges"]
    atoms = packing.atoms if packing.atoms is not None else packing.costs.astype(np.int64)
    sizes = np.zeros(
        atoms.shape[0],
        dtype=[("atoms", np.int64), ("edges", np.int64), ("family", f"U{max(1, names.dtype.itemsize // 4)}")],
    )
    sizes["atoms"], sizes["edges"], sizes["family"] = atoms, edges, family
    return packing, sizes
