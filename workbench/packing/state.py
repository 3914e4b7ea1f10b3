"""A batch sampler's saved position (``state_dict``) and the check that it belongs to the sampler
it is loaded into.

A state is ``{"epoch", "batches_done"}`` plus the sampler's *identity*: every setting that decides
the sequence of batches (for the bin packer: algorithm and its options, shuffle, seed,
num_replicas, rank, capacity, the number of graphs and a fingerprint of their costs). A position
is only meaningful in the same sequence, so :func:`check_state` refuses a state whose identity
differs, naming each differing field.

Older states: states written before ``shuffle``, ``sizes`` and ``options`` were recorded lack
them. Checkpoints of such runs still resume: a sampler names the fields its older states may lack
(``since``), and a state without them loads, with a warning naming them, when every field it does
hold matches. Any other missing field is an error.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from workbench.packing.checks import check_int

#: what every state holds besides the identity
POSITION = ("epoch", "batches_done")


def sizes_fingerprint(costs: np.ndarray) -> str:
    """16 hex digits of a hash of the per-graph costs as float64 (int and float arrays of the same
    values give the same fingerprint, as they give the same batches)."""
    values = np.ascontiguousarray(np.asarray(costs, dtype=np.float64))
    return hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()


def _same(saved: Any, value: Any) -> bool:
    # True == 1 in Python: a bool stands only for a bool.
    if isinstance(saved, (bool, np.bool_)) or isinstance(value, (bool, np.bool_)):
        return isinstance(saved, (bool, np.bool_)) and isinstance(value, (bool, np.bool_)) and saved == value
    try:
        return bool(saved == value)
    except (TypeError, ValueError):  # e.g. an array where a number belongs
        return False


#: what a field of the identity is, where its name does not say
_MEANING = {"sizes": " (a fingerprint of the per-graph costs)"}


def _differences(key: str, saved: Any, value: Any) -> list[tuple[str, Any, Any]]:
    """``(name, saved, value)`` of each field that differs; in a mapping (the options), each entry."""
    if isinstance(saved, Mapping) and isinstance(value, Mapping):
        names = [*value, *(k for k in saved if k not in value)]
        missing = "(not set)"
        return [
            (f"{key}.{k}", saved.get(k, missing), value.get(k, missing))
            for k in names
            if k not in saved or k not in value or not _same(saved[k], value[k])
        ]
    return [] if _same(saved, value) else [(key, saved, value)]


def _position(state: Any) -> tuple[int, int]:
    """``(epoch, batches_done)`` of a state, checked: a mapping holding both, integers >= 0."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"sampler state must be a dict (what state_dict() returns), got {type(state).__name__}: {state!r:.80}"
        )
    missing = [key for key in POSITION if key not in state]
    if missing:
        raise ValueError(
            f"sampler state lacks {', '.join(missing)}; a state holds {', '.join(POSITION)} and the sampler's "
            "settings (what state_dict() returns)"
        )
    epoch = check_int("sampler state: epoch", state["epoch"])
    return epoch, check_int("sampler state: batches_done", state["batches_done"])


def check_state(state: Any, identity: dict, since: tuple[str, ...] = ()) -> dict:
    """``state`` once it is known to belong to a sampler of ``identity``: a new dict, its position
    as ints, the fields of ``since`` it lacked filled in from ``identity``.

    Refuses (``ValueError``) a state that is not a mapping, lacks the position or a field of
    ``identity`` other than those of ``since``, or holds a value other than this sampler's,
    naming each such field. A state lacking fields of ``since`` (written before they were
    recorded) loads with a warning naming them (once: the state returned holds them)."""
    epoch, done = _position(state)
    differ = [d for key, value in identity.items() if key in state for d in _differences(key, state[key], value)]
    if differ:
        said = "; ".join(
            f"saved with {name}={saved!r}{_MEANING.get(name, '')}, this sampler has {now!r}"
            for name, saved, now in differ
        )
        raise ValueError(f"sampler state was {said}; resume only with the same data and batching settings")
    absent = [key for key in identity if key not in state]
    lacking = [key for key in absent if key not in since]
    if lacking:
        raise ValueError(
            f"sampler state lacks {', '.join(lacking)}; it cannot be checked against this sampler "
            "(a state holds what state_dict() returns)"
        )
    if absent:
        warnings.warn(
            f"sampler state from an older version: it does not record {', '.join(absent)}, so those are not "
            "checked; every setting it records matches, and it resumes",
            stacklevel=3,
        )
    return {**state, **{key: identity[key] for key in absent}, "epoch": epoch, "batches_done": done}
