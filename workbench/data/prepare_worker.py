"""One chunk of ``workbench data prepare``, in a worker process: parse, validate, measure, write.

A worker reads its chunk through the source's format (:mod:`workbench.data.formats`), validates every frame with one
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

from workbench.data.io import MIN_DISTANCE, StructureError
from workbench.data.keys import (
    ENERGY_KEY,
    FORCES_KEY,
    STRESS_KEY,
    STRESS_WEIGHT_KEY,
    VIRIALS_KEY,
    VIRIALS_WEIGHT_KEY,
    LabelKeys,
)
from workbench.data.prepare_sources import format_of
from workbench.data.shards import SHARDS, Graph, shard_name, write_shard
from workbench.data.store import INDEX_DTYPE
from workbench.limits import MAX_Z

ON_ERROR = ("fail", "skip")
#: the index fields a worker measures (the merge adds family, shard and row)
PART_FIELDS = ("atoms", "edges", "connected", "labelled", "energy", "fsq", "stress", "virials")
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
    stress_key: str = STRESS_KEY
    virials_key: str = VIRIALS_KEY

    @property
    def keys(self) -> LabelKeys:
        return LabelKeys(self.energy_key, self.forces_key, self.stress_key, self.virials_key)


def measure(atoms, settings: Settings, path: Path | None = None, frame: int | None = None) -> tuple[Graph, dict]:
    """Validate one structure and return its stored arrays and index fields.

    One count-only pass at the cutoff (:func:`~workbench.data.neighbours.neighbour_stats`) gives
    the edge count, the connected atoms and the close-pair check; the geometry is checked once,
    before it.
    """
    from workbench.data.formats.base import take_calculator_labels
    from workbench.data.io import check_geometry, close_pair_error
    from workbench.data.neighbours import neighbour_stats

    take_calculator_labels(atoms, settings.keys)
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
    labels = _labels(atoms, settings, path, frame)
    graph = Graph(
        numbers=atoms.numbers.astype(np.int64),
        positions=positions.copy(),
        cell=cell.copy(),
        pbc=pbc.copy(),
        family=str(atoms.info.get("config_type", "Default")),
        **labels,
    )
    labelled = bool(atoms.info.get("labelled", True))
    fields = {
        "atoms": n,
        "edges": nb.edges,
        "connected": nb.connected,
        "labelled": labelled,
        "energy": graph.energy,
        "fsq": float(np.sum(graph.forces * graph.forces)) if labelled else float("nan"),
        "stress": bool(np.isfinite(graph.stress).all()),
        "virials": bool(np.isfinite(graph.virials).all()),
    }
    return graph, fields


def _labels(atoms, settings: Settings, path: Path | None, frame: int | None) -> dict:
    """Energy, forces, stress, virials (NaN where absent) and mace's five loss weights, checked."""
    from workbench.data.io import check_labels, check_tensor_label

    info, n = atoms.info, len(atoms)
    nan3 = np.full((3, 3), np.nan)
    if not bool(info.get("labelled", True)):
        return {"energy": float("nan"), "forces": np.full((n, 3), np.nan), "weights": np.zeros(5)}
    keys = settings.keys
    check_labels(
        atoms,
        path=path,
        frame=frame,
        energy_key=keys.energy,
        forces_key=keys.forces,
        stress_key=keys.stress,
        virials_key=keys.virials,
    )
    stress = check_tensor_label(atoms, keys.stress, "stress", path=path, frame=frame)
    virials = check_tensor_label(atoms, keys.virials, "virials", path=path, frame=frame)
    keys_ = ("config_weight", "config_energy_weight", "config_forces_weight", STRESS_WEIGHT_KEY, VIRIALS_WEIGHT_KEY)
    present = (True, True, True, stress is not None, virials is not None)
    weights = np.array([_weight(info, k, path, frame) if has else 0.0 for k, has in zip(keys_, present)])
    return {
        "energy": float(info[keys.energy]),
        "forces": np.asarray(atoms.arrays[keys.forces], dtype=np.float64),
        "stress": nan3 if stress is None else stress,
        "virials": nan3.copy() if virials is None else virials,
        "weights": weights,
    }


def _weight(info: dict, key: str, path: Path | None, frame: int | None) -> float:
    """A per-configuration loss weight (default 1): a finite number >= 0, else the frame's error."""
    value = info.get(key, 1.0)
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise StructureError(path, frame, f"{key} is not a number: {str(value)[:60]!r}") from None
    if not (np.isfinite(weight) and weight >= 0):
        raise StructureError(path, frame, f"{key} is {weight}; a loss weight is a finite number >= 0")
    return weight


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
    fmt = format_of(path)
    graphs: list[Graph] = []
    records: list[dict] = []
    frames: list[int] = []
    skipped: list[dict] = []
    for frame, item in fmt.read(path, chunk.first_frame, chunk.payload, settings.keys):
        try:
            if isinstance(item, StructureError):
                raise item
            try:
                graph, fields = measure(item, settings, path, frame)
            except StructureError as exc:  # a check of the structure: say which row of the file it is
                raise fmt.locate(exc, chunk.payload[frame - chunk.first_frame]) from None  # type: ignore[index]
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
            **{k: np.array([r[k] for r in records], dtype=INDEX_DTYPE[k]) for k in PART_FIELDS},
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
