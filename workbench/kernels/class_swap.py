"""A model family whose hot op is one module class, swapped in place for the workbench's subclass.

NequIP's ``TensorProductScatter`` and Allegro's ``Contracter`` go to the workbench kernels by
``__class__`` assignment: the same object, so parameters, buffers (persistent or not), the
``state_dict`` and the optimizer's references stay the library's. :class:`ClassSwap` is that
swap and, through its methods, the whole adapter protocol of
:class:`~workbench.kernels.registry.ModelAdapter`; a family's ``adapter`` module only names them.

A swap may bring **companions**: swaps of modules around the hot op that compute the same
values with fewer passes (the radial basis, the radial MLP's activation, e3nn's linears). They
go onto the workbench with the hot op, exact-class modules that their check accepts only (a
subclass of someone else's is left alone), and back with it; they are not ops of their own.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workbench.kernels.launches import OpSite
from workbench.kernels.lazy_class import LazyClass

__all__ = ["CACHE", "ClassSwap", "KeepsOp"]

#: where a workbench module keeps what it built from its own buffers (an op, a plan): never
#: pickled, dropped when the module goes back to the library's class
CACHE = "_wb_op"


class KeepsOp:
    """Mixin for a workbench module that builds something from its own buffers once (an op, a
    plan) and keeps it in ``__dict__[CACHE]``; pickles leave it out (it is rebuilt on use)."""

    def cached_op(self, build: Callable[[], object], valid: Callable[[object], bool] | None = None):
        """The kept object, built by ``build()`` on first use or when ``valid(kept)`` is false."""
        kept = self.__dict__.get(CACHE)
        if kept is None or (valid is not None and not valid(kept)):
            kept = self.__dict__[CACHE] = build()
        return kept

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop(CACHE, None)
        return state


def probe_copy(m: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``m`` on the CPU, to probe what it computes (its own dtype would round the
    probes, and it may sit on a GPU), without the user's hooks: they must not fire on probes, and
    need not copy (a lambda does not pickle)."""
    hooks = [(mod, name, d) for mod in m.modules() for name, d in _hook_dicts(mod)]
    if not hooks:
        return copy.deepcopy(m).to("cpu", torch.float64)
    try:  # the copy gets empty hook registries; the module is not touched
        return copy.deepcopy(m, {id(d): type(d)() for _, _, d in hooks}).to("cpu", torch.float64)
    except Exception:  # e3nn >= 0.5 pickles its generated modules, hooks and all: copy without them
        try:
            for mod, name, d in hooks:
                setattr(mod, name, type(d)())
            return copy.deepcopy(m).to("cpu", torch.float64)
        finally:
            for mod, name, d in hooks:
                setattr(mod, name, d)


def _hook_dicts(mod: torch.nn.Module) -> list[tuple[str, dict]]:
    """``(attribute, dict)`` of every non-empty hook registry of ``mod`` (``_forward_hooks``, ...)."""
    return [(k, v) for k, v in vars(mod).items() if "_hooks" in k and isinstance(v, dict) and v]


