r"""Multihead fine-tuning with replay, as ``mace_run_train --multiheads_finetuning True`` does it.

The fine-tuned model gets two heads, ``pt_head`` (the foundation's, trained on replayed
pre-training structures) and ``Default`` (the new data's), or with ``heads`` one head per new
dataset after ``pt_head`` (:mod:`workbench.train.head_data`). All share every layer but the
readouts, so the replay keeps the shared layers from forgetting what the foundation knew:

.. math::

    L = \frac{1}{B}\sum_{g \in \text{batch}} w_g\,\ell(g), \qquad
    w_g = \texttt{weight\_pt\_head} \text{ for replayed } g,\ 1 \text{ otherwise}

with mace's ``universal`` loss :math:`\ell` and each graph predicted through its own head.

What a run does, from ``TrainConfig``:

* ``pt_dataset`` (a structure file or folder of any registered format, or a prepared dataset)
  is read with the run's label keys; ``num_samples_pt`` of its structures are kept
  (``subselect_pt``: ``random``, or ``fps``, farthest points in the foundation's invariant
  descriptors, as mace's ``fine_tuning_select``), then split by ``valid_fraction``;
* the E0s of ``pt_head`` are the foundation's, those of ``Default`` (each new head) follow
  ``e0s`` (``foundation``, ``estimated`` or a map; mace refuses ``average`` here, and so do we);
* when the new training structures (of all new heads) are fewer than :data:`RATIO_THRESHOLD`
  of the replayed ones, they are repeated :math:`\lfloor 0.1 / r \rfloor` more times (mace's
  ``real_pt_data_ratio_threshold``);
* mace's multihead recipe applies where the config keeps the defaults: lr 1e-4, EMA decay
  0.99999, loss ``universal`` (:func:`recipe`);
* validation is reported per head (and per family within each); the scheduler and
  ``keep: best`` follow the last head's loss, as mace's do.

mace 0.3.16 uses a local ``--pt_train_file`` whole and applies ``--num_samples_pt`` only to its
downloaded Materials Project replay; here the selection applies to every ``pt_dataset``, and
:func:`write_replay` writes what was selected so ``mace_run_train`` can be given the same files.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.train.replay_options import FT_HEAD, PT_HEAD, RATIO_THRESHOLD, repeats, run_heads
from workbench.train.values import ConfigError

if TYPE_CHECKING:
    from workbench.train.config import TrainConfig

__all__ = [
    "FT_HEAD",
    "PT_HEAD",
    "Replay",
    "ReplayOrigin",
    "fps_indices",
    "load_replay",
    "repeats",
    "run_heads",
    "with_replay",
    "write_replay",
]


@dataclass
class Replay:
    """The replayed structures of a run: selected, weighted, split."""

    train: list  # ase.Atoms, config_weight = weight_pt_head
    valid: list
    source: str  # pt_dataset as given
    read: int  # structures the source held
    picked: np.ndarray  # their positions in the source, in selection order

    @property
    def elements(self) -> set[int]:
        return {int(z) for a in (*self.train, *self.valid) for z in a.numbers}


def _read_source(config: TrainConfig) -> Sequence:
    """Every labelled structure of ``pt_dataset``, labels under the config's keys (a prepared
    dataset's are built when indexed)."""
    from workbench.data.io import read_structures
    from workbench.data.source import data_source

    source = data_source(config.pt_dataset, field="pt_dataset")
    keys = {k: getattr(config, k) for k in ("energy_key", "forces_key", "stress_key", "virials_key")}
    if source.kind == "prepared":
        return _StoreStructures(source.path, keys)
    atoms = read_structures(source.path, **keys)
    kept = [a for a in atoms if a.info.get("labelled", True)]
    if not kept:
        raise ConfigError(f"TrainConfig.pt_dataset: {source.path}: no labelled structures to replay")
    return kept


