"""``workbench data make|verify|info|stats|prepare|convert|sizes``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from workbench.cli_args import option_values
from workbench.data.keys import ENERGY_KEY, FORCES_KEY, STRESS_KEY, VIRIALS_KEY, LabelKeys


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
    from workbench.data.sizes import graph_sizes
    from workbench.data.summary import format_table, summarize
    from workbench.data.synth.mixture import make_mixture

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
    from workbench.data.embedded import ENERGY_RTOL, FORCE_ATOL, GEOMETRY_ATOL, STRESS_ATOL, check_regeneration
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
        f"energy {ENERGY_RTOL:g} relative, forces {FORCE_ATOL:g} eV/Å, stress {STRESS_ATOL:g} eV/Å³"
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


def _load_sizes(path: str | None, cutoff: float, stress_key: str = STRESS_KEY):
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
        return path, store.sizes(), np.asarray(store.column("labelled")), np.asarray(store.column("stress"))
    structures = read_structures(path, require_labels=False, stress_key=stress_key)
    sizes = graph_sizes(structures, cutoff=cutoff, progress=True)
    labelled = np.array([bool(a.info.get("labelled", True)) for a in structures])
    stress = np.array([stress_key in a.info for a in structures])
    return path, sizes, labelled, stress


def _info(args: argparse.Namespace) -> int:
    from workbench.data.summary import format_table, summarize

    path, sizes, labelled, stress = _load_sizes(args.path, args.cutoff, args.stress_key)
    print(f"{path}  (cutoff {args.cutoff} Å)")
    print(format_table(summarize(sizes, labelled, stress)))
    if not stress.any():
        print(f"no graph has a stress label ({args.stress_key!r}): stress_weight must stay 0 when training on it")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from workbench.data.sizes import edge_stats_from_sizes

    path, sizes, _, _ = _load_sizes(args.path, args.cutoff)
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
        _, sizes, _, _ = _load_sizes(args.path, args.cutoff)
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
        **option_values(
            args, "cutoff", "workers", "energy_key", "forces_key", "stress_key", "virials_key", "on_error", "shard_size"
        ),
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
    if not store.has_stress:
        print(f"no graph has a stress label (--stress-key {store.manifest['settings'].get('stress_key')})")
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
        if name == "info":
            q.add_argument("--stress-key", default=STRESS_KEY, help="info key of the stress (default: %(default)s)")
        if name == "stats":
            q.add_argument("--out", help="JSON path (default: workbench/data/edge_stats.json)")
        q.set_defaults(func=fn)


def _add_label_keys(p) -> None:
    """The four label keys: where each format's reader puts, and the checks look for, the labels."""
    for name, default, what in (
        ("energy", ENERGY_KEY, "info key of the energy"),
        ("forces", FORCES_KEY, "per-atom key of the forces"),
        ("stress", STRESS_KEY, "info key of the stress (3x3, Voigt 6 or 9; optional per graph)"),
        ("virials", VIRIALS_KEY, "info key of the virials (optional per graph)"),
    ):
        p.add_argument(f"--{name}-key", default=default, help=f"{what} (default: %(default)s)")


def _sources_help() -> str:
    from workbench.data.formats import FORMATS

    return "files or folders: " + "; ".join(f.summary for f in FORMATS.values() if f.preparable)


def _add_prepare(dsub) -> None:
    from workbench.data.prepare import DEFAULT_SHARD_SIZE, ON_ERROR

    pr = dsub.add_parser(
        "prepare",
        help="structure files (extxyz, mace HDF5, ASE db, aselmdb, mace LMDB) -> a sharded dataset that trains "
        "at any scale (index + streamed graphs)",
    )
    pr.add_argument("sources", nargs="+", metavar="SRC", help=_sources_help())
    pr.add_argument("--out", required=True, metavar="DIR", help="output directory (the same command resumes it)")
    pr.add_argument(
        "--cutoff", type=float, default=4.5, help="neighbour cutoff in Å for edge counts (default: %(default)s)"
    )
    pr.add_argument("--workers", type=int, default=0, help="parsing processes (default: all cores)")
    _add_label_keys(pr)
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


def _convert(args: argparse.Namespace) -> int:
    from workbench.data.io import read_structures, write_structures

    keys = option_values(args, "energy_key", "forces_key", "stress_key", "virials_key")
    structures = read_structures(args.source, format=args.source_format, require_labels=False, **keys)
    out = write_structures(args.out, structures, format=args.format, keys=LabelKeys(*keys.values()))
    print(f"wrote {len(structures)} structures from {args.source} to {out}")
    return 0


def _add_convert(dsub) -> None:
    from workbench.data.formats import FORMATS

    c = dsub.add_parser("convert", help="structures from one format into another (extxyz, ASE db, aselmdb, mace LMDB)")
    c.add_argument("source", help="a structure file or folder, in any format workbench reads")
    c.add_argument(
        "--out", required=True, help="a new file or folder; its name gives the format (.db, .aselmdb, *_lmdb)"
    )
    writable = [n for n in FORMATS if n not in ("ase", "mace-h5")]
    c.add_argument("--format", choices=writable, help="the output format, when the name does not say it")
    c.add_argument("--source-format", choices=list(FORMATS), help="the input format, when its name does not say it")
    _add_label_keys(c)
    c.set_defaults(func=_convert)


def _add_sizes(dsub) -> None:
    s = dsub.add_parser("sizes", help="write a sizes .npy (atoms, edges, family) from a file or synthetic")
    s.add_argument("path", nargs="?")
    s.add_argument("--synthetic", type=int, default=0, help="draw this many synthetic sizes instead")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--cutoff", type=float, default=4.5)
    s.add_argument("--out", required=True)
    s.set_defaults(func=_sizes)


def register(sub) -> None:
    """``workbench data ACTION``: make, verify, info, stats, prepare, convert, sizes (in this order in ``--help``)."""
    p = sub.add_parser("data", help="generate, inspect and measure structure datasets")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
    for add in (_add_make, _add_verify, _add_info_stats, _add_prepare, _add_convert, _add_sizes):
        add(dsub)
