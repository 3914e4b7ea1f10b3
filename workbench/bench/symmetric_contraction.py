"""``workbench bench symmetric-contraction``: MACE's symmetric contraction and the whole
``products[0]`` block, every backend in one run.

Backends: ``numba`` (workbench.kernels), ``e3nn`` (mace-torch's original), ``cueq``
(cuEquivariance via mace-torch's converter); see :mod:`workbench.bench.harness` for the others.
Passes:

* ``forward``
* ``forward_backward``: forward, then gradients to the input features and all weights
* ``double_backward``: forward, input-gradient with ``create_graph``, then the gradient of
  ``sum(grad_x ** 2)`` back to the weights (what force training does)

On CUDA each repeat is timed with CUDA events (after warm-up), on CPU with ``perf_counter``;
the JSON records the median, min and all repeats, plus FLOPs and minimum bytes from the
sparse descriptor and the device's measured copy bandwidth for a roofline. Every backend's
outputs are compared with e3nn's (``parity_vs_e3nn``) and each pass is run twice more for
``bitwise_repeatable``.

.. code-block:: text

    workbench bench symmetric-contraction                 # paper config, 3072 atoms, on the GPU
    workbench bench symmetric-contraction --device cpu --atoms 64 --repeats 5   # CPU smoke run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from workbench.bench import harness
from workbench.bench.harness import backend_model, compare_with_e3nn, kernel_run_header, measure_pass, pass_line
from workbench.bench.table import RESULTS_DIR, write_json
from workbench.kernels.tools.models import random_scaleshift_mace

__all__ = ["descriptor_costs", "main", "pass_fn"]


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    """The same random cotangent for every backend (parity compares their gradients)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)


def pass_fn(kind: str, call, x, params):
    """A closure running one pass; gradients via autograd.grad (no accumulation between repeats)."""
    g = None

    def fwd():
        with torch.no_grad():
            return call(x)

    def fwd_bwd():
        nonlocal g
        out = call(x)
        if g is None:
            g = _cotangent(out)
        return torch.autograd.grad(out, [x] + params, g, allow_unused=True)

    def dbl():
        nonlocal g
        out = call(x)
        if g is None:
            g = _cotangent(out)
        (gx,) = torch.autograd.grad(out, [x], g, create_graph=True)
        return torch.autograd.grad((gx**2).sum(), params, allow_unused=True)

    return {"forward": fwd, "forward_backward": fwd_bwd, "double_backward": dbl}[kind]


def descriptor_costs(block_sc, atoms: int, itemsize: int) -> dict:
    """FLOPs (multiplies + adds of the sparse term lists) and minimum bytes per pass."""
    from workbench.kernels import SymmetricContraction

    sc = block_sc if isinstance(block_sc, SymmetricContraction) else SymmetricContraction.from_mace(block_sc)
    op = sc.op
    C = sc.num_channels
    st = sc.stats()
    poly = op.outputs[0]
    x_n = poly.operands[0].size * C
    w_n = poly.operands[1].size * C
    out_n = poly.output.size * C
    Z = sc.contractions[0].weights_max.shape[0]
    d1 = op.derivative((True, True))
    d2 = d1.derivative((True, True, False), (True, False))  # loss on grad_x only
    f_fwd = sum(p.flops_per_channel() for p in op.outputs) * atoms * C
    f_bwd = f_fwd + sum(p.flops_per_channel() for p in d1.outputs) * atoms * C
    f_dbl = f_bwd + sum(p.flops_per_channel() for p in d2.outputs) * atoms * C
    b_fwd = itemsize * (atoms * (x_n + out_n) + Z * w_n)
    b_bwd = b_fwd + itemsize * (atoms * (out_n + x_n + x_n) + 2 * Z * w_n)
    b_dbl = b_bwd + itemsize * (atoms * (x_n + x_n + out_n + x_n + out_n) + 2 * Z * w_n)
    return {
        "sparsity": {
            "dense": st.dense,
            "nonzero": st.nonzero,
            "terms": st.terms,
            "nonzero_fraction": st.nonzero_fraction,
            "terms_fraction": st.terms_fraction,
        },
        **harness.pass_costs((op, d1, d2), (f_fwd, f_bwd, f_dbl), (b_fwd, b_bwd, b_dbl)),
    }


