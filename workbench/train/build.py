"""The model and what trains it: mace-torch's ScaleShiftMACE (accelerated when asked), Adam with
mace-torch's parameter groups, the plateau scheduler, the EMA of the weights and the loss."""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.kernels.registry import get_backend
from workbench.train import mace_order
from workbench.train.session import Session

#: the modules whose parameters mace-torch's optimiser steps (``get_params_options``)
TRAINED_MODULES = ("node_embedding", "interactions", "products", "readouts")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The optimiser's parameter groups: the parameters of :data:`TRAINED_MODULES`, as mace-torch
    steps (a fine-tuned model's Bessel weights are parameters that mace never steps). Without
    weight decay, one group. With it, mace-torch's split: decay on the interactions'
    ``linear.weight`` and ``skip_tp_full.weight`` and on the products, none on the rest."""
    trained = [p for name in TRAINED_MODULES for p in getattr(model, name).parameters()]
    if not weight_decay:
        return [{"params": trained, "weight_decay": 0.0}]
    decay = [p for n, p in model.interactions.named_parameters() if "linear.weight" in n or "skip_tp_full.weight" in n]
    decay += list(model.products.parameters())
    chosen = {id(p) for p in decay}
    rest = [p for p in trained if id(p) not in chosen]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_training(s: Session, ckpt: dict | None) -> None:
    """Model (accelerated when asked), optimiser, scheduler, EMA and loss."""
    from workbench.train.losses import build_loss, outputs_needed

    config = s.config
    s.stats = _stats(s, ckpt)
    # the initial weights depend on the seed and the model only, not on what drew random numbers
    # before (data loaders do): the same as mace_run_train's for the same seed and recipe
    torch.manual_seed(config.seed)
    s.model = _model(config, s.stats).to(s.device)
    if get_backend(config.backend).kind != "native":
        from workbench.kernels import accelerate

        if config.kernel_cache:  # for the rest of the rank's life; the precompile workers inherit it
            from workbench.kernels.options import configure

            configure(kernel_cache=str(Path(config.kernel_cache).expanduser().resolve()))
        # on a GPU, numba's kernels compile here, in parallel, once per node (rank 0 of a node
        # compiles under a file lock, the others wait and load the cache)
        s.model = accelerate(s.model, backend=config.backend).to(s.device)
    if config.cuda_graph:
        _prepare_capture(s)
    # the graph step skips a non-finite update on the device: fused Adam reads found_inf
    graph = {"fused": True, "capturable": s.device.type == "cuda"} if config.cuda_graph else {}
    s.optimizer = torch.optim.Adam(
        param_groups(s.model, config.weight_decay), lr=config.lr, amsgrad=config.amsgrad, **graph
    )
    s.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        s.optimizer, factor=config.lr_factor, patience=config.scheduler_patience
    )
    if config.ema_decay is not None:
        from torch_ema import ExponentialMovingAverage

        s.ema = ExponentialMovingAverage(s.model.parameters(), decay=config.ema_decay)
    check_labels_for_loss(config, s.data.train_labels)
    s.loss_fn = build_loss(config).to(s.device)
    stress, virials = outputs_needed(config.loss, config.stress_weight, config.virials_weight)
    s.outputs = {"compute_stress": stress, "compute_virials": virials}
    if config.fixed_shapes:
        _fix_shapes(s)
    if config.cuda_graph:
        from workbench.train.graph_step import StepGraphs

        s.optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=s.device)
        s.graphs = StepGraphs(s)


def _prepare_capture(s: Session) -> None:
    """The model made free of host syncs for the graph step (one rank: DDP's all-reduce is
    not in the captured step yet)."""
    from workbench.kernels.compiling import capture_ready
    from workbench.train.values import ConfigError

    if s.world > 1:
        raise ConfigError(
            f"TrainConfig.cuda_graph: captures one rank's step; this run has {s.world} ranks "
            "(DDP's gradient all-reduce is not captured yet); set cuda_graph: false, or train on one GPU"
        )
    for line in capture_ready(s.model, s.config.backend):
        s.say(f"cuda_graph: {line}")
    if s.device.type != "cuda":
        s.say("cuda_graph: no GPU, so the capture-safe step runs eagerly (what a GPU would capture)")


def _fix_shapes(s: Session) -> None:
    """The shapes training batches are padded to (the same on every rank: a function of the
    training split and the config alone)."""
    from workbench.packing.shapes import fixed_shape, shape_ladder

    config = s.config
    top = fixed_shape(s.data.train_atoms, s.data.train_edges, config.capacity, config.edge_capacity)
    s.shapes = shape_ladder(top, config.edge_bucket_step)
    s.r_max = float(s.model.r_max)
    s.say(
        f"fixed shapes: batches padded to {top.atoms} atoms, {top.graphs} graphs and the smallest of "
        f"{len(s.shapes.edges)} edge counts up to {top.edges} that holds them (edge_bucket_step {config.edge_bucket_step:g})"
    )


def _stats(s: Session, ckpt: dict | None):
    """The model's constants: a checkpoint's, the foundation's (fine-tuning, E0s per
    ``config.e0s``), or the training split's (mace-order: over mace's statistics passes)."""
    from workbench.train.stats import ModelStats, compute_stats

    config = s.config
    if ckpt:
        return ModelStats(**ckpt["stats"])
    if config.multihead_finetuning:  # every constant is the foundation's (mace refuses E0s average here)
        from workbench.train.foundation import finetune_stats

        by_head = {h: s.data.new_train_configs(h) for h in config.heads or ()}
        return finetune_stats(config, list(s.data.z_table.zs), {}, s.data.new_train_configs(), by_head)
    if config.sampler == mace_order.NAME:  # mace's statistics passes: particular to this seed and batch size
        if not s.data.train_configs:
            raise ValueError(
                f"sampler {mace_order.NAME!r} needs the structures in memory (an extxyz dataset), "
                "not a prepared dataset"
            )
        stats = compute_stats(s.data.train_configs, s.data.train, s.data.z_table, *s.sampler.statistics_rows())
    else:
        if s.data.stats is None:
            s.data.stats = compute_stats(s.data.train_configs, s.data.train, s.data.z_table)
        stats = s.data.stats
    if config.foundation_model:  # fine-tuning: the foundation's statistics, E0s per config.e0s
        from workbench.train.foundation import finetune_stats

        fitted = {z: e for z, e in zip(stats.zs, stats.e0s) if z in set(s.data.train_elements)}
        stats = finetune_stats(config, list(s.data.z_table.zs), fitted, s.data.new_train_configs())
    return stats


def _model(config, stats) -> torch.nn.Module:
    """A new ScaleShiftMACE, or the foundation model's rebuild when fine-tuning."""
    if config.foundation_model:
        from workbench.train.foundation import build_finetune_model

        return build_finetune_model(config, stats)
    from workbench.train.model import build_model

    return build_model(config, stats)


def check_labels_for_loss(config, counts: dict) -> None:
    """Refuse a stress (virials) term that no training graph has a label for: it would train nothing."""
    from workbench.train.losses import outputs_needed
    from workbench.train.values import ConfigError

    for name, needed in zip(
        ("stress", "virials"), outputs_needed(config.loss, config.stress_weight, config.virials_weight)
    ):
        if needed and not counts.get(name):
            key = getattr(config, f"{name}_key")
            raise ConfigError(
                f"TrainConfig.{name}_weight: {getattr(config, f'{name}_weight'):g}, but no training graph has a "
                f"{name} label ({name}_key {key!r}); set {name}_key to the file's key (a prepared dataset: "
                f"prepare it again with --{name}-key), or {name}_weight to 0"
            )
