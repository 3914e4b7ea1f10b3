"""mace's ``reshape_irreps`` as one column permutation (:mod:`workbench.kernels.mace.reshape`):
mace's values, gradients and second derivatives, which modules it takes, and the way back."""

import copy

import pytest
import torch
from e3nn import o3

from workbench.kernels.mace import reshape


def _mace(irreps: str, **kwargs):
    from mace.modules.irreps_tools import reshape_irreps

    return reshape_irreps(o3.Irreps(irreps), **kwargs)


@pytest.mark.parametrize("irreps", ["4x0e+4x1o+4x2e+4x3o", "3x1o+3x0e", "5x2e"])
def test_permutation_gives_mace_values_and_every_derivative(irreps):
    theirs = _mace(irreps)
    ours = copy.deepcopy(theirs)
    reshape.SWAP.swap(ours, "numba")
    assert type(ours).__name__ == "WorkbenchReshapeIrreps"
    g = torch.Generator().manual_seed(len(irreps))
    x = torch.randn(7, o3.Irreps(irreps).dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(theirs(x).shape, generator=g, dtype=torch.float64)
    results = []
    for m in (theirs, ours):
        y = m(x)
        (gx,) = torch.autograd.grad((y * v * y).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.pow(3).sum(), x)
        results.append((y, gx, ggx))
    for a, b in zip(*results):
        assert torch.equal(a, b)  # a permutation moves values; it rounds nothing
    assert torch.autograd.gradcheck(ours, (x,)) and torch.autograd.gradgradcheck(ours, (x,))


def test_column_permutation_is_a_permutation_of_mace_order():
    perm = reshape.column_permutation([2, 2], [1, 3])  # 2x0e+2x1o: [s0 s1 | v0x v0y v0z v1x v1y v1z]
    assert perm == [0, 2, 3, 4, 1, 5, 6, 7]


def test_what_it_takes_and_the_way_back():
    from mace.modules.irreps_tools import reshape_irreps

    plain = _mace("2x0e+2x1o")
    mixed = _mace("2x0e+3x1o")  # unequal multiplicities: mace's own cat would fail anyway
    holder = torch.nn.ModuleList([plain, mixed])
    reshape.SWAP.swap_all(holder, "numba")
    assert type(plain).__name__ == "WorkbenchReshapeIrreps" and type(mixed) is reshape_irreps
    plain(torch.randn(2, 8))
    reshape.SWAP.unswap_all(holder)
    assert type(plain) is reshape_irreps and "_wb_op" not in plain.__dict__


def test_other_widths_take_mace_reading():
    """mace reads only the first ``dim`` columns; a wider input goes through mace's own code."""
    theirs = _mace("2x0e+2x1o")
    ours = copy.deepcopy(theirs)
    reshape.SWAP.swap(ours, "numba")
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    assert torch.equal(ours(x), theirs(x))
    (g,) = torch.autograd.grad(ours(x).sum(), x)
    assert g.shape == x.shape and not g[:, 8:].any()
