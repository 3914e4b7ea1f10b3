"""``workbench bench ...``: every benchmark's options, and ``workbench kernels resources``.

Building the parser imports this module and the benchmarks' light constants only (no torch); a
command imports its benchmark when it runs. Each command prints its tables and writes JSON.
"""

from __future__ import annotations

import argparse

from workbench.bench import cold_start, cpu, data, kernel_cli, nequip, quality, step, train
from workbench.bench.quality_summary import PARITY_TOLERANCE
from workbench.bench.workloads import MODELS
from workbench.cli_args import option_values
from workbench.train.cli import add_config_args, config_from_args

__all__ = ["register_bench", "register_kernels"]


def _items(text: str | None) -> list[str] | None:
    """A comma list as a list (None when not given)."""
    return [x for x in text.split(",") if x] if text else None


def _done(table: str, out) -> int:
    print(table)
    print(f"wrote {out}")
    return 0


# --- packing ---------------------------------------------------------------------------------------


def _packing(args: argparse.Namespace) -> int:
    from workbench.bench.packing import run

    names = ("n", "capacity", "replicas", "real_replicas", "seed", "pyg_n", "repeats", "out")
    run(real_path=args.real, do_sweep=not args.no_sweep, **option_values(args, *names))
    return 0


def _register_packing(bench_sub) -> None:
    p = bench_sub.add_parser("packing", help="packing algorithms vs anchors at the paper's scale")
    p.add_argument("--n", type=int, default=2_650_000, help="synthetic graphs (default 2,650,000)")
    p.add_argument("--capacity", type=float, default=3072)
    p.add_argument("--replicas", type=int, default=740)
    p.add_argument("--real-replicas", type=int, default=4)
    p.add_argument(
        "--real",
        default=None,
        help="dataset or sizes file for the real-data table (default: the embedded data/mixture.extxyz.gz)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pyg-n", type=int, default=50_000, help="graphs for the real PyG DynamicBatchSampler check")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (best of)")
    p.add_argument("--no-sweep", action="store_true", help="skip the capacity x replicas sweep")
    p.add_argument("--out", default="runs/bench/packing.json")
    p.set_defaults(func=_packing)


# --- data and quality ------------------------------------------------------------------------------


def _data(args: argparse.Namespace) -> int:
    sizes = [int(float(x)) for x in args.sizes.split(",")] if args.sizes else []
    res = data.bench_data(
        out=args.out,
        workdir=args.workdir,
        parts=args.parts.split(","),
        frames=args.frames,
        sizes=sizes,
        steps=args.steps,
    )
    return _done(data.format_table(res), args.out)


def _register_data(bench_sub) -> None:
    p = bench_sub.add_parser(
        "data",
        help="data path at scale: prepare throughput, storage layout, and training "
        "memory / start-up / data wait at 100k-1M graphs",
    )
    p.add_argument("--parts", default=",".join(data.PARTS), help="comma list of %(default)s")
    p.add_argument(
        "--frames", type=int, default=20_000, help="extxyz frames for the prepare part (default: %(default)s)"
    )
    p.add_argument(
        "--sizes", default=",".join(str(n) for n in data.SIZES), help="graphs per tiled dataset (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default: %(default)s)")
    p.add_argument("--workdir", default="runs/bench/data", help="datasets and runs (default: %(default)s)")
    p.add_argument("--out", default="runs/bench/data.json")
    p.set_defaults(func=_data)


def _quality(args: argparse.Namespace) -> int:
    res = quality.bench_quality(
        seeds=[int(s) for s in args.seeds.split(",")],
        samplers=args.samplers.split(","),
        mace=not args.no_mace,
        **option_values(args, "preset", "dtype", "batch_size", "threads", "workdir", "out", "resume", "backend"),
    )
    return _done(quality.format_table(res), args.out)


