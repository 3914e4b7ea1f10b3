"""The bin packer under nequip's own trainer: Lightning DDP on 2 CPU ranks, a NequIP model on
the workbench kernels, ``PackedDataLoader`` for the training batches.

A callback (``nequip_fixtures.RecordGraphs``) writes, per rank and step, a fingerprint of each
graph it trained on. Every epoch must train every graph of the training split exactly once,
both ranks must take the same number of steps, and the epochs must differ in order (the
packer draws each epoch's batches after Lightning's ``set_epoch``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from nequip_fixtures import cu_dataset, frame_key

from workbench.packing.loader import PackedDataLoader, graph_sizes

HERE = Path(__file__).resolve().parent
EPOCHS = 2


def nequip_config(data: Path, out: Path) -> dict:
    dataset = {
        "_target_": "nequip.data.dataset.ASEDataset",
        "file_path": str(data),
        "transforms": [
            {"_target_": "nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper", "model_type_names": ["Cu"]},
            {"_target_": "nequip.data.transforms.NeighborListTransform", "r_max": 4.0},
        ],
    }
    loader = {"_target_": "torch.utils.data.DataLoader", "batch_size": 4}
    packed = {
        "_target_": "workbench.packing.loader.PackedDataLoader",
        "capacity": 80,
        "algorithm": "shuffled-paper",
        "seed": 3,
    }
    model = {
        "_target_": "nequip.model.NequIPGNNModel",
        "seed": 1,
        "model_dtype": "float64",
        "type_names": ["Cu"],
        "r_max": 4.0,
        "l_max": 1,
        "num_layers": 2,
        "num_features": 4,
        "radial_mlp_width": 8,
        "avg_num_neighbors": 20.0,
        "per_type_energy_shifts": -0.1,
        "per_type_energy_scales": 0.3,
    }
    return {
        "run": ["train"],
        "data": {
            "_target_": "nequip.data.datamodule.NequIPDataModule",
            "seed": 1,
            "split_dataset": {"dataset": dataset, "train": 24, "val": 6},
            "train_dataloader": packed,
            "val_dataloader": loader,
            "stats_manager": {"_target_": "nequip.data.CommonDataStatisticsManager", "type_names": ["Cu"]},
        },
        "trainer": {
            "_target_": "lightning.Trainer",
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "use_distributed_sampler": False,  # the packer shards the batches itself
            "max_epochs": EPOCHS,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "callbacks": [{"_target_": "nequip_fixtures.RecordGraphs", "path": str(out)}],
        },
        "training_module": {
            "_target_": "nequip.train.NequIPLightningModule",
            "loss": {"_target_": "nequip.train.EnergyForceLoss", "per_atom_energy": True},
            "val_metrics": {"_target_": "nequip.train.EnergyForceMetrics"},
            "optimizer": {"_target_": "torch.optim.Adam", "lr": 0.01},
            "model": {
                "_target_": "nequip.model.modify",
                "modifiers": [{"modifier": "enable_WorkbenchKernels"}],
                "model": model,
            },
        },
    }


def test_packed_loader_guarantees_without_a_trainer(tmp_path):
    """Two ranks: equal batch counts, every graph once per epoch, same batches for the same seed."""
    from nequip.data.dataset import ASEDataset
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper, NeighborListTransform

    data = cu_dataset(tmp_path / "cu.xyz", 30)
    calls: list = []

    def counted(d):
        calls.append(1)
        return d

    ds = ASEDataset(str(data), [ChemicalSpeciesToAtomTypeMapper(["Cu"]), NeighborListTransform(4.0), counted])
    sizes = graph_sizes(ds, edges=True)
    assert len(calls) == 30
    assert len(set(sizes["atoms"].tolist())) >= 4 and (sizes["edges"] > 0).all()
    # the packer's atom counts come without the neighbour list, through nequip's num_atoms
    fast = graph_sizes(ds)
    assert fast.dtype.names == ("atoms",) and np.array_equal(fast["atoms"], sizes["atoms"])
    assert len(calls) == 30, "no transform ran for the atom counts"
    half = torch.utils.data.Subset(ds, list(range(0, 30, 2)))
    both = torch.utils.data.ConcatDataset([half, ds])
    assert np.array_equal(graph_sizes(both)["atoms"], np.concatenate([sizes["atoms"][::2], sizes["atoms"]]))
    loaders = [PackedDataLoader(ds, 120, num_replicas=2, rank=r, sizes=sizes, collate_fn=list) for r in (0, 1)]
    for epoch in (0, 1):
        for dl in loaders:
            dl.set_epoch(epoch)
        batches = [list(dl.batch_sampler) for dl in loaders]
        assert len(batches[0]) == len(batches[1])
        seen = Counter(i for rank in batches for b in rank for i in b)
        assert sorted(seen) == list(range(len(ds))) and set(seen.values()) == {1}
        assert all(sizes["atoms"][b].sum() <= 120 for rank in batches for b in rank)
    again = PackedDataLoader(ds, 120, num_replicas=2, rank=0, sizes=sizes)
    again.set_epoch(1)
    assert list(again.batch_sampler) == batches[0]
    again.load_state_dict({**loaders[0].state_dict(), "batches_done": 2})  # resume after 2 batches
    assert list(again.batch_sampler) == batches[0][2:]


@pytest.mark.timeout(600)
def test_nequip_train_ddp_with_the_packer_trains_every_graph_once_per_epoch(tmp_path):
    data = cu_dataset(tmp_path / "cu.xyz", 30)
    out = tmp_path / "graphs"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(nequip_config(data, out)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", TEST_VAL_TWO="2")
    cmd = [sys.executable, "-m", "nequip.scripts.train", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    records = [json.loads(line) for f in sorted(out.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    ranks = {r["rank"] for r in records}
    assert ranks == {0, 1}
    train = {frame_key(a) for a in _read(data)}
    orders = []
    for epoch in range(EPOCHS):
        steps = [r for r in records if r["epoch"] == epoch]
        per_rank = Counter(r["rank"] for r in steps)
        assert per_rank[0] == per_rank[1] > 0, per_rank  # equal batches per rank
        seen = Counter(k for r in steps for k in r["graphs"])
        assert max(seen.values()) == 1 and len(seen) == 24 and set(seen) <= train, f"epoch {epoch}"
        orders.append([r["graphs"] for r in sorted(steps, key=lambda r: (r["step"], r["rank"]))])
    assert orders[0] != orders[1]  # a new packing each epoch (shuffled-paper draws one per epoch)


def _read(path: Path):
    import ase.io

    return ase.io.read(path, ":")


def test_frame_keys_are_distinct(tmp_path):
    frames = _read(cu_dataset(tmp_path / "cu.xyz", 30))
    assert len({frame_key(a) for a in frames}) == 30