@dataclass(frozen=True)
class ClassSwap:
    """``op``: the op's name; ``native_path``: the library's class as ``"package.module.Class"``;
    ``ours``: the workbench subclass; ``what``: the class in words, for errors; ``modifiers``: the
    library's own accelerations (what ``convert`` points to); ``check``: raises ``ValueError`` for
    a module the kernels cannot run (what it returns is unused); ``site``: ``module -> (op,
    channels)`` of an accelerated module; ``companions``: swaps that go on and off with this one
    (:meth:`companion`)."""

    op: str
    native_path: str
    ours: LazyClass
    what: str
    modifiers: str
    check: Callable[[torch.nn.Module], object]
    site: Callable[[torch.nn.Module], tuple[object, int]]
    companions: tuple[ClassSwap, ...] = ()

    @classmethod
    def companion(
        cls,
        name: str,
        native_path: str,
        namespace: dict,
        make: Callable[[], type],
        check: Callable[[torch.nn.Module], object] | None = None,
        class_name: str | None = None,
    ) -> ClassSwap:
        """A companion swap: no op of its own, no kernel site; a module ``check`` refuses
        (``ValueError``) stays the library's. Ours is built by ``make`` on first use, as the global
        ``class_name`` (default ``Workbench<the library's class name>``) of ``namespace``."""
        package, native_name = native_path.partition(".")[0], native_path.rpartition(".")[2]
        ours = LazyClass(namespace, class_name or f"Workbench{native_name}", make)
        what = f"{package}'s {native_name}"
        return cls(name, native_path, ours, what, "", check or (lambda m: None), lambda m: (None, 0))

    @property
    def OPS(self) -> tuple[str, ...]:
        return (self.op,)

    def native(self) -> type:
        """The library's class, imported on call: importing the workbench does not import the library."""
        module, _, name = self.native_path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def is_native(self, m: torch.nn.Module) -> bool:
        """``m`` is exactly the library's class (not ours, nor another library's subclass)."""
        try:
            return type(m) is self.native()
        except ImportError:
            return False

    def is_ours(self, m: torch.nn.Module) -> bool:
        try:
            return isinstance(m, self.ours())
        except ImportError:
            return False

    def swap(self, m: torch.nn.Module, backend: str) -> None:
        m.__class__ = self.ours()
        m.kernel_backend = backend

    def unswap(self, m: torch.nn.Module) -> None:
        m.__class__ = self.native()
        for key in (CACHE, "kernel_backend"):
            m.__dict__.pop(key, None)

    def _sites(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        try:
            native = self.native()
        except ImportError:
            return []
        return [(n, m) for n, m in model.named_modules() if isinstance(m, native)]

    # -- the adapter protocol
    def matches(self, model: torch.nn.Module) -> bool:
        return bool(self._sites(model))

    def to_workbench(self, model: torch.nn.Module, ops: Sequence[str], backend: str) -> None:
        """Every module of the class onto descriptor ``backend``: all checked first, then swapped."""
        if self.op not in ops:
            return
        sites = self._sites(model)
        for name, m in sites:
            if not (self.is_native(m) or self.is_ours(m)):
                raise TypeError(
                    f"{name} is a {type(m).__module__}.{type(m).__name__}, not {self.what} (a model "
                    f"with {self.modifiers} applied: build it without)"
                )
            try:
                self.check(m)
            except ValueError as exc:
                raise TypeError(f"{name} ({type(m).__name__}): {exc}") from None
        for _, m in sites:
            self.swap(m, backend)
        if sites:
            self.swap_companions(model, backend)

    def swap_all(self, model: torch.nn.Module, backend: str) -> None:
        """As a companion: every module of ``model`` of exactly the library's class (or ours) that
        the check accepts onto ``backend``; the others stay the library's."""
        for _, m in self._sites(model):
            if self.is_native(m) or self.is_ours(m):
                try:
                    self.check(m)
                except Exception:  # a form it cannot prove equal stays the library's
                    continue
                self.swap(m, backend)

    def unswap_all(self, model: torch.nn.Module) -> None:
        """As a companion: every module of ours in ``model`` back to the library's class."""
        for _, m in self._sites(model):
            if self.is_ours(m):
                self.unswap(m)

    def swap_companions(self, model: torch.nn.Module, backend: str) -> None:
        """The companions' modules of ``model`` onto ``backend`` (exact-class ones only)."""
        for companion in self.companions:
            companion.swap_all(model, backend)

    def unswap_companions(self, model: torch.nn.Module) -> None:
        """The companions' modules of ``model`` back to the library's classes."""
        for companion in self.companions:
            companion.unswap_all(model)

    def to_native(self, model: torch.nn.Module, ops: Sequence[str]) -> None:
        if self.op in ops:
            for _, m in self._sites(model):
                if self.is_ours(m):
                    self.unswap(m)
            self.unswap_companions(model)

    def accelerated(self, model: torch.nn.Module) -> dict[str, bool]:
        return {self.op: any(self.is_ours(m) for _, m in self._sites(model))}

    def convert(self, model: torch.nn.Module, backend: str) -> torch.nn.Module:
        raise ValueError(f"these models convert to {backend!r} with {self.modifiers}, not through accelerate()")

    def model_ops(self, model: torch.nn.Module) -> list:
        return [OpSite(name, *self.site(m)) for name, m in self._sites(model) if self.is_ours(m)]
