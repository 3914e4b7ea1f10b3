"""NequIP and Allegro on the CUDA kernels, run by numba's CUDA simulator on tiny graphs.

No GPU has run these families yet; the simulator runs the same kernels (forward, backward and
double backward) thread by thread. ``WORKBENCH_KERNELS_CUDASIM=1`` routes CPU tensors through
them. The simulator must be on before ``numba.cuda`` is first imported, so each check runs in a
fresh interpreter; it compares energy, forces, stress and every parameter gradient with the
family's own path in float64 (1e-10), and says how many kernels each family compiled, so a
family that silently fell back to the CPU loops fails (and the CPU loops raise if called).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import copy, json, sys
import numpy as np
sys.path.insert(0, {here!r})
from nequip_fixtures import batch, build_allegro, build_model, cell, molecule, outputs, rel
from workbench.kernels import accelerate
from workbench.kernels.numba.cpu import passes as cpu
from workbench.kernels.numba.gpu import atom as kc, edge as ec, unrolled as un
assert kc.cudasim_enabled() and kc.cuda_available()

def no_cpu_loops(*args, **kwargs):
    raise AssertionError("an op ran on the CPU loops, not on the CUDA kernels")

cpu.run_edge = cpu.run_atom = no_cpu_loops

def compiled():
    return un._compile.cache_info().currsize + kc.get_kernel.cache_info().currsize + \
        ec.get_node_kernel.cache_info().currsize + ec.get_edge_kernel.cache_info().currsize

rng = np.random.default_rng()
res = {{}}
for family, build in (("nequip", build_model), ("allegro", build_allegro)):
    before = compiled()
    model = build("float64", num_layers=1, num_types=2)
    # a triclinic cell small enough that atoms see their own images, and a molecule whose last atom has no edge
    data = batch([cell(rng, 3, 2, size=2.6), molecule(rng, 3, 2)], model, shuffle_edges=1)
    ref = outputs(model, data)
    got = outputs(accelerate(copy.deepcopy(model), backend="numba"), data)
    res[family] = {{"worst": max(rel(got[k], ref[k]) for k in ref), "kernels": compiled() - before,
                   "edges": int(data["edge_index"].shape[1])}}
print("RESULT", json.dumps(res))
"""


@pytest.mark.parametrize("kind", ["unrolled", "table"])
def test_nequip_and_allegro_on_the_cuda_kernels_under_the_simulator(kind):
    here = str(Path(__file__).parent)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", WORKBENCH_KERNELS_CUDASIM="1", WORKBENCH_CUDA_TPB="8")
    env["WORKBENCH_CUDA_KERNELS"] = kind
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=here)], capture_output=True, text=True, env=env, timeout=600, cwd=here
    )
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    print(res)
    for family, r in res.items():
        assert r["edges"] > 0 and r["kernels"] > 0, (family, r)
        assert r["worst"] <= 1e-10, (family, r)
