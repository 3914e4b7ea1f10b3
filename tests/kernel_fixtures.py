"""Shared builders for the kernels tests (no tests here): real mace-torch models on small random molecules."""

from __future__ import annotations

import functools

import numpy as np
import torch
from e3nn import o3

import workbench  # noqa: F401  (sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD before e3nn)
from workbench.dtypes import default_dtype


def build_model(
    cls_name: str,
    hidden: str,
    max_ell: int,
    correlation: int,
    n_elements: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    interaction: str = "RealAgnosticResidualInteractionBlock",
    **extra,
) -> torch.nn.Module:
    """A real ``mace.modules.MACE`` / ``ScaleShiftMACE`` with random (non-zero) weights;
    ``extra``: more of mace's keywords (``radial_type``, ``apply_cutoff``, ...)."""
    from mace import modules

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        kwargs = (
            dict(
                r_max=4.0,
                num_bessel=4,
                num_polynomial_cutoff=5,
                max_ell=max_ell,
                interaction_cls=modules.interaction_classes[interaction],
                interaction_cls_first=modules.interaction_classes[interaction],
                num_interactions=2,
                num_elements=n_elements,
                hidden_irreps=o3.Irreps(hidden),
                MLP_irreps=o3.Irreps("8x0e"),
                atomic_energies=np.linspace(-1.0, -2.0, n_elements),
                avg_num_neighbors=4.0,
                atomic_numbers=list(range(1, n_elements + 1)),
                correlation=correlation,
                gate=torch.nn.functional.silu,
            )
            | extra
        )
        if cls_name == "ScaleShiftMACE":
            model = modules.ScaleShiftMACE(atomic_inter_scale=1.3, atomic_inter_shift=0.2, **kwargs)
        else:
            model = modules.MACE(**kwargs)
        # random, non-zero everywhere (mace's init leaves some product weights small)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(old)
    return model


def save_md_model(path, atomic_numbers: tuple[int, ...]):
    """A random float64 ``ScaleShiftMACE`` (8x0e+8x1o, the elements ``atomic_numbers``), saved at
    ``path`` as mace saves models; returns ``path``."""
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, len(atomic_numbers), dtype=torch.float64)
    model.atomic_numbers = torch.tensor(list(atomic_numbers))
    torch.save(model, path)
    return path


@functools.cache
def mace_contraction(correlation: int, max_ell: int) -> torch.nn.Module:
    """mace's own SymmetricContraction, 1x(0e..max_ell) -> 1x0e+1x1o for 2 elements, float64,
    random non-zero weights (built once per configuration: mace's coupling tensors take seconds)."""
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    irreps_in = o3.Irreps([(1, (ell, (-1) ** ell)) for ell in range(max_ell + 1)])
    torch.manual_seed(correlation)
    with default_dtype(torch.float64):
        sc = MaceSC(irreps_in, o3.Irreps("1x0e+1x1o"), correlation=correlation, num_elements=2)
    with torch.no_grad():
        for p in sc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return sc


def contraction_derivatives(module, x, y, params, g, h) -> list[torch.Tensor]:
    """The output, the gradient of ``<out, g>`` by ``x``, and that gradient's derivatives along ``h``
    by ``x`` and the weights (the passes of an energy + force loss)."""
    out = module(x, y)
    (gx,) = torch.autograd.grad((out * g).sum(), x, create_graph=True)
    second = torch.autograd.grad((gx * h).sum(), [x, *params])
    return [out.detach(), gx.detach(), *second]


