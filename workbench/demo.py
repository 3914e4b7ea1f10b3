"""``workbench demo``: the main job on the embedded dataset.

1. load the embedded mixture (generating it if it is missing) and print the per-family summary;
2. pack it for 2 ranks with every registered algorithm and print the packing metrics (the
   count-based ones with as many atoms per batch on average as a full bin);
3. train a small MACE model for about a minute under ``torchrun`` (2 ranks, gloo on CPU);
4. write ``runs/demo/report.html`` (:mod:`workbench.viz.report`).
"""

from __future__ import annotations

import time

import numpy as np

from workbench.limits import DEFAULT_CAPACITY

DEMO_TRAIN = dict(
    name="demo",
    output_dir="runs",
    hidden_irreps="16x0e+16x1o",
    max_ell=1,
    correlation=2,
    num_bessel=6,
    radial_mlp=[32, 32],
    capacity=1024,
    max_structures=600,
    epochs=100,
    max_steps=60,
    checkpoint_every=20,
    lr=0.01,
    seed=0,
)


def run_demo(
    path: str | None = None,
    cutoff: float = 4.5,
    num_replicas: int = 2,
    capacity: int = DEFAULT_CAPACITY,
    train: bool = True,
    fresh: bool = False,
    overrides: dict | None = None,
) -> dict:
    from workbench.data.embedded import EMBEDDED_N, EMBEDDED_PATH, EMBEDDED_SEED, load_embedded
    from workbench.data.sizes import graph_sizes
    from workbench.data.summary import format_table, summarize

    target = path or EMBEDDED_PATH
    t0 = time.perf_counter()
    try:
        structures = load_embedded(target)
    except FileNotFoundError:
        from workbench.data.io import write_structures
        from workbench.data.synth.mixture import make_mixture

        print(f"{target} missing: generating make_mixture(n={EMBEDDED_N}, seed={EMBEDDED_SEED}) ...")
        structures = make_mixture(n=EMBEDDED_N, seed=EMBEDDED_SEED, progress=True)
        write_structures(target, structures)
    print(f"loaded {len(structures)} structures from {target} in {time.perf_counter() - t0:.1f} s\n")
    sizes = graph_sizes(structures, cutoff=cutoff)
    labelled = np.array([bool(a.info.get("labelled", True)) for a in structures])
    print(f"Embedded Table-3 mixture (edges at {cutoff} Å cutoff, periodic images included)")
    print(format_table(summarize(sizes, labelled)))
    result = {"n_structures": len(structures), "sizes": sizes}
    try:
        from workbench.packing.api import ALGORITHMS, pack
        from workbench.packing.grid import baseline_graphs_per_batch
    except ImportError:
        return result
    count = baseline_graphs_per_batch(sizes, capacity)
    print(f"\nPacking for {num_replicas} ranks, capacity {capacity} atoms ({count} graphs per batch when by count)")
    print(f"{'algorithm':<14} {'batches':>8} {'bins/LB':>8} {'padding':>8} {'imb max':>8} {'imb mean':>9}")
    for algo, spec in ALGORITHMS.items():
        options = {"graphs_per_batch": count} if spec.takes_graphs_per_batch else {}
        p = pack(sizes, capacity=capacity, num_replicas=num_replicas, algorithm=algo, seed=0, **options)
        m = p.metrics()
        print(
            f"{algo:<14} {m['n_bins']:>8} {m['n_bins'] / m['lower_bound_bins']:>8.3f} {m['padding_fraction']:>8.1%} "
            f"{m['step_imbalance_max']:>8.2f} {m['step_imbalance_mean']:>9.3f}"
        )
        result[algo] = m
        if algo == "paper":
            result["packing"] = p
    if train:
        result["run_dir"] = _train_and_report(path, num_replicas, fresh, overrides)
    return result


def _train_and_report(path: str | None, num_replicas: int, fresh: bool = False, overrides: dict | None = None) -> str:
    """Train the demo run (``overrides``: other TrainConfig fields, for tests) and write its report.
    A finished demo with the same settings is not trained again unless ``fresh``; a fresh start moves
    an earlier run's records aside (``superseded/``), so logs and report never mix two runs."""
    import os
    import subprocess

    from workbench.launch.local import train_cli_command
    from workbench.train import TrainConfig
    from workbench.train.rundir import RunDir
    from workbench.viz.report import write_report

    cfg = TrainConfig(dataset=path, **{**DEMO_TRAIN, **(overrides or {})})
    run = RunDir(cfg.run_dir)
    if not fresh and _finished(run, cfg):
        report = run.report if run.report.exists() else write_report(run.path)
        print(f"\ndemo: already trained, in {run.path} (report {report}); 'workbench demo --fresh' trains it again")
        return str(run.path)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = cfg.run_dir / "demo.yaml"
    cfg.to_yaml(cfg_path)
    print(
        f"\nTraining {cfg.hidden_irreps} MACE (max_ell {cfg.max_ell}, correlation {cfg.correlation}) "
        f"for {cfg.max_steps} steps on {num_replicas} ranks with torchrun (gloo, CPU) ...",
        flush=True,
    )
    t0 = time.perf_counter()
    cmd = [*train_cli_command(cfg_path, num_replicas), "--fresh"]
    subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    _summary(run, num_replicas, time.perf_counter() - t0)
    report = write_report(cfg.run_dir)
    print(f"report: {report}")
    return str(cfg.run_dir)


def _finished(run, cfg) -> bool:
    """True when ``run`` reached its end with the settings ``cfg`` (its ``finished.json`` and config)."""
    from workbench.train import TrainConfig

    if not (run.finished.exists() and run.config.exists()):
        return False
    try:
        return TrainConfig.from_yaml(run.config) == cfg
    except (OSError, ValueError):
        return False


def _summary(run, num_replicas: int, seconds: float) -> None:
    from workbench.train.rundir import read_epochs, read_steps

    steps, epochs = read_steps(run.path), read_epochs(run.path)
    if not steps or not epochs:
        raise RuntimeError(f"{run.path}: the demo run logged no steps; see the output above")
    first = np.mean([s["loss"] for s in steps[: 2 * num_replicas * 5]])
    last = np.mean([s["loss"] for s in steps[-2 * num_replicas * 5 :]])
    print(
        f"trained {len(steps) // num_replicas} steps in {seconds:.0f} s; loss {first:.3g} -> {last:.3g}; "
        f"validation force MAE {epochs[-1]['valid_f_mae_mev_a']:.0f} meV/Å"
    )


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job on the embedded dataset")
    p.add_argument("--path", help="structure file (default: the embedded dataset)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY)
    p.add_argument("--no-train", action="store_true", help="stop after the packing comparison")
    p.add_argument("--fresh", action="store_true", help="train again even when a finished demo run is there")
    p.set_defaults(func=_main)


def _main(a) -> int:
    run_demo(a.path, num_replicas=a.replicas, capacity=a.capacity, train=not a.no_train, fresh=a.fresh)
    return 0
