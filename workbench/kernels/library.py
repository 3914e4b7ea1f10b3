r"""The sparse-polynomial op as a torch custom op, ``workbench::sparse_poly``, for
``torch.compile`` and ``torch.export``.

.. math::

    \text{outputs} = \mathrm{op}(\text{index}, \text{tensors}), \qquad
    \bar{\text{tensors}} = \mathrm{op}'(\text{index}, \text{tensors}, \bar{\text{outputs}})

Dynamo cannot trace into a :class:`~workbench.kernels.ops.PolyOp` (numba launches, CSR caches
held by weak reference), so a traced model calls it through this opaque op instead:

* the op is named by a string key (:func:`op_key`), registered in this process when the op is
  built or unpickled (:func:`register`); the index is
  ``(first, second, num_rows)``: an atom op's ``species`` ``[atoms]`` and species count, or an
  edge op's ``sender`` and ``receiver`` ``[edges]`` and node count;
* :func:`register_fake` gives the output shapes from the op alone, ``[rows, width]`` per
  output, so a trace needs no kernel run;
* :func:`register_autograd`'s backward is ``op.derivative`` launched through this same op, so
  every order of derivative traces, as in eager.

Eager calls keep :class:`~workbench.kernels.ops._SparsePolyFunction`: it may skip the terms of
an output whose cotangent autograd left as None (the weight gradient of a force computation),
which a custom op cannot, since torch materialises its cotangents as zeros.

Keys live in this process only: a ``torch.export`` program calls ops by key, so it runs in
the process that exported it, not after ``torch.export.save`` and a load elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = [
    "capture_safe",
    "host_float",
    "host_side",
    "no_sync",
    "on_host_side",
    "op_key",
    "register",
    "sparse_poly",
    "tracing",
]

_OPS: dict[str, object] = {}
_COUNTER = itertools.count()
_LOCK = threading.Lock()


def tracing() -> bool:
    """Whether dynamo (``torch.compile``, ``torch.export``) is tracing the caller."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


_CAPTURE = threading.local()


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    """Set this thread's flag ``name`` for the block, and put back what it was."""
    before = getattr(_CAPTURE, name, False)
    setattr(_CAPTURE, name, True)
    try:
        yield
    finally:
        setattr(_CAPTURE, name, before)


def capture_safe() -> contextlib.AbstractContextManager[None]:
    """In this block (on this thread) the kernels' modules take their host-sync-free branches,
    as under a trace: what a CUDA-graph capture of the train step needs
    (:mod:`workbench.train.graph_step`), and its eager runs, so they compute the same."""
    return _flag("on")


def host_side() -> contextlib.AbstractContextManager[None]:
    """Code that runs for CPU tensors only, never inside a GPU capture (the kernels' CPU
    branches): :func:`workbench.train.host_sync.no_host_sync` does not look inside it."""
    return _flag("host")


def on_host_side() -> bool:
    """Whether the caller is inside :func:`host_side` (on this thread)."""
    return getattr(_CAPTURE, "host", False)


def no_sync() -> bool:
    """Whether the caller must not read device values on the host: under a trace, a CUDA-graph
    capture, or :func:`capture_safe`."""
    if tracing() or getattr(_CAPTURE, "on", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_float(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CPU float32 / float64 tensor that numba may read now (not under a trace
    or capture): where the host-side kernels run instead of torch's ops."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not no_sync()


def register(op) -> str:
    """A new key naming ``op`` (a :class:`~workbench.kernels.ops.PolyOp`) to
    ``workbench::sparse_poly`` in this process. The op calls this when it is built or
    unpickled, so that a trace only reads the key (:func:`op_key`)."""
    with _LOCK:
        key = f"poly{next(_COUNTER)}"
        _OPS[key] = op
    return key


def op_key(op) -> str:
    """The key of ``op``: a plain attribute read, which dynamo traces to a constant."""
    return op.library_key


def _op(key: str):
    try:
        return _OPS[key]
    except KeyError:
        raise KeyError(
            f"workbench::sparse_poly: no op {key!r} in this process (ops are registered by the model "
            "that uses them; an exported program runs only where it was exported)"
        ) from None


def _index(op, first: Tensor, second: Tensor | None, num_rows: int):
    from workbench.kernels.rows import EdgeGraph, SpeciesIndex

    return EdgeGraph.of(first, second, num_rows) if op.edge else SpeciesIndex(first, num_rows)


@torch.library.custom_op("workbench::sparse_poly", mutates_args=())
def sparse_poly(
    key: str, backend: str, first: Tensor, second: Tensor | None, num_rows: int, tensors: list[Tensor]
) -> list[Tensor]:
    """Every output of op ``key`` on ``tensors`` (:meth:`PolyOp.evaluate_rows` on ``backend``)."""
    op = _op(key)
    return op.evaluate_rows(tensors, _index(op, first, second, num_rows), backend)


@sparse_poly.register_fake
def _fake(key, backend, first, second, num_rows, tensors):
    op = _op(key)
    dtype = tensors[0].dtype

    def rows(kind: str):
        return first.shape[0] if kind in ("atom", "edge") else num_rows

    return [tensors[0].new_empty((rows(c.out_rows), c.output.width), dtype=dtype) for c in op.compiled]


def _setup_context(ctx, inputs, output) -> None:
    key, backend, first, second, num_rows, tensors = inputs
    ctx.key, ctx.backend, ctx.num_rows, ctx.count = key, backend, num_rows, len(tensors)
    ctx.has_second = second is not None
    ctx.save_for_backward(first, *((second,) if second is not None else ()), *tensors)


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    first = saved.pop(0)
    second = saved.pop(0) if ctx.has_second else None
    needed = tuple(bool(n) for n in ctx.needs_input_grad[5])
    if not any(needed):
        return None, None, None, None, None, [None] * ctx.count
    d = _op(ctx.key).derivative(needed)
    res = list(sparse_poly(op_key(d), ctx.backend, first, second, ctx.num_rows, [*saved, *grads]))
    return None, None, None, None, None, [res.pop(0) if n else None for n in needed]


sparse_poly.register_autograd(_backward, setup_context=_setup_context)
