"""``workbench bench ...``: every benchmark's options, and ``workbench kernels resources``.

Building the parser imports this module and the benchmarks' light constants only (no torch); a
command imports its benchmark when it runs. Each command prints its tables and writes JSON.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from workbench.bench import cold_start, cpu, data, kernel_cli, nequip, nequip_env, quality, step, train
from workbench.bench.cpu_compiled import COMPILERS
from workbench.bench.cpu_md import CALCULATORS
from workbench.bench.quality_summary import PARITY_TOLERANCE
from workbench.bench.workloads import MODEL_SETTINGS, MODELS
from workbench.cli_args import Options, add_command, add_options, option_values
from workbench.limits import DEFAULT_CAPACITY
from workbench.train.cli import add_config_args, config_from_args
from workbench.train.losses import LOSSES

__all__ = ["register_bench", "register_kernels"]


def _items(text: str | None) -> list[str] | None:
    """A comma list as a list (None when not given)."""
    return [x for x in text.split(",") if x] if text else None


def _done(table: str, out) -> int:
    print(table)
    print(f"wrote {out}")
    return 0


def _preset(presets: Iterable[str], **described: str) -> dict[str, Any]:
    """A bench's ``--preset`` option: one of ``presets``, each ``described`` in a few words (the first
    described is the default). A preset added without a word in ``--help`` fails every command."""
    if set(described) != set(presets):
        raise ValueError(f"--preset help describes {sorted(described)}, the presets are {sorted(presets)}")
    what = "; ".join(f"{name}: {text}" for name, text in described.items())
    return {"default": next(iter(described)), "choices": list(presets), "help": f"{what} (default: %(default)s)"}


def _comma_list(names: Iterable[str]) -> dict[str, Any]:
    """An option taking a comma list of ``names``, all of them by default."""
    return {"default": ",".join(names), "help": "comma list of %(default)s"}


# --- packing ---------------------------------------------------------------------------------------


def _packing(args: argparse.Namespace) -> int:
    """packing algorithms vs anchors at the paper's scale"""
    from workbench.bench.packing import run

    names = ("n", "capacity", "replicas", "real_replicas", "seed", "pyg_n", "repeats", "out")
    run(real_path=args.real, do_sweep=not args.no_sweep, **option_values(args, *names))
    return 0


_PACKING_OPTIONS: Options = {
    "--n": {"type": int, "default": 2_650_000, "help": "synthetic graphs (default 2,650,000)"},
    "--capacity": {"type": float, "default": DEFAULT_CAPACITY},
    "--replicas": {"type": int, "default": 740},
    "--real-replicas": {"type": int, "default": 4},
    "--real": {
        "default": None,
        "help": "dataset or sizes file for the real-data table (default: the embedded data/mixture.extxyz.gz)",
    },
    "--seed": {"type": int, "default": 0},
    "--pyg-n": {"type": int, "default": 50_000, "help": "graphs for the real PyG DynamicBatchSampler check"},
    "--repeats": {"type": int, "default": 3, "help": "timing repeats (best of)"},
    "--no-sweep": {"action": "store_true", "help": "skip the capacity x replicas sweep"},
    "--out": {"default": "runs/bench/packing.json"},
}


# --- data and quality ------------------------------------------------------------------------------


def _data(args: argparse.Namespace) -> int:
    """data path at scale: prepare throughput, storage layout, and training memory / start-up / data wait at 100k-1M
    graphs"""
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


_DATA_OPTIONS: Options = {
    "--parts": _comma_list(data.PARTS),
    "--frames": {"type": int, "default": 20_000, "help": "extxyz frames for the prepare part (default: %(default)s)"},
    "--sizes": {"default": ",".join(map(str, data.SIZES)), "help": "graphs per tiled dataset (default: %(default)s)"},
    "--steps": {"type": int, "default": 40, "help": "training steps per run (default: %(default)s)"},
    "--workdir": {"default": "runs/bench/data", "help": "datasets and runs (default: %(default)s)"},
    "--out": {"default": "runs/bench/data.json"},
}


def _quality(args: argparse.Namespace) -> int:
    """validation errors against mace_run_train (same split, dtype, steps), and fixed-count vs the packers over seeds"""
    if args.finetune:
        return _finetune(args)
    if args.stress_weight is None:  # mace's default weight wherever its loss has a stress term
        args.stress_weight = 1.0 if "stress" in LOSSES[args.loss].uses else 0.0
    res = quality.bench_quality(
        seeds=[int(s) for s in args.seeds.split(",")],
        samplers=args.samplers.split(","),
        mace=not args.no_mace,
        **option_values(
            args, "preset", "dtype", "batch_size", "threads", "workdir", "out", "resume", "backend", "loss"
        ),
        stress_weight=args.stress_weight,
    )
    return _done(quality.format_table(res), args.out)