class _StoreStructures:
    """The labelled graphs of a prepared dataset as ``ase.Atoms`` with their labels, built on
    access: a random replay of ``num_samples_pt`` reads only the structures it picks."""

    def __init__(self, path: Path, keys: dict[str, str]) -> None:
        from workbench.data.store import GraphStore

        self.store, self.keys = GraphStore(path), keys
        self.rows = self.store.select()
        if not self.rows.size:
            raise ConfigError(f"TrainConfig.pt_dataset: {path}: no labelled structures to replay")

    def __len__(self) -> int:
        return int(self.rows.size)

    def __getitem__(self, i: int):
        import ase

        g, keys = self.store.graph(int(self.rows[i])), self.keys
        a = ase.Atoms(numbers=g.numbers, positions=g.positions, cell=g.cell, pbc=g.pbc)
        a.info[keys["energy_key"]] = float(g.energy)
        a.arrays[keys["forces_key"]] = np.asarray(g.forces, dtype=np.float64)
        for name in ("stress", "virials"):
            value = np.asarray(getattr(g, name), dtype=np.float64)
            if np.isfinite(value).all():
                a.info[keys[f"{name}_key"]] = value.reshape(3, 3)
        a.info["config_type"] = str(g.family)
        return a

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def load_replay(config: TrainConfig) -> Replay:
    """Read, select (``num_samples_pt`` by ``subselect_pt``), weight and split the replay data."""
    from workbench.train.split import split_order

    structures = _read_source(config)
    k = len(structures) if config.num_samples_pt is None else min(config.num_samples_pt, len(structures))
    if config.subselect_pt == "fps" and k < len(structures):
        picked = fps_indices(descriptors(config, structures), k, config.seed)
    else:
        picked = np.sort(np.random.default_rng(config.seed).choice(len(structures), k, replace=False))
    chosen = []
    for i in picked:
        a = structures[int(i)].copy()
        a.info["config_weight"] = float(config.weight_pt_head)
        a.info["head"] = PT_HEAD
        chosen.append(a)
    split = config.replace(max_structures=None, valid_dataset=None)
    train_pos, valid_pos = split_order(len(chosen), split)
    train = [chosen[i] for i in np.sort(train_pos)]  # selection order: the file mace is given
    valid = [chosen[i] for i in np.sort(valid_pos)]
    return Replay(train, valid, str(config.pt_dataset), len(structures), np.asarray(picked, dtype=np.int64))


def descriptors(config: TrainConfig, structures: list) -> np.ndarray:
    """Per structure: the foundation's invariant node features averaged over the atoms of each
    element, concatenated over the elements of ``structures`` (zeros for an absent element),
    as mace's ``fine_tuning_select`` describes a structure for FPS."""
    from mace.modules.utils import extract_invariant
    from mace.tools import AtomicNumberTable

    from workbench.data.neighbour_frame import centred_atoms
    from workbench.progress import bar
    from workbench.train.foundation import foundation_of

    model = copy.deepcopy(foundation_of(config).model).double()  # the cached foundation stays as loaded
    table = AtomicNumberTable([int(z) for z in model.atomic_numbers])
    species = sorted({int(z) for a in structures for z in a.numbers})
    irreps = model.products[0].linear.irreps_out
    layers, lmax = int(model.num_interactions), int(irreps.lmax)
    width = irreps.dim // (lmax + 1) ** 2  # invariant features per layer, as mace's get_descriptors
    rows = []
    with bar(total=len(structures), desc="replay descriptors (fps)", unit="structure") as progress:
        for atoms in structures:
            feats = _node_feats(model, centred_atoms(atoms), table, float(model.r_max))
            inv = extract_invariant(feats, num_layers=layers, num_features=width, l_max=lmax).numpy()
            row = np.zeros((len(species), inv.shape[1]))
            for j, z in enumerate(species):
                mine = atoms.numbers == z
                if mine.any():
                    row[j] = inv[mine].mean(axis=0)
            rows.append(row.ravel())
            progress.update(1)
    return np.asarray(rows)


def _node_feats(model, atoms, table, cutoff: float):
    import torch
    from mace.data import AtomicData, config_from_atoms
    from mace.tools.torch_geometric import Batch

    from workbench.dtypes import default_dtype

    with default_dtype("float64"):
        data = AtomicData.from_config(config_from_atoms(atoms), z_table=table, cutoff=cutoff, heads=list(model.heads))
        batch = Batch.from_data_list([data])
        with torch.no_grad():
            out = model(batch.to_dict(), training=False, compute_force=False)
    return out["node_feats"].detach()


