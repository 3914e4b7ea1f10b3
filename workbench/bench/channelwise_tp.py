"""``workbench bench channelwise-tp``: MACE's ``interactions[1]`` (channelwise tensor product +
scatter, the message op), every backend in one run.

Backends: ``numba`` (workbench.kernels, fused gather + TP + scatter), ``e3nn`` (mace-torch's
original), ``cueq`` (cuEquivariance through mace-torch's converter); see
:mod:`workbench.bench.harness` for the others. The block's inputs are captured from a real
forward pass of each backend's model (a forward pre-hook on ``interactions[1]``) on periodic
liquid-water boxes, so layouts are each backend's own. Passes:

* ``forward``
* ``forward_backward``: gradients to the block inputs (node features, spherical harmonics,
  radial features) and all block parameters
* ``double_backward``: the input gradients with ``create_graph``, then the gradient of their
  squared norm back to the parameters (what force training does)

CUDA events after warm-up, median of ``--repeats``; peak memory over the repeats
(``torch.cuda.max_memory_allocated`` above the pre-pass baseline). The JSON records every repeat,
FLOPs and minimum bytes of the message op from the sparse descriptor, the radial MLP's share, the
device's copy bandwidth, and ratios to the reference timings :data:`ANCHORS_MS`.

.. code-block:: text

    workbench bench channelwise-tp                 # paper config, 4 x 768-atom water boxes, on the GPU
    workbench bench channelwise-tp --smoke         # tiny CPU end-to-end check
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from workbench.bench import harness
from workbench.bench.harness import backend_model, compare_with_e3nn, kernel_run_header, measure_pass, pass_line
from workbench.bench.table import RESULTS_DIR, Column, render, write_json
from workbench.kernels.registry import DEFAULT_BACKEND, contenders
from workbench.kernels.tools.models import random_scaleshift_mace

__all__ = ["ANCHORS_MS", "capture_block_inputs", "descriptor_costs", "format_table", "main", "pass_fn", "water_batch"]

PASSES = ("forward", "forward_backward", "double_backward")
#: interactions[1] in ms, (e3nn, cueq): the reference timings the project was set against (one H100,
#: paper config 128x0e+128x1o / max_ell 3 / correlation 3, 3072 atoms at ~48 edges per atom, float32)
ANCHORS_MS = {"forward": (15.9, 5.0), "forward_backward": (55.7, 12.6), "double_backward": (181.0, 31.4)}
#: the options of ``--smoke``: one 24-atom box, a small model, 2 repeats
SMOKE = {
    "boxes": 1,
    "atoms_per_box": 24,
    "hidden": "4x0e+4x1o",
    "max_ell": 2,
    "correlation": 2,
    "warmup": 1,
    "repeats": 2,
}
CONFIG_KEYS = ("boxes", "atoms_per_box", "cutoff", "hidden", "max_ell", "correlation", "warmup", "repeats", "smoke")


def water_batch(n_boxes: int, atoms_per_box: int, cutoff: float, seed: int = 0) -> tuple[dict, list[int]]:
    """``n_boxes`` periodic liquid-water boxes as one mace batch (mace's own graph builder)."""
    from mace.tools import torch_geometric

    from workbench.data.atomic_data import to_atomic_data, z_table_for
    from workbench.data.synth.generators import build_liquid_water

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
    from workbench.kernels.e3nn.tp import channelwise_tp_op

    tp = block.conv_tp
    op, st = channelwise_tp_op(tp)
    C = op.channels
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
        **harness.pass_costs((op, d1, d2), (f_fwd, f_bwd, f_dbl), (b_fwd, b_bwd, b_dbl)),
        "radial_mlp": {"forward_flops": mlp_flops, "weights_bytes": itemsize * w_b, "layers": [list(s) for s in dims]},
    }


def _header(args: argparse.Namespace, device: str, n_atoms: int, n_edges: int) -> dict:
    """The result's record of the run: device, configuration, graph, anchors, versions."""
    results = kernel_run_header(device, {k: getattr(args, k) for k in CONFIG_KEYS}, smoke=args.smoke)
    results["graph"] = {"atoms": n_atoms, "edges": n_edges, "edges_per_atom": n_edges / max(n_atoms, 1)}
    results["anchors_ms_float32"] = {k: {"e3nn": v[0], "cueq": v[1]} for k, v in ANCHORS_MS.items()}
    return results


