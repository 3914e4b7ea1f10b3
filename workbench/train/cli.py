"""``workbench train --config run.yaml [--set key=value ...]``; works as is under torchrun."""

from __future__ import annotations

import argparse


def _config(args: argparse.Namespace):
    """The TrainConfig named by ``--config`` (default: the paper's settings) with ``--set`` applied."""
    from workbench.train.config import TrainConfig

    return (TrainConfig.from_yaml(args.config) if args.config else TrainConfig()).with_overrides(args.set)


def _add_config_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--config", help=f"TrainConfig YAML{what} (default: the paper's settings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")


def _run(args: argparse.Namespace) -> int:
    from workbench.train.loop import train

    config = _config(args)
    result = train(config, resume=not args.fresh)
    if result.model_path is not None:
        print(f"done: {result.global_step} steps, final loss {result.final_loss:.4g}; model {result.model_path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from workbench.train.evaluate import evaluate_file, format_table

    result = evaluate_file(
        args.model,
        args.file,
        energy_key=args.energy_key,
        forces_key=args.forces_key,
        batch_size=args.batch_size,
        device=args.device,
    )
    print(format_table(result))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def register(sub) -> None:
    e = sub.add_parser("eval", help="energy and force errors of a mace model on an extxyz file, per config_type")
    e.add_argument("model", help="a saved mace-torch model (e.g. runs/<name>/model.model)")
    e.add_argument("file", help="extxyz file with labels")
    e.add_argument("--energy-key", default="REF_energy")
    e.add_argument("--forces-key", default="REF_forces")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--device", default="cpu")
    e.add_argument("--json", help="also write the result as JSON here")
    e.set_defaults(func=_eval)

    p = sub.add_parser("train", help="train a MACE model (single process or under torchrun)")
    _add_config_args(p, "")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in the run directory")
    p.set_defaults(func=_run)


def _bench(args: argparse.Namespace) -> int:
    from workbench.train.bench import VARIANTS, bench_train, format_table

    config = _config(args)
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    results = bench_train(
        config,
        structures=args.structures,
        batch_size=args.batch_size,
        variants=variants,
        warmup_steps=args.warmup_steps,
        out=args.out,
    )
    print(format_table(results))
    print(f"wrote {args.out}")
    return 0


def register_bench(bench_sub) -> None:
    _register_bench_data(bench_sub)
    _register_bench_quality(bench_sub)
    _register_bench_cpu(bench_sub)
    _register_bench_step(bench_sub)
    p = bench_sub.add_parser("train", help="one epoch per variant: fixed-count+e3nn vs packer+e3nn/numba/cueq")
    _add_config_args(p, " for the model and capacity")
    p.add_argument("--structures", type=int, default=5000, help="mixture size (embedded data tiled; default 5000)")
    p.add_argument("--batch-size", type=int, default=7, help="graphs per baseline batch (paper: 6-8)")
    p.add_argument("--variants", help="comma-separated subset of baseline,packer-e3nn,packer-numba,packer-cueq")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--out", default="runs/bench/train.json")
    p.set_defaults(func=_bench)


def _bench_data(args: argparse.Namespace) -> int:
    from workbench.train.bench_data import bench_data, format_table

    sizes = [int(float(x)) for x in args.sizes.split(",")] if args.sizes else []
    res = bench_data(
        out=args.out,
        workdir=args.workdir,
        parts=args.parts.split(","),
        frames=args.frames,
        sizes=sizes,
        steps=args.steps,
    )
    print(format_table(res))
    print(f"wrote {args.out}")
    return 0


def _register_bench_data(bench_sub) -> None:
    from workbench.train.bench_data import PARTS, SIZES

    p = bench_sub.add_parser(
        "data",
        help="data path at scale: prepare throughput, storage layout, and training "
        "memory / start-up / data wait at 100k-1M graphs",
    )
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of %(default)s")
    p.add_argument(
        "--frames", type=int, default=20_000, help="extxyz frames for the prepare part (default: %(default)s)"
    )
    p.add_argument(
        "--sizes", default=",".join(str(n) for n in SIZES), help="graphs per tiled dataset (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default: %(default)s)")
    p.add_argument("--workdir", default="runs/bench/data", help="datasets and runs (default: %(default)s)")
    p.add_argument("--out", default="runs/bench/data.json")
    p.set_defaults(func=_bench_data)


def _bench_quality(args: argparse.Namespace) -> int:
    from workbench.train.bench_quality import bench_quality, format_table

    res = bench_quality(
        preset=args.preset,
        seeds=[int(s) for s in args.seeds.split(",")],
        samplers=args.samplers.split(","),
        mace=not args.no_mace,
        dtype=args.dtype,
        batch_size=args.batch_size,
        threads=args.threads,
        workdir=args.workdir,
        out=args.out,
        resume=args.resume,
        backend=args.backend,
    )
    print(format_table(res))
    print(f"wrote {args.out}")
    return 0


def _register_bench_quality(bench_sub) -> None:
    from workbench.train.bench_quality import PRESETS, SAMPLERS
    from workbench.train.config import MODEL_BACKENDS

    p = bench_sub.add_parser(
        "quality",
        help="validation errors against mace_run_train (same split, dtype, steps), "
        "and fixed-count vs the packers over seeds",
    )
    p.add_argument(
        "--preset",
        default="small",
        choices=list(PRESETS),
        help="small: ~7 min on 2 cores (noisy); standard: issue 20's 32x0e+32x1o model, 3 epochs (default: %(default)s)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma list (default: %(default)s)")
    p.add_argument("--samplers", default=",".join(SAMPLERS), help="comma list of %(default)s")
    p.add_argument("--no-mace", action="store_true", help="skip mace_run_train (packers only)")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--batch-size", type=int, default=8, help="graphs per batch (packers: capacity = this x mean atoms)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (default: %(default)s)")
    p.add_argument(
        "--backend",
        default="e3nn",
        choices=list(MODEL_BACKENDS),
        help="the workbench runs' hot ops (mace_run_train always uses e3nn; default: %(default)s)",
    )
    p.add_argument(
        "--workdir", default="runs/bench/quality", help="split files, runs and logs (replaced unless --resume)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished runs in --workdir (same settings only) and run the rest",
    )
    p.add_argument("--out", default="runs/bench/quality.json")
    p.set_defaults(func=_bench_quality)


def _bench_cpu(args: argparse.Namespace) -> int:
    from workbench.train.bench_cpu import bench_cpu, format_table

    def items(text: str | None) -> list[str] | None:
        return [x for x in text.split(",") if x] if text else None

    res = bench_cpu(
        preset=args.preset,
        parts=items(args.parts),
        models=items(args.models),
        systems=items(args.systems),
        dtypes=items(args.dtypes),
        repeats=args.repeats,
        trajectory_steps=args.trajectory_steps,
        threads=args.threads,
        out=args.out,
        workdir=args.workdir,
    )
    print(format_table(res))
    print(f"wrote {args.out}")
    return 0


def _register_bench_cpu(bench_sub) -> None:
    from workbench.train.bench_cpu import MODELS, PARTS, PRESETS

    p = bench_sub.add_parser(
        "cpu",
        help="MACE on a CPU: MD and train steps, e3nn vs the numba kernels interleaved; "
        "hot-op GFLOP/s, step profile, and the e3nn-vs-numba training trajectory",
    )
    p.add_argument(
        "--preset",
        default="full",
        choices=list(PRESETS),
        help="full: paper + small model, water 96/384/768 atoms + a mixed batch, float32 + float64 (tens of "
        "minutes on 2 cores); smoke: a 24-atom box, the small model (default: %(default)s)",
    )
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of %(default)s")
    p.add_argument("--models", help=f"comma list of {','.join(MODELS)} (default: the preset's)")
    p.add_argument("--systems", help="comma list of water-<atoms> and mixed (default: the preset's)")
    p.add_argument("--dtypes", help="comma list of float32,float64 (default: the preset's)")
    p.add_argument("--repeats", type=int, help="timed steps per backend (default: the preset's)")
    p.add_argument("--trajectory-steps", type=int, help="training steps of the trajectory part (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (default: %(default)s)")
    p.add_argument("--workdir", default="runs/bench/cpu", help="trajectory runs (default: %(default)s)")
    p.add_argument("--out", default="runs/bench/cpu.json", help="JSON; the trajectory figure goes beside it as .html")
    p.set_defaults(func=_bench_cpu)


def _bench_step(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from workbench.train.bench_step import bench_step, format_table

    res = bench_step(
        preset=args.preset,
        parts=args.parts,
        model=args.model,
        dtypes=args.dtypes,
        workloads=args.workloads,
        backends=args.backends,
        warmup=args.warmup,
        repeats=args.repeats,
        device=args.device,
        out=args.out,
        budget_s=args.budget_s,
        profile_workload=args.profile_workload,
        command="workbench " + shlex.join(sys.argv[1:]),
    )
    print(format_table(res))
    print(f"wrote {res['meta']['out']}")
    return 0


def _register_bench_step(bench_sub) -> None:
    from workbench.train.bench_step import BACKENDS, PARTS, PRESETS

    options = {  # flag -> argparse keywords
        "--preset": {
            "default": "gpu",
            "choices": list(PRESETS),
            "help": "gpu: paper model, water 768-6144 atoms + the packed mixture at 3072, float32, 5 warm-up + 10 "
            "timed steps; smoke: small model, water-24/48 and a mixture at 96 atoms, 1 + 2 steps (a CPU "
            "test) (default: %(default)s)",
        },
        "--parts": {"nargs": "+", "default": list(PARTS), "choices": list(PARTS)},
        "--model": {"choices": ["paper", "small"], "help": "default: the preset's"},
        "--dtypes": {"nargs": "+", "choices": ["float32", "float64"], "help": "default: the preset's"},
        "--workloads": {"nargs": "+", "help": "water-<atoms> and mixture-<capacity> (default: the preset's)"},
        "--backends": {"nargs": "+", "default": list(BACKENDS), "choices": list(BACKENDS)},
        "--warmup": {"type": int, "help": "untimed steps per backend first (default: the preset's)"},
        "--repeats": {"type": int, "help": "timed steps per backend (default: the preset's)"},
        "--device": {"help": "cuda, cuda:1, cpu (default: cuda when available)"},
        "--profile-workload": {"help": "the profile part's workload (default: the preset's, water-3072 / water-48)"},
        "--budget-s": {
            "type": float,
            "help": "seconds per part after which no new row starts; the rest are recorded "
            "as skipped (default: no limit)",
        },
        "--out": {
            "help": "JSON, rewritten after every row (default: kernels/results/train_step_gpu_<gpu>.json on "
            "CUDA, runs/bench/train_step_cpu.json on a CPU)"
        },
    }
    p = bench_sub.add_parser(
        "step",
        help="the whole MACE train step on one device: numba vs cueq vs e3nn (same weights "
        "and batches), peak memory, and a profile of the numba step",
    )
    for flag, kwargs in options.items():
        p.add_argument(flag, **kwargs)
    p.set_defaults(func=_bench_step)