def fps_indices(points: np.ndarray, k: int, seed: int) -> np.ndarray:
    r"""Greedy farthest point sampling: ``k`` rows of ``points`` [n, d], starting from a seeded
    random row, each next row the one farthest (Euclidean) from all chosen so far."""
    n = points.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"farthest point sampling: cannot pick {k} of {n} structures")
    chosen = np.empty(k, dtype=np.int64)
    chosen[0] = np.random.default_rng(seed).integers(n)
    dist = np.linalg.norm(points - points[chosen[0]], axis=1)
    for j in range(1, k):
        chosen[j] = int(np.argmax(dist))
        dist = np.minimum(dist, np.linalg.norm(points - points[chosen[j]], axis=1))
    return chosen


def write_replay(config: TrainConfig, folder: str | os.PathLike) -> dict[str, Any]:
    """The run's replay structures written as ``pt_train.extxyz`` and ``pt_valid.extxyz`` (the
    files to give ``mace_run_train`` as ``--pt_train_file`` / ``--pt_valid_file``)."""
    from workbench.data.io import write_structures

    replay = load_replay(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"pt_train": folder / "pt_train.extxyz", "pt_valid": folder / "pt_valid.extxyz"}
    write_structures(paths["pt_train"], replay.train)
    write_structures(paths["pt_valid"], replay.valid)
    return {**{k: str(v) for k, v in paths.items()}, "n_pt_train": len(replay.train), "n_pt_valid": len(replay.valid)}


def describe(replay: Replay, new: dict[str, int]) -> str:
    """One line for the run's log (``new``: each new head's training structures)."""
    extra = repeats(sum(new.values()), len(replay.train))
    heads = "; ".join(f"{n} new training structures in head {h}" for h, n in new.items())
    line = (
        f"replay: {len(replay.train)} + {len(replay.valid)} (validation) of {replay.read} structures from "
        f"{replay.source} in head {PT_HEAD}; {heads}"
    )
    if extra:
        line += f", repeated {extra + 1}x (fewer than {RATIO_THRESHOLD:g} of the replay, as mace does)"
    return line


class ReplayOrigin:
    """Training-graph position -> where it came from, for a run with replay: the replayed graphs
    first, then each new head's (``copies`` times each). ``frames`` orders the graphs as mace
    reads its ConcatDataset (replay file, then each head's training file once per copy), for
    ``mace-order``. ``parts``: per new head ``(n, origin, file_order)``."""

    def __init__(self, replay: Replay, parts: list[tuple[int, Any, np.ndarray | None]], copies: int) -> None:
        self.source, self.picked = replay.source, replay.picked
        self.n_pt, self.parts = len(replay.train), parts
        self.starts = np.cumsum([self.n_pt] + [n * copies for n, _, _ in parts])
        order, start = [np.arange(self.n_pt)], self.n_pt
        for n, _, new_order in parts:
            base = np.arange(n) if new_order is None else np.asarray(new_order, dtype=np.int64)
            order += [start + c * n + base for c in range(copies)]
            start += n * copies
        order = np.concatenate(order)
        self.frames = np.empty_like(order)
        self.frames[order] = np.arange(order.size)

    def __call__(self, indices) -> list[str]:
        out = []
        for i in (int(k) for k in indices):
            if i < self.n_pt:
                out.append(f"{self.source}, replayed structure {i} (head {PT_HEAD})")
                continue
            j = int(np.searchsorted(self.starts, i, side="right")) - 1
            n, origin, _ = self.parts[j]
            local = (i - int(self.starts[j])) % n
            out.extend(origin([local]) if origin is not None else [f"training graph {local}"])
        return out


def _graphs(config: TrainConfig, atoms: list, z_table) -> tuple[list, list]:
    """``(configs, graphs)`` of replayed structures, in head pt_head."""
    from mace.data import config_from_atoms

    from workbench.data.atomic_data import key_specification
    from workbench.data.neighbour_frame import graph_from_config
    from workbench.dtypes import default_dtype

    spec = key_specification(config.energy_key, config.forces_key, config.stress_key, config.virials_key)
    configs = [config_from_atoms(a, key_specification=spec) for a in atoms]
    for c in configs:
        c.head = PT_HEAD
    with default_dtype(config.dtype):
        return configs, [graph_from_config(c, z_table, config.cutoff, heads=run_heads(config)) for c in configs]


