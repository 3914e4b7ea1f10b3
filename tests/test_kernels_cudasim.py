"""The CUDA kernels themselves, run by numba's CUDA simulator on tiny shapes.

``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is first imported, so the checks run
in a fresh interpreter. ``WORKBENCH_KERNELS_CUDASIM=1`` routes CPU tensors through the CUDA
kernels (forward, backward and double backward, including the weight gradient's per-atom
partials and per-species sum); results are compared with mace's e3nn model as in
``test_kernels_mace``, and a second evaluation must give the same bits. Outputs the kernels
fully write start as NaN under the simulator, so an element a kernel misses fails the check.
"""

import pytest
from kernel_fixtures import run_under_simulator

SCRIPT = r"""
import copy, json, sys, torch
sys.path.insert(0, {tests!r})
from kernel_fixtures import build_model, count_fused, energy_force_grads, random_batch, rel_err
from workbench.kernels import accelerate
from workbench.kernels.numba.gpu import atom as kc
from workbench.kernels.numba import dispatch as kops
assert kc.cudasim_enabled() and kc.cuda_available()
errs = {{}}
fused = count_fused(kops._apass)  # outputs computed by each fused atom pass (launched only where fusing applies)
for cfg in [("MACE", "2x0e+2x1o", 1, 2, 2), ("ScaleShiftMACE", "2x0e+2x1o", 2, 3, 2)]:
    m = build_model(*cfg)
    d = random_batch(cfg[4], n_atoms=(3, 4))
    ref = energy_force_grads(m, d)
    for dtype in (torch.float64, torch.float32):
        a = accelerate(copy.deepcopy(m).to(dtype))
        dd = {{k: (v.to(dtype) if v.is_floating_point() else v) for k, v in d.items()}}
        E, F, G = energy_force_grads(a, dd)
        errs[f"{{cfg}}-{{dtype}}"] = [rel_err(E, ref[0]), rel_err(F, ref[1]),
            max(rel_err(x, y) for x, y in zip(G, ref[2]) if y.abs().max() > 0) if dtype == torch.float64
            else rel_err(torch.cat([x.flatten() for x in G]), torch.cat([y.flatten() for y in ref[2]]))]
        if dtype == torch.float32:
            # deterministic: a second evaluation gives the same bits (count of differing elements)
            again = energy_force_grads(a, dd)
            errs[f"repeat-{{cfg}}"] = [int((torch.cat([t.flatten() for t in (E, F, *G)]) !=
                                            torch.cat([t.flatten() for t in (again[0], again[1], *again[2])])).sum())] * 3
errs["fused"] = sorted(set(fused))
"""


@pytest.mark.parametrize("variant", ["unrolled", "table", "unrolled-split", "unrolled-terms", "unrolled-weights"])
def test_cuda_kernels_under_simulator(variant):
    # unrolled-split: every polynomial's output components in 2 generated kernels writing one
    # output (message kernels too: each part walks the edges and stores its components);
    # unrolled-terms: every contraction polynomial in runs of 5 terms, later runs of a component
    # adding to what its first run stored (launched in order); unrolled-weights: the contraction's
    # terms in groups by weight component (parts of about 5 terms across output components)
    extra = {
        "unrolled-split": {"WORKBENCH_UNROLL_PARTS": "2"},
        "unrolled-terms": {"WORKBENCH_UNROLL_TERMS": "5"},
        "unrolled-weights": {"WORKBENCH_UNROLL_WEIGHT_GROUPS": "5"},
    }.get(variant, {})
    errs = run_under_simulator(SCRIPT, variant.split("-")[0], **extra)
    print(errs)
    # one launch per pass for the contraction: the backward's d(x) and d(W), the double
    # backward's d(x), d(W) and d(d(out)), each in all its parts (the forward, one output, too
    # when it is split); table kernels are never fused
    assert errs.pop("fused") == {"unrolled": [2, 3], "table": []}.get(variant, [1, 2, 3])
    assert sum(key.startswith("repeat") for key in errs) == 2
    for key, (e, f, g) in errs.items():
        tol = 0 if key.startswith("repeat") else (1e-10 if "float64" in key else 1e-5)
        assert max(e, f, g) <= tol, (key, e, f, g)


CONTRACTION_SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
from kernel_fixtures import contraction_errors
errs = {{f"corr{{c}}": max(contraction_errors(c)) for c in (4, 5)}}
"""


@pytest.mark.parametrize("variant", ["unrolled", "table"])
def test_contraction_at_correlation_4_and_5_under_simulator(variant):
    """mace's symmetric contraction alone at correlation 4 and 5 (four and more factors of one
    operand in a term): output, gradients and second derivatives, float64."""
    errs = run_under_simulator(CONTRACTION_SCRIPT, variant)
    assert max(errs.values()) <= 1e-12, errs


SEGMENT_SCRIPT = r"""
import json, numpy as np
from workbench.kernels.numba.gpu import segment
rng = np.random.default_rng(3)
errs = {}
for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
    species = rng.integers(0, 5, 70)
    species[species == 3] = 4  # an empty segment
    perm = np.argsort(species, kind="stable")
    ptr = np.searchsorted(species[perm], np.arange(6))
    partial = rng.standard_normal((70, 37)).astype(dtype)  # 37 columns: a partial tile of 32
    outs = []
    for _ in range(2):
        out = np.full((5, 37), np.nan, dtype=dtype)
        kernel, blocks, threads, args = segment.plan_segment_sum(partial, ptr, perm, out)
        kernel[blocks, threads](*args)
        outs.append(out)
    want = np.stack([partial[species == z].astype("float64").sum(0) for z in range(5)])
    errs[dtype] = [float(np.abs(outs[0] - want).max() / np.abs(want).max()), bool(np.array_equal(outs[0], outs[1])),
                   float(np.abs(outs[0][3]).max()), threads]
print("SEGMENT " + json.dumps(errs))
"""


def test_species_sums_use_row_lanes_and_keep_their_bits():
    """The per-species sum of the weight-gradient partials: 8 row lanes per column (the GPU's
    configuration), a segment with no atoms, a partial column tile; exact to rounding, the same
    bits on every run."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", WORKBENCH_KERNELS_CUDASIM="1", WORKBENCH_SEGMENT_LANES="8")
    res = subprocess.run([sys.executable, "-c", SEGMENT_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    errs = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("SEGMENT ")][-1][8:])
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        rel, repeat, empty, threads = errs[dtype]
        assert rel <= tol and repeat and empty == 0.0 and threads == 256, (dtype, errs[dtype])