def _finetune(args: argparse.Namespace) -> int:
    from workbench.bench.finetune import bench_finetune, format_finetune

    # its own folder and JSON unless given: a fine-tuning bench does not replace a quality bench
    workdir = "runs/bench/finetune" if args.workdir == "runs/bench/quality" else args.workdir
    out = "runs/bench/finetune.json" if args.out == "runs/bench/quality.json" else args.out
    res = bench_finetune(
        seeds=[int(s) for s in args.seeds.split(",")],
        **option_values(args, "preset", "dtype", "batch_size", "threads", "backend"),
        stress_weight=10.0 if args.stress_weight is None else args.stress_weight,
        workdir=workdir,
        out=out,
    )
    return _done(format_finetune(res), out)


_QUALITY_OPTIONS: Options = {
    "--finetune": {
        "action": "store_true",
        "help": "fine-tuning instead: a foundation trained by mace_run_train on mptrj, fine-tuned on new families "
        "by both trainers, against scratch and the foundation (workbench.bench.finetune)",
    },
    "--preset": _preset(
        quality.PRESETS,
        small="~7 min on 2 cores (noisy)",
        # "%%": argparse %-formats the help, and the tolerance prints as a percentage
        standard=f"a 32x0e+32x1o model, 3 epochs of the whole mixture (parity within ±{PARITY_TOLERANCE:.0%}%)",
    ),
    "--seeds": {"default": "0,1,2", "help": "comma list (default: %(default)s)"},
    "--samplers": _comma_list(quality.SAMPLERS),
    "--no-mace": {"action": "store_true", "help": "skip mace_run_train (packers only)"},
    "--dtype": {"default": "float64", "choices": ["float32", "float64"]},
    "--batch-size": {"type": int, "default": 8, "help": "graphs per batch (packers: capacity = this x mean atoms)"},
    "--threads": {"type": int, "default": 2, "help": "torch threads per run (default: %(default)s)"},
    "--backend": {
        "default": "e3nn",
        "help": "the workbench runs' hot ops, a TrainConfig backend such as e3nn or numba "
        "(mace_run_train always uses e3nn; default: %(default)s)",
    },
    "--loss": {
        "default": "weighted",
        "choices": list(LOSSES),
        "help": "both trainers' loss, as mace_run_train --loss (default: %(default)s)",
    },
    "--stress-weight": {
        "type": float,
        "default": None,
        "help": "the stress term's weight (default: 1.0 with --loss stress, huber or universal, as mace; else 0)",
    },
    "--workdir": {"default": "runs/bench/quality", "help": "split files, runs and logs (replaced unless --resume)"},
    "--resume": {
        "action": "store_true",
        "help": "keep the finished runs in --workdir (same settings only) and run the rest",
    },
    "--out": {"default": "runs/bench/quality.json"},
}


# --- cpu and step ----------------------------------------------------------------------------------


def _cpu(args: argparse.Namespace) -> int:
    """MACE on a CPU: MD and train steps, e3nn vs the numba kernels interleaved; hot-op GFLOP/s, step profile, the
    e3nn-vs-numba training trajectory; NequIP and Allegro rows through --nequip-python"""
    lists = option_values(args, "parts", "models", "systems", "dtypes")
    res = cpu.bench_cpu(
        **{k: _items(v) for k, v in lists.items()},
        **option_values(
            args, "preset", "repeats", "trajectory_steps", "threads", "out", "workdir", "nequip_python", "keep_memory"
        ),
        md_calculators=_items(args.md_calculators),
        compiler=args.compiler,
    )
    return _done(cpu.format_table(res), args.out)


