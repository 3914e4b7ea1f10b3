"""How a run chooses its graphs: the seeded train/validation split and the digest of what was
chosen (a resume checks it). Shared by the training data and the replay of multihead fine-tuning."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["configs_fingerprint", "hasher", "split_order"]


def hasher():
    import hashlib

    return hashlib.blake2b(digest_size=16)


def configs_fingerprint(configs: Sequence) -> str:
    """A digest of mace ``Configuration`` s: elements, geometry, labels, weights and family, in order."""
    h = hasher()
    for c in configs:
        values = (c.atomic_numbers, c.positions, c.cell, c.pbc, c.properties.get("energy"), c.properties.get("forces"))
        # stress and virials only where present: a dataset without them keeps its digest of before
        tensors = [c.properties[k] for k in ("stress", "virials") if c.properties.get(k) is not None]
        for v in (*values, *tensors, c.weight, c.config_type):
            if v is None or isinstance(v, str):
                h.update(f"<{v}>".encode())
            else:
                h.update(np.ascontiguousarray(np.asarray(v, dtype=np.float64)).tobytes())
    return h.hexdigest()


def split_order(n: int, config) -> tuple[np.ndarray, np.ndarray]:
    """``(train, valid)`` positions into ``n`` candidate graphs: a seeded shuffle, the
    ``max_structures`` cut, then the first ``valid_fraction`` for validation (none when
    ``valid_dataset`` names a validation file)."""
    order = np.random.default_rng(config.seed).permutation(n)
    if config.max_structures:
        order = order[: config.max_structures]
    if config.valid_dataset:  # validation comes from its own file: every candidate trains
        return order, order[:0]
    n_valid = round(config.valid_fraction * len(order))
    if config.valid_fraction > 0 and len(order) >= 2:
        n_valid = max(n_valid, 1)
    if len(order) - n_valid < 1:
        raise ValueError(
            f"dataset has {len(order)} structure(s): too few for a train/validation split "
            f"with valid_fraction={config.valid_fraction}"
        )
    return order[n_valid:], order[:n_valid]
