"""``Session``: everything one rank holds while it trains, filled in step by step:
:func:`~workbench.train.loop.set_up` (device, data, sampler, run directory),
:func:`~workbench.train.build.build_training` (model, optimiser, scheduler, EMA, loss),
:func:`~workbench.train.resume.restore` (counters and sampler position from a checkpoint) and
:func:`~workbench.train.distributed.wrap_ddp`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch_ema import ExponentialMovingAverage

from workbench.packing.shapes import ShapeLadder
from workbench.train.config import TrainConfig
from workbench.train.data import TrainData
from workbench.train.rundir import RunDir
from workbench.train.samplers import RecordingSampler, TrainSampler
from workbench.train.stats import ModelStats
from workbench.train.timing import AllreduceTimer


@dataclass
class Session:
    """Everything one rank holds while it trains. The fields after ``run`` are None until the
    step that fills them (see the module docstring)."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    data: TrainData
    sampler: TrainSampler
    run: RunDir
    # build_training
    stats: ModelStats | None = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.ReduceLROnPlateau | None = None
    ema: ExponentialMovingAverage | None = None
    loss_fn: torch.nn.Module | None = None  # the config's loss (workbench.train.losses)
    outputs: dict = field(default_factory=dict)  # compute_stress / compute_virials: what the loss trains
    shapes: ShapeLadder | None = None  # fixed_shapes: what training batches are padded to
    r_max: float = 0.0  # the model's cutoff: ghost edges are longer
    graphs: object | None = None  # cuda_graph: the captured steps (workbench.train.graph_step.StepGraphs)
    # wrap_ddp
    net: torch.nn.Module | None = None  # the DDP wrapper (or the model itself on one rank)
    timer: AllreduceTimer | None = None  # time blocked in the gradient all-reduce (DDP only)
    # progress, and what restore sets
    epoch: int = 0
    global_step: int = 0
    resume_sampler: dict | None = None  # this rank's sampler position in the checkpoint, used by its epoch
    loader: torch.utils.data.DataLoader | None = (
        None  # the training DataLoader, kept across epochs (its workers persist)
    )
    recording: RecordingSampler | None = None  # the loader's sampler: which graphs each batch holds
    last_loss: float = float("nan")
    best: dict | None = None  # keep="best": {"epoch", "loss", "model": state dict (EMA weights)} of the best epoch
    done: bool = False
    steps_run: int = 0  # steps this process took (since its start or resume), and how many were skipped
    steps_skipped: int = 0

    def say(self, message: str) -> None:
        """A line on stderr, from rank 0 only."""
        if self.rank == 0:
            print(f"workbench: {message}", file=sys.stderr, flush=True)
