"""Adversarial probes of the config, the CLI and the packer: every bad value gets one clear line."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workbench.packing import BinPackingBatchSampler, pack
from workbench.train import TrainConfig

BIN = Path(sys.executable).parent


# -- config: numbers as a user means them, every field checked by name --------------------------

def test_numbers_are_parsed_the_way_users_write_them(tmp_path):
    c = TrainConfig().with_overrides(["lr=1e-3", "correlation='3'", "families=mptrj", "seed=7", "clip_grad=null"])
    assert (c.lr, c.correlation, c.families, c.seed, c.clip_grad) == (0.001, 3, ["mptrj"], 7, None)
    assert isinstance(c.lr, float) and isinstance(c.correlation, int)
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nweight_decay: 5E-7\nfamilies: mptrj,hea\nmax_structures: 100.0\n")
    c = TrainConfig.from_yaml(path)
    assert (c.lr, c.weight_decay, c.families, c.max_structures) == (0.001, 5e-7, ["mptrj", "hea"], 100)


@pytest.mark.parametrize("item, message", [
    ("lr=inf", r"TrainConfig.lr: must be a finite number > 0, got inf"),
    ("lr=0", r"TrainConfig.lr: must be a finite number > 0"),
    ("forces_weight=-100", r"TrainConfig.forces_weight: must be a finite number >= 0, got -100"),
    ("clip_grad=-1", r"TrainConfig.clip_grad: must be a finite number > 0 or null, got -1"),
    ("max_structures=-5", r"TrainConfig.max_structures: must be an integer >= 1 or null, got -5"),
    ("cutoff=1000", r"TrainConfig.cutoff: must be a finite number in \(0, 15\], got 1000"),
    ("seed=abc", r"TrainConfig.seed: expected an integer, got 'abc'"),
    ("seed=-1", r"TrainConfig.seed: must be an integer >= 0, got -1"),
    ("radial_mlp=64", r"TrainConfig.radial_mlp: expected a list like \[64, 64\], got 64"),
    ("device=tpu", r"TrainConfig.device: 'tpu' is not one of auto, cpu, cuda, cuda:N"),
    ("capacity=abc", r"TrainConfig.capacity: expected an integer, got 'abc'"),
    ("capacity=.nan", r"TrainConfig.capacity: expected an integer, got nan"),
    ("correlation=x", r"TrainConfig.correlation: expected an integer, got 'x'"),
    ("lr=[1", r"--set lr, line 1: not valid YAML"),
])
def test_bad_values_name_the_field(item, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig().with_overrides([item])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lr: 0.01\nfamilies: [mptrj\nseed: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml, line \d: not valid YAML"):
        TrainConfig.from_yaml(path)


def test_device_cuda_without_gpu_is_a_clear_error(tmp_path):
    import torch

    from workbench.train.loop import _device

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(ValueError, match=r"TrainConfig.device: 'cuda', but no CUDA GPU is visible"):
        _device(TrainConfig(device="cuda"), 0)


def test_cli_error_convention(tmp_path):
    res = subprocess.run([str(BIN / "workbench"), "train", "--set", "lr=abc"], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip() == "workbench: error: TrainConfig.lr: expected a number, got 'abc'"
    res = subprocess.run([str(BIN / "workbench"), "--debug", "train", "--set", "lr=abc"], capture_output=True, text=True)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr


def test_absurd_cutoff_is_refused_before_building_graphs():
    from workbench.data import read_structures
    from workbench.data.embedded import EMBEDDED_PATH
    from workbench.train.data import check_graph_memory

    structures = read_structures(EMBEDDED_PATH)
    assert check_graph_memory(structures, 4.5) < 2**30  # the embedded set at 4.5 Å: well under a GiB
    with pytest.raises(ValueError, match=r"cutoff 14.0 Å: about \d+ neighbours per atom.*GiB"):
        check_graph_memory(structures, 14.0, fraction=0.01)


# -- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["paper", "shuffled-paper", "ffd"])
def test_non_finite_capacity_and_huge_costs(algorithm):
    costs = np.arange(1, 41)
    for capacity in (float("inf"), float("nan"), -1, "abc"):
        with pytest.raises(ValueError, match="capacity must be a finite number > 0"):
            pack(costs, capacity, 2, algorithm=algorithm)
    huge = costs.astype(np.float64).copy()
    huge[7] = 2.0**63
    with pytest.raises(ValueError, match=r"graph 7 has cost .* beyond .*2\*\*53"):
        pack(huge, 1000, 2, algorithm=algorithm)
    with pytest.raises(ValueError, match=r"capacity .* is beyond .*2\*\*53"):
        pack(costs, 2.0**60, 2, algorithm=algorithm)


def test_sampler_state_from_other_data_or_packing_is_refused():
    rng = np.random.default_rng(0)
    costs = rng.integers(5, 100, 400)
    s = BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    assert state["n_graphs"] == 400 and state["capacity"] == 512
    for other, what in ((BinPackingBatchSampler(costs[:300], capacity=512, num_replicas=2, rank=0), "n_graphs=400"),
                        (BinPackingBatchSampler(costs, capacity=256, num_replicas=2, rank=0), "capacity=512"),
                        (BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0, seed=1), "seed=0"),
                        (BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0, algorithm="ffd"),
                         "algorithm='paper'")):
        with pytest.raises(ValueError, match=rf"sampler state was saved with {what}"):
            other.load_state_dict(state)
    same = BinPackingBatchSampler(costs, capacity=512, num_replicas=2, rank=0)
    same.load_state_dict(state)
    assert list(same) == s.rank_batches()[2:]