def contraction_errors(correlation: int, derivatives: bool = True) -> list[float]:
    """Relative errors of the accelerated :func:`mace_contraction` (``max_ell`` 1) against mace's
    module on 6 atoms: the output and, with ``derivatives``, every :func:`contraction_derivatives`."""
    from workbench.kernels import SymmetricContraction

    ref = mace_contraction(correlation, max_ell=1)
    fast = SymmetricContraction.from_mace(ref)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.one_hot(torch.tensor([0, 1, 1, 0, 1, 1]), 2).double()
    if not derivatives:
        return [rel_err(fast(x, y), ref(x, y))]
    cot = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(x.shape, generator=g, dtype=torch.float64)
    params = [p for p in ref.parameters() if p.requires_grad]
    want = contraction_derivatives(ref, x, y, params, *cot)
    got = contraction_derivatives(fast, x, y, params, *cot)
    assert len(got) == len(want) == 3 + len(params)
    return [rel_err(a, b) for a, b in zip(got, want)]


def random_batch(n_elements: int, n_atoms=(5, 7), dtype=torch.float64, seed: int = 0, r_max: float = 4.0) -> dict:
    """Two random molecules batched the way mace expects, with an O(n^2) neighbour list."""
    g = torch.Generator().manual_seed(seed)
    pos, attrs, batch, edges, ptr = [], [], [], [], [0]
    start = 0
    for gi, n in enumerate(n_atoms):
        p = torch.rand(n, 3, generator=g, dtype=torch.float64) * 3.0
        z = torch.randint(0, n_elements, (n,), generator=g)
        for i in range(n):
            for j in range(n):
                if i != j and torch.linalg.norm(p[i] - p[j]) < r_max:
                    edges.append((start + i, start + j))
        pos.append(p)
        attrs.append(torch.nn.functional.one_hot(z, n_elements).to(torch.float64))
        batch.append(torch.full((n,), gi, dtype=torch.int64))
        start += n
        ptr.append(start)
    E = len(edges)
    return {
        "positions": torch.cat(pos).to(dtype),
        "node_attrs": torch.cat(attrs).to(dtype),
        "edge_index": torch.tensor(edges, dtype=torch.int64).T.contiguous(),
        "shifts": torch.zeros(E, 3, dtype=dtype),
        "unit_shifts": torch.zeros(E, 3, dtype=dtype),
        "cell": torch.zeros(3 * len(n_atoms), 3, dtype=dtype),
        "batch": torch.cat(batch),
        "ptr": torch.tensor(ptr, dtype=torch.int64),
    }


def energy_force_grads(model: torch.nn.Module, data: dict, seed: int = 1):
    """Energies, forces and the parameter gradients of an energy+force loss (double backward)."""
    data = {k: v.clone() for k, v in data.items()}
    out = model(data, training=True, compute_force=True)
    E, F = out["energy"], out["forces"]
    g = torch.Generator().manual_seed(seed)
    tE = torch.randn(E.shape, generator=g, dtype=torch.float64).to(E.dtype)
    tF = torch.randn(F.shape, generator=g, dtype=torch.float64).to(F.dtype)
    loss = ((E - tE) ** 2).sum() + ((F - tF) ** 2).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)]
    return E.detach(), F.detach(), [gr.detach() for gr in grads]


def count_fused(module) -> list[int]:
    """Record, per call of ``module.launch`` (a fused-pass launcher), how many outputs it
    computed (0: the pass launched them one kernel each); returns the list it appends to."""
    fused: list[int] = []
    launch = module.launch

    def spy(*args, **kwargs):
        done = launch(*args, **kwargs)
        fused.append(len(done))
        return done

    module.launch = spy
    return fused


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64, detached, with no floor: an all-zero reference gives NaN,
    which fails every bound."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def weight_as_input(module: torch.nn.Module):
    """``(f, weight)``: ``f(*inputs, weight)`` runs ``module`` with a fresh leaf ``weight`` (a copy of
    its own, which it no longer holds as a parameter), so gradcheck differentiates the weights too."""
    weight = module.weight.detach().clone().requires_grad_()
    del module._parameters["weight"]

    def f(*args: torch.Tensor) -> torch.Tensor:
        module.weight = args[-1]
        return module(*args[:-1])

    return f, weight


def swapped_copy(module: torch.nn.Module, swap) -> torch.nn.Module:
    """A copy of an e3nn ``module`` with its companion ``swap`` applied (checked first)."""
    import copy

    ours = copy.deepcopy(module)
    swap.check(ours)
    swap.swap(ours, "numba")
    return ours


