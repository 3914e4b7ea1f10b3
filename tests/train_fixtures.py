"""Training helpers shared by the test modules: a tiny MACE config and the train CLI under torchrun."""

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from workbench.launch.local import train_cli_command
from workbench.train import TrainConfig
from workbench.train.presets import tiny_config

BIN = Path(sys.executable).parent


def tiny(tmp_path: Path, name: str, **kw) -> TrainConfig:
    base = dict(families=["water_clusters", "hea"], max_structures=48, epochs=50, max_steps=60)
    return tiny_config(tmp_path, name, **{**base, **kw})


def run_cli(
    cfg: TrainConfig, tmp_path: Path, nproc: int = 1, env_extra: dict | None = None, restarts: int = 0
) -> subprocess.CompletedProcess:
    path = tmp_path / f"{cfg.name}.yaml"
    cfg.to_yaml(path)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = train_cli_command(path, nproc, restarts)
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


def file_size_limit(limit: int):
    """A ``preexec_fn`` that makes writes past ``limit`` bytes fail with EFBIG: a full disk, for real."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal that kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def pair_with_mace_run_train(cfg: TrainConfig, tmp_path: Path, epochs: int):
    """Real mace_run_train and a workbench ``mace-order`` run (``keep="best"``) on ``cfg``'s split,
    in one thread each: ``(split, mace's model, ours, mace's step losses, ours)``."""
    import json
    from dataclasses import replace

    from workbench.bench.quality import run_mace, run_workbench, write_split

    if cfg.heads:  # each head's split, written; both trainers read the files
        from workbench.train.head_data import head_config

        splits = {h: write_split(head_config(cfg, h), tmp_path / "split" / h) for h in cfg.heads}
        heads = {h: {**cfg.heads[h], "dataset": x["train"], "valid_dataset": x["valid"]} for h, x in splits.items()}
        cfg = replace(cfg, heads=heads, max_structures=None, families=None)
        split = {**splits[next(iter(splits))], "heads": splits}
    else:
        split = write_split(cfg, tmp_path / "split")
    if cfg.multihead_finetuning:  # mace is given the structures our run replays
        from workbench.train.replay import write_replay

        split.update(write_replay(cfg, tmp_path / "split"))
    mace_model, _ = run_mace(cfg, split, tmp_path / "mace", epochs, threads=1)
    files = {} if cfg.heads else dict(dataset=split["train"], valid_dataset=split["valid"])
    ours = replace(
        cfg, name="ours", sampler="mace-order", keep="best", max_structures=None, families=None, epochs=epochs, **files
    )
    our_model, _ = run_workbench(ours, tmp_path / "ours", threads=1)
    results = next((tmp_path / "mace" / "results").glob("*_train.txt")).read_text().splitlines()
    half = len(results) // 2
    if len(results) % 2 == 0 and results[:half] == results[half:]:
        results = results[:half]  # multihead runs: mace 0.3.16 writes every line of this file twice
    theirs = [json.loads(line)["loss"] for line in results if json.loads(line).get("mode") == "opt"]
    return split, mace_model, our_model, theirs, step_losses(ours.run_dir)


def step_losses(run_dir) -> list[float]:
    """Every step's training loss that rank 0 logged."""
    import json

    lines = (Path(run_dir) / "metrics" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line).get("type") == "step"]
