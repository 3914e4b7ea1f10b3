"""The shared parallel driver of the CPU row-pass kernels (workbench.kernels.numba.cpu.segments)."""

import numba
import numpy as np
from numba import njit

from workbench.kernels.numba.cpu import segments as cpu_segments
from workbench.kernels.numba.cpu.segments import Segments


@njit(nogil=True)
def _sums(lo, hi, x, seg_ptr, out):
    for s in range(lo, hi):
        total = 0.0
        for p in range(seg_ptr[s], seg_ptr[s + 1]):
            total += x[p]
        out[s] = total


@njit(nogil=True)
def _maxima(lo, hi, x, seg_ptr, out):
    for s in range(lo, hi):
        best = -np.inf
        for p in range(seg_ptr[s], seg_ptr[s + 1]):
            best = max(best, x[p])
        out[s] = best


def _segments(rng, n):
    sizes = rng.integers(1, 9, size=n)
    return rng.normal(size=int(sizes.sum())), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def test_kernels_of_one_signature_share_one_driver_and_match_serial():
    rng = np.random.default_rng(7)
    x, ptr = _segments(rng, 1001)  # not a multiple of the chunks
    want_sum = np.add.reduceat(x, ptr[:-1])
    want_max = np.maximum.reduceat(x, ptr[:-1])
    driver = cpu_segments._driver(3, 1).run_parallel
    compiled = []
    for kernel, want in ((_sums, want_sum), (_maxima, want_max)):
        segments = Segments(kernel, 1)
        parallel, serial = np.full(1001, np.nan), np.full(1001, np.nan)
        segments.parallel(x, ptr, parallel)
        segments.serial(x, ptr, serial)
        np.testing.assert_array_equal(parallel, serial)  # the same order per segment: the same bits
        np.testing.assert_allclose(parallel, want, rtol=1e-12)
        compiled.append(list(driver.signatures))
    assert compiled[1] == compiled[0]  # the second kernel compiled no driver of its own


def test_a_new_argument_layout_gets_its_own_kernel_signature():
    rng = np.random.default_rng(8)
    x, ptr = _segments(rng, 64)
    segments = Segments(_sums, 1)
    out = np.zeros(64)
    segments.parallel(x, ptr, out)
    strided = np.repeat(x, 2)[::2]  # the same values, not contiguous: another numba type
    assert numba.typeof(strided) != numba.typeof(x)
    again = np.zeros(64)
    segments.parallel(strided, ptr, again)
    np.testing.assert_array_equal(again, out)
    assert len(segments._kernels) == 2
