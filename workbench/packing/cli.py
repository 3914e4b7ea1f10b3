"""``workbench pack``.

``workbench pack SIZES`` reads a dataset (``.extxyz[.gz]``, sizes computed with
``workbench.data.graph_sizes``) or a sizes file (``.npy``/``.npz``: a structured
array with fields ``atoms``/``edges``, a plain 1-D cost array, or an ``.npz``
with ``atoms`` and optional ``edges`` arrays), prints a packing summary and
writes the packing (``.npz``, see :meth:`workbench.packing.Packing.save`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from workbench.cli_args import add_command
from workbench.limits import DEFAULT_CAPACITY

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def _check_magic(path: Path, magic: bytes, kind: str) -> None:
    # np.load takes anything else for a pickle and suggests allow_pickle: never load one.
    with open(path, "rb") as fh:
        head = fh.read(len(magic))
    if head != magic:
        raise ValueError(f"{path}: not a numpy {kind} file (it does not start with the {kind} header)")


def _load_npz(path: Path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as z:
        keys = list(z.keys())
        if "sizes" in keys:
            return z["sizes"]
        if "atoms" in keys:
            columns = {f: z[f] for f in ("atoms", "edges") if f in keys}
            lengths = {f: c.shape for f, c in columns.items()}
            if any(len(shape) != 1 for shape in lengths.values()) or len({*lengths.values()}) > 1:
                raise ValueError(f"{path}: 'atoms' and 'edges' must be 1-D, one entry per graph; shapes {lengths}")
            arr = np.zeros(columns["atoms"].shape[0], dtype=[(f, c.dtype) for f, c in columns.items()])
            for f, column in columns.items():
                arr[f] = column
            return arr
        if keys == ["arr_0"]:  # one unnamed array (np.savez(path, costs)): a plain cost array
            return z["arr_0"]
    raise ValueError(f"{path}: missing key 'atoms' (or 'sizes'): the .npz holds {keys}")


def _check_numbers(path: Path, values: np.ndarray, field: str) -> None:
    """Sizes are finite numbers >= 0, one per graph; the error names the file, field and graph."""
    if values.ndim != 1:
        raise ValueError(f"{path}: {field} must hold one number per graph, not arrays of shape {values.shape[1:]}")
    if not (np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)):
        raise ValueError(f"{path}: {field} has dtype {values.dtype}; sizes must be integers or floats")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if len(bad):
        raise ValueError(f"{path}: graph {bad[0]} has {field} {values[bad[0]]}; sizes must be finite and >= 0")


def load_sizes(path: str | Path) -> np.ndarray:
    """Per-graph sizes as a structured array with ``atoms`` and (if known) ``edges``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset or sizes file")
    name = path.name.lower()
    if name.endswith(".npy"):
        _check_magic(path, _NPY_MAGIC, ".npy array")
        arr = _no_objects(path, lambda: np.load(path, allow_pickle=False))
    elif name.endswith(".npz"):
        _check_magic(path, _ZIP_MAGIC, ".npz archive")
        arr = _no_objects(path, lambda: _load_npz(path))
    elif ".extxyz" in name or ".xyz" in name:
        from workbench.data import graph_sizes, read_structures

        return graph_sizes(read_structures(path))
    else:
        raise ValueError(f"{path}: unknown format; use .extxyz[.gz], .npy or .npz")
    if arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D array of sizes, one entry per graph, got shape {arr.shape}")
    if arr.dtype.names is None:
        out = np.zeros(arr.shape[0], dtype=[("atoms", arr.dtype)])
        out["atoms"] = arr
        arr = out
    if "atoms" not in arr.dtype.names:
        raise KeyError(f"{path}: sizes array has no 'atoms' field (fields: {arr.dtype.names})")
    for field in ("atoms", "edges"):  # other fields (e.g. SIZES_DTYPE's family) are labels
        if field in arr.dtype.names:
            _check_numbers(path, arr[field], field)
    if arr.shape[0] == 0:
        raise ValueError(f"{path}: holds no graphs")
    return arr


