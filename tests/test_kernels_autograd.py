"""gradcheck / gradgradcheck of the fused symmetric contraction and agreement with mace's op."""

import pytest
import torch
from e3nn import o3

import workbench  # noqa: F401
from workbench.kernels import SymmetricContraction, apply_poly_op


def _pair(ell: int, correlation: int, channels: int, n_elements: int, out: str = "0e+1o", seed: int = 0):
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        irreps_in = o3.Irreps("+".join(f"{channels}x{l}{'e' if l % 2 == 0 else 'o'}" for l in range(ell + 1)))
        irreps_out = o3.Irreps("+".join(f"{channels}x{ir}" for _, ir in o3.Irreps(out)))
        ref = MaceSC(irreps_in, irreps_out, correlation, num_elements=n_elements)
        with torch.no_grad():
            for p in ref.parameters():
                if p.requires_grad:
                    p.normal_()
    finally:
        torch.set_default_dtype(old)
    return ref, SymmetricContraction.from_mace(ref)


def _inputs(ref, n_atoms: int, n_elements: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    C = ref.contractions[0].num_features
    I = ref.irreps_in.dim // C
    x = torch.randn(n_atoms, C, I, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.randint(0, n_elements, (n_atoms,), generator=g)
    y = torch.nn.functional.one_hot(z, n_elements).double()
    return x, y


def test_gradcheck_and_gradgradcheck():
    ref, ours = _pair(ell=1, correlation=3, channels=2, n_elements=2)
    x, y = _inputs(ref, 3, 2)
    species = y.argmax(-1)
    W = ours.concatenated_weights().detach().clone()
    Z = W.shape[0]
    W = W.reshape(Z, -1).requires_grad_(True)
    x2 = x.detach().reshape(3, -1).clone().requires_grad_(True)

    def f(x2, W):
        return apply_poly_op(ours.op, species, Z, x2, W)[0]

    assert torch.autograd.gradcheck(f, (x2, W), eps=1e-6, atol=1e-7, rtol=1e-6)
    assert torch.autograd.gradgradcheck(f, (x2, W), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ell,correlation,out", [(1, 1, "0e"), (2, 2, "0e+1o"), (3, 3, "0e+1o")])
def test_matches_mace_forward_backward_double_backward(ell, correlation, out):
    ref, ours = _pair(ell=ell, correlation=correlation, channels=3, n_elements=3, out=out)
    x, y = _inputs(ref, 6, 3)
    g = torch.randn(6, ref.irreps_out.dim, dtype=torch.float64)
    results = []
    for mod in (ref, ours):
        params = [p for p in mod.parameters() if p.requires_grad]
        o = mod(x, y)
        gx, *gw = torch.autograd.grad(o, [x] + params, g, create_graph=True)
        # "double backward": gradient of the squared input-gradient, back to inputs and weights
        s = (gx**2).sum() + sum((w**2).sum() for w in gw)
        hh = torch.autograd.grad(s, [x] + params)
        results.append([t.detach() for t in (o, gx, *gw, *hh)])
    for a, b in zip(results[1], results[0]):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
        assert b.abs().max() > 0
        assert err <= 1e-10, err


def test_atoms_of_no_species_get_zeros_like_e3nn_and_soft_attributes_are_refused():
    ref, ours = _pair(ell=1, correlation=2, channels=3, n_elements=3)
    x, y = _inputs(ref, 7, 3, seed=int(torch.randint(0, 2**31, ())))
    y = y.clone()
    y[[2, 5]] = 0.0  # two atoms of no species: e3nn mixes the weights by y, so they get zeros
    g = torch.randn(7, ref.irreps_out.dim, dtype=torch.float64)
    outs = []
    for mod in (ref, ours):
        o = mod(x, y)
        (gx,) = torch.autograd.grad(o, [x], g)
        outs.append((o.detach(), gx))
    for a, b in zip(outs[1], outs[0]):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-12
    assert outs[1][0][[2, 5]].abs().max() == 0 and outs[1][0][[0, 1]].abs().max() > 0
    soft = y.clone()
    soft[4] = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="node_attrs row 4 is not one-hot"):
        ours(x, soft)


def test_a_cuda_tensor_without_a_numba_cuda_target_is_an_error_naming_why(monkeypatch):
    from numba import cuda

    from workbench.kernels.numba import dispatch
    from workbench.kernels.numba.gpu import device

    def broken():
        raise OSError("libcuda.so: cannot open shared object file")

    monkeypatch.setattr(cuda, "is_available", broken)
    device.cuda_status.cache_clear()
    try:
        assert device.cuda_status() == (
            False,
            "numba.cuda.is_available() failed (OSError: libcuda.so: cannot open shared object file)",
        )
        monkeypatch.delenv(dispatch.HOST_FALLBACK_ENV, raising=False)
        with pytest.raises(RuntimeError, match=r"cuda:0 tensors, but numba\.cuda\.is_available\(\) failed .*libcuda"):
            dispatch._no_cuda_target(torch.device("cuda:0"))
        monkeypatch.setenv(dispatch.HOST_FALLBACK_ENV, "1")
        with pytest.warns(RuntimeWarning, match="host copies"):
            dispatch._no_cuda_target(torch.device("cuda:1"))
    finally:
        device.cuda_status.cache_clear()


def test_row_groups_from_a_stable_sort_and_a_binary_search():
    """The CSR the CUDA kernels walk (species of atoms, receivers of edges): every position of a
    value in [0, n) in its group, ascending; values outside fall in no group."""
    from workbench.kernels.ops import EdgeGraph, SpeciesIndex

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    species = torch.randint(0, 5, (200,), generator=g)
    species[::17] = 7  # beyond num_species: no group
    ptr, perm = SpeciesIndex(species, 5).csr()
    assert ptr.tolist()[0] == 0 and ptr.tolist()[-1] == int((species < 5).sum())
    for z in range(5):
        members = perm[ptr[z] : ptr[z + 1]].tolist()
        assert members == torch.nonzero(species == z).flatten().tolist()  # ascending atom order
    ei = torch.randint(0, 9, (2, 300), generator=g)
    graph = EdgeGraph(ei, 9)
    for rows, idx in (("sender", ei[0]), ("receiver", ei[1])):
        ptr, perm = graph.csr(rows)
        assert torch.equal(ptr[1:] - ptr[:-1], torch.bincount(idx, minlength=9))
        for n in range(9):
            assert perm[ptr[n] : ptr[n + 1]].tolist() == torch.nonzero(idx == n).flatten().tolist()


def test_backward_skips_the_gradients_this_run_does_not_use(monkeypatch):
    """``autograd.grad`` toward one input asks the derivative for that input only (forces need no
    gradient toward the weights), with the same values; ``backward()`` asks for every input."""
    ref, ours = _pair(ell=1, correlation=2, channels=2, n_elements=2)
    x, y = _inputs(ref, 4, 2)
    species, Z = y.argmax(-1), 2
    a = x.detach().reshape(4, -1).clone().requires_grad_(True)
    w = ours.concatenated_weights().detach().reshape(Z, -1).clone().requires_grad_(True)
    asked, derivative = [], type(ours.op).derivative
    monkeypatch.setattr(type(ours.op), "derivative", lambda op, *args: asked.append(args[0]) or derivative(op, *args))

    def loss():  # non-leaf inputs: the engine can say whether it will use their gradients
        return apply_poly_op(ours.op, species, Z, a * 2.0, w * 1.0)[0].pow(2).sum()

    (da,) = torch.autograd.grad(loss(), [a])
    assert asked == [(True, False)]
    full = torch.autograd.grad(loss(), [a, w])
    assert asked[1:] == [(True, True)] and torch.allclose(da, full[0], rtol=1e-12, atol=0)
    loss().backward()
    assert asked[2:] == [(True, True)] and torch.equal(a.grad, full[0]) and torch.equal(w.grad, full[1])

    def leaf_loss():  # leaves: torch refuses the query for the one asked for (it counts as used)
        return apply_poly_op(ours.op, species, Z, a, w)[0].pow(2).sum()

    (da_leaf,) = torch.autograd.grad(leaf_loss(), [a])
    both = torch.autograd.grad(leaf_loss(), [a, w])
    assert asked[3:] == [(True, False), (True, True)] and torch.allclose(da_leaf, both[0], rtol=1e-12, atol=0)
