"""Keep mace-torch's import notice about cuequivariance off the console.

mace-torch ``print``\\ s "cuequivariance or cuequivariance_torch is not available. Cuequivariance
acceleration will be disabled." when ``mace.tools.cg`` is first imported (a plain ``print`` at
module level, so no logging or warnings filter reaches it). The workbench selects its kernels
itself (``backend=``) and says so when a backend is missing, so the notice is only noise.
:func:`quiet_mace` installs an import hook that runs that one module with its standard output
filtered: every other line it prints still appears. It imports nothing heavy, so it can run at
package import. ``WORKBENCH_SHOW_MACE_NOTICES=1`` leaves the notice in.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import sys

from workbench.switches import switch

__all__ = ["NOTICE", "quiet_mace"]

NOTICE = "cuequivariance or cuequivariance_torch is not available"
_MODULE = "mace.tools.cg"


class _FilteredLoader(importlib.abc.Loader):
    """Runs the wrapped loader's module with stdout captured, then prints all but the notice."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                self.inner.exec_module(module)
        finally:
            sys.stdout.write("".join(line for line in out.getvalue().splitlines(True) if NOTICE not in line))


class _QuietFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _FilteredLoader(spec.loader)
                return spec
        return None


def quiet_mace() -> None:
    """Hide mace-torch's cuequivariance notice from now on (idempotent; a no-op once
    ``mace.tools.cg`` is imported, or with ``WORKBENCH_SHOW_MACE_NOTICES=1``)."""
    if switch("WORKBENCH_SHOW_MACE_NOTICES") not in ("", "0"):
        return
    if _MODULE in sys.modules or any(isinstance(f, _QuietFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _QuietFinder())
