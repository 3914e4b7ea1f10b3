r"""Fixed-shape batches: a collated mace batch padded with a ghost graph to a
:class:`~workbench.packing.shapes.FixedShape`, so that every training step has the same tensor
shapes (what a CUDA graph replays).

The ghost graph holds every ghost atom and ghost edge, and the graphs after it are empty:

* ghost atoms sit at the origin with an all-zero one-hot row: their embedding, messages,
  products and readouts are exactly zero, and their E0 is zero;
* ghost edges are self-loops of the first ghost atom through a periodic image
  (``unit_shifts`` (1, 0, 0) in a cubic cell of side :math:`L = 2 r_\mathrm{max}`), so every
  one is :math:`L > r_\mathrm{max}` long, where mace's polynomial envelope and its derivative
  are exactly zero: they add nothing to any message or gradient;
* ghost graphs carry zero labels and zero weights, and the batch's ``real_graphs`` (a 0-d
  tensor) says how many graphs come first and are real. The losses
  (:mod:`workbench.train.loss_terms`) and the step's sums mask the rest out.

The ghost graph's energy is not zero (mace's scale-shift adds its shift per atom); nothing
reads it but the model. Energies, forces, stress and every parameter gradient of the real
graphs equal the unpadded batch's (``tests/test_padding.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.packing.shapes import FixedShape, ShapeLadder

__all__ = ["EDGE_KEYS", "GRAPH_KEYS", "NODE_KEYS", "BatchTooLarge", "pad_batch", "pad_to_ladder", "real_size"]

#: mace ``AtomicData`` fields with a row per atom, per edge, and per graph (``cell`` and
#: ``rcell``: three rows per graph). A field in none of them is refused: padding it by guess
#: could misalign a batch silently.
NODE_KEYS = ("positions", "node_attrs", "forces", "charges", "density_coefficients", "batch")
EDGE_KEYS = ("edge_index", "shifts", "unit_shifts")
CELL_KEYS = ("cell", "rcell")
GRAPH_KEYS = (
    *("weight", "head", "energy_weight", "forces_weight", "stress_weight", "virials_weight"),
    *("dipole_weight", "charges_weight", "polarizability_weight"),
    *("energy", "stress", "virials", "dipole", "polarizability", "elec_temp", "total_charge", "total_spin"),
    *("pbc", "volume", "fermi_level", "external_field"),
)


class BatchTooLarge(ValueError):
    """A batch with more atoms, edges or graphs than its fixed shape leaves room for."""


def real_size(batch) -> tuple[int, int, int]:
    """``(atoms, edges, graphs)`` of a batch's real graphs: without the ghost graph of a padded
    batch (they lead every per-atom, per-edge and per-graph field). No device sync."""
    size = getattr(batch, "__real_size__", None)
    return size if size is not None else (int(batch.num_nodes), int(batch.edge_index.shape[1]), int(batch.num_graphs))


def _room(batch, shape: FixedShape, indices: Sequence[int]) -> tuple[int, int, int]:
    atoms, edges, graphs = int(batch.num_nodes), int(batch.edge_index.shape[1]), int(batch.num_graphs)
    need = {"atoms": (atoms, shape.atoms - 1), "edges": (edges, shape.edges), "graphs": (graphs, shape.graphs - 1)}
    for what, (have, room) in need.items():
        if have > room:
            shown = ", ".join(str(int(i)) for i in list(indices)[:8]) or "unknown"
            raise BatchTooLarge(
                f"a batch of {graphs} graphs (training graphs {shown}) has {have} {what}; its fixed shape "
                f"{shape.as_dict()} leaves room for {room}. Raise TrainConfig.edge_capacity (or unset it) "
                "for edges; atoms and graphs follow from TrainConfig.capacity"
            )
    return shape.atoms - atoms, shape.edges - edges, shape.graphs - graphs


def _ghost_rows(key: str, value: torch.Tensor, rows: int, cell_side: float) -> torch.Tensor:
    """``rows`` ghost rows of per-graph field ``key`` (``value``: the batch's)."""
    shape = (rows * 3 if key in CELL_KEYS else rows, *value.shape[1:])
    ghost = torch.zeros(shape, dtype=value.dtype, device=value.device)
    eye = torch.eye(3, dtype=value.dtype, device=value.device)
    if key == "cell":
        ghost = (cell_side * eye).repeat(rows, 1)
    elif key == "rcell":
        ghost = (eye / cell_side).repeat(rows, 1)
    elif key == "volume":
        ghost.fill_(cell_side**3)
    elif key == "pbc":
        ghost.fill_(True)
    return ghost


def _ghost_edges(key: str, value: torch.Tensor, edges: int, first_ghost: int, cell_side: float) -> torch.Tensor:
    if key == "edge_index":
        return torch.full((2, edges), first_ghost, dtype=value.dtype, device=value.device)
    ghost = torch.zeros((edges, 3), dtype=value.dtype, device=value.device)
    ghost[:, 0] = 1.0 if key == "unit_shifts" else cell_side
    return ghost


def pad_batch(batch, shape: FixedShape, r_max: float, indices: Sequence[int] = ()):
    """``batch`` (a collated mace ``Batch``, changed in place and returned) padded to ``shape``
    with a ghost graph (the module docstring). Raises :class:`BatchTooLarge` naming the
    ``indices`` (training graphs) of a batch that does not fit, and ``KeyError`` for a field
    this module does not know."""
    ghost_atoms, ghost_edges, ghost_graphs = _room(batch, shape, indices)
    atoms, graphs = int(batch.num_nodes), int(batch.num_graphs)
    side = 2.0 * float(r_max)
    for key in batch.keys:
        value = batch[key]
        if key == "ptr" or not isinstance(value, torch.Tensor):
            continue
        if key == "batch":
            ghost = torch.full((ghost_atoms,), graphs, dtype=value.dtype, device=value.device)
        elif key in NODE_KEYS:
            ghost = torch.zeros((ghost_atoms, *value.shape[1:]), dtype=value.dtype, device=value.device)
        elif key in EDGE_KEYS:
            ghost = _ghost_edges(key, value, ghost_edges, atoms, side)
        elif key in GRAPH_KEYS or key in CELL_KEYS:
            ghost = _ghost_rows(key, value, ghost_graphs, side)
        else:
            raise KeyError(f"pad_batch: mace's batch has field {key!r}, which workbench.train.padding does not know")
        batch[key] = torch.cat([value, ghost], dim=1 if key == "edge_index" else 0)
    ptr = batch.ptr
    batch.ptr = torch.cat([ptr, torch.full((ghost_graphs,), shape.atoms, dtype=ptr.dtype, device=ptr.device)])
    batch.real_graphs = torch.tensor(graphs, dtype=torch.int64, device=ptr.device)
    batch.__real_size__ = (atoms, shape.edges - ghost_edges, graphs)
    batch.__num_graphs__ = shape.graphs
    batch.__slices__ = None  # the per-graph slices no longer describe it
    return batch


def pad_to_ladder(batch, ladder: ShapeLadder, r_max: float, indices: Sequence[int] = ()):
    """:func:`pad_batch` to the smallest shape of ``ladder`` with room for the batch's edges."""
    edges = int(batch.edge_index.shape[1])
    shape = ladder.shape_for(edges) if edges <= ladder.edges[-1] else ladder.top  # the top: refused, named
    return pad_batch(batch, shape, r_max, indices)
