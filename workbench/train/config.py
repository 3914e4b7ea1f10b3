"""``TrainConfig``: everything a training run needs, loadable from and savable to YAML.

Defaults are the paper's setup (HPDC'25 §5.2): 2 interaction layers, hidden
irreps 128x0e+128x1o, max_ell 3, correlation 3, 8 Bessel functions, cutoff 4.5 Å,
float32, Adam with lr 0.005, EMA of the weights, weighted energy+forces loss,
and the ``paper`` packer with a capacity of 3072 atoms per batch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from workbench.packing.api import ALGORITHMS

SAMPLERS: tuple[str, ...] = tuple(ALGORITHMS)  # one source: the packing algorithms
MODEL_BACKENDS = ("e3nn", "numba", "cueq")  # how the model's hot ops run (workbench.kernels.accelerate)
DTYPES = ("float32", "float64")


@dataclass
class TrainConfig:
    """A training run. Every field has a default; see the module docstring."""

    # run
    name: str = "mace"
    output_dir: str = "runs"
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    # data
    dataset: str | None = None  # None: the embedded mixture; a structure file; or a prepared dataset directory
    valid_fraction: float = 0.1
    max_structures: int | None = None  # keep the first N (after a seeded shuffle), for quick runs
    families: list[str] | None = None  # restrict to these config_types
    energy_key: str = "REF_energy"
    forces_key: str = "REF_forces"
    # model (mace-torch ScaleShiftMACE)
    num_interactions: int = 2
    hidden_irreps: str = "128x0e+128x1o"
    max_ell: int = 3
    correlation: int = 3
    num_bessel: int = 8
    num_polynomial_cutoff: int = 5
    cutoff: float = 4.5
    mlp_irreps: str = "16x0e"
    radial_mlp: list[int] = field(default_factory=lambda: [64, 64, 64])
    dtype: str = "float32"
    # optimisation
    lr: float = 0.005
    weight_decay: float = 0.0
    amsgrad: bool = True
    ema_decay: float | None = 0.99  # None disables EMA
    energy_weight: float = 1.0
    forces_weight: float = 100.0
    lr_factor: float = 0.8  # ReduceLROnPlateau on validation loss, as mace-torch does
    scheduler_patience: int = 50
    clip_grad: float | None = 10.0
    # batching
    sampler: str = "paper"
    capacity: int = 3072  # atoms per batch for the packers
    batch_size: int = 8  # graphs per batch for fixed-count
    # kernels
    backend: str = "e3nn"
    # length and checkpoints
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimiser steps in total
    checkpoint_every: int = 50  # steps; 0 disables mid-epoch checkpoints (one is still written per epoch)
    num_workers: int = 0  # DataLoader processes building graphs (a prepared dataset builds them on demand)
    prefetch_factor: int = 2  # batches each worker builds ahead
    persistent_workers: bool = True  # keep the workers across epochs
    progress: bool = True
    export: bool = True  # write model.model (MACECalculator) and the per-backend model at the end
    dist_timeout_s: int = 1800  # a collective stuck this long fails the group (torchrun can then restart it)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for any invalid value."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}: {why}")

        if self.sampler not in SAMPLERS:
            raise bad("sampler", f"{self.sampler!r} is not one of {', '.join(SAMPLERS)}")
        if self.backend not in MODEL_BACKENDS:
            raise bad("backend", f"{self.backend!r} is not one of {', '.join(MODEL_BACKENDS)}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise bad("valid_fraction", f"must be in [0, 1), got {self.valid_fraction}")
        if int(self.num_workers) < 0:
            raise bad("num_workers", f"must be >= 0, got {self.num_workers}")
        for name in ("capacity", "batch_size", "num_interactions", "correlation", "num_bessel", "epochs",
                     "prefetch_factor"):
            if int(getattr(self, name)) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_ell <= 4:
            raise bad("max_ell", f"must be in 0..4, got {self.max_ell}")
        if self.cutoff <= 0:
            raise bad("cutoff", f"must be > 0, got {self.cutoff}")
        if self.lr <= 0:
            raise bad("lr", f"must be > 0, got {self.lr}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise bad("ema_decay", f"must be in (0, 1) or null, got {self.ema_decay}")
        if self.max_steps is not None and self.max_steps < 1:
            raise bad("max_steps", f"must be >= 1 or null, got {self.max_steps}")
        if not re.fullmatch(r"\s*\d+x\d[eo](\s*\+\s*\d+x\d[eo])*\s*", self.hidden_irreps):
            raise bad("hidden_irreps", f"{self.hidden_irreps!r} is not an irreps string like '128x0e+128x1o'")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise bad("name", f"{self.name!r}: use letters, digits, '.', '_' or '-' (it names the run directory)")

    # -- paths
    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    # -- YAML
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown TrainConfig field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "TrainConfig":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such config file")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of TrainConfig fields, got {type(data).__name__}")
        return cls.from_dict(data, source=str(path))

    def with_overrides(self, items: list[str] | None, source: str = "--set") -> "TrainConfig":
        """A copy with ``key=value`` strings applied (values parsed as YAML: ``capacity=2048``,
        ``families=[mptrj,hea]``); the command lines' ``--set``."""
        import yaml

        overrides = {}
        for item in items or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{source} expects key=value, got {item!r}")
            overrides[key.strip()] = yaml.safe_load(value)
        return TrainConfig.from_dict({**self.to_dict(), **overrides}, source=source) if overrides else self

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)
