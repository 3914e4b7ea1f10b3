"""Training data: choose, split and serve graphs as mace ``AtomicData``.

Two sources, one split:

* **a structure file** (default: the embedded mixture): every structure is read and every
  graph built up front, in memory, on every rank. Fine for thousands of graphs.
* **a prepared dataset** (``workbench data prepare``, :mod:`workbench.data.store`): each rank
  loads only the index, packs and computes mace's statistics from it
  (:func:`~workbench.train.stats.stats_from_index`), and builds ``AtomicData`` for a graph
  only when a batch needs it (in DataLoader workers), so memory per rank does not grow with
  the dataset.

Both paths choose the same graphs in the same order for the same config and the same
structures, and build identical ``AtomicData`` (``mace.data.AtomicData.from_config``, through
:func:`workbench.data.neighbour_frame.graph_from_config`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from workbench.train.config import FINETUNE_DATA_FIELDS, TrainConfig
from workbench.train.replay_options import FT_HEAD
from workbench.train.split import configs_fingerprint, hasher, split_order

#: The ``TrainConfig`` fields ``prepare_data`` reads: configs equal on these get equal ``TrainData``.
PREPARE_FIELDS = (
    "dataset",
    "families",
    "energy_key",
    "forces_key",
    "stress_key",
    "virials_key",
    "seed",
    "max_structures",
    "valid_fraction",
    "cutoff",
    "dtype",
    # fine-tuning: the foundation's elements may define the one-hot table, and the fps replay
    # selection reads its descriptors
    *FINETUNE_DATA_FIELDS,
)
#: A structure file above this size is read whole by every rank: point the user at ``data prepare``.
LARGE_FILE_BYTES = 200 * 2**20


@dataclass(frozen=True)
class HeadPart:
    """How one new head's data is built in a run of several (:mod:`workbench.train.head_data`):
    its graphs carry head ``name`` of ``heads``, over a one-hot table of every head's ``elements``."""

    name: str
    heads: list[str]
    elements: frozenset = frozenset()
    loaded: tuple | None = None  # (structures, frames, path) already read from the head's file


@dataclass
class TrainData:
    """Train/validation graphs (a list of ``AtomicData`` or a lazy dataset), sizes and statistics."""

    train: Sequence
    valid: Sequence
    z_table: object
    train_atoms: np.ndarray  # atoms per training graph, int64
    train_edges: np.ndarray  # directed edges per training graph, int64
    stats: object | None = None  # ModelStats of the training split, filled by the first run that needs it
    train_configs: list = field(default_factory=list)  # mace Configurations (in-memory source only)
    valid_configs: list = field(default_factory=list)
    origin: object = None  # callable: training-graph positions -> "file, frame N" descriptions
    valid_families: Sequence[str] | None = None  # config_type of each validation graph (per-family errors)
    family_names: Sequence[str] = ()  # config_types, in code order
    train_family: np.ndarray | None = None  # int16 code into family_names of each training graph
    fingerprint: str = ""  # the content of the validation and training graphs, in split order (resume checks it)
    train_labels: dict = field(default_factory=dict)  # {"stress": n, "virials": n}: training graphs with the label
    train_elements: list[int] = field(default_factory=list)  # atomic numbers the training split holds
    heads: list[str] | None = None  # multihead fine-tuning: the model's heads (workbench.train.replay)
    valid_heads: list[str] | None = None  # the head of each validation graph
    train_heads: np.ndarray | None = None  # int8 index into heads of each training graph
    replay_note: str = ""  # what was replayed, for the run's log
    new_train: dict[str, int] | None = None  # with replay: each new head's training graphs, counted once
    head_configs: dict[str, list] | None = None  # with replay: each new head's training Configurations, once

    def new_train_configs(self, head: str | None = None) -> list:
        """The training ``Configuration`` s of new head ``head`` (default: every new head), each
        once (without the replayed ones and mace's repeats); empty for a prepared dataset."""
        if self.head_configs is None:
            return list(self.train_configs)
        return [c for name, configs in self.head_configs.items() if head in (None, name) for c in configs]

    def describe(self, indices: Sequence[int], limit: int = 8) -> str:
        """Where training graphs ``indices`` came from, for error messages."""
        idx = [int(i) for i in indices]
        shown = self.origin(idx[:limit]) if self.origin is not None else [f"training graph {i}" for i in idx[:limit]]
        more = f" and {len(idx) - limit} more" if len(idx) > limit else ""
        return "; ".join(shown) + more


