#!/usr/bin/env python
"""Benchmark: MACE's ``interactions[1]`` (channelwise tensor product + scatter, the message op).

Backends in one run: ``numba`` (workbench.kernels, fused gather + TP + scatter), ``e3nn``
(mace-torch's original), ``cueq`` (cuEquivariance through mace-torch's converter). The block's
inputs are captured from a real forward pass of each backend's model (a forward pre-hook on
``interactions[1]``) on periodic liquid-water boxes, so layouts are each backend's own. Passes:

* ``forward``
* ``forward_backward``: gradients to the block inputs (node features, spherical harmonics,
  radial features) and all block parameters
* ``double_backward``: the input gradients with ``create_graph``, then the gradient of their
  squared norm back to the parameters (what force training does)

CUDA events after warm-up, median of ``--repeats`` (>= 20 by default on GPU); peak memory over
the repeats (``torch.cuda.max_memory_allocated`` above the pre-pass baseline). The JSON records
every repeat, FLOPs and minimum bytes of the message op from the sparse descriptor, the radial
MLP's share, the device's copy bandwidth, and ratios to the DESIGN.md anchors.

Run on the GPU (needs mace-torch, numba-cuda, cuequivariance-torch)::

    python kernels/bench_channelwise_tp.py                 # paper config, 4 x 768-atom water boxes
    python kernels/bench_channelwise_tp.py --smoke         # tiny CPU end-to-end check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

import numpy as np
import torch
from bench_symmetric_contraction import _save, measured_bandwidth

import workbench  # noqa: F401  (env fix for e3nn before torch/e3nn imports)
from workbench.kernels.tools.bench import (
    add_common_arguments,
    backend_model,
    compare_with_e3nn,
    measure_pass,
    random_scaleshift_mace,
    run_versions,
)

PASSES = ("forward", "forward_backward", "double_backward")
#: DESIGN.md, H100, paper config, 3072 atoms, float32, interactions[1], ms (e3nn, cueq)
ANCHORS_MS = {"forward": (15.9, 5.0), "forward_backward": (55.7, 12.6), "double_backward": (181.0, 31.4)}


def water_batch(n_boxes: int, atoms_per_box: int, cutoff: float, seed: int = 0) -> tuple[dict, list[int]]:
    """``n_boxes`` periodic liquid-water boxes as one mace batch (mace's own graph builder)."""
    from mace.tools import torch_geometric

    from workbench.data.atomic_data import to_atomic_data, z_table_for
    from workbench.data.generators import build_liquid_water

    rng = np.random.default_rng(seed)
    boxes = [build_liquid_water(atoms_per_box, rng) for _ in range(n_boxes)]
    z_table = z_table_for(boxes)
    data = to_atomic_data(boxes, cutoff=cutoff, z_table=z_table)
    batch = torch_geometric.batch.Batch.from_data_list(data)
    return batch.to_dict(), [int(z) for z in z_table.zs]


def capture_block_inputs(model, batch: dict) -> dict:
    """The keyword arguments ``interactions[1]`` receives in a real forward pass."""
    captured = {}

    def hook(mod, args, kwargs):
        captured.update({k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()})

    h = model.interactions[1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model({k: v.clone() for k, v in batch.items()}, training=False, compute_force=False)
    finally:
        h.remove()
    return captured


def pass_fn(kind: str, block, kwargs: dict, params: list):
    """One pass over the block; gradients with autograd.grad (nothing accumulates)."""
    diff = [k for k in ("node_feats", "edge_attrs", "edge_feats") if torch.is_tensor(kwargs.get(k))]
    cot = {}

    def run(kw):
        out = block(**kw)
        outs = [o for o in out if torch.is_tensor(o)]
        if not cot:
            g = torch.Generator(device="cpu").manual_seed(1)
            for i, o in enumerate(outs):
                cot[i] = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
        return sum((o * cot[i]).sum() for i, o in enumerate(outs))

    def inputs():
        kw = dict(kwargs)
        for k in diff:
            kw[k] = kwargs[k].clone().requires_grad_(True)
        return kw

    def fwd():
        with torch.no_grad():
            return block(**kwargs)

    def fwd_bwd():
        kw = inputs()
        loss = run(kw)
        return torch.autograd.grad(loss, [kw[k] for k in diff] + params, allow_unused=True)

    def dbl():
        kw = inputs()
        loss = run(kw)
        gs = torch.autograd.grad(loss, [kw[k] for k in diff], create_graph=True, allow_unused=True)
        second = sum((g**2).sum() for g in gs if g is not None)
        return torch.autograd.grad(second, params, allow_unused=True)

    return {"forward": fwd, "forward_backward": fwd_bwd, "double_backward": dbl}[kind]


def descriptor_costs(block, num_nodes: int, num_edges: int, itemsize: int) -> dict:
    """Exact FLOPs (multiplies + adds of the sparse term lists) and minimum bytes of the fused
    message op per pass, plus the radial MLP (which produces the per-edge weights) for scale."""
    from workbench.kernels.mace.channelwise_tp import channelwise_tp_op

    tp = block.conv_tp
    op, st = channelwise_tp_op(tp)
    C = op.channels
    op.outputs[0]
    d1 = op.derivative((True, True, True))
    d2 = d1.derivative((True, True, True, True), (True, True, True))  # cotangents on grad_x, grad_Y, grad_W

    def flops(o):
        total = 0
        for p in o.outputs:
            rows = num_edges  # every polynomial is a sum over edges (node outputs: scattered)
            total += p.flops_per_channel() * rows * C
        return total

    x_b = num_nodes * tp.irreps_in1.dim
    y_b = num_edges * tp.irreps_in2.dim
    w_b = num_edges * tp.weight_numel
    o_b = num_nodes * tp.irreps_out.dim
    idx = num_edges * 2 * 8 / itemsize  # int64 sender / receiver, in elements
    f_fwd = flops(op)
    f_bwd = f_fwd + flops(d1)
    f_dbl = f_bwd + flops(d2)
    b_fwd = itemsize * (x_b + y_b + w_b + o_b + idx)
    b_bwd = b_fwd + itemsize * (x_b + y_b + w_b + o_b + idx + x_b + y_b + w_b)
    b_dbl = b_bwd + itemsize * (2 * (x_b + y_b + w_b + o_b + idx) + x_b + y_b + w_b + o_b)
    # radial MLP [E, num_bessel] -> hidden -> [E, weight_numel]: dense GEMMs
    mlp_flops = 0
    dims = [m.weight.shape for m in block.conv_tp_weights.modules() if hasattr(m, "weight") and m.weight.dim() == 2]
    for shp in dims:
        mlp_flops += 2 * num_edges * shp[0] * shp[1]
    return {
        "channels": C,
        "sparsity": {
            "dense": st.dense,
            "nonzero": st.nonzero,
            "terms": st.terms,
            "nonzero_fraction": st.nonzero_fraction,
            "per_instruction_l1_l2_l3_dense_nonzero": st.per_instruction,
        },
        "terms": {
            "forward": [c.num_terms for c in op.compiled],
            "backward": [c.num_terms for c in d1.compiled],
            "double_backward": [c.num_terms for c in d2.compiled],
        },
        "flops": {"forward": f_fwd, "forward_backward": f_bwd, "double_backward": f_dbl},
        "min_bytes": {"forward": b_fwd, "forward_backward": b_bwd, "double_backward": b_dbl},
        "radial_mlp": {"forward_flops": mlp_flops, "weights_bytes": itemsize * w_b, "layers": [list(s) for s in dims]},
    }


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=add_help
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--boxes", type=int, default=4)
    ap.add_argument("--atoms-per-box", type=int, default=768)
    ap.add_argument("--cutoff", type=float, default=4.5)
    add_common_arguments(ap, PASSES)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run (1 box of 24 atoms, 4x0e+4x1o, 2 repeats) to check the script end to end",
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default kernels/results/channelwise_tp_<device>_<time>.json)"
    )
    return ap


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        args = build_parser().parse_args(argv)
    if args.smoke:
        args.boxes, args.atoms_per_box, args.hidden, args.max_ell, args.correlation = 1, 24, "4x0e+4x1o", 2, 2
        args.warmup, args.repeats = 1, 2
    device = args.device
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    on_gpu = device.startswith("cuda")
    dev_name = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or platform.machine()
    batch, zs = water_batch(args.boxes, args.atoms_per_box, args.cutoff)
    N, E = int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1])
    results = {
        "label": ("GPU" if on_gpu else "CPU (not the GPU benchmark; correctness/smoke timing only)")
        + (" SMOKE" if args.smoke else ""),
        "device": device,
        "device_name": dev_name,
        "timestamp": stamp,
        "config": {
            k: getattr(args, k)
            for k in (
                "boxes",
                "atoms_per_box",
                "cutoff",
                "hidden",
                "max_ell",
                "correlation",
                "warmup",
                "repeats",
                "smoke",
            )
        },
        "graph": {"atoms": N, "edges": E, "edges_per_atom": E / max(N, 1)},
        "anchors_ms_float32": {k: {"e3nn": v[0], "cueq": v[1]} for k, v in ANCHORS_MS.items()},
        "versions": run_versions(),
        "measured_bandwidth_GBps": measured_bandwidth(device),
        "runs": [],
    }
    print(f"graph: {N} atoms, {E} edges ({E / max(N, 1):.1f} per atom), device {dev_name}", flush=True)
    out = (
        Path(args.out)
        if args.out
        else ROOT
        / "kernels"
        / "results"
        / (f"channelwise_tp_{'gpu' if on_gpu else 'cpu'}{'_smoke' if args.smoke else ''}_{stamp}.json")
    )
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        bdt = {
            k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
            for k, v in batch.items()
            if torch.is_tensor(v)
        }
        base = random_scaleshift_mace(args.hidden, args.max_ell, args.correlation, zs, E / max(N, 1), dtype, device)
        results.setdefault("descriptor", {})[dtype_name] = descriptor_costs(
            base.interactions[1], N, E, torch.finfo(dtype).bits // 8
        )
        snaps = {}  # (backend, pass) -> the pass's outputs, for parity against e3nn
        for backend in args.backends:
            try:
                model = backend_model(base, backend, ("interactions.",), results, dtype_name)
                kwargs = capture_block_inputs(model, bdt)
            except Exception as exc:
                results["runs"].append(
                    {"backend": backend, "dtype": dtype_name, "skipped": f"{type(exc).__name__}: {exc}"}
                )
                print(f"{dtype_name:8s} {backend:12s} skipped: {type(exc).__name__}: {exc}", flush=True)
                continue
            _time_passes(args, model.interactions[1], kwargs, backend, dtype_name, results, snaps, out)
        for (backend, kind), entry in compare_with_e3nn(snaps):
            print(
                f"{dtype_name:8s} {backend:12s} {kind:17s} max rel err vs e3nn {entry['parity_vs_e3nn']['max_rel_err']:.2e}, "
                f"bitwise repeatable {entry['bitwise_repeatable']}",
                flush=True,
            )
        _save(results, out)
    print_table(results)
    print(f"wrote {out}")
    return 0


