"""The fused message-op CUDA kernels (node kernel: forward and gradients to node features; edge
kernel: gradients to radial weights, and channel-reduced in shared memory to the spherical
harmonics; the double backward; unrolled, each backward pass as one fused launch) run by numba's CUDA simulator on tiny shapes and compared with
mace's e3nn path; a second evaluation must give the same bits.

``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is first imported, so the checks run
in a fresh interpreter; ``WORKBENCH_KERNELS_CUDASIM=1`` routes CPU tensors through the kernels.
"""

import pytest
from kernel_fixtures import run_under_simulator

SCRIPT = r"""
import copy, json, sys, torch
sys.path.insert(0, {tests!r})
from kernel_fixtures import count_fused, energy_force_grads, rel_err
from test_kernels_channelwise import (MODEL_CFGS, build, e3nn_message, make_conv_tp, mixed_graphs,
                                      random_graph, away_from_zero)
from workbench.kernels import accelerate
from workbench.kernels.numba.gpu import atom as kc
from workbench.kernels.e3nn.tp import channelwise_tp_op
from workbench.kernels.ops import EdgeGraph, apply_edge_poly_op
import workbench.kernels.numba.dispatch as kops
assert kc.cudasim_enabled() and kc.cuda_available()
errs = {{}}
fused = count_fused(kops._epass)  # outputs computed by each fused pass launch (0: the pass launched them one by one)

# op level: forward, backward, double backward (channel count 4 -> 4 threads share an edge
# in the channel-reduced gradient to Y, which exercises the shared-memory reduction)
tp = make_conv_tp("4x0e+4x1o", 2)
N, E = 5, 7
ei = random_graph(N, E, seed=4)
g = torch.Generator().manual_seed(5)
x = away_from_zero((N, tp.irreps_in1.dim), g)
Y = away_from_zero((E, tp.irreps_in2.dim), g)
W = away_from_zero((E, tp.weight_numel), g)
ct = away_from_zero((N, tp.irreps_out.dim), g)
op, _ = channelwise_tp_op(tp)
def passes(f, dtype):
    xs = [t.to(dtype).requires_grad_() for t in (x, Y, W)]
    out = f(*xs)
    gx, gY, gW = torch.autograd.grad((out * ct.to(dtype)).sum(), xs, create_graph=True)
    dd = torch.autograd.grad((gx**2).sum() + (gY**3).sum() + (gW * 0.7).sum(), xs)
    return [out, gx, gY, gW, *dd]
ref = passes(lambda x, Y, W: e3nn_message(tp, x, Y, W, ei), torch.float64)
graph = EdgeGraph(ei, N)
for dtype in (torch.float64, torch.float32):
    got = passes(lambda x, Y, W: apply_edge_poly_op(op, graph, x, Y, W)[0], dtype)
    errs[f"op-{{dtype}}"] = max(rel_err(a.detach(), b.detach()) for a, b in zip(got, ref))
# deterministic: the same inputs give the same bits (number of differing elements)
again = passes(lambda x, Y, W: apply_edge_poly_op(op, graph, x, Y, W)[0], torch.float32)
errs["repeat"] = sum(int((a.detach() != b.detach()).sum()) for a, b in zip(got, again))

# more channels than a block holds nodes of: one node of 12 threads per block (tiny blocks of 8
# asked), sender segments of 0 to 5 edges
tp = make_conv_tp("12x0e+12x1o", 1)
N, E = 6, 17
ei = random_graph(N, E, seed=7)
x = away_from_zero((N, tp.irreps_in1.dim), g)
Y = away_from_zero((E, tp.irreps_in2.dim), g)
W = away_from_zero((E, tp.weight_numel), g)
ct = away_from_zero((N, tp.irreps_out.dim), g)
op, _ = channelwise_tp_op(tp)
ref = passes(lambda x, Y, W: e3nn_message(tp, x, Y, W, ei), torch.float64)
graph = EdgeGraph(ei, N)
got = passes(lambda x, Y, W: apply_edge_poly_op(op, graph, x, Y, W)[0], torch.float64)
errs["op-wide-torch.float64"] = max(rel_err(a.detach(), b.detach()) for a, b in zip(got, ref))

# full model, message op only (the contraction has its own simulator test)
cfg = ("ScaleShiftMACE", "2x0e+2x1o", 2, 2, 2, "RealAgnosticResidualInteractionBlock")
m = build(cfg)
d = mixed_graphs(cfg[4])
ref = energy_force_grads(m, d)
for dtype in (torch.float64, torch.float32):
    a = accelerate(copy.deepcopy(m).to(dtype), ops=("channelwise_tp",))
    dd = {{k: (v.to(dtype) if v.is_floating_point() else v) for k, v in d.items()}}
    E_, F_, G_ = energy_force_grads(a, dd)
    gerr = (max(rel_err(p, q) for p, q in zip(G_, ref[2]) if q.abs().max() > 0) if dtype == torch.float64
            else rel_err(torch.cat([p.flatten() for p in G_]), torch.cat([q.flatten() for q in ref[2]])))
    errs[f"model-{{dtype}}"] = max(rel_err(E_, ref[0]), rel_err(F_, ref[1]), gerr)
errs["fused"] = sorted(set(fused))
"""


@pytest.mark.parametrize("variant", ["unrolled", "table"])
def test_channelwise_kernels_under_simulator(variant):
    errs = run_under_simulator(SCRIPT, variant)
    print(errs)
    assert set(errs) == {
        "op-torch.float64",
        "op-torch.float32",
        "op-wide-torch.float64",
        "model-torch.float64",
        "model-torch.float32",
        "repeat",
        "fused",
    }
    assert errs.pop("repeat") == 0
    # unrolled: the forward has one output; the backward's 3 outputs are one launch, and in the
    # model 2 or 3: each pass computes only the gradients the autograd run uses (the forces skip
    # the first layer's node features, the parameter gradients the spherical harmonics'); table
    # kernels are never fused
    assert errs.pop("fused") == ([0, 2, 3] if variant == "unrolled" else [0])
    for key, e in errs.items():
        assert e <= (1e-10 if "float64" in key else 1e-5), (key, e)