class FileOrigin:
    """Training-graph position -> ``file, frame N`` for structures read from one file."""

    def __init__(self, path, frames: np.ndarray) -> None:
        self.path, self.frames = str(path), np.asarray(frames, dtype=np.int64)

    def __call__(self, indices: Sequence[int]) -> list[str]:
        return [f"{self.path}, frame {int(self.frames[i])}" for i in indices]


class StoreOrigin:
    """Training-graph position -> ``file, frame N`` through a prepared dataset's ``origin.npy``."""

    def __init__(self, store_path, rows: np.ndarray) -> None:
        self.store_path, self.rows = str(store_path), np.asarray(rows, dtype=np.int32)

    def __call__(self, indices: Sequence[int]) -> list[str]:
        from workbench.data.store import GraphStore

        store = GraphStore(self.store_path)
        rows = self.rows[list(indices)]
        shards = [store.shards[int(code)] for code in store.column("shard", rows)]
        # The shard too: a graph damaged in the store is not the source file's fault ('workbench data verify').
        return [f"{path}, frame {frame} (shard {shard})" for (path, frame), shard in zip(store.origin(rows), shards)]


def store_fingerprint(store, rows: np.ndarray) -> str:
    """A digest of a prepared dataset's ``rows``: their index records and the digests of the shards.
    Without stress or virials the records are hashed as format 2 held them, so that a run on a
    store of that format still resumes."""
    from workbench.data.store import INDEX_DTYPE_V2

    records = store.records(rows)
    if not (store.has_stress or store.has_virials):
        records = records[list(INDEX_DTYPE_V2.names)].astype(INDEX_DTYPE_V2)
    h = hasher()
    h.update(np.ascontiguousarray(records).tobytes())
    h.update("".join(r["digest"] for r in store.manifest["shards"]).encode())
    return h.hexdigest()


def warn_unseen_elements(valid_z: set[int], train_z: set[int], where: str) -> list[int]:
    """Warn, naming them, about elements that occur in validation but never in training (the
    model has nothing to learn them from); returns them."""
    from ase.data import chemical_symbols

    unseen = sorted(valid_z - train_z)
    if unseen:
        names = ", ".join(f"{chemical_symbols[z]} (Z={z})" for z in unseen)
        warnings.warn(
            f"{where}: validation graphs hold elements that no training graph has: {names}; their errors measure "
            "extrapolation (change seed or valid_fraction, or add training data with them)",
            stacklevel=3,
        )
    return unseen


def _no_structures(path, config: TrainConfig) -> ValueError:
    return ValueError(
        f"{path}: no labelled structures to train on" + (f" in families {config.families}" if config.families else "")
    )


def load_structures(config: TrainConfig) -> list:
    """Read ``config.dataset`` (default: embedded mixture); keep labelled frames of the chosen families."""
    return _load_with_frames(config)[0]