def _time_passes(
    args, block, kwargs: dict, backend: str, dtype_name: str, results: dict, snaps: dict, out: Path
) -> None:
    """Every pass of ``block`` for one backend: a row each in ``results``, outputs in ``snaps``."""
    params = [p for p in block.parameters() if p.requires_grad]
    for kind in args.passes:
        entry = {
            "backend": backend,
            "dtype": dtype_name,
            "pass": kind,
            "fused": hasattr(block, "conv_fusion"),
            "block_class": type(block).__name__,
        }
        outputs = measure_pass(
            lambda: pass_fn(kind, block, kwargs, params), args.device, args.warmup, args.repeats, entry
        )
        if outputs is not None:
            snaps[(backend, kind)] = (entry, outputs)
            entry["message_op_min_bytes_GBps"] = (
                results["descriptor"][dtype_name]["min_bytes"][kind] / (entry["median_ms"] * 1e-3) / 1e9
            )
            if dtype_name == "float32":
                a_e3nn, a_cueq = ANCHORS_MS[kind]
                entry["ratio_to_anchor_e3nn"] = entry["median_ms"] / a_e3nn
                entry["ratio_to_anchor_cueq"] = entry["median_ms"] / a_cueq
        results["runs"].append(entry)
        _save(results, out)  # every row: a step stopped at its time limit keeps what it measured
        print(
            f"{dtype_name:8s} {backend:12s} {kind:17s} "
            + (
                f"{entry['median_ms']:10.3f} ms"
                + (f"  peak {entry['peak_mem_MB']:.0f} MB" if "peak_mem_MB" in entry else "")
                if "median_ms" in entry
                else entry.get("error", "")
            ),
            flush=True,
        )