def _register_quality(bench_sub) -> None:
    p = bench_sub.add_parser(
        "quality",
        help="validation errors against mace_run_train (same split, dtype, steps), "
        "and fixed-count vs the packers over seeds",
    )
    p.add_argument(
        "--preset",
        default="small",
        choices=list(quality.PRESETS),
        help="small: ~7 min on 2 cores (noisy); standard: a 32x0e+32x1o model, 3 epochs of the whole mixture "
        f"(parity within ±{PARITY_TOLERANCE:.0%}) (default: %(default)s)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma list (default: %(default)s)")
    p.add_argument("--samplers", default=",".join(quality.SAMPLERS), help="comma list of %(default)s")
    p.add_argument("--no-mace", action="store_true", help="skip mace_run_train (packers only)")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--batch-size", type=int, default=8, help="graphs per batch (packers: capacity = this x mean atoms)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (default: %(default)s)")
    p.add_argument(
        "--backend",
        default="e3nn",
        help="the workbench runs' hot ops, a TrainConfig backend such as e3nn or numba "
        "(mace_run_train always uses e3nn; default: %(default)s)",
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
    p.set_defaults(func=_quality)


# --- cpu and step ----------------------------------------------------------------------------------


def _cpu(args: argparse.Namespace) -> int:
    lists = option_values(args, "parts", "models", "systems", "dtypes")
    res = cpu.bench_cpu(
        **{k: _items(v) for k, v in lists.items()},
        **option_values(args, "preset", "repeats", "trajectory_steps", "threads", "out", "workdir"),
    )
    return _done(cpu.format_table(res), args.out)


def _register_cpu(bench_sub) -> None:
    p = bench_sub.add_parser(
        "cpu",
        help="MACE on a CPU: MD and train steps, e3nn vs the numba kernels interleaved; "
        "hot-op GFLOP/s, step profile, and the e3nn-vs-numba training trajectory",
    )
    p.add_argument(
        "--preset",
        default="full",
        choices=list(cpu.PRESETS),
        help="full: paper + small model, water 96/384/768 atoms + a mixed batch, float32 + float64 (tens of "
        "minutes on 2 cores); smoke: a 24-atom box, the small model (default: %(default)s)",
    )
    p.add_argument("--parts", default=",".join(cpu.PARTS), help="comma list of %(default)s")
    p.add_argument("--models", help=f"comma list of {','.join(MODELS)} (default: the preset's)")
    p.add_argument("--systems", help="comma list of water-<atoms> and mixed (default: the preset's)")
    p.add_argument("--dtypes", help="comma list of float32,float64 (default: the preset's)")
    p.add_argument("--repeats", type=int, help="timed steps per backend (default: the preset's)")
    p.add_argument("--trajectory-steps", type=int, help="training steps of the trajectory part (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (default: %(default)s)")
    p.add_argument("--workdir", default="runs/bench/cpu", help="trajectory runs (default: %(default)s)")
    p.add_argument("--out", default="runs/bench/cpu.json", help="JSON; the trajectory figure goes beside it as .html")
    p.set_defaults(func=_cpu)


def _nequip(args: argparse.Namespace) -> int:
    lists = option_values(args, "families", "configs", "dtypes")
    res = nequip.bench_nequip(
        **{k: _items(v) for k, v in lists.items()}, **option_values(args, "repeat", "repeats", "threads", "out")
    )
    return _done(nequip.format_table(res), args.out)


def _register_nequip(bench_sub) -> None:
    p = bench_sub.add_parser(
        "nequip",
        help="NequIP and Allegro on a CPU: MD and train steps, their own path vs the numba kernels, "
        "interleaved (run in the NequIP environment, .venv-nequip)",
    )
    p.add_argument("--families", default=",".join(nequip.FAMILIES), help="comma list of %(default)s")
    p.add_argument("--configs", default=",".join(nequip.CONFIGS), help="comma list of %(default)s")
    p.add_argument("--dtypes", default="float32,float64", help="comma list of %(default)s")
    p.add_argument("--repeat", type=int, default=4, help="fcc Cu cell of 4*repeat^3 atoms (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per backend (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (default: %(default)s)")
    p.add_argument("--out", default="runs/bench/nequip.json", help="JSON (default: %(default)s)")
    p.set_defaults(func=_nequip)


def _step(args: argparse.Namespace) -> int:
    import shlex
    import sys

    names = ("preset", "parts", "model", "dtypes", "workloads", "backends", "warmup", "repeats", "device", "out")
    res = step.bench_step(
        **option_values(args, *names, "budget_s", "profile_workload"), command="workbench " + shlex.join(sys.argv[1:])
    )
    return _done(step.format_table(res), res["meta"]["out"])


def _register_step(bench_sub) -> None:
    options = {  # flag -> argparse keywords
        "--preset": {
            "default": "gpu",
            "choices": list(step.PRESETS),
            "help": "gpu: paper model, water 768-6144 atoms + the packed mixture at 3072, float32, 5 warm-up + 10 "
            "timed steps; smoke: small model, water-24/48 and a mixture at 96 atoms, 1 + 2 steps (a CPU "
            "test) (default: %(default)s)",
        },
        "--parts": {"nargs": "+", "default": list(step.PARTS), "choices": list(step.PARTS)},
        "--model": {"choices": list(MODELS), "help": "default: the preset's"},
        "--dtypes": {"nargs": "+", "choices": ["float32", "float64"], "help": "default: the preset's"},
        "--workloads": {"nargs": "+", "help": "water-<atoms> and mixture-<capacity> (default: the preset's)"},
        "--backends": {"nargs": "+", "default": list(step.BACKENDS), "choices": list(step.BACKENDS)},
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
    p.set_defaults(func=_step)


# --- train and cold start --------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    results = train.bench_train(
        config_from_args(args),
        structures=args.structures,
        batch_size=args.batch_size,
        variants=args.variants.split(",") if args.variants else list(train.VARIANTS),
        warmup_steps=args.warmup_steps,
        out=args.out,
    )
    return _done(train.format_table(results), args.out)


def _register_train(bench_sub) -> None:
    p = bench_sub.add_parser("train", help="one epoch per variant: fixed-count+e3nn vs packer+e3nn/numba/cueq")
    add_config_args(p, " for the model and capacity")
    p.add_argument("--structures", type=int, default=5000, help="mixture size (embedded data tiled; default 5000)")
    p.add_argument("--batch-size", type=int, default=7, help="graphs per baseline batch (paper: 6-8)")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(train.VARIANTS)}")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--out", default="runs/bench/train.json")
    p.set_defaults(func=_train)


