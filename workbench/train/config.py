"""``TrainConfig``: everything a training run needs, loadable from and savable to YAML.

Defaults are the paper's setup (HPDC'25 §5.2): 2 interaction layers, hidden
irreps 128x0e+128x1o, max_ell 3, correlation 3, 8 Bessel functions, cutoff 4.5 Å,
float32, Adam with lr 0.005, EMA of the weights, weighted energy+forces loss,
and the ``paper`` packer with a capacity of 3072 atoms per batch. Stress and virials train
when a loss that has them (:mod:`workbench.train.losses`) gets a weight above zero.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from workbench.kernels.registry import backend_names
from workbench.limits import DEFAULT_CAPACITY, MAX_CUTOFF, MAX_ELL_RANGE
from workbench.packing.api import ALGORITHMS
from workbench.packing.shapes import DEFAULT_EDGE_STEP
from workbench.train.e0s import check_e0s
from workbench.train.losses import check_weights, loss_names
from workbench.train.mace_order import NAME as MACE_ORDER
from workbench.train.replay_options import check_replay_fields
from workbench.train.values import MAX_CONFIG_BYTES, ConfigError, Interval, brief, coerce, load_yaml

#: The trainer's samplers: the packing algorithms of the registry, and mace_run_train's own batch
#: order (workbench.train.mace_order). workbench.train.samplers.make_sampler builds them.
SAMPLERS: tuple[str, ...] = (*ALGORITHMS, MACE_ORDER)
#: the samplers whose batches hold at most ``capacity`` atoms (what fixed_shapes pads to)
CAPACITY_SAMPLERS: tuple[str, ...] = tuple(name for name, spec in ALGORITHMS.items() if spec.respects_capacity)
DTYPES = ("float32", "float64")
#: the losses of workbench.train.losses (mace-torch's definitions)
LOSSES: tuple[str, ...] = loss_names()

#: Numeric fields and their accepted ranges (non-finite values are always rejected).
RANGES: dict[str, Interval] = {
    "seed": Interval(0),
    "valid_fraction": Interval(0.0, 1.0, hi_open=True),
    "max_structures": Interval(1),
    "num_interactions": Interval(1),
    "max_ell": Interval(*MAX_ELL_RANGE),
    "correlation": Interval(1, 4),
    "num_bessel": Interval(1),
    "num_polynomial_cutoff": Interval(1),
    "cutoff": Interval(0.0, MAX_CUTOFF, lo_open=True),
    "lr": Interval(0.0, lo_open=True),
    "weight_decay": Interval(0.0),
    "ema_decay": Interval(0.0, 1.0, True, True),
    "energy_weight": Interval(0.0),
    "forces_weight": Interval(0.0),
    "stress_weight": Interval(0.0),
    "virials_weight": Interval(0.0),
    "huber_delta": Interval(0.0, lo_open=True),
    "lr_factor": Interval(0.0, 1.0, lo_open=True),
    "scheduler_patience": Interval(0),
    "clip_grad": Interval(0.0, lo_open=True),
    "capacity": Interval(1),
    "edge_capacity": Interval(1),
    "edge_bucket_step": Interval(0.0, 1.0, hi_open=True),
    "batch_size": Interval(1),
    "epochs": Interval(1),
    "max_steps": Interval(1),
    "checkpoint_every": Interval(0),
    "num_workers": Interval(0),
    "prefetch_factor": Interval(1),
    "dist_timeout_s": Interval(1),
    "num_samples_pt": Interval(1),
    "weight_pt_head": Interval(0.0),
}
#: bounds that keep a typo from allocating gigabytes (mace's foundation models: [64, 64, 64])
MAX_RADIAL_LAYERS, MAX_WIDTH = 16, 16384
NULLABLE = ("max_structures", "ema_decay", "clip_grad", "max_steps", "num_samples_pt", "edge_capacity")
# null means a default; an empty string is a mistake
PATH_FIELDS = ("dataset", "valid_dataset", "foundation_model", "pt_dataset")
ON_NONFINITE = ("stop", "skip")
KEEP = ("last", "best")  # which weights the run exports
#: The fine-tuning fields that shape a run's data: the foundation model (its elements, heads and
#: descriptors) and the replay set drawn from its training data.
FINETUNE_DATA_FIELDS = (
    "foundation_model",
    "foundation_elements",
    "foundation_head",
    "multihead_finetuning",
    "pt_dataset",
    "num_samples_pt",
    "subselect_pt",
    "weight_pt_head",
    "heads",
)
#: The fields that define a run: a checkpoint resumes only under the same values (model, data,
#: split, packing, precision, seed). Others (lr, epochs, max_steps, workers, ...) may change.
RUN_IDENTITY = (
    "dataset",
    "valid_dataset",
    "families",
    "energy_key",
    "forces_key",
    "stress_key",
    "virials_key",
    "max_structures",
    "valid_fraction",
    "seed",
    "num_interactions",
    "hidden_irreps",
    "max_ell",
    "correlation",
    "num_bessel",
    "num_polynomial_cutoff",
    "cutoff",
    "mlp_irreps",
    "radial_mlp",
    "dtype",
    "sampler",
    "capacity",
    "batch_size",
    "e0s",
    *FINETUNE_DATA_FIELDS,
)
#: which elements a fine-tuned model keeps: the data's (mace_run_train's default) or all of the
#: foundation model's (its --foundation_model_elements True)
FOUNDATION_ELEMENTS = ("data", "all")


def _capacity_samplers(sampler: str) -> str:
    return f"choose a sampler that respects it ({', '.join(CAPACITY_SAMPLERS)}), not {sampler!r}"


def _check_cuda_graph(config: TrainConfig) -> None:
    if not config.fixed_shapes:
        raise ConfigError("TrainConfig.cuda_graph: a graph replays one shape; set fixed_shapes: true too")
    kernels = backend_names("descriptor")
    if config.backend not in kernels:
        raise ConfigError(
            f"TrainConfig.cuda_graph: backend {config.backend!r} runs TorchScript or another library's modules, "
            f"which a capture cannot take; choose one of {', '.join(kernels)}"
        )


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
    valid_dataset: str | None = None  # validation structures from this file instead of a valid_fraction split
    valid_fraction: float = 0.1
    max_structures: int | None = None  # keep the first N (after a seeded shuffle), for quick runs
    families: list[str] | None = None  # restrict to these config_types
    energy_key: str = "REF_energy"
    forces_key: str = "REF_forces"
    stress_key: str = "REF_stress"  # eV/Å³, ASE's sign; 3x3, Voigt 6 or 9 numbers (workbench.data.keys)
    virials_key: str = "REF_virials"  # eV
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
    # fine-tuning (workbench.train.foundation): start from a mace model file, whose architecture
    # and weights then define the model above (fields left at their defaults take the file's values)
    foundation_model: str | None = None
    foundation_head: str | None = None  # the head to start from, for a file with several
    foundation_elements: str = "data"  # data: keep the data's elements; all: every element of the file
    e0s: str | dict[int, float] | None = None  # foundation, average, or {Z: eV}; None: foundation when fine-tuning
    trust_model: bool = False  # load foundation_model as a full pickle (runs code from the file)
    # multihead fine-tuning with replay (workbench.train.replay): heads pt_head + Default (or heads)
    multihead_finetuning: bool = False
    pt_dataset: str | None = None  # the pre-training structures to replay: any structure format or a prepared dataset
    num_samples_pt: int | None = 10000  # replayed structures kept (mace's default); None: all
    subselect_pt: str = "random"  # random, or fps (farthest points in the foundation's descriptors)
    weight_pt_head: float = 1.0  # the replayed structures' weight in the loss
    # several new datasets, one head each: {name: {dataset, valid_dataset, valid_fraction, e0s}}
    heads: dict[str, dict[str, Any]] | None = None
    # optimisation
    lr: float = 0.005
    weight_decay: float = 0.0  # > 0: on the parameters mace-torch decays (workbench.train.build.param_groups)
    amsgrad: bool = True
    ema_decay: float | None = 0.99  # None disables EMA
    loss: str = "weighted"  # weighted (E+F), stress, virials, huber, universal: workbench.train.losses
    energy_weight: float = 1.0
    forces_weight: float = 100.0
    stress_weight: float = 0.0  # > 0 with loss stress, huber or universal: the model computes the stress
    virials_weight: float = 0.0  # > 0 with loss virials
    huber_delta: float = 0.01  # the Huber losses' threshold (mace's default)
    lr_factor: float = 0.8  # ReduceLROnPlateau on validation loss, as mace-torch does
    scheduler_patience: int = 50
    clip_grad: float | None = 10.0
    # batching
    sampler: str = "paper"
    capacity: int = DEFAULT_CAPACITY  # atoms per batch, for the samplers that respect a capacity (paper, ffd, ...)
    batch_size: int = (
        8  # graphs per batch for the samplers that batch by count (fixed-count, mace-order; lpt: per rank on average)
    )
    # every batch padded to capacity + 1 atoms and a fixed edge and graph count (workbench.train.padding)
    fixed_shapes: bool = False
    edge_capacity: int | None = None  # with fixed_shapes: real edges per batch; null: a bound no bin can exceed
    edge_bucket_step: float = (
        DEFAULT_EDGE_STEP  # fixed_shapes' edge counts, each this share above the next (0: one shape)
    )
    # with fixed_shapes and a kernel backend: the step as one CUDA graph per shape (workbench.train.graph_step)
    cuda_graph: bool = False
    # kernels
    backend: str = "e3nn"
    kernel_cache: str = ""  # compiled-kernel folder ("": generated.source_dir()'s default); may be shared
    # length and checkpoints
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimiser steps in total
    checkpoint_every: int = 50  # steps; 0 disables mid-epoch checkpoints (one is still written per epoch)
    num_workers: int = 0  # DataLoader processes building graphs (a prepared dataset builds them on demand)
    prefetch_factor: int = 2  # batches each worker builds ahead
    persistent_workers: bool = True  # keep the workers across epochs
    progress: bool = True
    # resume from a checkpoint that needs a full pickle (runs code from the file: only one you wrote yourself)
    trust_checkpoint: bool = False
    export: bool = True  # write model.model (MACECalculator) and the per-backend model at the end
    keep: str = "last"  # export the last weights, or the epoch's with the lowest validation loss (as mace_run_train)
    dist_timeout_s: int = 1800  # a collective stuck this long fails the group (torchrun can then restart it)
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient: stop (naming the graphs) or skip the step
    deterministic: bool = True  # torch.use_deterministic_algorithms; see README "Reproducibility"
    log_graph_ids: bool = False  # each step record lists its graphs (dataset indices): audit an epoch's coverage

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # coerce would read "" as null, silently the default data
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                raise ConfigError(f"TrainConfig.{name}: an empty path; give a file or folder, or null for the default")
        hints = _hints()
        for f in fields(self):  # coerce first: "1e-3", "3", "mptrj,hea" mean what the user meant
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], f"TrainConfig.{f.name}"))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~workbench.train.values.ConfigError` (a ``ValueError``) naming the field
        for any invalid value: its accepted range or choices, and what it got."""

        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"TrainConfig.{name}: {why}")

        for name, choices in (
            ("sampler", SAMPLERS),
            ("backend", backend_names()),  # read now: a backend registered since counts
            ("dtype", DTYPES),
            ("on_nonfinite", ON_NONFINITE),
            ("keep", KEEP),
            ("loss", LOSSES),
            ("foundation_elements", FOUNDATION_ELEMENTS),
        ):
            if getattr(self, name) not in choices:
                raise bad(name, f"{brief(getattr(self, name))} is not one of {', '.join(choices)}")
        hints = _hints()
        for name, interval in RANGES.items():
            value = getattr(self, name)
            if value is None and name in NULLABLE:
                continue
            if value not in interval:
                kind = "an integer" if int in (hints[name], *typing.get_args(hints[name])) else "a finite number"
                raise bad(
                    name, f"must be {interval.describe(kind)}{' or null' if name in NULLABLE else ''}, got {value}"
                )
        if not 1 <= len(self.radial_mlp) <= MAX_RADIAL_LAYERS or not all(1 <= n <= MAX_WIDTH for n in self.radial_mlp):
            raise bad(
                "radial_mlp",
                f"must be 1 to {MAX_RADIAL_LAYERS} layer widths in [1, {MAX_WIDTH}], like [64, 64, 64], "
                f"got {brief(self.radial_mlp)}",
            )
        if self.energy_weight == 0 and self.forces_weight == 0:
            raise bad("forces_weight", "energy_weight and forces_weight are both 0: nothing to train on")
        mismatch = check_weights(self.loss, self.stress_weight, self.virials_weight)
        if mismatch:
            raise bad(*mismatch.split(": ", 1))
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise bad("device", f"{brief(self.device)} is not one of auto, cpu, cuda, cuda:N")
        for name in ("hidden_irreps", "mlp_irreps"):
            if not re.fullmatch(r"\s*\d+x\d[eo](\s*\+\s*\d+x\d[eo])*\s*", getattr(self, name)):
                raise bad(name, f"{brief(getattr(self, name))} is not an irreps string like '128x0e+128x1o'")
            if any(int(m) > MAX_WIDTH for m in re.findall(r"(\d+)x", getattr(self, name))):
                raise bad(name, f"{brief(getattr(self, name))}: a multiplicity above {MAX_WIDTH}")
        if self.fixed_shapes and self.sampler not in CAPACITY_SAMPLERS:
            raise bad("fixed_shapes", f"pads batches to the capacity: {_capacity_samplers(self.sampler)}")
        if self.cuda_graph:
            _check_cuda_graph(self)
        if self.keep == "best" and self.valid_fraction == 0 and not self.valid_dataset:
            raise bad("keep", "'best' picks the epoch by validation loss: set valid_fraction > 0 or valid_dataset")
        if any(c in self.kernel_cache for c in "\n\r\0"):
            raise bad("kernel_cache", f"{brief(self.kernel_cache)}: a folder path on one line")
        self.e0s = check_e0s(self.e0s, self.foundation_model)
        if self.foundation_head is not None and not self.foundation_model:
            raise bad("foundation_head", "names a head of foundation_model, which is not set")
        check_replay_fields(self)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise bad("name", f"{brief(self.name)}: use letters, digits, '.', '_' or '-' (it names the run directory)")

    def identity_changes(self, saved: dict[str, Any]) -> list[str]:
        """``field: saved -> now`` for every :data:`RUN_IDENTITY` field that differs from ``saved``."""

        def ordered(v: Any) -> Any:  # the order of heads is the order of the model's readouts
            return list(v.items()) if isinstance(v, dict) else v

        return [
            f"{k}: {saved.get(k)!r} -> {getattr(self, k)!r}"
            for k in RUN_IDENTITY
            if k in saved and ordered(saved[k]) != ordered(getattr(self, k))
        ]

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
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ConfigError(
                f"{source}: unknown TrainConfig field(s) {brief(unknown)}; valid fields: {', '.join(sorted(known))}"
            )
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> TrainConfig:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such config file")
        if path.stat().st_size > MAX_CONFIG_BYTES:  # before reading it: a 90 MB "config" is a mistake
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes; a config is at most {MAX_CONFIG_BYTES:,}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config is a YAML file") from None
        data = load_yaml(text, str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of TrainConfig fields, got {type(data).__name__}")
        return cls.from_dict(data, source=str(path))

    def with_overrides(self, items: list[str] | None, source: str = "--set") -> TrainConfig:
        """A copy with ``key=value`` strings applied (values parsed as YAML: ``capacity=2048``,
        ``families=[mptrj,hea]``); the command lines' ``--set``."""
        overrides = {}
        for item in items or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"{source} expects key=value, got {brief(item)}")
            if not value.strip():  # "dataset=" would read as null: the embedded data, not what was meant
                raise ConfigError(
                    f"{source} {item}: no value for {key.strip()}; give one (null for none), "
                    f"or leave {key.strip()} out for its default"
                )
            overrides[key.strip()] = load_yaml(value, f"{source} {key.strip()}")
        return TrainConfig.from_dict({**self.to_dict(), **overrides}, source=source) if overrides else self

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)
