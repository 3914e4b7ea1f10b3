"""The packer's argument checks, in one place: counts (``num_replicas``, ``seed``, ``epoch``,
``rank``, the algorithms' integer options) and the capacity.

The rules, and why:

* **Integers** are Python ``int`` or numpy integers. ``bool`` is refused although Python counts it
  as an ``int`` (``num_replicas=True`` is a mistake, never a count of one), and so is every
  ``float``, ``2.0`` included, as PyTorch's ``BatchSampler`` refuses ``batch_size=2.0``: a float
  where a count belongs is most often a quotient that was not rounded. (The trainer's YAML config
  turns ``2.0`` into ``2`` itself before it reaches the packer, see ``workbench.train.values``.)
* **The capacity** is a real number (``int``, ``float`` or a numpy number, not ``bool``), finite,
  ``> 0`` and at most ``2**53``: costs may be floats (seconds from a cost model), so a float
  capacity is valid; sums beyond ``2**53`` are no longer exact in float64.

Every refusal is a ``ValueError`` naming the argument, the value given and what is valid (the
command line reports ``ValueError`` as one line with exit status 2). The launcher's
``workbench.launch.validate.check_count`` sits on a floor above this package, so it cannot be
shared from there.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

#: loads are summed in float64 (and int64): beyond 2**53 sums are no longer exact
EXACT_LIMIT = float(2**53)


def _kind(value: Any) -> str:
    return type(value).__name__


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as a Python ``int`` ``>= minimum``; a ``ValueError`` naming ``name`` otherwise.

    Accepts ``int`` and numpy integers; refuses ``bool``, floats (also ``2.0``) and the rest."""
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not integral or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(
            f"{name} must be {what} (int or numpy integer, not bool or float), got {value!r} ({_kind(value)})"
        )
    return int(value)


def check_capacity(capacity: Any) -> float:
    """The capacity as a float: a finite real number in ``(0, 2**53]``, not ``bool``."""
    real = isinstance(capacity, numbers.Real) and not isinstance(capacity, (bool, np.bool_))
    if not (real and np.isfinite(capacity) and capacity > 0):
        raise ValueError(
            f"capacity must be a finite number > 0 (int or float, not bool), got {capacity!r} ({_kind(capacity)})"
        )
    if capacity > EXACT_LIMIT:
        raise ValueError(f"capacity {capacity:g} is beyond {EXACT_LIMIT:g} (2**53), where sums of sizes are not exact")
    return float(capacity)


#: the algorithms' integer options and their least valid value (None is their default)
INT_OPTIONS = {"graphs_per_batch": 1, "window": 1, "max_restarts": 0}


def check_options(algorithm: str, options: dict, accepted: dict) -> dict:
    """``options`` of ``algorithm``, checked: names among ``accepted`` (name -> default), the
    integer options integers of their range."""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"algorithm {algorithm!r} takes no option {', '.join(unknown)}; its options: {valid}")
    checked = dict(options)
    for name, least in INT_OPTIONS.items():
        if checked.get(name) is not None:
            checked[name] = check_int(name, checked[name], least)
    return checked
