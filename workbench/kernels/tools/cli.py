"""``workbench kernels precompile``: fill the kernel cache for a model configuration ahead of a
job; ``workbench kernels cache``: what the cache holds, and pruning what no run loaded for a while.

Building the command line's parser imports this module: it imports no torch (the command does,
when it runs). Run it once on one GPU node with the cache folder a cluster shares (``--cache`` or
``$WORKBENCH_KERNEL_CACHE``), and every rank of the job that follows loads the kernels instead of
compiling them; ``--target ptx`` checks (and times) the compile on a machine without a GPU.

.. code-block:: text

    workbench kernels precompile                                   # paper config, float32, this GPU
    workbench kernels precompile --hidden 128x0e+128x1o+128x2e --dtype float32 float64 --cache /shared/kernels
    workbench kernels precompile --target ptx                      # no GPU: PTX + ptxas for sm_90
    workbench kernels cache --prune --older-than 30                 # drop modules unused for 30 days
"""

from __future__ import annotations

import json
import os
import sys

from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["register_kernels"]


def _model(hidden: str, max_ell: int, correlation: int, elements: int, dtype: str, device: str):
    import torch

    from workbench.kernels import accelerate
    from workbench.kernels.tools.models import random_scaleshift_mace

    z = list(range(1, elements + 1))
    model = random_scaleshift_mace(hidden, max_ell, correlation, z, 16.0, getattr(torch, dtype), device, perturb=0.0)
    return accelerate(model, backend=DEFAULT_BACKEND, precompile=False)


def _use_cache(folder: str | None) -> None:
    """``--cache``: the kernel cache folder for this process and the ones it starts."""
    from workbench.kernels.options import configure

    if folder:
        configure(kernel_cache=os.path.abspath(os.path.expanduser(folder)))


def _checked_cache(args, what: str) -> None:
    """``--cache`` in effect, and the folder refused in one line when it cannot be written."""
    from workbench.kernels.numba.cache_folder import require_cache_on, require_writable, source_dir

    _use_cache(args.cache)
    require_cache_on(what)
    require_writable(source_dir(), what)


def _check_modules(model, modules: list[str] | None) -> None:
    from workbench.kernels.acceleration import model_ops

    labels = [site.label for site in model_ops(model)]
    unknown = [m for m in modules or () if not any(label.startswith(m) for label in labels)]
    if unknown:
        raise ValueError(
            f"--modules {','.join(unknown)}: no module starts with it; the model's are {', '.join(labels)}"
        )


def _main(args) -> int:
    import torch

    from workbench.kernels.acceleration import precompile_model
    from workbench.kernels.numba.generated import source_dir
    from workbench.kernels.tools.precompile_args import check_precompile_args, parse_cc

    check_precompile_args(args)  # every option, before anything is built or compiled
    target = args.target
    if target == "auto":
        target = "device" if torch.cuda.is_available() else "ptx"
    if target == "device" and not torch.cuda.is_available():
        raise ValueError(
            "--target device: torch sees no CUDA device here; use --target ptx to check the compile without a GPU"
        )
    _checked_cache(args, "precompile")
    cc = parse_cc(args.cc) if target == "ptx" else None
    modules = [m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else None
    reports = {}
    for dtype in args.dtype:
        model = _model(
            args.hidden, args.max_ell, args.correlation, args.elements, dtype, "cuda" if target == "device" else "cpu"
        )
        _check_modules(model, modules)
        r = precompile_model(model, target=target, cc=cc, workers=args.workers, modules=modules)
        reports[dtype] = r.as_dict()
        print(
            f"{args.hidden} {dtype}: {r.jobs} kernels, {r.compiled} compiled, {r.cached} already in the cache, "
            f"{r.workers} processes, {r.seconds:.1f} s"
            + (f", waited {r.waited_s:.1f} s for another process" if r.waited_s > 1 else ""),
            flush=True,
        )
        for label, err in r.errors:
            print(f"  failed: {label}: {err}", file=sys.stderr)
    print(f"kernel cache: {source_dir()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"hidden": args.hidden, "target": target, "reports": reports}, fh, indent=1)
    return 1 if any(r["errors"] for r in reports.values()) else 0


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _cache_main(args) -> int:
    from datetime import datetime

    from workbench.kernels.numba.cache_folder import require_writable, source_dir
    from workbench.kernels.tools.cache import prune, scan

    _use_cache(args.cache)
    if args.older_than is not None and not args.prune:
        raise ValueError("--older-than: give it with --prune")
    directory = source_dir()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"kernel cache {directory}: a regular file, not a folder; give --cache a folder")
    if args.prune and not args.dry_run and directory.is_dir():
        require_writable(directory, "--prune")
    modules = scan(directory)
    line = f"kernel cache {directory}: {len(modules)} modules, {_megabytes(sum(m.size for m in modules))}"
    if modules:
        first, last = (datetime.fromtimestamp(m.last_used).strftime("%Y-%m-%d") for m in (modules[0], modules[-1]))
        line += f", last used {first} to {last}"
    print(line)
    if not args.prune:
        return 0
    days = 30.0 if args.older_than is None else args.older_than
    report = prune(directory, days, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"{verb} {len(report.modules)} modules not loaded for {days:g} days and {len(report.strays)} stray files: "
        f"{_megabytes(report.size)}"
    )
    return 0


def register_kernels(ks) -> None:
    """``workbench kernels precompile`` (``ks``: the ``kernels`` command's subparsers; the static
    resource report, ``workbench kernels resources``, is registered by :mod:`workbench.bench.cli`)."""
    p = ks.add_parser("precompile", help="compile a configuration's CUDA kernels into the kernel cache, in parallel")
    p.add_argument("--hidden", default="128x0e+128x1o", help="hidden irreps (default: the paper's %(default)s)")
    p.add_argument("--max-ell", type=int, default=3)
    p.add_argument("--correlation", type=int, default=3)
    p.add_argument("--elements", type=int, default=10, help="number of chemical elements of the model")
    p.add_argument("--dtype", nargs="+", choices=("float32", "float64"), default=["float32"])
    p.add_argument(
        "--target",
        choices=("auto", "device", "ptx"),
        default="auto",
        help="device: this GPU, into the cache; ptx: PTX + ptxas, no GPU needed (nothing loadable is cached)",
    )
    p.add_argument("--cc", default="9.0", help="compute capability for --target ptx (default %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: the usable cores)")
    p.add_argument(
        "--cache",
        default=None,
        help="kernel cache folder (default: $WORKBENCH_KERNEL_CACHE, else $WORKBENCH_CACHE_DIR/kernels, "
        "else ~/.cache/cfm-workbench/kernels)",
    )
    p.add_argument(
        "--modules",
        default=None,
        help="only these modules' kernels, comma-separated name prefixes (e.g. products.0.,interactions.1.)",
    )
    p.add_argument("--json", default=None, help="write the reports here")
    p.set_defaults(func=_main)
    c = ks.add_parser("cache", help="what the kernel cache holds; --prune removes modules no run loaded lately")
    c.add_argument("--cache", default=None, help="kernel cache folder (default: as for precompile)")
    c.add_argument("--prune", action="store_true", help="remove modules not loaded for --older-than days")
    c.add_argument("--older-than", type=float, default=None, help="days since last load (default with --prune: 30)")
    c.add_argument("--dry-run", action="store_true", help="with --prune: only say what would go")
    c.set_defaults(func=_cache_main)
