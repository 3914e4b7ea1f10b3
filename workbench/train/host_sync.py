"""Catch host synchronisations in code meant to be captured in a CUDA graph, on any device.

A CUDA graph replays device work only: any value the host reads back during capture (``.item()``,
``bool(t)``, ``float(t)``, ``.tolist()``), any tensor built from host data (``torch.tensor``:
a copy from pageable host memory) or any op whose output size depends on the data (boolean
indexing, ``nonzero``, ``unique``) either fails the capture or bakes one batch's answer into
every replay. :func:`no_host_sync` raises :class:`HostSync` at the first such op,
on the CPU as on a GPU, so a test can prove a step capture-safe without one
(``torch.cuda.set_sync_debug_mode`` sees CUDA syncs only).

What it cannot see: numpy views of CPU tensors (the numba CPU kernels' path; on a GPU the
kernels take device arrays), Python work on values already on the host, and the kernels' CPU-only
branches, which say so (:func:`workbench.kernels.library.host_side`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.kernels.library import on_host_side

__all__ = ["HostSync", "no_host_sync"]

#: ops that read a value back to the host, or size their output by the data
_SYNCING = {
    "aten::_local_scalar_dense": "reads a value to the host (.item(), bool(), float(), a 0-d tensor as an index)",
    "aten::nonzero": "sizes its output by the data",
    "aten::nonzero_static": None,  # sized by the caller: safe
    "aten::masked_select": "sizes its output by the data",
    "aten::unique_dim": "sizes its output by the data",
    "aten::_unique2": "sizes its output by the data",
    "aten::unique_consecutive": "sizes its output by the data",
    "aten::bincount": "sizes its output by the data (its maximum)",
    "aten::equal": "reads a comparison to the host",
    "aten::is_nonzero": "reads a value to the host",
    "aten::lift_fresh": "builds a tensor from host data (torch.tensor: a copy from the host on a GPU)",
}
_INDEXING = ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_")


class HostSync(RuntimeError):
    """An op under :func:`no_host_sync` that would synchronise with the host; names the op."""


def _reason(func, args, kwargs) -> str | None:
    name = func._schema.name
    if name in _SYNCING:
        return _SYNCING[name]
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
        return "sizes its output by the data (give output_size)"
    if name in _INDEXING and len(args) > 1:
        indices = args[1] if isinstance(args[1], (list, tuple)) else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return "indexes with a boolean mask, which sizes its output by the data (use torch.where)"
    return None


class _Guard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = None if on_host_side() else _reason(func, args, kwargs)
        if why:
            raise HostSync(f"{func._schema.name} {why}: a CUDA graph cannot capture it")
        return func(*args, **kwargs)


def _tolist(self, *args, **kwargs):
    raise HostSync("Tensor.tolist reads values to the host: a CUDA graph cannot capture it")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise :class:`HostSync` at the first op in this block that would synchronise with the
    host (the module docstring lists what it sees). For tests and checks: it slows every op."""
    saved = torch.Tensor.tolist
    torch.Tensor.tolist = _tolist
    try:
        with _Guard():
            yield
    finally:
        torch.Tensor.tolist = saved