def _load_with_frames(config: TrainConfig) -> tuple[list, np.ndarray, Path]:
    """:func:`load_structures`, with each kept structure's frame number in the file, and the file."""
    from workbench.data.io import read_structures
    from workbench.data.source import data_source

    path = data_source(config.dataset).path
    size = _source_bytes(path)
    if size > LARGE_FILE_BYTES:
        warnings.warn(
            f"{path}: {size / 2**20:.0f} MiB of structures are read whole into memory "
            f"on every rank; for large datasets run 'workbench data prepare {path} --out DIR' once "
            "and train with dataset=DIR (streamed, bounded memory)",
            stacklevel=3,
        )
    structures = read_structures(
        path,
        energy_key=config.energy_key,
        forces_key=config.forces_key,
        stress_key=config.stress_key,
        virials_key=config.virials_key,
    )
    keep = set(config.families or ())
    frames = [
        k
        for k, a in enumerate(structures)
        if a.info.get("labelled", True) and (not keep or a.info.get("config_type") in keep)
    ]
    if not frames:
        raise _no_structures(path, config)
    return [structures[k] for k in frames], np.asarray(frames, dtype=np.int64), path


def _source_bytes(path: Path) -> int:
    """Bytes of a structure file, or of every file a structure folder's format reads."""
    from workbench.data import formats

    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(file.stat().st_size for file, _ in formats.expand(path))
    return 0


def prepare_data(config: TrainConfig, structures: list | None = None) -> TrainData:
    """Seeded shuffle, optional ``max_structures`` cut, train/validation split, mace conversion.

    Tensors are built in ``config.dtype`` (the torch default dtype is set while this runs).
    A prepared dataset (``config.dataset`` is its directory) is split from its index, and its
    graphs are built lazily.
    """
    from workbench.data.source import data_source
    from workbench.dtypes import default_dtype  # imports torch: not at module level
    from workbench.train.foundation import resolve
    from workbench.train.replay import load_replay

    config = resolve(config)  # fine-tuning: the foundation's cutoff and elements
    replay = load_replay(config) if config.multihead_finetuning else None
    if config.heads:  # several new datasets, one head each
        from workbench.train.head_data import from_heads

        return from_heads(config, replay, (HeadPart, _from_structures, _from_store, _load_with_frames))
    if structures is None:
        source = data_source(config.dataset)
        if source.kind == "prepared":
            return _from_store(config, source.path, replay)
    with default_dtype(config.dtype):  # mace builds AtomicData in the default dtype
        return _from_structures(config, structures, replay)


#: bytes an in-memory AtomicData spends per directed edge (edge_index, shifts, unit_shifts)
BYTES_PER_EDGE = 64
SAMPLE_FOR_ESTIMATE = 64


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_graph_memory(structures: list, cutoff: float, fraction: float = 0.5) -> float:
    """Estimated bytes of every graph at ``cutoff`` (neighbour lists of an evenly spaced sample
    of up to 64 structures, scaled by atoms); raise before building graphs that would not fit
    in ``fraction`` of the available memory. Returns the estimate."""
    from workbench.data.sizes import count_edges

    pick = np.unique(np.linspace(0, len(structures) - 1, min(SAMPLE_FOR_ESTIMATE, len(structures))).astype(int))
    sample_atoms = sum(len(structures[i]) for i in pick)
    per_atom = sum(count_edges(structures[i], cutoff) for i in pick) / max(sample_atoms, 1)
    total_atoms = sum(len(a) for a in structures)
    estimate = per_atom * total_atoms * BYTES_PER_EDGE
    available = _available_memory()
    if estimate > fraction * available:
        raise ValueError(
            f"cutoff {cutoff} Å: about {per_atom:.0f} neighbours per atom, {per_atom * total_atoms:.3g} edges, "
            f"~{estimate / 2**30:.1f} GiB of graphs in memory on every rank, more than {fraction:.0%} of the "
            f"{available / 2**30:.1f} GiB available; use a smaller cutoff (MACE uses 4-6 Å), fewer structures "
            "(max_structures), or a prepared dataset ('workbench data prepare'), which builds graphs per batch"
        )
    return estimate


