"""`workbench data make` and `data verify` refuse bad input in one line and write nothing."""

import subprocess
import sys
from pathlib import Path

import numpy as np

BIN = Path(sys.executable).parent


def _data(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "workbench"), "data", *args], capture_output=True, text=True, timeout=300)


def test_make_refuses_no_structures_and_bad_counts(tmp_path):
    out = tmp_path / "mix.extxyz"
    for args, message in (
        (["--n", "0"], "--n: must be >= 1 structure, got 0"),
        (["--families", "cuni=0,hea=0"], "--n: must be >= 1 structure, got 0 (the --families counts)"),
        (["--families", "cuni=abc"], "--families: 'cuni=abc' is not NAME=COUNT with a whole count"),
        (["--families", "cuni=-2"], "--families: 'cuni=-2' is not NAME=COUNT"),
    ):
        res = _data("make", "--out", str(out), *args)
        assert res.returncode == 2 and message in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_verify_names_a_file_that_is_not_a_mixture(tmp_path):
    from ase import Atoms

    from workbench.data.io import write_structures

    water = Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])
    water.info["REF_energy"] = -14.2
    water.arrays["REF_forces"] = np.random.default_rng(1).normal(size=(3, 3))
    path = write_structures(tmp_path / "water.extxyz", [water])
    res = _data("verify", str(path))
    assert res.returncode == 2, res.stderr
    assert "water.extxyz, frame 0: no config_type, family_index, seed; verify rebuilds frames" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
