"""The row-parallel column gather (:mod:`workbench.kernels.numba.cpu.columns`): numpy's ``take``
to the bit, serially and in parallel, for permutations, subsets and repeats; clear errors; and
mace's reshape on it against ``index_select``."""

import numpy as np
import pytest
import torch

from workbench.kernels.mace.reshape import permute_columns
from workbench.kernels.numba.cpu import columns
from workbench.kernels.numba.cpu.columns import gather_columns


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [3, 2000])  # under and over SERIAL_ELEMENTS for every column list
def test_equals_numpy_take(dtype, rows):
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 160)).astype(dtype)
    for cols in (rng.permutation(160), rng.integers(0, 160, 57), np.arange(0)):
        out = gather_columns(x, cols)
        assert out.dtype == x.dtype and out.shape == (rows, cols.size)
        assert np.array_equal(out, np.take(x, cols, axis=1))
        assert (rows * cols.size >= columns.SERIAL_ELEMENTS) == (rows == 2000 and cols.size > 0)
    assert gather_columns(x[:0], np.arange(4)).shape == (0, 4)


def test_writes_into_the_given_array():
    x = np.random.default_rng(1).normal(size=(5, 8))
    out = np.full((5, 8), np.nan)
    cols = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    assert gather_columns(x, cols, out) is out and np.array_equal(out, x[:, ::-1])


def test_bad_input_is_refused():
    x = np.zeros((4, 6), dtype=np.float32)
    with pytest.raises(ValueError, match=r"outside \[0, 6\)"):
        gather_columns(x, np.array([0, 6]))
    with pytest.raises(ValueError, match=r"outside \[0, 6\)"):
        gather_columns(x, np.array([-1, 2]))
    with pytest.raises(ValueError, match="C-contiguous 2-d"):
        gather_columns(np.zeros((6, 4), dtype=np.float32).T, np.array([0]))
    with pytest.raises(ValueError, match=r"out must be float32 \[4, 2\]"):
        gather_columns(x, np.array([0, 1]), np.zeros((4, 1), dtype=np.float32))
    with pytest.raises(ValueError, match="out must be float32"):
        gather_columns(x, np.array([0, 1]), np.zeros((4, 2), dtype=np.float64))


def test_the_reshape_permutation_batches_under_vmap_and_forward_mode():
    from workbench.kernels.mace.reshape import _Permute

    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    inverse = torch.argsort(perm)
    x = torch.randn(5, 3, 12, dtype=torch.float64)
    batched = torch.vmap(lambda t: _Permute.apply(t, perm, inverse))(x)
    assert torch.equal(batched, x[..., perm])
    tangent = torch.func.jvp(lambda t: _Permute.apply(t, perm, inverse), (x[0],), (x[1],))[1]
    assert torch.equal(tangent, x[1][:, perm])


def test_the_reshape_permutation_equals_index_select_in_every_dtype():
    x = torch.randn(300, 240, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(240, generator=torch.Generator().manual_seed(2))
    assert torch.equal(permute_columns(x, perm), x.detach().index_select(1, perm))
    assert torch.equal(permute_columns(x.float(), perm), x.detach().float().index_select(1, perm))
    half = x.detach().half()  # other dtypes: torch's own
    assert torch.equal(permute_columns(half, perm), half.index_select(1, perm))