def main(args: argparse.Namespace) -> int:
    """Run the benchmark with the options of ``workbench bench channelwise-tp``; JSON to ``--out``."""
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    device = args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch, zs = water_batch(args.boxes, args.atoms_per_box, args.cutoff)
    N, E = int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1])
    results = _header(args, device, N, E)
    print(f"graph: {N} atoms, {E} edges ({E / max(N, 1):.1f} per atom), device {results['device_name']}", flush=True)
    where = ("gpu" if device.startswith("cuda") else "cpu") + ("_smoke" if args.smoke else "")
    out = Path(args.out) if args.out else RESULTS_DIR / f"channelwise_tp_{where}_{results['timestamp']}.json"
    for dtype_name in args.dtypes:
        _run_dtype(args, dtype_name, batch, zs, results, out)
        write_json(out, results)
    print(format_table(results))
    print(f"wrote {out}")
    return 0


def _run_dtype(args, dtype_name: str, batch: dict, zs: list[int], results: dict, out: Path) -> None:
    """Every backend and pass in one dtype, then each backend's parity against e3nn."""
    dtype, device = getattr(torch, dtype_name), args.device
    graph = results["graph"]
    bdt = {
        k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
        for k, v in batch.items()
        if torch.is_tensor(v)
    }
    base = random_scaleshift_mace(
        args.hidden, args.max_ell, args.correlation, zs, graph["edges_per_atom"], dtype, device
    )
    results.setdefault("descriptor", {})[dtype_name] = descriptor_costs(
        base.interactions[1], graph["atoms"], graph["edges"], torch.finfo(dtype).bits // 8
    )
    snaps = {}  # (backend, pass) -> the pass's outputs, for parity against e3nn
    for backend in args.backends:
        try:
            model = backend_model(base, backend, ("interactions.",), results, dtype_name)
            kwargs = capture_block_inputs(model, bdt)
        except Exception as exc:
            results["runs"].append({"backend": backend, "dtype": dtype_name, "skipped": f"{type(exc).__name__}: {exc}"})
            print(f"{dtype_name:8s} {backend:12s} skipped: {type(exc).__name__}: {exc}", flush=True)
            continue
        _time_passes(args, model.interactions[1], kwargs, backend, dtype_name, results, snaps, out)
    for (backend, kind), entry in compare_with_e3nn(snaps):
        print(
            f"{dtype_name:8s} {backend:12s} {kind:17s} max rel err vs e3nn {entry['parity_vs_e3nn']['max_rel_err']:.2e}, "
            f"bitwise repeatable {entry['bitwise_repeatable']}",
            flush=True,
        )


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
            lambda kind=kind: pass_fn(kind, block, kwargs, params), args.device, args.warmup, args.repeats, entry
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
        write_json(out, results)  # every row: a step stopped at its time limit keeps what it measured
        print(pass_line(f"{dtype_name:8s} {backend:12s} {kind:17s}", entry, width=10), flush=True)


def format_table(results: dict) -> str:
    """Median ms per (dtype, pass) and backend; ours over each other measured backend and over the anchors."""
    runs = [r for r in results["runs"] if "median_ms" in r]
    order = contenders()
    backends = sorted({r["backend"] for r in runs}, key=lambda b: order.index(b) if b in order else len(order))
    rows = []
    for dt in sorted({r["dtype"] for r in runs}):
        for kind in PASSES:
            by = {r["backend"]: r for r in runs if r["dtype"] == dt and r["pass"] == kind}
            if by:
                rows.append({"dtype": dt, "pass": kind, "by": by, "ours": by.get(DEFAULT_BACKEND)})

    def ms(b):
        return lambda r: r["by"][b]["median_ms"] if b in r["by"] else None

    def ratio(b):
        return lambda r: r["ours"]["median_ms"] / r["by"][b]["median_ms"] if r["ours"] and b in r["by"] else None

    def anchor(b):
        return lambda r: r["ours"][f"ratio_to_anchor_{b}"] if r["ours"] and r["dtype"] == "float32" else ""

    columns = [
        Column("dtype", "dtype", width=8, align="<"),
        Column("pass", "pass", width=17, align="<"),
        *(Column(f"{b} ms", ms(b), ".3f", 11) for b in backends),
        *(Column(f"{DEFAULT_BACKEND}/{b}", ratio(b), ".3f", 11) for b in backends if b != DEFAULT_BACKEND),
        Column("/anchor e3nn", anchor("e3nn"), ".3f", 13),
        Column("/anchor cueq", anchor("cueq"), ".3f", 13),
    ]
    g = results["graph"]
    title = f"\ninteractions[1], {g['atoms']} atoms, {g['edges']} edges, {results['device_name']}"
    return render(rows, columns, title=title, rule=False)
