"""The options of multihead fine-tuning with replay (:mod:`workbench.train.replay`): its heads,
mace's multihead recipe and the rules that check and complete a ``TrainConfig``. No data here,
so that ``TrainConfig`` can check its fields without importing the data side.

``heads`` (mace's ``--heads``) trains several new datasets, one head each, next to the replay::

    heads:
      surfaces: {dataset: surfaces.extxyz}
      molecules: {dataset: molecules.extxyz, e0s: {H: -13.6, O: -2041.8}, valid_fraction: 0.2}

A head's ``valid_fraction`` and ``e0s`` default to the config's; ``valid_dataset`` gives its
validation structures instead. The model's heads are ``pt_head`` then these, in the order given.
"""

from __future__ import annotations

import math
import re
from typing import Any

from workbench.train.values import ConfigError

#: a ``workbench.train.config.TrainConfig`` (not imported: the config imports this module)
TrainConfig = Any

__all__ = [
    "FT_HEAD",
    "HEAD_KEYS",
    "PT_HEAD",
    "RATIO_THRESHOLD",
    "RECIPE",
    "SUBSELECT",
    "check_replay_fields",
    "head_settings",
    "new_heads",
    "recipe",
    "repeats",
    "run_heads",
]

PT_HEAD = "pt_head"  # mace's name for the replayed head (its remove_pt_head, our select_head)
FT_HEAD = "Default"
SUBSELECT = ("random", "fps")
#: below this ratio of new to replayed training structures, the new ones are repeated (mace's default)
RATIO_THRESHOLD = 0.1
#: mace's multihead recipe (unless --force_mh_ft_lr): applied where the config keeps our defaults
RECIPE = {"lr": 1e-4, "ema_decay": 0.99999, "loss": "universal"}
LOSSES = ("weighted", "universal")  # weighted is the default: it becomes universal
#: what a head of ``heads`` may set; the rest is the config's
HEAD_KEYS = ("dataset", "valid_dataset", "valid_fraction", "e0s")
HEAD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
MAX_HEADS = 64  # mace-mh-1 has a handful; hundreds would be a generated mistake


def check_replay_fields(config: TrainConfig) -> None:
    """Refuse replay settings that cannot work together, naming the field."""

    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"TrainConfig.{name}: {why}")

    if config.subselect_pt not in SUBSELECT:
        raise bad("subselect_pt", f"{config.subselect_pt!r} is not one of {', '.join(SUBSELECT)}")
    if not config.multihead_finetuning:
        if config.heads:
            raise bad(
                "heads", "several new datasets, one head each, train with multihead_finetuning: true, which is not set"
            )
        if config.pt_dataset:
            raise bad("pt_dataset", "replay data is used by multihead_finetuning: true, which is not set")
        return
    if not config.foundation_model:
        raise bad("multihead_finetuning", "fine-tunes foundation_model, which is not set")
    if not config.pt_dataset:
        raise bad(
            "multihead_finetuning",
            "needs pt_dataset, the pre-training structures to replay (mace_run_train silently turns "
            "multihead fine-tuning off without --pt_train_file; we refuse instead)",
        )
    if config.e0s == "average":
        raise bad("e0s", "'average' cannot be used with multihead_finetuning (as in mace); use foundation or a map")
    if config.loss not in LOSSES:
        raise bad("loss", f"{config.loss!r}: multihead fine-tuning trains mace's universal loss; set loss: universal")
    if config.heads is not None:
        _check_heads(config, bad)


