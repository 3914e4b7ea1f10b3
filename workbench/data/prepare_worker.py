"""One chunk of ``workbench data prepare``, in a worker process: parse, validate, measure, write.

A worker parses its chunk (extxyz text or mace HDF5 keys), validates every frame with one
count-only neighbour pass at the cutoff, and writes the chunk's shard and then its part of the
index (``*.part.npz``); the part, renamed into place last, marks the chunk done.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workbench.data.extxyz import parse_frames
from workbench.data.io import ENERGY_KEY, FORCES_KEY, MIN_DISTANCE, StructureError
from workbench.data.mace_h5 import read_mace_h5
from workbench.data.prepare_sources import is_h5
from workbench.data.store import INDEX_DTYPE, MAX_Z, SHARDS, Graph, shard_name, write_shard

ON_ERROR = ("fail", "skip")
DEFAULT_SHARD_SIZE = 2048


@dataclass(frozen=True)
class Settings:
    """What decides the prepared content: a resume must use the same."""

    cutoff: float = 4.5
    energy_key: str = ENERGY_KEY
    forces_key: str = FORCES_KEY
    shard_size: int = DEFAULT_SHARD_SIZE
    on_error: str = "fail"
    min_distance: float = MIN_DISTANCE


def _labels_from_calc(atoms, settings: Settings) -> None:
    # ASE moves extxyz keys named like calculator results (energy, forces) onto a calculator.
    calc = getattr(atoms, "calc", None)
    if calc is None:
        return
    results = getattr(calc, "results", {})
    if settings.energy_key not in atoms.info and settings.energy_key in results:
        atoms.info[settings.energy_key] = results[settings.energy_key]
    if settings.forces_key not in atoms.arrays and settings.forces_key in results:
        atoms.arrays[settings.forces_key] = np.asarray(results[settings.forces_key])


def measure(atoms, settings: Settings, path: Path | None = None, frame: int | None = None) -> tuple[Graph, dict]:
    """Validate one structure and return its stored arrays and index fields.

    One count-only pass at the cutoff (:func:`~workbench.data.neighbours.neighbour_stats`) gives
    the edge count, the connected atoms and the close-pair check; the geometry is checked once,
    before it.
    """
    from workbench.data.io import check_geometry, check_labels, close_pair_error
    from workbench.data.neighbours import neighbour_stats

    _labels_from_calc(atoms, settings)
    n = len(atoms)
    if n == 0:
        raise StructureError(path, frame, "no atoms")
    bad_z = [int(z) for z in atoms.numbers if not 1 <= z <= MAX_Z]
    if bad_z:  # before anything looks up a chemical symbol
        raise StructureError(path, frame, f"atomic number {bad_z[0]} outside 1..{MAX_Z}")
    check_geometry(atoms, path=path, frame=frame)
    positions, cell, pbc = atoms.positions, atoms.cell.array, atoms.pbc
    nb = neighbour_stats(positions, cell, pbc, settings.cutoff, settings.min_distance)
    if nb.closest is not None:
        raise close_pair_error(*nb.closest, nb.close_pairs, settings.min_distance, path=path, frame=frame)
    info = atoms.info
    labelled = bool(info.get("labelled", True))
    if labelled:
        check_labels(atoms, path=path, frame=frame, energy_key=settings.energy_key, forces_key=settings.forces_key)
        energy = float(info[settings.energy_key])
        forces = np.asarray(atoms.arrays[settings.forces_key], dtype=np.float64)
    else:
        energy, forces = float("nan"), np.full((n, 3), np.nan)
    weights = np.array(
        [
            float(info.get("config_weight", 1.0)),
            float(info.get("config_energy_weight", 1.0)) if labelled else 0.0,
            float(info.get("config_forces_weight", 1.0)) if labelled else 0.0,
        ]
    )
    graph = Graph(
        numbers=atoms.numbers.astype(np.int64),
        positions=positions.copy(),
        forces=forces,
        cell=cell.copy(),
        pbc=pbc.copy(),
        energy=energy,
        weights=weights,
        family=str(info.get("config_type", "Default")),
    )
    fields = {
        "atoms": n,
        "edges": nb.edges,
        "connected": nb.connected,
        "labelled": labelled,
        "energy": energy,
        "fsq": float(np.sum(forces * forces)) if labelled else float("nan"),
    }
    return graph, fields


def worker_init() -> None:
    """Pool initializer: keep torch out of the workers; die with the parent."""
    # Nothing here needs torch (2-3 s to import per process); keep it out should a library reach for it.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it dies (a killed prepare
    would otherwise leave its workers, and through them the resource tracker, running)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def part_path(out: Path, source: int, chunk: int) -> Path:
    """Where the index part of chunk ``(source, chunk)`` lives, next to its shard."""
    return out / SHARDS / shard_name(source, chunk).replace(".h5", ".part.npz")


def run_chunk(job: tuple) -> dict:
    """Worker: parse, validate and measure one chunk; write its shard and index part."""
    out, path, chunk, settings, fingerprint = job
    out, path = Path(out), Path(path)
    reader = read_mace_h5 if is_h5(path) else parse_frames
    graphs: list[Graph] = []
    records: list[dict] = []
    frames: list[int] = []
    skipped: list[dict] = []
    for frame, item in reader(path, chunk.first_frame, chunk.payload):
        try:
            if isinstance(item, StructureError):
                raise item
            graph, fields = measure(item, settings, path, frame)
        except StructureError as exc:
            if settings.on_error == "fail":
                raise
            skipped.append({"source": str(path), "frame": frame, "reason": exc.reason})
            continue
        graphs.append(graph)
        records.append(fields)
        frames.append(frame)
    shard = write_shard(out / SHARDS / shard_name(chunk.source, chunk.chunk), graphs)
    families = sorted({g.family for g in graphs})
    code = {f: k for k, f in enumerate(families)}
    counts = np.zeros((len(graphs), MAX_Z + 1), dtype=np.uint32)
    for k, g in enumerate(graphs):
        counts[k] = np.bincount(g.numbers, minlength=MAX_Z + 1)
    part = part_path(out, chunk.source, chunk.chunk)
    tmp = part.with_name(f".{part.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez_compressed(
            fh,
            **{
                k: np.array([r[k] for r in records], dtype=INDEX_DTYPE[k])
                for k in ("atoms", "edges", "connected", "labelled", "energy", "fsq")
            },
            family=np.array([code[g.family] for g in graphs], dtype=np.int64),
            families=np.array(families, dtype=str),
            counts=counts,
            frame=np.array(frames, dtype=np.int64),
            skipped=np.array(json.dumps(skipped)),
            fingerprint=np.array(json.dumps(fingerprint)),
            shard=np.array(json.dumps(shard)),
        )
    os.replace(tmp, part)  # last: marks the chunk done
    return {"graphs": len(graphs), "skipped": len(skipped)}
