"""numba's on-disk cache of the generated kernels: where its files are, and surviving damaged ones.

numba keeps a function's machine code in an index (``<module>.<function>-<line>.py311.nbi``) and
data files (``.nbc``), in ``__pycache__`` beside the module, under ``$NUMBA_CACHE_DIR``, or in its
user-wide folder when ``__pycache__`` cannot be written. numba reads them with ``pickle``: a
truncated, empty or overwritten file raises (``UnpicklingError``, ``EOFError``, ``ValueError``:
"unregistered extension code") at every launch and is never rewritten, and a full disk raises
``OSError`` when it saves. :func:`guard` makes both recoverable for one generated module: a file
that does not load is dropped and the kernel compiled again (numba then writes fresh files, each
through a temporary file and ``os.replace``); a save that fails leaves the kernel in memory.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from workbench.kernels.numba.cache_folder import reason, warn_in_memory

__all__ = ["guard", "numba_folders"]


def numba_folders(directory: Path) -> list[Path]:
    """Every folder where numba may keep the cache of modules in ``directory``: its
    ``__pycache__``, and the folders numba derives from the directory under ``$NUMBA_CACHE_DIR``
    and its user-wide cache (numba's own naming, so the two cannot drift apart)."""
    import numba
    from numba.core import config
    from numba.core.caching import _CacheLocator
    from numba.misc.appdirs import AppDirs

    directory = Path(directory)
    sub = _CacheLocator.get_suitable_cache_subpath(str(directory.absolute() / "module.py"))
    roots = [config.CACHE_DIR, AppDirs(appname=numba.__name__, appauthor=False).user_cache_dir]
    return [directory / "__pycache__", *(Path(root) / sub for root in roots if root)]


def _drop(cache: Any, folder: Path) -> None:
    """Forget what ``cache`` has on disk (numba writes an empty index); a folder where even that
    fails keeps the kernel in memory."""
    try:
        cache.flush()
    except OSError as exc:
        cache.disable()
        warn_in_memory(folder, reason(exc))


def _guard_one(cache: Any, folder: Path) -> None:
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        try:
            return load(sig, target_context)
        except Exception:  # damaged files fail in many ways (pickle, rebuild); a real problem fails the compile
            _drop(cache, folder)
            return None

    def save_overload(sig: Any, data: Any) -> None:
        for _ in range(2):
            try:
                return save(sig, data)
            except FileNotFoundError:  # a prune took the folder or a temporary file meanwhile: once more
                continue
            except OSError as exc:  # full disk, read-only fallback folder: the kernel stays in memory
                cache.disable()
                warn_in_memory(folder, reason(exc))
                return None
        return None

    cache.load_overload, cache.save_overload = load_overload, save_overload


def guard(module: ModuleType, folder: Path) -> None:
    """Make the disk cache of every numba function in ``module`` (CPU ``njit`` and ``cuda.jit``
    dispatchers) recover from damaged files and failed saves, as the module docstring says."""
    for value in list(vars(module).values()):
        cache = getattr(value, "_cache", None)
        if cache is not None and hasattr(cache, "_cache_file"):  # a real disk cache, not numba's NullCache
            _guard_one(cache, folder)
