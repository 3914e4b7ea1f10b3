r"""Several new datasets, one head each (``TrainConfig.heads``, mace's ``--heads``), next to the
replayed pre-training head of multihead fine-tuning.

Each head's dataset is read, split and built as a one-head run's would be (its own
``valid_fraction`` or ``valid_dataset``, the config's seed), with two differences:

* every graph carries its head's index in the model's heads ``[pt_head, h_1, ..., h_k]``;
* the one-hot table covers the elements of every head and of the replay, as mace's does, so
  the graphs of all heads go through one model.

The heads are then joined after the replay (:func:`workbench.train.replay.join_heads`): mace's
ConcatDataset order, which ``mace-order`` replays.
"""

from __future__ import annotations

from pathlib import Path

from workbench.train.config import TrainConfig
from workbench.train.replay import Replay, join_heads
from workbench.train.replay_options import head_settings, new_heads, run_heads

__all__ = ["from_heads", "head_config"]


def head_config(config: TrainConfig, head: str) -> TrainConfig:
    """The one-head config that reads, splits and labels head ``head``'s data."""
    return config.replace(heads=None, multihead_finetuning=False, pt_dataset=None, **head_settings(config, head))


def from_heads(config: TrainConfig, replay: Replay, build):
    """The run's :class:`~workbench.train.data.TrainData`: the replay, then every head of
    ``config.heads`` in order. ``build``: the data module's builders ``(HeadPart, from_structures,
    from_store, load_with_frames)``, passed in so that this module does not import it back."""
    HeadPart, _from_structures, _from_store, _load_with_frames = build
    from workbench.data.source import data_source
    from workbench.dtypes import default_dtype

    heads = run_heads(config)
    sources, elements = {}, set(replay.elements)
    for head in new_heads(config):
        sub = head_config(config, head)
        source = data_source(sub.dataset, field=f"heads.{head}.dataset")
        if source.kind == "prepared":
            sources[head] = (sub, source.path, None)
            elements |= _store_elements(sub, source.path)
        else:
            loaded = _load_with_frames(sub)
            sources[head] = (sub, source.path, loaded)
            elements |= {int(z) for a in loaded[0] for z in a.numbers}
        if sub.valid_dataset:
            if data_source(sub.valid_dataset, field=f"heads.{head}.valid_dataset").kind == "prepared":
                raise ValueError(
                    f"TrainConfig.heads.{head}.valid_dataset ({sub.valid_dataset}): a structure file; a prepared "
                    "dataset is split by valid_fraction"
                )
            valid = _load_with_frames(sub.replace(dataset=sub.valid_dataset))[0]
            elements |= {int(z) for a in valid for z in a.numbers}
    parts = []
    for head, (sub, path, loaded) in sources.items():
        part = HeadPart(head, heads, frozenset(elements), loaded)
        if loaded is None:
            parts.append((head, _from_store(sub, Path(path), part=part)))
        else:
            with default_dtype(config.dtype):  # mace builds AtomicData in the default dtype
                parts.append((head, _from_structures(sub, None, part=part)))
    return join_heads(parts, replay, config)


def _store_elements(config: TrainConfig, path: Path) -> set[int]:
    from workbench.data.store import GraphStore

    store = GraphStore(path)
    return {int(z) for z in store.present_elements(store.select(config.families))}
