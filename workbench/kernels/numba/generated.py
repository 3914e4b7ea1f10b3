"""Generated kernel modules: source written once under the cache directory and imported, so that
numba's on-disk cache (``cache=True``) keeps their machine code and a configuration compiles
once per machine, not once per process or rank.

A cached source is trusted only byte for byte: one that differs (damaged, truncated, another
encoding) is written again, atomically. The machine code numba cached for it recovers the same
way (:func:`~workbench.kernels.numba.numba_cache.guard`). Where the folder cannot be written,
or with ``WORKBENCH_KERNEL_DISK_CACHE=0``, the module is compiled in memory and nothing is written
(:mod:`~workbench.kernels.numba.cache_folder` has the rule).
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

from workbench.kernels.numba.cache_folder import KERNEL_CACHE_ENV, folder_lock, reason, source_dir, warn_in_memory
from workbench.kernels.numba.numba_cache import guard
from workbench.kernels.options import kernel_options

__all__ = ["KERNEL_CACHE_ENV", "load_module", "source_dir"]

_LOCK = threading.RLock()
#: the disk-cache switch of a generated function's decorator: a module in memory has no file
#: for numba to key its cache on ("no locator available"), so there it is turned off
_CACHE_FLAG = re.compile(r"(?m)^(@[\w.]*jit\(.*?)\bcache=True")


def load_module(text: str, prefix: str) -> ModuleType:
    """Import the module whose source is ``text``, named ``<prefix>_<digest of text>``: written to
    :func:`source_dir` first (atomically, so concurrent ranks never read half a file) and
    registered in ``sys.modules`` (numba's cache re-imports a function's module by name). In
    memory (no file) when the cache is off or its folder cannot be written."""
    name = f"{prefix}_{hashlib.sha1(text.encode()).hexdigest()[:20]}"
    with _LOCK:  # threads of one process: one writes and imports, the others get its module
        if name in sys.modules:
            return sys.modules[name]
        if not kernel_options().cache:
            return _in_memory(name, text)
        folder = source_dir()
        try:
            return _from_folder(folder, name, text)
        except OSError as exc:
            warn_in_memory(folder, reason(exc))
        except RuntimeError as exc:
            if "no locator available" not in str(exc):
                raise
            warn_in_memory(folder, "numba finds no writable folder for its machine code")
        sys.modules.pop(name, None)
        return _in_memory(name, text)


def _mark_used(path: Path) -> None:
    """The source's modification time is the module's last use (``workbench kernels cache --prune``)."""
    with contextlib.suppress(OSError):  # a read-only shared cache: pruning goes by when it was written
        os.utime(path)


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file and ``os.replace``: readers see the old file or
    the new one, never half of one; a failed write (full disk) leaves no temporary file."""
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _from_folder(folder: Path, name: str, text: str) -> ModuleType:
    path = folder / f"{name}.py"
    data = text.encode()
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder, exclusive=False):  # a prune waits until the module is imported
        if _holds(path, data):
            _mark_used(path)
        else:
            _write(path, data)
        module = _execute(name, text, str(path))
    guard(module, folder)
    return module


def _in_memory(name: str, text: str) -> ModuleType:
    filename = f"<{name}>"
    text = _CACHE_FLAG.sub(r"\1cache=False", text)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # for tracebacks and numba
    return _execute(name, text, None)


def _execute(name: str, text: str, path: str | None) -> ModuleType:
    """Run ``text`` as module ``name`` (from its source, so that no bytecode file is written or
    read: a damaged ``.pyc`` cannot break it)."""
    code = compile(text, path or f"<{name}>", "exec")
    module = ModuleType(name)
    if path is not None:
        module.__file__ = path
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