def _no_objects(path: Path, load):
    """``load()``, with numpy's refusal of a pickled (object) array said in terms of the file."""
    try:
        return load()
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise
        raise ValueError(f"{path}: holds Python objects, which are never unpickled; save a numeric array") from None


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _cmd_pack(args: argparse.Namespace) -> int:
    """pack a dataset or sizes file into batches for R ranks"""
    from workbench.packing.api import ALGORITHMS, pack
    from workbench.packing.cost import CostModel

    options = {}
    if args.graphs_per_batch is not None:
        if not ALGORITHMS[args.algorithm].takes_graphs_per_batch:
            counted = ", ".join(a.name for a in ALGORITHMS.values() if a.takes_graphs_per_batch)
            raise ValueError(f"--graphs-per-batch: {args.algorithm} packs to capacity; it applies to {counted}")
        options["graphs_per_batch"] = args.graphs_per_batch
    sizes = load_sizes(args.sizes)
    names = sizes.dtype.names
    atoms = np.asarray(sizes["atoms"])
    edges = np.asarray(sizes["edges"]) if "edges" in names else None
    model = CostModel()
    if args.cost == "atoms":
        costs = atoms
    elif args.cost == "edges":
        if edges is None:
            raise KeyError("--cost edges needs an 'edges' column in the sizes")
        costs = edges
    else:
        costs = model.graph_costs(atoms, edges)
    p = pack(
        costs,
        args.capacity,
        args.replicas,
        algorithm=args.algorithm,
        seed=args.seed,
        epoch=args.epoch,
        atoms=atoms,
        edges=edges,
        cost_model=model,
        oversize=args.oversize,
        **options,
    )
    m = p.metrics(randomness=not args.no_randomness)
    if args.json:
        print(json.dumps(m, indent=1))
    else:
        width = max(len(k) for k in m)
        for k, v in m.items():
            print(f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    stem = Path(args.sizes).name.split(".")[0]
    out = Path(args.out) if args.out else Path("runs/pack") / f"{stem}.{args.algorithm}.r{args.replicas}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    p.save(out)
    print(f"wrote {out} ({p.n_bins} batches, {p.n_steps} steps x {p.num_replicas} ranks)")
    return 0


def register(subparsers) -> None:
    """Add ``workbench pack``."""
    from workbench.packing.api import ALGORITHMS

    options = {
        "sizes": {"help": "dataset (.extxyz[.gz]) or sizes file (.npy/.npz)"},
        "--capacity": {
            "type": float,
            "default": DEFAULT_CAPACITY,
            "help": "max cost per batch (default %(default)s; in seconds with --cost model)",
        },
        "--replicas": {"type": int, "default": 1, "help": "number of DDP ranks (default 1)"},
        "--algorithm": {
            "default": "paper",
            "choices": list(ALGORITHMS),
            "help": "; ".join(f"{a.name}: {a.description}" for a in ALGORITHMS.values()),
        },
        "--cost": {
            "default": "atoms",
            "choices": ("atoms", "edges", "model"),
            "help": "per-graph cost: atoms, edges, or the cost model's b*atoms + c*edges",
        },
        "--graphs-per-batch": {
            "type": int,
            "default": None,
            "help": "graphs per batch, for the algorithms that batch by count (default: theirs, 8)",
        },
        "--seed": {"type": int, "default": 0},
        "--epoch": {"type": _non_negative, "default": 0, "help": "epoch to pack (>= 0, default 0)"},
        "--oversize": {
            "default": "error",
            "choices": ("error", "alone"),
            "help": "graphs above capacity: error (default) or a batch of their own",
        },
        ("--out", "-o"): {
            "default": None,
            "help": "packing file to write (default runs/pack/<name>.<algorithm>.r<replicas>.npz)",
        },
        "--json": {"action": "store_true", "help": "print the summary as JSON"},
        "--no-randomness": {"action": "store_true", "help": "skip the epoch-to-epoch repeat metric"},
    }
    raw = argparse.RawDescriptionHelpFormatter  # the module docstring's layout, as written
    add_command(subparsers, "pack", options, _cmd_pack, description=__doc__, formatter_class=raw)
