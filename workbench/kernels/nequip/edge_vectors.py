r"""nequip's ``SphericalHarmonicEdgeAttrs`` with the edge vectors of a batch computed frame by frame.

The vector of edge :math:`e` from atom :math:`i` to :math:`j` with cell shift :math:`s_e` in
frame :math:`f` is

.. math::

    r_e = x_j - x_i + s_e\, H_f

(``H_f`` the frame's cell, vectors as rows). For a batch, nequip gathers the cell of every edge
(``[E, 3, 3]``) and takes one batched product; the stress then differentiates that gather, an
``index_add`` of ``[E, 3, 3]`` into ``[frames, 3, 3]``. Edges come frame after frame, so here
each frame's shifts are one ``[E_f, 3] x [3, 3]`` product with its own cell, and the cell's
gradient one ``[3, E_f] x [E_f, 3]`` (NequIP's tutorial MD step, 11,050 edges: the gather and
its gradient took ~0.4 ms). Values agree with nequip's to rounding.

The module then runs as nequip's (the spherical harmonics are e3nn's). Where this form does
not apply nequip computes the vectors itself: vectors already in the data, no cell or no batch
index, tensors off the CPU (the frame sizes are read on the host), or edges not grouped by frame.
"""

from __future__ import annotations

import torch

from workbench.kernels.class_swap import ClassSwap

__all__ = ["SWAP", "WorkbenchSphericalHarmonicEdgeAttrs", "edge_vectors"]  # noqa: F822 (module __getattr__)


def edge_vectors(data: dict) -> torch.Tensor | None:
    """``[E, 3]``: the edge vectors of nequip batch ``data`` frame by frame, or None where this
    form does not apply (module docstring)."""
    from nequip.data import AtomicDataDict as K

    if K.EDGE_VECTORS_KEY in data or K.CELL_KEY not in data or K.BATCH_KEY not in data:
        return None
    pos, edges, cell = data[K.POSITIONS_KEY], data[K.EDGE_INDEX_KEY], data[K.CELL_KEY]
    shift = data[K.EDGE_CELL_SHIFT_KEY]
    if any(t.device.type != "cpu" for t in (pos, edges, cell, shift)) or cell.dim() != 3:
        return None
    frame = data[K.BATCH_KEY].index_select(0, edges[0])
    if frame.shape[0] > 1 and not bool((frame[1:] >= frame[:-1]).all()):
        return None
    counts = torch.bincount(frame, minlength=cell.shape[0]).tolist()
    if len(counts) != cell.shape[0]:
        return None  # a frame index beyond the cells: nequip's own error
    parts, start = [], 0
    for f, n in enumerate(counts):
        if n:
            parts.append(shift[start : start + n] @ cell[f])
        start += n
    vec = pos.index_select(0, edges[1]) - pos.index_select(0, edges[0])
    if not parts:
        return vec
    return vec + (parts[0] if len(parts) == 1 else torch.cat(parts))


def _make_class() -> type:
    from nequip.data import AtomicDataDict

    class WorkbenchSphericalHarmonicEdgeAttrs(SWAP.native()):
        """nequip's ``SphericalHarmonicEdgeAttrs`` computing a batch's edge vectors per frame."""

        def forward(self, data: dict) -> dict:
            vec = edge_vectors(data)
            if vec is not None:
                data[AtomicDataDict.EDGE_VECTORS_KEY] = vec
            return super().forward(data)

    return WorkbenchSphericalHarmonicEdgeAttrs


# built on first use: importing the workbench does not import nequip
SWAP = ClassSwap.companion(
    "edge_vectors", "nequip.nn.embedding._edge.SphericalHarmonicEdgeAttrs", globals(), _make_class
)
__getattr__ = SWAP.ours.module_getattr