def _check_heads(config: TrainConfig, bad) -> None:
    """``heads``: a mapping of new head names to their settings (:data:`HEAD_KEYS`), normalised in place."""
    from workbench.train.e0s import check_e0s
    from workbench.train.values import brief

    if not isinstance(config.heads, dict) or not config.heads:
        raise bad("heads", f"expected a mapping like {{surfaces: {{dataset: surf.extxyz}}}}, got {brief(config.heads)}")
    if len(config.heads) > MAX_HEADS:
        raise bad("heads", f"{len(config.heads)} heads; at most {MAX_HEADS}")
    for name in ("dataset", "valid_dataset"):
        if getattr(config, name):
            raise bad(name, f"with heads, each head names its own {name} (heads.NAME.{name}); leave {name} out")
    out = {}
    for name, spec in config.heads.items():
        where = f"heads.{name}"
        if not isinstance(name, str) or not HEAD_NAME.fullmatch(name) or name == PT_HEAD:
            raise bad(
                "heads",
                f"{brief(name)}: a head name is a letter then letters, digits, '.', '_' or '-' "
                f"(at most 64), and not {PT_HEAD!r}, the replay's",
            )
        if not isinstance(spec, dict):
            raise bad(where, f"expected a mapping like {{dataset: {name}.extxyz}}, got {brief(spec)}")
        unknown = sorted(map(str, set(spec) - set(HEAD_KEYS)))
        if unknown:
            raise bad(where, f"unknown key(s) {', '.join(unknown)}; a head sets {', '.join(HEAD_KEYS)}")
        for key in ("dataset", "valid_dataset"):
            value = spec.get(key)
            if (key == "dataset" or value is not None) and (not isinstance(value, str) or not value.strip()):
                raise bad(
                    f"{where}.{key}", f"expected the path of a structure file or prepared dataset, got {brief(value)}"
                )
        fraction = spec.get("valid_fraction", config.valid_fraction)
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (math.isfinite(fraction) and 0 <= fraction < 1)
        ):
            raise bad(f"{where}.valid_fraction", f"must be in [0, 1), got {brief(fraction)}")
        try:
            e0s = check_e0s(spec.get("e0s", config.e0s), config.foundation_model)
        except ConfigError as exc:
            raise bad(f"{where}.e0s", str(exc).split(": ", 1)[1]) from None
        if e0s == "average":
            raise bad(
                f"{where}.e0s",
                "'average' cannot be used with multihead_finetuning (as in mace); use foundation or a map",
            )
        if not fraction and not spec.get("valid_dataset"):  # mace: "No valid datasets found for head"
            raise bad(f"{where}.valid_fraction", "0 leaves the head without validation; give > 0 or a valid_dataset")
        out[name] = dict(spec)  # what the user gave: the rest follows the config (head_settings)
        for key, value in (("valid_fraction", float(fraction)), ("e0s", e0s)):
            if key in spec:
                out[name][key] = value
    config.heads = out


def run_heads(config: TrainConfig) -> list[str] | None:
    """The heads of the run's model, pt_head first as mace orders them; None: one head."""
    return [PT_HEAD, *new_heads(config)] if config.multihead_finetuning else None


def new_heads(config: TrainConfig) -> list[str]:
    """The heads that train new data: those of ``heads`` in order, else ``Default``."""
    return list(config.heads) if config.heads else [FT_HEAD]


def head_settings(config: TrainConfig, head: str) -> dict[str, Any]:
    """The config fields head ``head`` trains with: its ``heads`` entry over the config's."""
    spec = (config.heads or {}).get(head, {})
    return {
        "dataset": spec.get("dataset", config.dataset),
        "valid_dataset": spec.get("valid_dataset", None if config.heads else config.valid_dataset),
        "valid_fraction": spec.get("valid_fraction", config.valid_fraction),
        "e0s": spec.get("e0s", config.e0s),
    }


def recipe(config: TrainConfig) -> TrainConfig:
    """``config`` with mace's multihead lr, EMA decay and loss where it keeps our defaults."""
    if not config.multihead_finetuning:
        return config
    defaults = type(config).__dataclass_fields__
    changes = {k: v for k, v in RECIPE.items() if getattr(config, k) == defaults[k].default}
    return config.replace(**changes) if changes else config


def repeats(n_new: int, n_replay: int) -> int:
    """How many extra copies of the new training structures mace adds: ``floor(0.1 / r)`` when
    :math:`r = n_\text{new} / n_\text{replay}` is below :data:`RATIO_THRESHOLD`, else 0."""
    if n_replay <= 0 or n_new <= 0:
        return 0
    ratio = n_new / n_replay
    return int(RATIO_THRESHOLD / ratio) if ratio < RATIO_THRESHOLD else 0
