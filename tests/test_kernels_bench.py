"""The kernel benchmarks check what they time: every backend against e3nn in the same run, and
each pass twice for bit-identical results (the GPU run's correctness record)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from workbench.bench.harness import parity, snapshot


def test_parity_is_the_worst_relative_error_over_comparable_tensors():
    g = torch.Generator().manual_seed(3)
    ref = [torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64), None]
    res = [ref[0] + 1e-3 * ref[0].abs().max(), torch.randn(2, 3, dtype=torch.float64), torch.ones(2)]
    p = parity(res, ref)
    assert p["compared"] == 1 and p["skipped_shape"] == 1
    assert p["max_rel_err"] == pytest.approx(1e-3, rel=1e-9)
    assert parity(snapshot((ref[0].float(), None)), snapshot(ref[0]))["max_rel_err"] < 1e-7


def test_channelwise_tp_bench_records_parity_with_e3nn_and_repeatability(tmp_path):
    from workbench.cli import main

    out = tmp_path / "tp.json"
    assert main(
        [
            "bench",
            "channelwise-tp",
            "--smoke",
            "--device",
            "cpu",
            "--backends",
            "numba",
            "e3nn",
            "--dtypes",
            "float64",
            "--out",
            str(out),
        ]
    ) in (0, None)
    runs = json.loads(out.read_text())["runs"]
    numba = [r for r in runs if r["backend"] == "numba"]
    assert {r["pass"] for r in numba} == {"forward", "forward_backward", "double_backward"}
    for r in numba:
        assert r["parity_vs_e3nn"]["compared"] >= 1, r
        assert r["parity_vs_e3nn"]["max_rel_err"] <= 1e-10, r
        assert r["bitwise_repeatable"] is True
    assert all("parity_vs_e3nn" not in r for r in runs if r["backend"] == "e3nn")


def test_numpy_row_stack_alias_is_present_for_numba_cuda():
    import workbench  # noqa: F401  (applies the compat fixes)

    a = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(np.row_stack((a, a)), np.vstack((a, a)))
