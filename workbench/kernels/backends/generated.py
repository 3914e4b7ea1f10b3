"""Generated kernel modules: source written once under the cache directory and imported, so that
numba's on-disk cache (``cache=True``) keeps their machine code and a configuration compiles
once per machine, not once per process or rank."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from workbench.cache_dir import cache_dir
from workbench.kernels.options import ENV, kernel_options

__all__ = ["KERNEL_CACHE_ENV", "load_module", "source_dir"]

_LOCK = threading.RLock()


#: the kernel cache folder; a cluster may point it at a shared filesystem, so that a kernel one
#: job compiled is loaded by the next
KERNEL_CACHE_ENV = ENV["kernel_cache"][0]


def source_dir() -> Path:
    """Where generated kernel modules (and numba's cache of their machine code) live:
    ``$WORKBENCH_KERNEL_CACHE``, else ``$WORKBENCH_CACHE_DIR/kernels`` (default
    ``~/.cache/cfm-workbench/kernels``)."""
    cache = kernel_options().kernel_cache
    if cache:
        return Path(cache).expanduser()
    return cache_dir("kernels")


def load_module(text: str, prefix: str) -> ModuleType:
    """Import the module whose source is ``text``, named ``<prefix>_<digest of text>``: written to
    :func:`source_dir` first (atomically, so concurrent ranks never read half a file) and
    registered in ``sys.modules`` (numba's cache re-imports a function's module by name)."""
    name = f"{prefix}_{hashlib.sha1(text.encode()).hexdigest()[:20]}"
    with _LOCK:  # threads of one process: one writes and imports, the others get its module
        if name in sys.modules:
            return sys.modules[name]
        return _write_and_import(name, text)


def _mark_used(path: Path) -> None:
    """The source's modification time is the module's last use (``workbench kernels cache --prune``)."""
    with contextlib.suppress(OSError):  # a read-only shared cache: pruning goes by when it was written
        os.utime(path)


def _write_and_import(name: str, text: str) -> ModuleType:
    path = source_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    else:
        _mark_used(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
