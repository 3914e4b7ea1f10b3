"""Training helpers shared by the test modules: a tiny MACE config and the train CLI under torchrun."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from workbench.train import TrainConfig

BIN = Path(sys.executable).parent


def tiny(tmp_path: Path, name: str, **kw) -> TrainConfig:
    base = dict(
        name=name,
        output_dir=str(tmp_path),
        hidden_irreps="8x0e+8x1o",
        max_ell=1,
        correlation=2,
        num_bessel=4,
        radial_mlp=[16, 16],
        families=["water_clusters", "hea"],
        max_structures=48,
        valid_fraction=0.1,
        capacity=200,
        epochs=50,
        max_steps=60,
        checkpoint_every=4,
        lr=0.01,
        progress=False,
        seed=3,
        dist_timeout_s=120,
    )
    base.update(kw)
    return TrainConfig(**base)


def run_cli(
    cfg: TrainConfig, tmp_path: Path, nproc: int = 1, env_extra: dict | None = None, restarts: int = 0
) -> subprocess.CompletedProcess:
    path = tmp_path / f"{cfg.name}.yaml"
    cfg.to_yaml(path)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    if nproc == 1:
        cmd = [str(BIN / "workbench"), "train", "--config", str(path)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}",
            "--no-python",
            str(BIN / "workbench"),
            "train",
            "--config",
            str(path),
        ]
    # Own process group, so a hung torchrun is killed together with its workers.
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired as timeout:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"training timed out after 400 s:\n{err[-4000:]}") from timeout
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
