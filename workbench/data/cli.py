"""``workbench data make|info|stats|sizes``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from workbench.cli_args import option_values


def _families(text: str | None):
    if not text:
        return None
    if "=" not in text:
        return [t.strip() for t in text.split(",") if t.strip()]
    counts = {}  # mptrj=100,cuni=5
    for item in text.split(","):
        name, _, count = item.partition("=")
        if not count.strip().isdigit():
            raise ValueError(f"--families: {item!r} is not NAME=COUNT with a whole count (e.g. mptrj=100,cuni=5)")
        counts[name.strip()] = int(count)
    return counts


def _make(args: argparse.Namespace) -> int:
    from workbench.data.io import write_structures
    from workbench.data.mixture import make_mixture
    from workbench.data.sizes import graph_sizes
    from workbench.data.summary import format_table, summarize

    families = _families(args.families)
    total = sum(families.values()) if isinstance(families, dict) else args.n
    if total < 1:  # refused before anything is generated or written
        raise ValueError(f"--n: must be >= 1 structure, got {total}" + (" (the --families counts)" if families else ""))
    t0 = time.perf_counter()
    structures = make_mixture(
        n=args.n,
        seed=args.seed,
        families=families,
        progress=True,
        **({"workers": args.workers} if args.workers else {}),
    )
    gen_s = time.perf_counter() - t0
    path = write_structures(args.out, structures)
    sizes = graph_sizes(structures, cutoff=args.cutoff)
    labelled = np.array([bool(a.info.get("labelled", True)) for a in structures])
    print(format_table(summarize(sizes, labelled)))
    print(
        f"\nwrote {len(structures)} structures to {path} ({path.stat().st_size / 1e6:.2f} MB) "
        f"in {gen_s:.1f} s of generation"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from workbench.data.embedded import ENERGY_RTOL, FORCE_ATOL, GEOMETRY_ATOL, check_regeneration
    from workbench.data.source import data_source

    if data_source(args.path or None).kind == "prepared":
        return _verify_store(args.path)

    skip = tuple(s for s in (args.skip or "").split(",") if s)
    n, problems = check_regeneration(args.path, per_family=args.per_family, skip=skip)
    for line in problems:
        print(line)
    verdict = "differ" if problems else "regenerate"
    print(
        f"{n} frames checked: {len(problems)} difference(s); frames {verdict} within geometry {GEOMETRY_ATOL:g} Å, "
        f"energy {ENERGY_RTOL:g} relative, forces {FORCE_ATOL:g} eV/Å"
    )
    return 1 if problems else 0


def _verify_store(path: str) -> int:
    from workbench.data.store import SHARDS, GraphStore, repair_hint, verify_shards

    store = GraphStore(path)  # sizes, counts and the index; the digests below read every shard
    problems = verify_shards(store)
    for name, why in problems:
        print(f"{store.path / SHARDS / name}: {why}")
    if problems:
        print(f"{len(problems)} of {len(store.shards)} shards damaged: delete them, then {repair_hint(store.path)}")
        return 1
    print(f"{store.path}: {len(store.shards)} shards, {len(store)} graphs: every digest matches")
    return 0


def _load_sizes(path: str | None, cutoff: float):
    from workbench.data.io import read_structures
    from workbench.data.sizes import graph_sizes
    from workbench.data.source import data_source

    source = data_source(path or None)
    path = source.path
    if source.kind == "prepared":  # everything is in its index
        from workbench.data.store import GraphStore

        store = GraphStore(path)
        if abs(store.cutoff - cutoff) > 1e-12:
            raise ValueError(
                f"{path}: prepared at cutoff {store.cutoff} Å; pass --cutoff {store.cutoff} "
                "(or prepare again at the cutoff you want)"
            )
        return path, store.sizes(), np.asarray(store.column("labelled"))
    structures = read_structures(path, require_labels=False)
    sizes = graph_sizes(structures, cutoff=cutoff, progress=True)
    labelled = np.array([bool(a.info.get("labelled", True)) for a in structures])
    return path, sizes, labelled


def _info(args: argparse.Namespace) -> int:
    from workbench.data.summary import format_table, summarize

    path, sizes, labelled = _load_sizes(args.path, args.cutoff)
    print(f"{path}  (cutoff {args.cutoff} Å)")
    print(format_table(summarize(sizes, labelled)))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from workbench.data.sizes import edge_stats_from_sizes

    path, sizes, _ = _load_sizes(args.path, args.cutoff)
    stats = edge_stats_from_sizes(sizes, args.cutoff, source=Path(path).name)
    out = Path(args.out) if args.out else Path(__file__).with_name("edge_stats.json")
    out.write_text(json.dumps(stats, indent=1) + "\n")
    for name, s in stats["families"].items():
        print(
            f"{name:<15} {s['n_graphs']:>6} graphs  edges/atom mean {s['edges_per_atom_mean']:6.1f} "
            f"[{s['edges_per_atom_min']:.1f}, {s['edges_per_atom_max']:.1f}]"
        )
    print(f"wrote {out}")
    return 0


def _sizes(args: argparse.Namespace) -> int:
    from workbench.data.sizes import synthetic_sizes

    t0 = time.perf_counter()
    if args.synthetic:
        sizes = synthetic_sizes(args.synthetic, seed=args.seed)
    else:
        _, sizes, _ = _load_sizes(args.path, args.cutoff)
    np.save(args.out, sizes)
    print(f"wrote {sizes.size} sizes to {args.out} in {time.perf_counter() - t0:.2f} s")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from workbench.data.prepare import prepare
    from workbench.data.summary import format_table

    t0 = time.perf_counter()
    store = prepare(
        args.sources,
        args.out,
        **option_values(args, "cutoff", "workers", "energy_key", "forces_key", "on_error", "shard_size"),
    )
    seconds = time.perf_counter() - t0
    print(format_table(store.summary()))
    m = store.manifest
    atoms = int(store.column("atoms").sum())
    print(
        f"\n{store.path}: {len(store)} graphs ({atoms} atoms) in {len(store.shards)} shards, cutoff {store.cutoff} Å; "
        f"prepared in {m['seconds']:.1f} s ({len(store) / max(m['seconds'], 1e-9):.0f} graphs/s)"
        + ("" if seconds > 0.5 * m["seconds"] else "; already prepared, nothing to do")
    )
    if m["n_skipped"]:
        print(f"{m['n_skipped']} frame(s) skipped, each with its reason, in {store.path / 'skipped.jsonl'}")
    print(f"train on it with: workbench train --set dataset={store.path}")
    return 0


def _add_make(dsub) -> None:
    from workbench.data.embedded import EMBEDDED_N, EMBEDDED_PATH, EMBEDDED_SEED

    m = dsub.add_parser("make", help="generate the labelled Table-3 mixture and write extxyz(.gz)")
    m.add_argument("--n", type=int, default=EMBEDDED_N, help="number of structures (default: %(default)s)")
    m.add_argument("--seed", type=int, default=EMBEDDED_SEED)
    m.add_argument(
        "--families", help="comma list (mptrj,cuni) or counts (mptrj=100,cuni=5); default all, Table-3 shares"
    )
    m.add_argument("--out", default=str(EMBEDDED_PATH), help="output file (default: %(default)s)")
    m.add_argument("--workers", type=int, default=0, help="processes for labelling (default: all cores)")
    m.add_argument("--cutoff", type=float, default=4.5)
    m.set_defaults(func=_make)


def _add_verify(dsub) -> None:
    v = dsub.add_parser(
        "verify", help="rebuild frames of a mixture file from their seeds and compare (tolerances in the dataset card)"
    )
    v.add_argument(
        "path",
        nargs="?",
        help="mixture file (default: the embedded dataset), or a prepared dataset directory: recompute every "
        "shard's digest",
    )
    v.add_argument("--per-family", type=int, default=2, help="frames per family to rebuild (default: %(default)s)")
    v.add_argument(
        "--skip", default="al_hcl", help="comma list of families to skip (default: %(default)s, ~2 min of xTB)"
    )
    v.set_defaults(func=_verify)


def _add_info_stats(dsub) -> None:
    for name, fn, text in (
        ("info", _info, "per-family summary of a structure file"),
        ("stats", _stats, "measure edges per atom per family (feeds synthetic_sizes)"),
    ):
        q = dsub.add_parser(name, help=text)
        q.add_argument(
            "path", nargs="?", help="structure file or prepared dataset directory (default: the embedded dataset)"
        )
        q.add_argument("--cutoff", type=float, default=4.5)
        if name == "stats":
            q.add_argument("--out", help="JSON path (default: workbench/data/edge_stats.json)")
        q.set_defaults(func=fn)


def _add_prepare(dsub) -> None:
    from workbench.data.io import ENERGY_KEY, FORCES_KEY
    from workbench.data.prepare import DEFAULT_SHARD_SIZE, ON_ERROR

    pr = dsub.add_parser(
        "prepare",
        help="extxyz(.gz) files or mace HDF5 shards -> a sharded dataset that trains "
        "at any scale (index + streamed graphs)",
    )
    pr.add_argument(
        "sources",
        nargs="+",
        metavar="SRC",
        help="extxyz files (.gz too), or a folder of mace preprocess_data .h5 shards",
    )
    pr.add_argument("--out", required=True, metavar="DIR", help="output directory (the same command resumes it)")
    pr.add_argument(
        "--cutoff", type=float, default=4.5, help="neighbour cutoff in Å for edge counts (default: %(default)s)"
    )
    pr.add_argument("--workers", type=int, default=0, help="parsing processes (default: all cores)")
    pr.add_argument("--energy-key", default=ENERGY_KEY, help="extxyz info key of the energy (default: %(default)s)")
    pr.add_argument("--forces-key", default=FORCES_KEY, help="extxyz per-atom key of the forces (default: %(default)s)")
    pr.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="fail",
        help="a bad frame stops the prepare (fail), or is left out and listed in DIR/skipped.jsonl (skip)",
    )
    pr.add_argument(
        "--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="graphs per shard (default: %(default)s)"
    )
    pr.set_defaults(func=_prepare)


def _add_sizes(dsub) -> None:
    s = dsub.add_parser("sizes", help="write a sizes .npy (atoms, edges, family) from a file or synthetic")
    s.add_argument("path", nargs="?")
    s.add_argument("--synthetic", type=int, default=0, help="draw this many synthetic sizes instead")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--cutoff", type=float, default=4.5)
    s.add_argument("--out", required=True)
    s.set_defaults(func=_sizes)


def register(sub) -> None:
    """``workbench data ACTION``: make, verify, info, stats, prepare, sizes (in this order in ``--help``)."""
    p = sub.add_parser("data", help="generate, inspect and measure structure datasets")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    for add in (_add_make, _add_verify, _add_info_stats, _add_prepare, _add_sizes):
        add(dsub)
