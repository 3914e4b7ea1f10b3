"""The Allegro family for :func:`~workbench.kernels.accelerate`: its hot op is the ``Contracter``
of every Allegro layer (:mod:`.contracter`), swapped in place. Registered in
:mod:`workbench.kernels.registry` as ``"allegro"``; cuEquivariance and Triton are Allegro's own
modifiers, so this adapter converts to nothing.
"""

from __future__ import annotations

from workbench.kernels.allegro.contracter import SWAP

__all__ = ["OPS", "accelerated", "convert", "matches", "model_ops", "to_native", "to_workbench"]

OPS = SWAP.OPS
matches, to_workbench, to_native = SWAP.matches, SWAP.to_workbench, SWAP.to_native
accelerated, convert, model_ops = SWAP.accelerated, SWAP.convert, SWAP.model_ops
