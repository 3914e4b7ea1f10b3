"""The one testing hook of the training loop.

``WORKBENCH_STEP_HOOK="module:function"`` names a function called after every training step as
``function(global_step, rank)``, after the step is logged and before its checkpoint. The suite's
resume and rank-failure tests use it to kill a rank mid-epoch (``tests/fault_injection.py``);
nothing in the package sets it, and unset it costs one dictionary lookup per run. Like
``PYTHONPATH``, it is a setting of the process's owner: it runs code, so it is read from the
environment only, never from a config or a data file.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from workbench.switches import switch

__all__ = ["STEP_HOOK_ENV", "step_hook"]

STEP_HOOK_ENV = "WORKBENCH_STEP_HOOK"


@functools.cache
def step_hook() -> Callable[[int, int], None] | None:
    """The function ``WORKBENCH_STEP_HOOK`` names, imported once per process; None when unset."""
    target = switch(STEP_HOOK_ENV)
    if not target:
        return None
    module, sep, name = target.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{STEP_HOOK_ENV}={target!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), name)
