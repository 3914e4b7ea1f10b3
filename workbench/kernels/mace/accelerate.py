"""Moved: :func:`workbench.kernels.acceleration.accelerate` (model-agnostic, reads the registry) and
:mod:`workbench.kernels.mace.adapter` (the MACE family). Kept while callers move over."""

from workbench.kernels.acceleration import AVAILABLE_OPS, KERNEL_BACKENDS, accelerate, model_ops, precompile_model

__all__ = ["AVAILABLE_OPS", "KERNEL_BACKENDS", "accelerate", "model_ops", "precompile_model"]