def _joined(first: list, seconds: list, copies: int = 1):
    """``first``, then each of ``seconds`` ``copies`` times: a list when all are, else a ConcatDataset."""
    if all(isinstance(x, list) for x in seconds):
        return list(first) + [g for x in seconds for g in x * copies]
    from torch.utils.data import ConcatDataset

    return ConcatDataset([first, *[x for x in seconds for _ in range(copies)]])


def with_replay(data, replay: Replay, config: TrainConfig):
    """``data`` (the new structures' :class:`~workbench.train.data.TrainData`, built in head
    Default) with the replayed graphs before them, per head and per family."""
    return join_heads([(FT_HEAD, data)], replay, config)


def join_heads(parts: list, replay: Replay, config: TrainConfig):
    """One :class:`~workbench.train.data.TrainData` of the replayed graphs (head pt_head) and each
    new head's ``(name, TrainData)`` after them, in order; every new head is repeated as mace does
    when all of them together are fewer than a tenth of the replay."""
    from dataclasses import replace

    from workbench.train.mace_order import file_order
    from workbench.train.split import configs_fingerprint

    first = parts[0][1]
    pt_train_c, pt_train = _graphs(config, replay.train, first.z_table)
    pt_valid_c, pt_valid = _graphs(config, replay.valid, first.z_table)
    new = {name: len(d.train) for name, d in parts}
    copies = 1 + repeats(sum(new.values()), len(pt_train))
    names = sorted(
        {*(n for _, d in parts for n in d.family_names), *(str(c.config_type) for c in pt_train_c + pt_valid_c)}
    )
    code = {n: k for k, n in enumerate(names)}
    families = [np.array([code[str(c.config_type)] for c in pt_train_c], dtype=np.int16)]
    for _, d in parts:
        families += [np.array([code[d.family_names[int(k)]] for k in d.train_family], dtype=np.int16)] * copies
    datas = [d for _, d in parts]
    return replace(
        first,
        train=_joined(pt_train, [d.train for d in datas], copies),
        valid=_joined(pt_valid, [d.valid for d in datas]),
        train_atoms=np.concatenate(
            [[int(g.num_nodes) for g in pt_train], *[d.train_atoms for d in datas for _ in range(copies)]]
        ).astype(np.int64),
        train_edges=np.concatenate(
            [[int(g.edge_index.shape[1]) for g in pt_train], *[d.train_edges for d in datas for _ in range(copies)]]
        ).astype(np.int64),
        train_configs=(pt_train_c + [c for d in datas for c in d.train_configs * copies])
        if all(isinstance(d.train, list) for d in datas)
        else [],
        valid_configs=(pt_valid_c + [c for d in datas for c in d.valid_configs])
        if all(isinstance(d.valid, list) for d in datas)
        else [],
        origin=ReplayOrigin(replay, [(len(d.train), d.origin, file_order(d)) for d in datas], copies),
        valid_families=[str(c.config_type) for c in pt_valid_c] + [f for d in datas for f in (d.valid_families or [])],
        family_names=names,
        train_family=np.concatenate(families),
        fingerprint=configs_fingerprint(pt_valid_c + pt_train_c) + "".join(d.fingerprint for d in datas),
        train_labels={
            k: v + sum(d.train_labels.get(k, 0) * copies for d in datas) for k, v in _labels(pt_train_c).items()
        },
        train_elements=sorted(
            {int(z) for c in pt_train_c for z in c.atomic_numbers}.union(*(d.train_elements for d in datas))
        ),
        heads=[PT_HEAD, *new],
        valid_heads=[PT_HEAD] * len(pt_valid) + [name for name, d in parts for _ in range(len(d.valid))],
        train_heads=np.concatenate(
            [np.zeros(len(pt_train))] + [np.full(n * copies, k + 1) for k, n in enumerate(new.values())]
        ).astype(np.int8),
        replay_note=describe(replay, new),
        new_train=new,
        head_configs={name: list(d.train_configs) for name, d in parts},
    )


def _labels(configs: list) -> dict[str, int]:
    return {k: sum(c.properties.get(k) is not None for c in configs) for k in ("stress", "virials")}
