"""Step modes of ``workbench bench step``: a row ``<backend>+<mode>`` runs that backend's step on
fixed-shape batches, and for ``graph`` as one CUDA graph per shape.

* ``fixed``: every batch padded with a ghost graph (:mod:`workbench.train.padding`) to
  ``max atoms + 1`` atoms, ``max graphs + 1`` graphs and the smallest rung of a 5% ladder of
  edge counts (:mod:`workbench.packing.shapes`) that holds it: what ``fixed_shapes`` trains on.
  cuEquivariance re-plans per shape, so this is the row that shows what fixed shapes give it;
* ``graph``: ``fixed`` and :class:`~workbench.train.graph_step.ShapeGraphs`: the step captured
  once per shape and replayed (kernel backends only: e3nn's TorchScript and cueq's modules
  read values on the host). Before the timed steps, each shape among them is captured once, as
  a training run captures each rung once in its first epoch.

The loss of a padded batch counts its real graphs and atoms only
(:func:`~workbench.bench.step_model.step_loss`), so a
mode's first loss equals the plain row's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workbench.kernels.registry import backend_names, resolve

__all__ = ["MODES", "fixed_batches", "mode_labels", "ready_for_mode", "split_label", "stepper"]

MODES = {"fixed": "batches padded to fixed shapes", "graph": "fixed shapes, the step as one CUDA graph per shape"}


def split_label(label: str) -> tuple[str, str | None]:
    """``"numba+graph"`` -> ``("numba", "graph")``; ``"cueq"`` -> ``("cueq", None)``. An unknown
    mode, or ``graph`` on a backend a capture cannot take, is refused listing the choices."""
    backend, plus, mode = label.partition("+")
    if not plus:
        return label, None
    if mode not in MODES:
        raise ValueError(f"row {label!r}: unknown step mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "graph" and resolve(backend)[0].name not in backend_names("descriptor"):
        raise ValueError(
            f"row {label!r}: a graph needs a kernel backend, one of {', '.join(backend_names('descriptor'))}"
        )
    return backend, mode


def mode_labels(backends: Sequence[str]) -> tuple[str, ...]:
    """Every ``<backend>+<mode>`` row the ``backends`` allow."""
    kernels = set(backend_names("descriptor"))
    out = []
    for b in backends:
        if "+" in b:
            continue
        out += [f"{b}+{m}" for m in MODES if m != "graph" or resolve(b)[0].name in kernels]
    return tuple(out)


def fixed_batches(batches: Sequence[dict], r_max: float) -> list[dict]:
    """``batches`` (mace batch dicts) padded to fixed shapes (the module docstring)."""
    from mace.tools.torch_geometric.batch import Batch

    from workbench.packing.shapes import DEFAULT_EDGE_STEP, FixedShape, shape_ladder
    from workbench.train.padding import pad_to_ladder

    atoms = max(int(b["positions"].shape[0]) for b in batches)
    edges = max(int(b["edge_index"].shape[1]) for b in batches)
    graphs = max(int(b["ptr"].shape[0]) - 1 for b in batches)
    ladder = shape_ladder(FixedShape(atoms + 1, edges, graphs + 1), DEFAULT_EDGE_STEP)
    return [pad_to_ladder(Batch(**dict(b)), ladder, r_max).to_dict() for b in batches]


def ready_for_mode(model, backend: str, mode: str | None, batches: Sequence[dict], r_max: float) -> list[dict]:
    """The batches a row in ``mode`` takes (padded beyond cutoff ``r_max`` to fixed shapes in a
    mode), with ``model`` (on ``backend``) made capture-ready for ``graph``, in place."""
    if mode is None:
        return list(batches)
    if mode == "graph":
        from workbench.kernels.compiling import capture_ready

        capture_ready(model, backend)
    return fixed_batches(batches, r_max)


def stepper(model, mode: str | None, device: str) -> tuple[Callable, Callable[[Sequence[dict]], None]]:
    """``(step, prime)``: ``step(batch) -> loss`` in ``mode`` with its own Adam (capturable for a
    graph on a GPU), and ``prime(batches)``, which for ``graph`` captures each shape among
    ``batches`` before they are timed (a no-op otherwise)."""
    from workbench.bench.step_model import make_optimizer, train_step

    optimizer = make_optimizer(model, capturable=device.startswith("cuda") and mode == "graph")
    if mode != "graph":
        return (lambda batch: train_step(model, optimizer, batch)), (lambda batches: None)
    import torch

    from workbench.kernels.library import capture_safe
    from workbench.train.graph_step import ShapeGraphs, batch_key

    def safe_step(batch):  # the warm-up takes the branches the capture takes
        with capture_safe():
            return train_step(model, optimizer, batch, set_to_none=False)

    runner = ShapeGraphs(safe_step, torch.device(device))

    def step(batch):
        return runner(batch, batch_key(batch))

    def prime(batches: Sequence[dict]) -> None:
        while runner.calls < runner.warmup:
            step(batches[0])
        for batch in batches:
            if batch_key(batch) not in runner.graphs:
                step(batch)

    step.runner = runner
    return step, prime