def _from_structures(config: TrainConfig, structures: list | None, replay=None, part: HeadPart | None = None):
    from mace.data import config_from_atoms

    from workbench.data.atomic_data import key_specification, z_table_for
    from workbench.data.neighbour_frame import graph_from_config
    from workbench.train.replay import run_heads, with_replay

    if structures is None:
        structures, frames, path = part.loaded if part and part.loaded else _load_with_frames(config)
    else:
        frames, path = np.arange(len(structures)), "<structures given>"
    train_pos, valid_pos = split_order(len(structures), config)
    if config.valid_dataset:
        valid = _load_with_frames(replace(config, dataset=config.valid_dataset))[0]
    else:
        valid = [structures[i] for i in valid_pos]
    chosen = valid + [structures[i] for i in train_pos]
    check_graph_memory(chosen, config.cutoff)
    warn_unseen_elements(
        {int(z) for a in valid for z in a.numbers}, {int(z) for a in chosen[len(valid) :] for z in a.numbers}, str(path)
    )
    n_valid = len(valid)
    extra = (replay.elements if replay else set()) | (part.elements if part else set())
    z_table = _table(config, sorted(set(z_table_for(chosen).zs) | extra), str(path))
    spec = key_specification(config.energy_key, config.forces_key, config.stress_key, config.virials_key)
    configs = [config_from_atoms(a, key_specification=spec, head_name=part.name if part else FT_HEAD) for a in chosen]
    heads = part.heads if part else run_heads(config)
    data = [graph_from_config(c, z_table, config.cutoff, heads=heads) for c in configs]
    train, valid = data[n_valid:], data[:n_valid]
    atoms = np.array([int(d.num_nodes) for d in train], dtype=np.int64)
    edges = np.array([int(d.edge_index.shape[1]) for d in train], dtype=np.int64)
    names = sorted({str(c.config_type) for c in configs})
    code = {n: k for k, n in enumerate(names)}
    made = TrainData(
        train,
        valid,
        z_table,
        atoms,
        edges,
        train_configs=configs[n_valid:],
        valid_configs=configs[:n_valid],
        origin=FileOrigin(path, frames[train_pos]),
        valid_families=[c.config_type for c in configs[:n_valid]],
        family_names=names,
        train_family=np.array([code[str(c.config_type)] for c in configs[n_valid:]], dtype=np.int16),
        fingerprint=configs_fingerprint(configs),
        train_labels={
            k: sum(1 for c in configs[n_valid:] if c.properties.get(k) is not None) for k in ("stress", "virials")
        },
        train_elements=sorted({int(z) for c in configs[n_valid:] for z in c.atomic_numbers}),
    )
    return made if replay is None else with_replay(made, replay, config)


def _table(config: TrainConfig, data_zs, where: str):
    """The one-hot table of the graphs: the data's elements, or a fine-tuned model's, which must
    hold every element of the data."""
    from mace.tools import AtomicNumberTable

    from workbench.train.foundation import check_data_elements, table_elements

    check_data_elements(config, data_zs, where)
    return AtomicNumberTable(table_elements(config) or [int(z) for z in data_zs])


