"""Mini-batches as multi-objective bin packing (HPDC'25 §3), served to DDP as a batch sampler.

``pack(costs, capacity, num_replicas, algorithm, seed)`` returns a :class:`Packing`
whose batch ``k`` runs on rank ``k % num_replicas`` at step ``k // num_replicas``.
Algorithms: see :data:`ALGORITHMS` (``paper`` is Algorithm 1, its ambiguities are
resolved in :mod:`workbench.packing.paper`; ``shuffled-paper`` restores
randomness across epochs). :class:`BinPackingBatchSampler` is the DDP sampler.
"""

from typing import TYPE_CHECKING

from workbench.limits import DEFAULT_CAPACITY
from workbench.packing.api import ALGORITHMS, Algorithm, Packing, pack
from workbench.packing.cost import CostModel
from workbench.packing.metrics import lower_bound_bins, packing_metrics, pair_repeat_fraction, step_imbalance

if TYPE_CHECKING:  # static readers (the API reference) see the sampler; at run time __getattr__ imports it
    from workbench.packing.sampler import BinPackingBatchSampler


def __getattr__(name: str):
    # The sampler needs torch; import it only when asked so `pack` stays light.
    if name == "BinPackingBatchSampler":
        from workbench.packing.sampler import BinPackingBatchSampler

        return BinPackingBatchSampler
    raise AttributeError(f"module 'workbench.packing' has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "DEFAULT_CAPACITY",
    "Algorithm",
    "BinPackingBatchSampler",
    "CostModel",
    "Packing",
    "lower_bound_bins",
    "pack",
    "packing_metrics",
    "pair_repeat_fraction",
    "step_imbalance",
]