_CPU_OPTIONS: Options = {
    "--preset": _preset(
        cpu.PRESETS,
        full="paper + small model, water 96/384/768 atoms + a mixed batch, float32 + float64 "
        "(tens of minutes on 2 cores)",
        smoke="a 24-atom box, the small model",
    ),
    "--parts": _comma_list(cpu.PARTS),
    "--models": {"help": f"comma list of {','.join(MODELS)} (default: the preset's)"},
    "--systems": {"help": "comma list of water-<atoms> and mixed (default: the preset's)"},
    "--dtypes": {"help": "comma list of float32,float64 (default: the preset's)"},
    "--repeats": {"type": int, "help": "timed steps per backend (default: the preset's)"},
    "--trajectory-steps": {"type": int, "help": "training steps of the trajectory part (default: the preset's)"},
    "--threads": {
        "type": int,
        "default": 2,
        "help": "torch, numba and the peers' OpenMP threads (default: %(default)s)",
    },
    "--workdir": {"default": "runs/bench/cpu", "help": "trajectory runs (default: %(default)s)"},
    "--keep-memory": {
        "action": "store_true",
        "help": "md part: keep freed memory in the process, as `workbench md` does (workbench.train.heap; "
        "process-wide, so every row gets it)",
    },
    "--md-calculators": {
        "default": ",".join(CALCULATORS),
        "help": "md part: comma list of the rows, of %(default)s (e3nn's minutes-long calls at 1,536 atoms "
        "slow the rows timed between them: leave it out to compare the others alone)",
    },
    "--compiler": {
        "choices": COMPILERS,
        "help": "compiled part: torch.compile's backend (default: the preset's, full: inductor, smoke: aot_eager, "
        "which checks without compiling C++)",
    },
    "--out": {"default": "runs/bench/cpu.json", "help": "JSON; the trajectory figure goes beside it as .html"},
    "--nequip-python": {
        "default": nequip_env.named_python(),
        "help": "python of the NequIP environment, which runs the families part (e.g. .venv-nequip/bin/python; "
        "default: $WORKBENCH_NEQUIP_PYTHON, else the part runs here if nequip imports, else it is skipped)",
    },
}


def _nequip(args: argparse.Namespace) -> int:
    """NequIP and Allegro: MD and train steps, their own path vs the numba kernels (and, on a GPU, vs their cueq and
    oeq modifiers), interleaved (run in the NequIP environment, .venv-nequip)"""
    lists = option_values(args, "families", "configs", "dtypes", "backends")
    res = nequip.bench_nequip(
        **{k: _items(v) for k, v in lists.items()},
        **option_values(args, "repeat", "repeats", "threads", "out", "device", "settle"),
    )
    return _done(nequip.format_table(res), args.out)


_NEQUIP_OPTIONS: Options = {
    "--families": _comma_list(nequip.FAMILIES),
    "--configs": _comma_list(nequip.CONFIGS),
    "--dtypes": _comma_list(("float32", "float64")),
    "--repeat": {"type": int, "default": 4, "help": "fcc Cu cell of 4*repeat^3 atoms (default: %(default)s)"},
    "--repeats": {"type": int, "default": 5, "help": "timed steps per backend (default: %(default)s)"},
    "--settle": {
        "type": int,
        "default": 1,
        "help": "untimed steps of the same model right before each timed one (default: %(default)s; 0: timed "
        "right after the other backends' steps)",
    },
    "--threads": {
        "type": int,
        "default": 2,
        "help": "torch, numba and the peers' OpenMP threads (default: %(default)s)",
    },
    "--device": {"default": "cpu", "help": "cpu, cuda or cuda:N (default: %(default)s)"},
    "--backends": {
        "help": f"comma list of {','.join(nequip.backends())} ({','.join(nequip.REQUIRED)} always run; "
        "default: all on a GPU, those three on a CPU)"
    },
    "--out": {"default": "runs/bench/nequip.json", "help": "JSON (default: %(default)s)"},
}


def _step(args: argparse.Namespace) -> int:
    """the whole MACE train step on one device: numba vs cueq vs e3nn (same weights and batches), peak memory, and a
    profile of the numba step"""
    import shlex
    import sys

    names = ("preset", "parts", "model", "dtypes", "workloads", "backends", "warmup", "repeats", "device", "out")
    res = step.bench_step(
        **option_values(args, *names, "budget_s", "profile_workload"), command="workbench " + shlex.join(sys.argv[1:])
    )
    return _done(step.format_table(res), res["meta"]["out"])