def main(args: argparse.Namespace) -> int:
    """Run the benchmark with the options of ``workbench bench symmetric-contraction``; JSON to ``--out``."""
    device = args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    keys = ("atoms", "hidden", "max_ell", "correlation", "elements", "warmup", "repeats")
    results = kernel_run_header(device, {k: getattr(args, k) for k in keys})
    stamp = results["timestamp"]
    if device == "cpu":
        results["cpu_threads"] = torch.get_num_threads()
    where = "gpu" if device.startswith("cuda") else "cpu"
    out = Path(args.out) if args.out else RESULTS_DIR / f"symmetric_contraction_{where}_{stamp}.json"
    for dtype_name in args.dtypes:
        snaps = _run_dtype(args, dtype_name, results, out)
        for (backend, target, kind), entry in compare_with_e3nn(snaps):
            print(
                f"{dtype_name:8s} {backend:12s} {target:12s} {kind:17s} max rel err vs e3nn "
                f"{entry['parity_vs_e3nn']['max_rel_err']:.2e}, bitwise repeatable {entry['bitwise_repeatable']}",
                flush=True,
            )
        write_json(out, results)
    print(f"wrote {out}")
    return 0


def _inputs(args, block0, dtype, device: str) -> dict:
    """The same random inputs for every backend: node features, species (one-hot), the
    self-connection input of products[0]."""
    C = block0.symmetric_contractions.contractions[0].num_features
    I = block0.symmetric_contractions.irreps_in.dim // C
    g = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(args.atoms, C, I, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    species = torch.randint(0, args.elements, (args.atoms,), generator=g)
    y = torch.nn.functional.one_hot(species, args.elements).to(device=device, dtype=dtype)
    sc_in = torch.randn(args.atoms, block0.linear.irreps_out.dim, generator=g, dtype=torch.float64).to(
        device=device, dtype=dtype
    )
    return {"x0": x0, "species": species, "y": y, "sc_in": sc_in}


def _call(block, target: str, backend: str, inp: dict, device: str):
    """``(call(x), module)`` for one target: the contraction alone, or the whole products[0] block."""
    if target != "contraction":
        return (lambda x: block(node_feats=x, sc=inp["sc_in"], node_attrs=inp["y"])), block
    mod = block.symmetric_contractions
    if backend == "cueq":  # cueq's contraction takes flat features and integer species
        idx = inp["species"].to(device=device, dtype=torch.int32)
        return (lambda x: mod(x.flatten(1), idx)), mod
    return (lambda x: mod(x, inp["y"])), mod


def _measure(kind: str, call, x0, params, args, entry: dict) -> list | None:
    """Time one pass into ``entry``; its outputs (None after an error)."""
    return measure_pass(
        lambda: pass_fn(kind, call, x0.clone().requires_grad_(kind != "forward"), params),
        args.device,
        args.warmup,
        args.repeats,
        entry,
    )


def _roofline(entry: dict, d: dict, kind: str, bandwidth: float | None) -> None:
    sec = entry["median_ms"] * 1e-3
    entry["achieved_GBps_min_bytes"] = d["min_bytes"][kind] / sec / 1e9
    entry["achieved_GFLOPs_sparse"] = d["flops"][kind] / sec / 1e9
    if bandwidth:
        entry["pct_of_measured_bandwidth"] = 100 * entry["achieved_GBps_min_bytes"] / bandwidth


def _run_dtype(args, dtype_name: str, results: dict, out: Path) -> dict:
    """Every backend, target and pass in one dtype; returns the outputs for the parity check."""
    dtype = getattr(torch, dtype_name)
    base = random_scaleshift_mace(
        args.hidden, args.max_ell, args.correlation, range(1, args.elements + 1), 40.0, dtype, args.device
    )
    inp = _inputs(args, base.products[0], dtype, args.device)
    d = results.setdefault("descriptor", {})[dtype_name] = descriptor_costs(
        base.products[0].symmetric_contractions, args.atoms, inp["x0"].element_size()
    )
    snaps = {}  # (backend, target, pass) -> the pass's outputs, for parity against e3nn
    for backend in args.backends:
        try:
            model = backend_model(base, backend, ("products.0.",), results, dtype_name)
        except Exception as exc:
            results["runs"].append({"backend": backend, "dtype": dtype_name, "skipped": f"{type(exc).__name__}: {exc}"})
            continue
        for target in args.targets:
            call, mod = _call(model.products[0], target, backend, inp, args.device)
            params = [p for p in mod.parameters() if p.requires_grad]
            for kind in args.passes:
                entry = {"backend": backend, "dtype": dtype_name, "target": target, "pass": kind}
                outputs = _measure(kind, call, inp["x0"], params, args, entry)
                if outputs is not None:
                    snaps[(backend, target, kind)] = (entry, outputs)
                    if target == "contraction":
                        _roofline(entry, d, kind, results["measured_bandwidth_GBps"])
                results["runs"].append(entry)
                write_json(out, results)  # every row: a step stopped at its time limit keeps what it measured
                print(pass_line(f"{dtype_name:8s} {backend:12s} {target:12s} {kind:17s}", entry), flush=True)
    return snaps
