r"""MACE's radial networks as tables, for MD: :func:`tabulate_radial`.

Every interaction of a mace-torch model computes its tensor-product weights as
``conv_tp_weights(edge_feats)``, ``edge_feats = radial_embedding(lengths)[0]`` (Bessel basis,
times the cutoff unless the model applies it later): a function of the edge length alone,
:math:`R: r \mapsto \mathbb{R}^J`. :func:`tabulate_radial` tabulates it per interaction
(:mod:`workbench.kernels.radial_table`, error measured against the network in float64), and
switches two objects by ``__class__`` assignment (same parameters and ``state_dict`` keys; a
pickle or deep copy keeps the link between them and rebuilds the tables on first use):

- ``radial_embedding`` -> :class:`TappedRadialEmbedding`: remembers the lengths it was called on
  and the ``edge_feats`` tensor it returned;
- each ``conv_tp_weights`` (e3nn ``FullyConnectedNet``) -> :class:`TabulatedRadialMLP`: when
  called on exactly that tensor, returns the table at those lengths (numba, CPU), differentiable
  once for forces and stress: a :class:`~workbench.kernels.tabulated_edge.TabulatedWeights`,
  which the fused message op reads from the table in place (``WORKBENCH_TABLE_IN_PASSES``) and
  anything else as values.

Anything else runs the network: training mode, parameters that take gradients, other input
(mace's attention block concatenates species to ``edge_feats``), lengths off the table's domain,
CUDA tensors, an ``edge_feats`` changed in place. The table is rebuilt when a parameter or buffer
of the network or the embedding changes value (compared with a copy at every call: writes through
``.data``, as EMA helpers make, bump no version counter).
"""

from __future__ import annotations

import torch

from workbench.kernels.class_swap import CACHE, KeepsOp, probe_copy
from workbench.kernels.lazy_class import LazyClass
from workbench.kernels.options import kernel_options
from workbench.kernels.radial_table import TOLERANCE, RadialTable, TableRefused, build
from workbench.kernels.tabulated_edge import TableValues, TabulatedWeights

__all__ = [
    "TabulatedRadialMLP",  # noqa: F822  (built on first access by the module __getattr__)
    "TappedRadialEmbedding",  # noqa: F822
    "tabulate_radial",
    "untabulate_radial",
]

_TAP = "_wb_radial_tap"  # (edge_feats, its version, lengths) of the latest call; never pickled
_SOURCE = "_wb_radial_source"  # the tapped embedding a tabulated network reads


def _make_tap():
    from mace.modules.blocks import RadialEmbeddingBlock

    class TappedRadialEmbedding(RadialEmbeddingBlock):
        """mace's ``RadialEmbeddingBlock`` that keeps ``(edge_feats, lengths)`` of its latest call
        for the tabulated networks (:func:`tabulate_radial`); outputs unchanged."""

        def forward(self, edge_lengths: torch.Tensor, *args, **kwargs) -> tuple:
            out = super().forward(edge_lengths, *args, **kwargs)
            self.__dict__[_TAP] = (out[0], out[0]._version, edge_lengths)
            return out

        def __getstate__(self):
            state = dict(super().__getstate__())
            state.pop(_TAP, None)
            return state

    return TappedRadialEmbedding


