"""The process-level switches: every ``WORKBENCH_*`` environment variable that is not a kernel
option, with the one module that reads it. The kernel options have their own list
(:data:`workbench.kernels.options.ENV`); nothing else in the package reads a ``WORKBENCH_*``
variable, and no module sets one for another to read (``tests/test_structure.py`` holds both).

A switch says something about the process or the machine (where caches and runs live, which
interpreter has nequip, which signals mean "stop at the next step"), not about one call, so it is
read where it acts; the entry points pass every other choice down as a value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SWITCHES", "Switch", "switch"]


@dataclass(frozen=True)
class Switch:
    """One variable: the module that reads it, and what it does."""

    owner: str
    meaning: str


SWITCHES: dict[str, Switch] = {
    "WORKBENCH_CACHE_DIR": Switch(
        "workbench.cache_dir", "root of the workbench's caches (default ~/.cache/cfm-workbench)"
    ),
    "WORKBENCH_DATA_CACHE": Switch("workbench.data.cache", "0: read structure files without the parsed-frame cache"),
    "WORKBENCH_DATA": Switch("workbench.data.embedded", "a folder holding a copy of the embedded dataset"),
    "WORKBENCH_RUNS": Switch("workbench.viz.paths", "the notebooks' runs folder (default <repo>/runs)"),
    "WORKBENCH_NEQUIP_PYTHON": Switch(
        "workbench.bench.nequip_env", "the Python interpreter with nequip installed (default .venv-nequip)"
    ),
    "WORKBENCH_NOTEBOOK_TINY": Switch("workbench.viz.nequip_views", "1: the NequIP notebook runs its smallest case"),
    "WORKBENCH_SHOW_MACE_NOTICES": Switch("workbench.quiet", "1: keep mace-torch's import notices"),
    "WORKBENCH_PREEMPT_SIGNALS": Switch(
        "workbench.train.preempt", "signals that stop every rank at one step boundary with a checkpoint"
    ),
    "WORKBENCH_STEP_HOOK": Switch("workbench.train.hooks", "module:function called after every training step"),
    "WORKBENCH_ATTEMPT": Switch("workbench.launch.worker", "the attempt id the local launcher gives a worker"),
}


def switch(name: str, default: str = "") -> str:
    """The value of the switch ``name`` (``default`` when unset or empty); a KeyError for a name
    that is not in :data:`SWITCHES`, so a new variable gets listed before it is read."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a process-level switch; list it in workbench.switches.SWITCHES")
    return os.environ.get(name) or default
