"""``workbench train --config run.yaml [--set key=value ...]`` (works as is under torchrun) and ``workbench
eval``. The benchmarks that train (``workbench bench train``, ``quality``, ...) are in :mod:`workbench.bench`."""

from __future__ import annotations

import argparse

from workbench.cli_args import option_values


def config_from_args(args: argparse.Namespace):
    """The TrainConfig named by ``--config`` (default: the paper's settings) with ``--set`` applied."""
    from workbench.train.config import TrainConfig

    return (TrainConfig.from_yaml(args.config) if args.config else TrainConfig()).with_overrides(args.set)


def add_config_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--config`` and ``--set``: a TrainConfig from YAML with fields overridden (``what`` ends the help)."""
    p.add_argument("--config", help=f"TrainConfig YAML{what} (default: the paper's settings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def add_trust_model_arg(p: argparse.ArgumentParser) -> None:
    """``--trust-model``: load a model file as a full pickle (``eval`` and ``md``)."""
    p.add_argument(
        "--trust-model",
        action="store_true",
        help="load a model file that the safe loader refuses as a full pickle, which runs any code it "
        "contains: only for files from a source you trust",
    )


def _run(args: argparse.Namespace) -> int:
    from workbench.train.loop import train

    config = config_from_args(args)
    result = train(config, resume=not args.fresh)
    if result.model_path is not None:
        print(done_line(result))
    return 0


def done_line(result) -> str:
    """The run's closing line. A rerun of a complete run takes no step: it says so, with the loss the
    checkpoint recorded (none in checkpoints older than that record)."""
    import math

    loss = "unknown" if math.isnan(result.final_loss) else f"{result.final_loss:.4g}"
    if result.steps_run == 0:
        return (
            f"done already: {result.global_step} steps in {result.epochs_done} epochs, last loss {loss}; "
            f"nothing left to train (raise epochs or max_steps to go on, or --fresh); model {result.model_path}"
        )
    return f"done: {result.global_step} steps, final loss {loss}; model {result.model_path}"


def _eval(args: argparse.Namespace) -> int:
    import json

    from workbench.train.evaluation import evaluate_file, format_table

    keys = ("energy_key", "forces_key", "stress_key", "virials_key", "batch_size", "device", "trust_model", "head")
    result = evaluate_file(args.model, args.file, **option_values(args, *keys))
    print(format_table(result))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def register(sub) -> None:
    e = sub.add_parser(
        "eval", help="energy, force and stress errors of a mace model on labelled structures, per config_type"
    )
    e.add_argument("model", help="a saved mace-torch model (e.g. runs/<name>/model.model)")
    e.add_argument("file", help="labelled structures: extxyz, mace HDF5, ASE .db, .aselmdb, mace LMDB (file or folder)")
    e.add_argument("--energy-key", default="REF_energy")
    e.add_argument("--forces-key", default="REF_forces")
    e.add_argument("--stress-key", default="REF_stress", help="stress errors where frames carry it")
    e.add_argument("--virials-key", default="REF_virials")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    e.add_argument("--json", help="also write the result as JSON here")
    e.add_argument("--head", help="the head of a multihead model (default: its only head that is not pt_head)")
    add_trust_model_arg(e)
    e.set_defaults(func=_eval)

    p = sub.add_parser("train", help="train a MACE model (single process or under torchrun)")
    add_config_args(p, "")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in the run directory")
    p.set_defaults(func=_run)
