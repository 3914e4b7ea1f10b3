"""``workbench launch --config X --backend local|slurm --nodes N --gpus-per-node G [--dry-run] [--set k=v]``."""

from __future__ import annotations

import argparse
import sys


def _config(args: argparse.Namespace):
    from workbench.train.config import TrainConfig

    return (TrainConfig.from_yaml(args.config) if args.config else TrainConfig()).with_overrides(args.set)


#: SLURM options that map one to one onto ``launch(...)`` keywords
SLURM_KEYS = (
    "account",
    "partition",
    "qos",
    "time",
    "constraint",
    "gpus_per_task",
    "cpus_per_task",
    "mem",
    "signal_delay_s",
)


def _slurm_options(args: argparse.Namespace) -> dict:
    """The SLURM keywords for ``launch``; with another backend, refuse any SLURM option given."""
    if args.backend != "slurm":
        given = [k for k in (*SLURM_KEYS, "sbatch", "setup") if getattr(args, k)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a SLURM option; use --backend slurm")
        return {}
    opts = {k: getattr(args, k) for k in SLURM_KEYS if getattr(args, k) is not None}
    if args.sbatch:
        opts["sbatch_lines"] = args.sbatch
    if args.setup:
        opts["setup"] = args.setup
    return opts


def _report(run, wait: bool) -> int:
    """Print where the run started; with ``wait``, wait for it and print how it ended."""
    where = f"SLURM job {run.job_id}" if run.backend == "slurm" else f"torchrun pid {run.pid}"
    print(f"launched {run.name}: {where}; run directory {run.run_dir}")
    if not wait:
        return 0
    status = run.wait()
    m = run.metrics()
    print(f"{status}: {run.reason}; {m.global_step} steps, last loss {m.last_loss}")
    return 0 if status == "done" else 1


def _run(args: argparse.Namespace) -> int:
    from workbench.launch import LaunchError, RunFailed, launch

    slurm_opts = _slurm_options(args)
    try:
        out = launch(
            _config(args),
            backend=args.backend,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            dry_run=args.dry_run,
            fresh=args.fresh,
            max_restarts=args.max_restarts,
            **slurm_opts,
        )
        if args.dry_run:
            print(out, end="" if out.endswith("\n") else "\n")
            return 0
        return _report(out, args.wait)
    except (LaunchError, RunFailed) as exc:
        if isinstance(exc, ValueError):
            raise  # a refused request is a usage error: workbench.cli prints one line, exit 2
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 1


def register(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="start a training run locally (torchrun) or on SLURM (submitit)",
        epilog="Exit codes: 0 started (or, with --wait, done); 2 a refused request (a bad option or value, "
        "--fresh on a directory that is not a run directory, a run already active there); 1 SLURM is missing "
        "or not answering, sbatch rejected the job, or the awaited run failed.",
    )
    p.add_argument("--config", help="TrainConfig YAML (default: the paper's settings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--backend", required=True, choices=("local", "slurm"), help="where to run (required)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (one per GPU)")
    p.add_argument("--dry-run", action="store_true", help="print the job script / command instead of starting it")
    p.add_argument("--fresh", action="store_true", help="delete the run directory first instead of resuming")
    p.add_argument("--wait", action="store_true", help="wait for the run to finish")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="after a rank or node is lost, resume from the checkpoint at most this many times "
        "(torchrun restart, or the SLURM job requeues itself; default 0)",
    )
    s = p.add_argument_group("SLURM options")
    s.add_argument("--account")
    s.add_argument("--partition")
    s.add_argument("--qos")
    s.add_argument("--time", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS (default 01:00:00)")
    s.add_argument("--constraint")
    s.add_argument("--gpus-per-task", type=int)
    s.add_argument("--cpus-per-task", type=int)
    s.add_argument("--mem", help="memory per node: megabytes, or with a K, M, G or T suffix (e.g. 64G)")
    s.add_argument("--signal-delay-s", type=int, help="SIGUSR2 this many seconds before the time limit (default 120)")
    s.add_argument(
        "--sbatch",
        action="append",
        metavar="LINE",
        help="extra sbatch directive, e.g. --sbatch=--exclusive; "
        "not one the options above set (nodes, tasks, GPUs, time, memory, ...)",
    )
    s.add_argument("--setup", action="append", metavar="SHELL", help="shell line run before srun (repeatable)")
    p.set_defaults(func=_run)
