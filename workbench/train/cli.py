"""``workbench train --config run.yaml [--set key=value ...]``; works as is under torchrun."""

from __future__ import annotations

import argparse

import yaml


def _run(args: argparse.Namespace) -> int:
    from workbench.train.config import TrainConfig
    from workbench.train.loop import train

    config = TrainConfig.from_yaml(args.config) if args.config else TrainConfig()
    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    if overrides:
        config = TrainConfig.from_dict({**config.to_dict(), **overrides}, source="--set")
    result = train(config, resume=not args.fresh)
    if result.model_path is not None:
        print(f"done: {result.global_step} steps, final loss {result.final_loss:.4g}; model {result.model_path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train a MACE model (single process or under torchrun)")
    p.add_argument("--config", help="TrainConfig YAML (default: the paper's settings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in the run directory")
    p.set_defaults(func=_run)
