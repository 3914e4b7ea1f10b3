"""Fine-tuning fixtures: a small foundation model trained by real mace_run_train on the mixture's
mptrj structures (with stress), its pre-training file (the replay source), and hea alloys to
fine-tune on. Import the fixtures by name into a test module (each module builds its own)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent
#: the foundation's architecture as TrainConfig fields (a fine-tuning run must match it)
ARCH = dict(hidden_irreps="8x0e+8x1o", max_ell=1, correlation=2, num_interactions=2, cutoff=4.0)
ARCH.update(radial_mlp=[16, 16], num_bessel=8)


def residual_mace(**fields):
    """A random-weight mace-torch ``ScaleShiftMACE`` with residual interactions, max_ell 1,
    correlation 2 and 2 interactions (``fields`` set the rest), built in float64."""
    from mace import modules

    from workbench.dtypes import default_dtype

    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    common = dict(num_polynomial_cutoff=5, max_ell=1, num_interactions=2, correlation=2)
    common.update(interaction_cls=block, interaction_cls_first=block, gate=torch.nn.functional.silu)
    with default_dtype(torch.float64):
        return modules.ScaleShiftMACE(**common, **fields)


def write_family(path: Path, families: list[str], n: int, max_atoms: int) -> Path:
    """The first ``n`` embedded structures of ``families`` with at most ``max_atoms`` atoms, written to ``path``."""
    from workbench.data.embedded import load_embedded
    from workbench.data.io import write_structures

    picked = [a for a in load_embedded() if a.info.get("config_type") in families and len(a) <= max_atoms][:n]
    write_structures(path, picked)
    return path


@pytest.fixture(scope="module")
def foundation(tmp_path_factory) -> Path:
    """A foundation model by mace_run_train: 24 small mptrj structures, with stress, float64."""
    where = tmp_path_factory.mktemp("foundation")
    train = write_family(where / "pt.extxyz", ["mptrj"], 24, 16)
    cmd = [str(BIN / "mace_run_train"), "--name", "found", "--seed", "1", "--work_dir", str(where), "--device", "cpu"]
    cmd += ["--default_dtype", "float64", "--model", "ScaleShiftMACE", "--train_file", str(train)]
    cmd += ["--valid_fraction", "0.2", "--E0s", "average", "--r_max", "4.0", "--max_ell", "1", "--correlation", "2"]
    cmd += ["--hidden_irreps", "8x0e+8x1o", "--MLP_irreps", "8x0e", "--radial_MLP", "[16,16]", "--batch_size", "4"]
    cmd += ["--max_num_epochs", "1", "--loss", "stress", "--stress_weight", "10", "--energy_key", "REF_energy"]
    cmd += ["--forces_key", "REF_forces", "--stress_key", "REF_stress", "--eval_interval", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": str(BIN)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return where / "found.model"


@pytest.fixture(scope="module")
def hea(tmp_path_factory) -> Path:
    return write_family(tmp_path_factory.mktemp("hea") / "hea.extxyz", ["hea"], 19, 1000)


@pytest.fixture(scope="module")
def pt_file(foundation) -> Path:
    """The foundation's pre-training structures (the replay source of multihead fine-tuning)."""
    return foundation.parent / "pt.extxyz"


def train_cli(tmp_path: Path, cfg, *extra: str) -> tuple[int, str]:
    """``workbench train`` on ``cfg`` (written as YAML) with ``extra`` arguments: ``(exit code, stderr)``."""
    from workbench.cli import main

    path = tmp_path / "cli.yaml"
    cfg.to_yaml(path)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh, pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", fh)
        code = main(["train", "--config", str(path), *extra])
    return code, err.read_text()