def _make_tabulated():
    from e3nn.nn import FullyConnectedNet

    class TabulatedRadialMLP(KeepsOp, FullyConnectedNet):
        """e3nn's ``FullyConnectedNet`` that answers a call on its tapped embedding's
        ``edge_feats`` from a table of the embedding and itself (:func:`tabulate_radial`)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lengths = self._tabulable(x)
            if lengths is None:
                return super().forward(x)
            table = self.radial_table()
            if not table.covers(lengths):
                return super().forward(x)
            if kernel_options().table_in_passes:  # read in place by the fused message op
                return TabulatedWeights(lengths.reshape(-1), table)
            return TableValues.apply(lengths.reshape(-1), table)

        def _tabulable(self, x: torch.Tensor) -> torch.Tensor | None:
            source = self.__dict__.get(_SOURCE)
            tap = source.__dict__.get(_TAP) if source is not None else None
            if tap is None or tap[0] is not x or tap[1] != x._version or self.training or x.device.type != "cpu":
                return None  # not the embedding's own output of this forward, unchanged
            if torch.is_grad_enabled() and any(p.requires_grad for m in (self, source) for p in m.parameters()):
                return None
            lengths = tap[2]
            return lengths if lengths.dtype == x.dtype and lengths.dim() <= 2 else None

        def radial_table(self) -> RadialTable:
            """The table of this network after its embedding, rebuilt when a parameter changed."""
            return self.cached_op(lambda: _build(self), lambda kept: _same(kept[0], _state(self)))[1]

    return TabulatedRadialMLP


_tap_class = LazyClass(globals(), "TappedRadialEmbedding", _make_tap)
_tabulated_class = LazyClass(globals(), "TabulatedRadialMLP", _make_tabulated)


def __getattr__(name: str) -> type:
    for lazy in (_tap_class, _tabulated_class):
        if name == lazy.name:
            return lazy()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _state(mlp: torch.nn.Module) -> list[torch.Tensor]:
    """What the table depends on: the network's and the embedding's parameters and buffers."""
    mods = (mlp, mlp.__dict__[_SOURCE])
    return [t.detach() for m in mods for t in (*m.parameters(), *m.buffers())]


def _same(kept: list[torch.Tensor], now: list[torch.Tensor]) -> bool:
    """Whether the values the table was built from are still the module's (compared by value:
    writes through ``.data``, as EMA helpers make, leave no version behind)."""
    return len(kept) == len(now) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(kept, now))


def _probe(m: torch.nn.Module, native: type) -> torch.nn.Module:
    """A float64 CPU copy of ``m`` as the library's class ``native``, without the workbench's links."""
    kept = {k: m.__dict__.pop(k) for k in (_SOURCE, _TAP, CACHE) if k in m.__dict__}
    try:
        probe = probe_copy(m)
    finally:
        m.__dict__.update(kept)
    probe.__class__ = native
    return probe


def _build(mlp: torch.nn.Module) -> tuple[list[torch.Tensor], RadialTable]:
    from e3nn.nn import FullyConnectedNet
    from mace.modules.blocks import RadialEmbeddingBlock

    embedding = mlp.__dict__[_SOURCE]
    probe_embedding, probe_mlp = _probe(embedding, RadialEmbeddingBlock), _probe(mlp, FullyConnectedNet)
    r_max = float(embedding.cutoff_fn.r_max)

    def radial(r: torch.Tensor) -> torch.Tensor:
        return probe_mlp(probe_embedding(r[:, None], None, None, None)[0])

    dtype = next(mlp.parameters()).dtype
    snapshot = [t.clone() for t in _state(mlp)]
    if dtype not in TOLERANCE:
        raise TableRefused(f"no tolerance for {dtype} (tables are float32 or float64)")
    try:
        return snapshot, build(radial, lo=r_max * 2.0**-10, hi=r_max, dtype=dtype)
    except (RuntimeError, NotImplementedError) as exc:  # an op without forward-mode AD
        raise TableRefused(f"the network has no forward-mode slope ({str(exc).splitlines()[0]})") from exc


def _why_not(embedding: torch.nn.Module | None, block: torch.nn.Module) -> str | None:
    """Why ``block``'s radial network cannot be tabulated after ``embedding``, or ``None``."""
    from e3nn.nn import FullyConnectedNet
    from mace.modules.blocks import RadialEmbeddingBlock

    if embedding is None or not isinstance(embedding, RadialEmbeddingBlock):
        return "the model has no mace RadialEmbeddingBlock named radial_embedding"
    if hasattr(embedding, "distance_transform"):
        return f"its radial embedding applies a {type(embedding.distance_transform).__name__} (depends on species)"
    mlp = block.conv_tp_weights
    if not isinstance(mlp, FullyConnectedNet):
        return f"its radial network is a {type(mlp).__name__}, not e3nn's FullyConnectedNet"
    if mlp.hs[0] != embedding.out_dim:
        return f"its radial network takes {mlp.hs[0]} inputs, not the embedding's {embedding.out_dim}"
    return None


def tabulate_radial(model: torch.nn.Module) -> dict[str, str]:
    """Tabulate every interaction's radial network of a mace-torch ``model``, in place; for each
    interaction (``"interactions.0"``, ...) what was done: the table's size and measured errors, or
    why it keeps the network. Tables are built now (float64 probes, a fraction of a second each)
    and used in ``eval()`` with frozen parameters on the CPU. Undo: :func:`untabulate_radial`."""
    from mace.modules.blocks import RadialEmbeddingBlock

    embedding = getattr(model, "radial_embedding", None)
    blocks = [(f"interactions.{i}", b) for i, b in enumerate(getattr(model, "interactions", ()))]
    report = {}
    for name, block in blocks:
        why = _why_not(embedding, block)
        if why is None:
            if type(embedding) is RadialEmbeddingBlock:
                embedding.__class__ = _tap_class()
            mlp = block.conv_tp_weights
            mlp.__class__ = _tabulated_class()
            mlp.__dict__[_SOURCE] = embedding
            try:
                table = mlp.radial_table()
            except TableRefused as exc:
                _untabulate_one(mlp)
                why = str(exc)
            else:
                report[name] = (
                    f"table of {table.num_intervals} intervals x {table.outputs} weights, errors "
                    f"{table.value_error:.1e} (values) / {table.slope_error:.1e} (slopes)"
                )
        if why is not None:
            report[name] = f"network kept: {why}"
    if isinstance(embedding, _tap_class()) and not any(v.startswith("table of") for v in report.values()):
        untabulate_radial(model)  # nothing reads the tap: it would only keep the last edges alive
    return report


def _untabulate_one(mlp: torch.nn.Module) -> None:
    from e3nn.nn import FullyConnectedNet

    mlp.__class__ = FullyConnectedNet
    for key in (_SOURCE, CACHE):
        mlp.__dict__.pop(key, None)


def untabulate_radial(model: torch.nn.Module) -> None:
    """Back to mace's and e3nn's classes, in place (same parameters)."""
    from mace.modules.blocks import RadialEmbeddingBlock

    for m in model.modules():
        if isinstance(m, _tabulated_class()):
            _untabulate_one(m)
        elif isinstance(m, _tap_class()):
            m.__class__ = RadialEmbeddingBlock
            m.__dict__.pop(_TAP, None)