def _register_cold_start(bench_sub) -> None:
    p = bench_sub.add_parser("cold-start", help="accelerate() with an empty kernel cache to the first optimizer step")
    p.add_argument("--hidden", default="128x0e+128x1o")
    p.add_argument("--max-ell", type=int, default=3)
    p.add_argument("--correlation", type=int, default=3)
    p.add_argument("--atoms", type=int, default=3072, help="periodic water box size (a multiple of 3)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument(
        "--target",
        choices=("auto", "device", "ptx"),
        default="auto",
        help="device: a GPU, to the first step; ptx: PTX + ptxas for sm_90, no GPU needed",
    )
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: the usable cores)")
    p.add_argument("--serial", action="store_true", help="also time one worker from an empty cache")
    p.add_argument(
        "--cache",
        default=None,
        help="kernel cache folder for the cold and warm runs (empty or absent; default: a temporary folder)",
    )
    p.add_argument("--name", default=None, help="machine name in the JSON (default: the GPU's, else cpu-<cores>-cores)")
    p.add_argument("--out", default=cold_start.DEFAULT_OUT, help="JSON ('' for none; {machine} is replaced)")
    p.set_defaults(func=cold_start.main)


def register_bench(bench_sub) -> None:
    """Every ``workbench bench`` command (``bench_sub``: the ``bench`` command's subparsers)."""
    _register_packing(bench_sub)
    kernel_cli.register_bench(bench_sub)
    _register_data(bench_sub)
    _register_quality(bench_sub)
    _register_cpu(bench_sub)
    _register_nequip(bench_sub)
    _register_step(bench_sub)
    _register_train(bench_sub)
    _register_cold_start(bench_sub)


def register_kernels(kernels_sub) -> None:
    """``workbench kernels resources`` (``kernels_sub``: the ``kernels`` command's subparsers)."""
    kernel_cli.register_kernels(kernels_sub)
