"""The options of multihead fine-tuning with replay (:mod:`workbench.train.replay`): its heads,
mace's multihead recipe and the rules that check and complete a ``TrainConfig``. No data here,
so that ``TrainConfig`` can check its fields without importing the data side."""

from __future__ import annotations

from typing import Any

from workbench.train.values import ConfigError

#: a ``workbench.train.config.TrainConfig`` (not imported: the config imports this module)
TrainConfig = Any

__all__ = [
    "FT_HEAD",
    "PT_HEAD",
    "RATIO_THRESHOLD",
    "RECIPE",
    "SUBSELECT",
    "check_replay_fields",
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


def check_replay_fields(config: TrainConfig) -> None:
    """Refuse replay settings that cannot work together, naming the field."""

    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"TrainConfig.{name}: {why}")

    if config.subselect_pt not in SUBSELECT:
        raise bad("subselect_pt", f"{config.subselect_pt!r} is not one of {', '.join(SUBSELECT)}")
    if not config.multihead_finetuning:
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


def run_heads(config: TrainConfig) -> list[str] | None:
    """The heads of the run's model, pt_head first as mace orders them; None: one head."""
    return [PT_HEAD, FT_HEAD] if config.multihead_finetuning else None


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
