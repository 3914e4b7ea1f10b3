"""Where kernel backends and model families are registered: the one list of each.

A **backend** says how a model's hot ops run. Three kinds:

* ``"descriptor"``: the workbench's own modules evaluate the sparse polynomials of
  :mod:`~workbench.kernels.descriptor` with the backend's evaluator (``numba``: the fused numba
  kernels, CUDA or CPU; ``torch``: the plain-torch reference of :mod:`~workbench.kernels.reference`);
* ``"native"``: the model family's own modules (``e3nn`` for MACE): what :func:`accelerate` goes back to;
* ``"convert"``: another library's modules, made by the model adapter's converter (``cueq``).

A **model adapter** knows one model family: which of its modules are the hot ops, how to swap
them for the workbench's modules and back, and its converters for ``"convert"`` backends.

Adding a backend or a model family is a new module plus one registration line at the bottom of
this file. Nothing here imports torch: the CLI reads the names while building its parser.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "MODELS",
    "Backend",
    "ModelAdapter",
    "adapter_for",
    "backend_names",
    "contenders",
    "get_backend",
    "labels",
    "register_backend",
    "register_model",
    "resolve",
]

KINDS = ("descriptor", "native", "convert")

#: the backend the workbench's modules run when none is named: its own fused kernels
DEFAULT_BACKEND = "numba"


def _resolve(target: str | Callable | None) -> Any:
    """A ``"package.module:attribute"`` string imported on first use, or the object itself."""
    return _imported(target) if isinstance(target, str) else target


@functools.cache
def _imported(target: str) -> Any:
    # cached: every op evaluation looks its backend's evaluate up through here
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


@dataclass(frozen=True)
class Backend:
    """One way to run the hot ops.

    ``kind``: one of :data:`KINDS`. ``devices``: where it runs (``"cpu"``, ``"cuda"``).
    ``evaluate`` (descriptor backends): ``(op, tensors, row index, channels) -> outputs``, every
    output of the :class:`~workbench.kernels.ops.PolyOp` ``op`` on checked, contiguous tensors of
    one dtype, without autograd (the op differentiates itself); or a ``"module:function"`` path to
    it. ``compiled``: it runs the workbench's compiled kernels, so the modules around the hot ops
    take their fused forms too (SiLU's derivatives, the MD calculator's radial tables) and its
    CUDA kernels can be compiled before the first step (``accelerate(precompile=...)``).
    ``probe``: ``() -> None`` when usable here, else the reason it is not. ``variants``: named
    :class:`~workbench.kernels.options.KernelOptions` settings a benchmark may compare, each a row
    called ``"<name>-<variant>"`` (:func:`labels`, :func:`resolve`). ``contender``: the benchmarks
    time it by default (:func:`contenders`; the plain-torch reference is exact, not fast).
    ``packages``: the Python packages it runs on, whose versions a benchmark result records.
    """

    name: str
    kind: str
    description: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    compiled: bool = False
    evaluate: str | Callable | None = None
    probe: str | Callable[[], str | None] | None = None
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    contender: bool = True
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend {self.name!r}: kind {self.kind!r}; choose one of {KINDS}")

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine, or ``None`` when it can."""
        probe = _resolve(self.probe)
        return probe() if probe is not None else None

    @property
    def available(self) -> bool:
        return self.unavailable() is None

    def evaluator(self) -> Callable | None:
        return _resolve(self.evaluate)


@dataclass(frozen=True)
class ModelAdapter:
    """One model family. ``adapter`` (``"module"``): a module with ``matches(model) -> bool``,
    ``to_workbench(model, ops, backend)``, ``to_native(model, ops)``, ``convert(model, backend)``,
    ``model_ops(model)`` and ``OPS`` (the op names it can swap)."""

    name: str
    description: str
    adapter: str
    converts: tuple[str, ...] = field(default=())

    def module(self) -> Any:
        return _resolve(self.adapter)


BACKENDS: dict[str, Backend] = {}
MODELS: dict[str, ModelAdapter] = {}