def random_features(module: torch.nn.Module, shape=(5, 2), dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    """Fresh random inputs of ``module.irreps_in`` (drawn in float64, then cast), with grad."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, module.irreps_in.dim, generator=g, dtype=torch.float64)
    return x.to(dtype).requires_grad_()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


#: appended to every simulator script: which kernel kinds were compiled, then the errors
SIMULATOR_REPORT = """
from workbench.kernels.numba.gpu import atom as _kc, edge as _ec, unrolled as _un
print("KERNELS", json.dumps({"unrolled": _un._compile.cache_info().currsize,
                             "table": _kc.get_kernel.cache_info().currsize + _ec.get_node_kernel.cache_info().currsize
                             + _ec.get_edge_kernel.cache_info().currsize}))
print("RESULT", json.dumps(errs))
"""


def run_under_simulator(script: str, variant: str, **extra_env: str) -> dict:
    """Run ``script`` (which fills ``errs``) in a fresh interpreter with numba's CUDA simulator,
    the CUDA kernels of kind ``variant`` and tiny blocks; check that ``variant`` is the kind that
    ran, and return ``errs``. The simulator must be switched on before ``numba.cuda`` is imported."""
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        NUMBA_ENABLE_CUDASIM="1",
        WORKBENCH_KERNELS_CUDASIM="1",
        WORKBENCH_CUDA_TPB="8",
        WORKBENCH_CUDA_KERNELS=variant,
        **extra_env,
    )
    res = subprocess.run(
        [sys.executable, "-c", script.format(tests=tests) + SIMULATOR_REPORT],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tests,
    )
    assert res.returncode == 0, res.stderr[-4000:]

    def last(tag: str):
        return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith(tag + " ")][-1][len(tag) + 1 :])

    kernels = last("KERNELS")
    other = "table" if variant == "unrolled" else "unrolled"
    assert kernels[variant] > 0 and kernels[other] == 0, kernels  # the kind asked for is the one that ran
    return last("RESULT")


def periodic_batch(n_elements: int, dtype=torch.float64, seed: int = 0, r_max: float = 4.0) -> dict:
    """Two strained, rattled periodic cells (one sees its own images), batched by mace's own
    graph builder: the input of a stress computation."""
    from ase.build import bulk
    from mace.data import AtomicData, config_from_atoms
    from mace.tools import AtomicNumberTable
    from mace.tools.torch_geometric import Batch

    rng = np.random.default_rng(seed)
    graphs = []
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for reps in ((1, 1, 1), (2, 1, 1)):
            atoms = bulk("Cu", "fcc", a=3.0, cubic=True).repeat(reps)
            atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.normal(0, 0.03, (3, 3))), scale_atoms=True)
            atoms.positions += rng.normal(0, 0.08, atoms.positions.shape)
            atoms.numbers = rng.integers(1, n_elements + 1, len(atoms))
            config = config_from_atoms(atoms)
            table = AtomicNumberTable(list(range(1, n_elements + 1)))
            graphs.append(AtomicData.from_config(config, z_table=table, cutoff=r_max))
    finally:
        torch.set_default_dtype(old)
    batch = Batch.from_data_list(graphs).to_dict()
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def stress_grads(model: torch.nn.Module, data: dict, seed: int = 1):
    """Energies, forces, stress and the parameter gradients of an energy+force+stress loss."""
    data = {k: v.clone() for k, v in data.items()}
    out = model(data, training=True, compute_force=True, compute_stress=True)
    E, F, S = out["energy"], out["forces"], out["stress"]
    g = torch.Generator().manual_seed(seed)
    targets = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) for t in (E, F, S)]
    loss = sum(((t - r) ** 2).sum() for t, r in zip((E, F, S), targets))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)]
    return E.detach(), F.detach(), S.detach(), [gr.detach() for gr in grads]