class StoreGraphs:
    """``AtomicData`` for rows of a prepared dataset, built on access (a map-style dataset).

    ``dataset[k]`` reads graph ``k`` of ``locations`` (:meth:`GraphStore.locations
    <workbench.data.store.GraphStore.locations>`) through ``reader`` and builds it with mace's
    ``AtomicData.from_config`` in ``dtype``, exactly as the in-memory path would from the same
    structure. It holds 10 bytes per graph and no index, and forks cheaply: DataLoader workers
    share the arrays and open their own shard maps.
    """

    def __init__(
        self,
        reader,
        locations: np.ndarray,
        z_table,
        cutoff: float,
        dtype: str,
        heads: list[str] | None = None,
        head: str = FT_HEAD,
    ) -> None:
        self.reader = reader
        self.locations = locations
        self.z_table = z_table
        self.cutoff = float(cutoff)
        self.dtype = dtype
        self.heads = heads  # the model's heads (multihead fine-tuning)
        self.head = head  # the head these graphs train

    def __len__(self) -> int:
        return int(self.locations.shape[0])

    def configuration(self, k: int):
        """The mace ``Configuration`` of item ``k``."""
        from mace.data.utils import Configuration

        loc = self.locations[k]
        g = self.reader.read(loc["shard"], loc["row"], loc["family"])
        # as config_from_atoms builds it: a missing stress or virial label is None with weight 0
        tensors = {k: (v if np.isfinite(v).all() else None) for k, v in (("stress", g.stress), ("virials", g.virials))}
        return Configuration(
            atomic_numbers=g.numbers,
            positions=g.positions,
            properties={"energy": g.energy, "forces": g.forces, **tensors},
            property_weights={
                "energy": float(g.weights[1]),
                "forces": float(g.weights[2]),
                "stress": float(g.weights[3]),
                "virials": float(g.weights[4]),
            },
            cell=g.cell,
            pbc=tuple(bool(p) for p in g.pbc),
            weight=float(g.weights[0]),
            config_type=g.family,
            head=self.head,
        )

    def __getitem__(self, k: int):
        from workbench.data.neighbour_frame import graph_from_config
        from workbench.dtypes import default_dtype

        if not -len(self) <= k < len(self):
            raise IndexError(f"graph {k} out of range for {len(self)} graphs")
        with default_dtype(self.dtype):  # mace builds AtomicData in the default dtype
            return graph_from_config(self.configuration(k), self.z_table, self.cutoff, heads=self.heads)


def _from_store(config: TrainConfig, path: Path, replay=None, part: HeadPart | None = None) -> TrainData:
    from workbench.data.store import GraphStore
    from workbench.train.replay import run_heads, with_replay
    from workbench.train.stats import stats_from_index

    if config.valid_dataset:
        raise ValueError(
            f"TrainConfig.valid_dataset ({config.valid_dataset}) works with a structure file as dataset; "
            f"a prepared dataset ({path}) is split by valid_fraction"
        )
    store = GraphStore(path)
    if abs(store.cutoff - config.cutoff) > 1e-12:
        raise ValueError(
            f"{store.path}: prepared at cutoff {store.cutoff} Å, but TrainConfig.cutoff is {config.cutoff} Å; "
            f"train at {store.cutoff} or prepare again with --cutoff {config.cutoff}"
        )
    candidates = store.select(config.families)
    if candidates.size == 0:
        raise _no_structures(store.path, config)
    train_pos, valid_pos = split_order(candidates.size, config)
    train_rows, valid_rows = candidates[train_pos], candidates[valid_pos]
    data_zs = store.present_elements(np.concatenate([valid_rows, train_rows]))
    extra = (replay.elements if replay else set()) | (part.elements if part else set())
    z_table = _table(config, sorted(set(data_zs) | extra), str(store.path))
    if valid_rows.size:
        warn_unseen_elements(
            set(store.present_elements(valid_rows)), set(store.present_elements(train_rows)), str(path)
        )
    stats = stats_from_index(store, train_rows, [int(z) for z in data_zs])
    # The datasets keep 10 bytes a graph; the index itself is dropped with ``store``.
    heads, head = (part.heads, part.name) if part else (run_heads(config), FT_HEAD)
    train, valid = (
        StoreGraphs(store.reader, store.locations(rows), z_table, config.cutoff, config.dtype, heads, head)
        for rows in (train_rows, valid_rows)
    )
    made = TrainData(
        train,
        valid,
        z_table,
        store.column("atoms", train_rows).astype(np.int64),
        store.column("edges", train_rows).astype(np.int64),
        stats=stats,
        origin=StoreOrigin(store.path, train_rows),
        valid_families=store.family_names(valid_rows),
        family_names=list(store.families),
        train_family=store.column("family", train_rows).astype(np.int16),
        fingerprint=store_fingerprint(store, np.concatenate([valid_rows, train_rows])),
        train_labels={k: int(store.column(k, train_rows).sum()) for k in ("stress", "virials")},
        train_elements=[int(z) for z in store.present_elements(train_rows)],
    )
    return made if replay is None else with_replay(made, replay, config)