def _add(table: dict, entry: Any, what: str) -> Any:
    if entry.name in table:
        raise ValueError(f"{what} {entry.name!r} is registered already")
    table[entry.name] = entry
    return entry


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` (a second one of the same name is refused)."""
    return _add(BACKENDS, backend, "backend")


def register_model(adapter: ModelAdapter) -> ModelAdapter:
    """Add ``adapter`` to :data:`MODELS` (a second one of the same name is refused)."""
    return _add(MODELS, adapter, "model family")


def backend_names(kind: str | None = None) -> tuple[str, ...]:
    """Registered backend names (of one ``kind``), in registration order."""
    return tuple(n for n, b in BACKENDS.items() if kind is None or b.kind == kind)


def labels(kinds: Iterable[str] | None = None, family: str | None = None, device: str | None = None) -> tuple[str, ...]:
    """Every name a benchmark row may carry, in registration order: each backend (of ``kinds``,
    that the model ``family`` can take, that runs on ``device``) followed by its variants."""
    out = []
    for name, b in BACKENDS.items():
        if kinds is not None and b.kind not in kinds:
            continue
        if family is not None and b.kind == "convert" and name not in MODELS[family].converts:
            continue
        if device is not None and device.split(":")[0] not in b.devices:
            continue
        out += [name, *(f"{name}-{v}" for v in b.variants)]
    return tuple(out)


def contenders(family: str | None = None, device: str | None = None) -> tuple[str, ...]:
    """The backends a benchmark compares unless told otherwise: every contender the model
    ``family`` can take on ``device``, the default backend first, no variants."""
    names = [n for n in labels(family=family, device=device) if n in BACKENDS and BACKENDS[n].contender]
    return tuple(sorted(names, key=lambda n: n != DEFAULT_BACKEND))


def resolve(label: str) -> tuple[Backend, dict[str, Any]]:
    """The backend a benchmark row ``label`` runs and the kernel options it sets: ``"numba"`` is
    the backend with no options, ``"numba-table"`` its variant ``table``. An unknown label gets an
    error listing the choices."""
    if label in BACKENDS:
        return BACKENDS[label], {}
    name, _, variant = label.partition("-")
    if name in BACKENDS and variant in BACKENDS[name].variants:
        return BACKENDS[name], dict(BACKENDS[name].variants[variant])
    raise ValueError(f"unknown backend {label!r}; choose one of {', '.join(labels())}")


def get_backend(name: str) -> Backend:
    """The backend called ``name``; an unknown name gets an error listing the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def adapter_for(model: Any) -> ModelAdapter:
    """The model family of ``model``: the first registered adapter whose ``matches`` accepts it."""
    for adapter in MODELS.values():
        if adapter.module().matches(model):
            return adapter
    raise TypeError(
        f"{type(model).__name__}: no registered model family holds it (registered: {', '.join(MODELS)}); "
        "register one with workbench.kernels.registry.register_model"
    )


# ------------------------------------------------------------------ the built-in registrations
register_backend(
    Backend(
        DEFAULT_BACKEND,
        "descriptor",
        "the workbench's fused numba kernels: CUDA on GPU tensors, vectorised CPU loops otherwise",
        compiled=True,
        evaluate="workbench.kernels.numba.dispatch:evaluate",
        probe="workbench.kernels.numba.gpu.device:numba_unavailable",
        packages=("numba",),
        variants={
            "table": {"cuda_kernels": "table"},
            "unrolled": {"cuda_kernels": "unrolled"},
            "unfused": {"fuse_passes": False},
        },
    )
)
register_backend(
    Backend(
        "torch",
        "descriptor",
        "plain torch gathers and index_add over the descriptor's terms: the reference the others are tested against",
        evaluate="workbench.kernels.reference:evaluate",
        contender=False,
    )
)
register_backend(Backend("e3nn", "native", "the model family's own e3nn modules", packages=("e3nn",)))
register_backend(
    Backend(
        "cueq",
        "convert",
        "NVIDIA cuEquivariance, through mace-torch's converter (a new model; CUDA only)",
        devices=("cuda",),
        probe="workbench.kernels.mace.adapter:cueq_unavailable",
        packages=("cuequivariance_torch",),
    )
)
register_backend(
    Backend(
        "oeq",
        "convert",
        "OpenEquivariance's fused message op, through the family's converter (a new model; CUDA only)",
        devices=("cuda",),
        probe="workbench.kernels.mace.adapter:oeq_unavailable",
        packages=("openequivariance",),
    )
)
register_model(
    ModelAdapter(
        "mace", "mace-torch models (MACE, ScaleShiftMACE, ...)", "workbench.kernels.mace.adapter", ("cueq", "oeq")
    )
)
register_model(ModelAdapter("nequip", "NequIP models (nequip 0.19)", "workbench.kernels.nequip.adapter"))
register_model(ModelAdapter("allegro", "Allegro models (nequip-allegro 0.8)", "workbench.kernels.allegro.adapter"))
