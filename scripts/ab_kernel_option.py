"""Time the MD or train step of a bench model with one kernel option toggled call by call.

One process, one model per system, the option's values interleaved (each timed call after an
untimed one of the same value, so a value's kernels and caches are warm), medians. Two runs of
a bench an hour apart differ by 10% on a 2-core VM; a toggle in one process does not.

    .venv/bin/python scripts/ab_kernel_option.py --variable WORKBENCH_CPU_REGISTERS \\
        --values 32,1000000 --model paper --systems water-384,water-1536 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variable", required=True, help="a WORKBENCH_* kernel option (docs/reference/environment.md)")
    p.add_argument("--values", required=True, help="comma list of its values; the first is the ratios' numerator")
    p.add_argument(
        "--model",
        default="paper",
        help="paper, small or mp0; or a NequIP family and config, nequip-tutorial ... allegro-large "
        "(run with the NequIP environment's python)",
    )
    p.add_argument(
        "--systems", default="water-384", help="comma list of one-structure systems (NequIP families: cu-<repeat>)"
    )
    p.add_argument("--kind", choices=("md", "train"), default="md")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("runs/bench/ab"), help="the random model files")
    args = p.parse_args(argv)
    from workbench.kernels.options import ENV

    known = {env for env, *_ in ENV.values()}
    if args.variable not in known:
        p.error(f"--variable {args.variable}: not a kernel option; choose one of {sorted(known)}")
    _check_values(p, args.variable, args.values.split(","))
    return args


def _check_values(p: argparse.ArgumentParser, variable: str, values: list[str]) -> None:
    """Every value parsed as the kernels will parse it, before any model is built."""
    from workbench.kernels.options import environment, kernel_options

    for v in values:
        with environment({variable: v}):
            try:
                kernel_options()
            except ValueError as exc:
                p.error(f"--values: {exc}")


def _nequip_step(kind: str, model: str, system: str, dtype: str) -> Callable[[], object]:
    """The MD or train step of ``bench nequip`` (numba) for ``model`` = ``<family>-<config>`` on
    ``system`` = ``cu-<repeat>``: a rattled fcc Cu cell of ``4 * repeat**3`` atoms."""
    import copy

    from workbench.bench.nequip import R_MAX, build, cu_cell, md_step, train_step
    from workbench.kernels import accelerate
    from workbench.kernels.nequip.graphs import atomic_data

    family, _, config = model.partition("-")
    if not system.startswith("cu-") or not system[3:].isdigit() or int(system[3:]) < 1:
        raise SystemExit(f"--systems {system}: the NequIP families run on cu-<repeat> (e.g. cu-4: 256 atoms)")
    data = atomic_data([cu_cell(int(system[3:]))], ["Cu"], R_MAX)
    m = accelerate(copy.deepcopy(build(family, config, dtype)), backend="numba")
    m = m.eval() if kind == "md" else m.train()
    fn = md_step if kind == "md" else train_step
    return lambda: fn(m, data)


def _step(kind: str, model: str, system: str, dtype: str, folder: Path):
    """A zero-argument step of ``kind`` on ``system``: ``md`` through ``workbench md``'s ASE
    calculator (numba, its radial tables and linears), ``train`` the bench's train step."""
    import numpy as np

    if model.startswith(("nequip-", "allegro-")):
        return _nequip_step(kind, model, system, dtype)
    rng = np.random.default_rng(0)
    if kind == "md":
        from workbench.bench import cpu_md
        from workbench.bench.workloads import system_structures
        from workbench.train.heap import keep_freed_memory

        keep_freed_memory()  # as `workbench md` does (process-wide)

        (atoms,) = system_structures(system)
        calc = cpu_md._calculator("numba", cpu_md._model_file(model, system, atoms, dtype, folder), dtype, folder)[0]
        return lambda: cpu_md._call(calc, atoms, atoms.positions + rng.normal(0.0, 1e-3, atoms.positions.shape))
    from workbench.bench.cpu import _models, train_step
    from workbench.bench.workloads import system_batch

    batch, zs, info = system_batch(system, dtype, model=model)
    m = _models(model, zs, info, dtype)[("numba", "train")]
    return lambda: train_step(m, batch)


def _time(step, variable: str, values: list[str], repeats: int) -> dict[str, float]:
    from workbench.kernels.options import environment

    with environment({variable: values[0]}):  # the variable's own value comes back after
        return _interleaved(step, variable, values, repeats)


def _interleaved(step, variable: str, values: list[str], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {v: [] for v in values}
    for v in values:  # first calls compile
        os.environ[variable] = v
        step()
    for _ in range(repeats):
        for v in values:
            os.environ[variable] = v
            step()
            t0 = time.perf_counter()
            step()
            times[v].append(1e3 * (time.perf_counter() - t0))
    return {v: statistics.median(t) for v, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from workbench.bench.harness import set_threads

    set_threads(args.threads)
    values = args.values.split(",")
    rows = {}
    print(f"{args.kind} step, {args.model}, {args.dtype}, {args.threads} threads, {args.variable} = {values}")
    for system in args.systems.split(","):
        step = _step(args.kind, args.model, system, args.dtype, args.workdir)
        ms = _time(step, args.variable, values, args.repeats)
        rows[system] = {"median_ms": ms, "ratio": ms[values[0]] / ms[values[-1]]}
        cells = "  ".join(f"{v}: {t:8.1f} ms" for v, t in ms.items())
        print(f"{system:16s} {cells}  {values[0]} / {values[-1]} = {rows[system]['ratio']:.3f}")
    from workbench.bench.table import cpu_name, run_versions

    machine = {"cpu": cpu_name(), "threads": args.threads, "versions": run_versions()}
    result = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