_STEP_OPTIONS: Options = {
    "--preset": _preset(
        step.PRESETS,
        gpu="paper model, water 768-6144 atoms + the packed mixture at 3072, float32, 5 warm-up + 10 timed steps",
        smoke="small model, water-24/48 and a mixture at 96 atoms, 1 + 2 steps (a CPU test)",
    ),
    "--parts": {"nargs": "+", "default": list(step.PARTS), "choices": list(step.PARTS)},
    "--model": {"choices": [m for m in MODELS if m not in MODEL_SETTINGS], "help": "default: the preset's"},
    "--dtypes": {"nargs": "+", "choices": ["float32", "float64"], "help": "default: the preset's"},
    "--workloads": {"nargs": "+", "help": "water-<atoms> and mixture-<capacity> (default: the preset's)"},
    "--backends": {
        "nargs": "+",
        "help": f"row labels, any of {' '.join(step.backend_choices())}; <backend>+fixed pads the batches to "
        "fixed shapes, <backend>+graph also replays the step as a CUDA graph "
        f"(default: the preset's; gpu: {' '.join(step.PRESETS['gpu']['backends'])})",
    },
    "--warmup": {"type": int, "help": "untimed steps per backend first (default: the preset's)"},
    "--repeats": {"type": int, "help": "timed steps per backend (default: the preset's)"},
    "--device": {"help": "cuda, cuda:1, cpu (default: cuda when available)"},
    "--profile-workload": {"help": "the profile part's workload (default: the preset's, water-3072 / water-48)"},
    "--budget-s": {
        "type": float,
        "help": "seconds per part after which no new row starts; the rest are recorded as skipped (default: no limit)",
    },
    "--out": {
        "help": "JSON, rewritten after every row (default: benchmarks/results/train_step_gpu_<gpu>.json on "
        "CUDA, runs/bench/train_step_cpu.json on a CPU)"
    },
}


# --- train and cold start --------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    """one epoch per variant: fixed-count+e3nn vs packer+e3nn/numba/cueq"""
    results = train.bench_train(
        config_from_args(args),
        structures=args.structures,
        batch_size=args.batch_size,
        variants=args.variants.split(",") if args.variants else list(train.VARIANTS),
        warmup_steps=args.warmup_steps,
        out=args.out,
    )
    return _done(train.format_table(results), args.out)


# after --config and --set (train.cli.add_config_args)
_TRAIN_OPTIONS: Options = {
    "--structures": {"type": int, "default": 5000, "help": "mixture size (embedded data tiled; default 5000)"},
    "--batch-size": {"type": int, "default": 7, "help": "graphs per baseline batch (paper: 6-8)"},
    "--variants": {"help": f"comma-separated subset of {','.join(train.VARIANTS)}"},
    "--warmup-steps": {"type": int, "default": 3},
    "--out": {"default": "runs/bench/train.json"},
}


_COLD_START_OPTIONS: Options = {
    "--hidden": {"default": "128x0e+128x1o"},
    "--max-ell": {"type": int, "default": 3},
    "--correlation": {"type": int, "default": 3},
    "--atoms": {"type": int, "default": 3072, "help": "periodic water box size (a multiple of 3)"},
    "--dtype": {"choices": ("float32", "float64"), "default": "float32"},
    "--target": {
        "choices": ("auto", "device", "ptx"),
        "default": "auto",
        "help": "device: a GPU, to the first step; ptx: PTX + ptxas for sm_90, no GPU needed",
    },
    "--workers": {"type": int, "default": None, "help": "compile processes (default: the usable cores)"},
    "--serial": {"action": "store_true", "help": "also time one worker from an empty cache"},
    "--cache": {
        "default": None,
        "help": "kernel cache folder for the cold and warm runs (empty or absent; default: a temporary folder)",
    },
    "--name": {"default": None, "help": "machine name in the JSON (default: the GPU's, else cpu-<cores>-cores)"},
    "--out": {"default": cold_start.DEFAULT_OUT, "help": "JSON ('' for none; {machine} is replaced)"},
}


def register_bench(bench_sub) -> None:
    """Every ``workbench bench`` command (``bench_sub``: the ``bench`` command's subparsers), in
    ``--help`` order; a command's help line is its function's docstring."""
    add_command(bench_sub, "packing", _PACKING_OPTIONS, _packing)
    kernel_cli.register_bench(bench_sub)
    add_command(bench_sub, "data", _DATA_OPTIONS, _data)
    add_command(bench_sub, "quality", _QUALITY_OPTIONS, _quality)
    add_command(bench_sub, "cpu", _CPU_OPTIONS, _cpu)
    add_command(bench_sub, "nequip", _NEQUIP_OPTIONS, _nequip)
    add_command(bench_sub, "step", _STEP_OPTIONS, _step)
    train_parser = add_command(bench_sub, "train", {}, _train)
    add_config_args(train_parser, " for the model and capacity")
    add_options(train_parser, _TRAIN_OPTIONS)
    # cold_start.main's docstring speaks of the function, so its help line is given here
    cold_start_help = "accelerate() with an empty kernel cache to the first optimizer step"
    add_command(bench_sub, "cold-start", _COLD_START_OPTIONS, cold_start.main, cold_start_help)


def register_kernels(kernels_sub) -> None:
    """``workbench kernels resources`` (``kernels_sub``: the ``kernels`` command's subparsers)."""
    kernel_cli.register_kernels(kernels_sub)
