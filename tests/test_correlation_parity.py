"""Every correlation order ``TrainConfig`` accepts trains with the numba kernels as with mace's e3nn
modules, in float64, step for step. At correlation 4 the numba contraction was wrong (issue 47,
AC03/TR06a): float64 losses differed from e3nn's by 1e-9 relative, where correlation 3 agrees to
1e-15, so the tolerance here is far tighter than that error and far looser than rounding."""

import numpy as np
import pytest
import torch
from train_fixtures import tiny

from workbench.train.config import RANGES
from workbench.train.rundir import read_steps

CORRELATIONS = range(int(RANGES["correlation"].lo), int(RANGES["correlation"].hi) + 1)


def test_the_correlations_are_the_accepted_range():
    from workbench.kernels.mace.symmetric_contraction import PROVEN_CORRELATIONS

    assert list(CORRELATIONS) == [1, 2, 3, 4]
    assert set(CORRELATIONS) <= set(PROVEN_CORRELATIONS)  # accelerate takes every one a config accepts


@pytest.mark.parametrize("correlation", [c for c in CORRELATIONS if c != 2])  # 2: test_train's numba run
def test_numba_training_follows_e3nn_at_every_correlation(tmp_path, correlation):
    from workbench.train import train

    losses = {}
    for backend in ("e3nn", "numba"):
        cfg = tiny(
            tmp_path,
            f"c{correlation}_{backend}",
            backend=backend,
            correlation=correlation,
            max_ell=2,
            max_steps=3,
            checkpoint_every=0,
            dtype="float64",
            export=False,
            max_structures=24,
        )
        train(cfg, resume=False)
        losses[backend] = [s["loss"] for s in read_steps(cfg.run_dir)]
    assert len(losses["e3nn"]) == 3 and np.all(np.isfinite(losses["e3nn"]))
    np.testing.assert_allclose(losses["numba"], losses["e3nn"], rtol=1e-11, atol=0)
    assert torch.get_default_dtype() == torch.float32  # train restored it
