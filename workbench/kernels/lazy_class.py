"""A module-level class built on first use.

The workbench's drop-in modules subclass a library's class (e3nn's ``TensorProduct``, nequip's
``TensorProductScatter``), so defining them imports that library. :class:`LazyClass` defines
such a class on first access instead, once (under a lock), as a global of its module, so that
pickles and ``torch.save`` files find it by ``module.ClassName`` and importing the module stays
cheap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class LazyClass:
    """``LazyClass(globals(), "Name", make)``: call it for the class; ``module_getattr`` serves the
    module's ``__getattr__`` (PEP 562) so that ``module.Name`` builds it too."""

    def __init__(self, namespace: dict[str, Any], name: str, make: Callable[[], type]) -> None:
        self.namespace, self.name, self.make = namespace, name, make
        self._lock = threading.Lock()

    def __call__(self) -> type:
        with self._lock:
            if self.name not in self.namespace:
                cls = self.make()
                cls.__module__, cls.__qualname__ = self.namespace["__name__"], self.name
                self.namespace[self.name] = cls
            return self.namespace[self.name]

    def module_getattr(self, name: str) -> type:
        if name == self.name:
            return self()
        raise AttributeError(f"module {self.namespace['__name__']!r} has no attribute {name!r}")
