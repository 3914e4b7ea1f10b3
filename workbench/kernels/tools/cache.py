"""``workbench kernels cache``: what the kernel cache holds, and pruning what no run has loaded
for a while.

Each generated kernel module is ``workbench_<kind>_<digest>.py`` in the cache folder
(:func:`~workbench.kernels.numba.generated.source_dir`), with numba's machine code for it
(``<module>.<function>-<line>.py311.nbi`` and ``.nbc``) wherever numba keeps it: ``__pycache__``
beside the module, or the folder numba derives from the cache folder under ``$NUMBA_CACHE_DIR`` or
its user-wide cache (:func:`~workbench.kernels.numba.numba_cache.numba_folders`); all of them
count towards a module's size and go with it.
A new model configuration, dtype or workbench version writes new modules and never deletes the
old ones, so a shared cache only grows. Loading a module refreshes its source's modification
time, which is therefore its last use; :func:`prune` removes the modules (all their files) whose
last use is older than a number of days, numba's files whose module is gone, and temporary files a
crashed writer left. It holds the folder's lock
(:func:`~workbench.kernels.numba.cache_folder.folder_lock`), so a process that is writing and
importing a module finishes first; a job that needs a pruned module writes and compiles it
again. Pruning is therefore safe while jobs run.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from workbench.kernels.numba.cache_folder import folder_lock
from workbench.kernels.numba.numba_cache import numba_folders

__all__ = ["CachedModule", "PruneReport", "prune", "scan"]

MODULE = re.compile(r"^(workbench_[a-z0-9_]+_[0-9a-f]{20})\.py$")
#: numba's (and Python's) files of a generated module: its name, a dot, then anything
CACHED = re.compile(r"^(workbench_[a-z0-9_]+_[0-9a-f]{20})\.")
TEMPORARY = re.compile(r"^workbench_[a-z0-9_]+_[0-9a-f]{20}\.\d+\.\d+\.tmp$")
DAY = 86400.0


@dataclass(frozen=True)
class CachedModule:
    """One generated module: its ``files`` (source first), their ``size`` in bytes and its
    ``last_used`` time (seconds since the epoch)."""

    name: str
    files: tuple[Path, ...]
    size: int
    last_used: float


@dataclass
class PruneReport:
    """What :func:`prune` removed (or, on a dry run, would remove)."""

    directory: Path
    modules: list[CachedModule] = field(default_factory=list)
    strays: list[Path] = field(default_factory=list)
    size: int = 0
    dry_run: bool = False


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # another process pruned or replaced it meanwhile
        return None


def _by_module(directory: Path) -> dict[str, list[Path]]:
    """numba's files of the generated modules, in every folder numba may keep them, grouped by
    the module name they start with."""
    groups: dict[str, list[Path]] = defaultdict(list)
    for folder in numba_folders(directory):
        for f in folder.iterdir() if folder.is_dir() else ():
            match = CACHED.match(f.name)
            if match:
                groups[match.group(1)].append(f)
    return groups


def scan(directory: str | Path) -> list[CachedModule]:
    """The generated modules in ``directory``, least recently used first."""
    directory = Path(directory)
    return _modules(directory, _by_module(directory)) if directory.is_dir() else []


def _modules(directory: Path, extra: dict[str, list[Path]]) -> list[CachedModule]:
    modules = []
    for source in directory.iterdir():
        match = MODULE.match(source.name)
        if not match:
            continue
        try:
            last_used = source.stat().st_mtime
        except FileNotFoundError:
            continue
        files = (source, *sorted(extra.get(match.group(1), ())))
        size = sum(s for s in map(_size, files) if s is not None)
        modules.append(CachedModule(match.group(1), files, size, last_used))
    return sorted(modules, key=lambda m: (m.last_used, m.name))


def _strays(directory: Path, extra: dict[str, list[Path]], names: set[str], before: float) -> list[Path]:
    """numba's files of modules that are gone, and old temporary files."""
    out = [f for name, files in extra.items() if name not in names for f in files]
    for f in directory.iterdir() if directory.is_dir() else ():
        try:
            if TEMPORARY.match(f.name) and f.stat().st_mtime < before:
                out.append(f)
        except FileNotFoundError:
            continue
    return out


def prune(
    directory: str | Path, older_than_days: float, dry_run: bool = False, now: float | None = None
) -> PruneReport:
    """Remove the modules of ``directory`` not loaded for ``older_than_days`` days (every file of
    each), and the strays; ``dry_run``: only report them."""
    if not older_than_days >= 0:
        raise ValueError(f"--older-than: {older_than_days!r} days; give a number of days >= 0")
    directory = Path(directory)
    before = (time.time() if now is None else now) - older_than_days * DAY
    with folder_lock(directory, exclusive=not dry_run):  # a module being written and imported is not cut short
        extra = _by_module(directory)
        modules = _modules(directory, extra) if directory.is_dir() else []
        report = PruneReport(directory, [m for m in modules if m.last_used < before], dry_run=dry_run)
        report.strays = _strays(directory, extra, {m.name for m in modules}, before)
        for f in [f for m in report.modules for f in m.files] + report.strays:
            size = _size(f)
            if size is None:
                continue
            report.size += size
            if not dry_run:
                f.unlink(missing_ok=True)
    return report