def print_table(results: dict) -> None:
    """Median ms per (dtype, pass) and backend; numba's ratio to measured e3nn / cueq and to the anchors."""
    runs = [r for r in results["runs"] if "median_ms" in r]
    backends = sorted(
        {r["backend"] for r in runs},
        key=lambda b: ("numba", "e3nn", "cueq").index(b) if b in ("numba", "e3nn", "cueq") else 9,
    )
    print(
        f"\ninteractions[1], {results['graph']['atoms']} atoms, {results['graph']['edges']} edges, {results['device_name']}"
    )
    head = f"{'dtype':8s} {'pass':17s} " + " ".join(f"{b + ' ms':>11s}" for b in backends)
    head += f" {'numba/e3nn':>11s} {'numba/cueq':>11s} {'/anchor e3nn':>13s} {'/anchor cueq':>13s}"
    print(head)
    for dt in sorted({r["dtype"] for r in runs}):
        for kind in PASSES:
            row = {r["backend"]: r for r in runs if r["dtype"] == dt and r["pass"] == kind}
            if not row:
                continue
            line = f"{dt:8s} {kind:17s} " + " ".join(
                f"{row[b]['median_ms']:11.3f}" if b in row else f"{'-':>11s}" for b in backends
            )
            nb = row.get("numba")

            def ratio(b):
                return f"{nb['median_ms'] / row[b]['median_ms']:11.3f}" if nb and b in row else f"{'-':>11s}"

            line += f" {ratio('e3nn')} {ratio('cueq')}"
            if nb and dt == "float32":
                line += f" {nb['ratio_to_anchor_e3nn']:13.3f} {nb['ratio_to_anchor_cueq']:13.3f}"
            print(line)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sys.exit(main())
