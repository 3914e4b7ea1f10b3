"""A foundation model saved with cuEquivariance layers (mace's --enable_cueq): read without running
code from it, converted to e3nn by mace's own converter, and fine-tuned as its e3nn twin is.

cuEquivariance's Python layers live in ``.venv/cueq-lib`` (the Makefile installs them there, off
the main environment's path, where they would make the cueq backend count as available); the
runs that need them are subprocesses with that folder on PYTHONPATH."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from finetune_fixtures import foundation, hea  # noqa: F401 (fixtures)
from train_fixtures import step_losses

from workbench.train.config import TrainConfig

CUEQ_LIB = Path(sys.prefix) / "cueq-lib"


def _with_cueq(code: str, *args: str) -> subprocess.CompletedProcess:
    if not (CUEQ_LIB / "cuequivariance_torch").is_dir():
        pytest.fail(f"{CUEQ_LIB} is missing: run `make test` (it installs cuEquivariance's Python layers there)")
    env = dict(os.environ, PYTHONPATH=str(CUEQ_LIB), OMP_NUM_THREADS="1", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def cueq_file(foundation, tmp_path_factory) -> Path:  # noqa: F811
    """The foundation converted to cuEquivariance layers by mace's converter, as --enable_cueq saves it."""
    out = tmp_path_factory.mktemp("cueq") / "found_cueq.model"
    code = (
        "import sys, torch\n"
        "from mace.cli.convert_e3nn_cueq import run\n"
        "m = torch.load(sys.argv[1], weights_only=False)\n"
        "torch.save(run(m, device='cpu', return_model=True), sys.argv[2])\n"
    )
    done = _with_cueq(code, str(foundation), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _cfg(tmp_path: Path, model: Path, data: Path, name: str) -> TrainConfig:
    return TrainConfig(
        name=name,
        output_dir=str(tmp_path),
        dataset=str(data),
        foundation_model=str(model),
        dtype="float64",
        sampler="fixed-count",
        batch_size=4,
        max_steps=3,
        progress=False,
        checkpoint_every=0,
        export=False,
    )


def test_a_cueq_file_is_converted_and_finetunes_as_its_e3nn_twin(tmp_path, foundation, hea, cueq_file):  # noqa: F811
    from workbench.train import train

    e3nn = _cfg(tmp_path, foundation, hea, "e3nn")
    train(e3nn)
    cueq = _cfg(tmp_path, cueq_file, hea, "cueq")
    path = tmp_path / "cueq.yaml"
    cueq.to_yaml(path)
    code = "import sys; from workbench.cli import main; sys.exit(main(['train', '--config', sys.argv[1]]))"
    done = _with_cueq(code, str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "full pickle" not in done.stderr  # read by the safe loader, no trust_model needed
    np.testing.assert_allclose(step_losses(cueq.run_dir), step_losses(e3nn.run_dir), rtol=1e-10)


def test_without_cuequivariance_the_file_is_one_line_naming_the_fix(tmp_path, hea, cueq_file):  # noqa: F811
    from workbench.cli import main

    path = tmp_path / "cueq.yaml"
    _cfg(tmp_path, cueq_file, hea, "cueq").to_yaml(path)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh, pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", fh)
        code = main(["train", "--config", str(path)])
    lines = [line for line in err.read_text().splitlines() if line.startswith("workbench: error:")]
    assert code == 2 and len(lines) == 1, err.read_text()
    assert re.search(r"found_cueq\.model: saved with cuEquivariance layers.*pip install cuequivariance-torch", lines[0])
