"""The kernel cache folder: where it is, whether this process can write to it, and the lock that
keeps ``workbench kernels cache --prune`` from removing a module while a process writes and
imports it.

The rule for a folder that cannot be written (a read-only mount, a full disk, a path that is a
regular file): a run never stops for it. Kernels then compile in memory, and the process says so
once per folder (:class:`KernelCacheWarning`, naming the folder and the settings that move it).
Only the commands whose whole job is the cache (``workbench kernels precompile``, ``workbench
kernels cache --prune``) refuse it, in one line (:func:`require_writable`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from workbench.cache_dir import CACHE_DIR_ENV, cache_dir
from workbench.kernels.options import kernel_options, variable

__all__ = [
    "CACHE_SWITCH_ENV",
    "KERNEL_CACHE_ENV",
    "LOCK_NAME",
    "KernelCacheWarning",
    "folder_lock",
    "reason",
    "require_cache_on",
    "require_writable",
    "source_dir",
    "unwritable",
    "warn_in_memory",
]

#: the kernel cache folder; a cluster may point it at a shared filesystem, so that a kernel one
#: job compiled is loaded by the next
KERNEL_CACHE_ENV = variable("kernel_cache")
#: ``0``: generated kernels compile in memory only, nothing is written
CACHE_SWITCH_ENV = variable("cache")
#: the lock file in the folder (loading holds it shared, pruning exclusive)
LOCK_NAME = "prune.lock"

#: folders this process has warned about (one warning each); under the lock below
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()
#: fcntl locks belong to the process, so threads of one process exclude each other with this
_IN_PROCESS = threading.RLock()


class KernelCacheWarning(UserWarning):
    """The kernel cache folder cannot be written: kernels compile in memory."""


def source_dir() -> Path:
    """Where generated kernel modules (and numba's cache of their machine code) live:
    ``$WORKBENCH_KERNEL_CACHE``, else ``$WORKBENCH_CACHE_DIR/kernels`` (default
    ``~/.cache/cfm-workbench/kernels``)."""
    cache = kernel_options().kernel_cache
    if cache:
        return Path(cache).expanduser()
    return cache_dir("kernels")


def _setting() -> str:
    return KERNEL_CACHE_ENV if kernel_options().kernel_cache else f"{KERNEL_CACHE_ENV} (or {CACHE_DIR_ENV})"


def reason(exc: OSError) -> str:
    """What an ``OSError`` from writing into the folder means, in words."""
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        return "a regular file is in the way, not a folder"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return exc.strerror or type(exc).__name__


def warn_in_memory(folder: Path, why: str) -> None:
    """Say once per folder and process that ``folder`` cannot be written (``why``, e.g. from
    :func:`reason`) and kernels compile in memory."""
    key = str(folder)
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(
        KernelCacheWarning(
            f"kernel cache {folder}: cannot write ({why}); kernels compile in memory in this process and "
            f"again in the next one. Point {_setting()} at a writable folder, or set {CACHE_SWITCH_ENV}=0"
        ),
        stacklevel=3,
    )


def _probe(folder: Path) -> None:
    """Raise the ``OSError`` that writing a file into ``folder`` meets (nothing is left behind)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)  # a full disk refuses data, not always an empty file
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def require_cache_on(what: str) -> None:
    """For the command that fills the cache: a ``ValueError`` when ``WORKBENCH_KERNEL_DISK_CACHE=0``."""
    if not kernel_options().cache:
        raise ValueError(f"{what}: {CACHE_SWITCH_ENV}=0 keeps kernels in memory only; unset it to fill the cache")


def unwritable(folder: Path) -> str | None:
    """Why a file cannot be written into ``folder`` (created if missing), or None when it can."""
    try:
        _probe(folder)
    except OSError as exc:
        return reason(exc)
    return None


def require_writable(folder: Path, what: str) -> None:
    """For the commands that exist to fill or prune the cache: a ``ValueError`` (one line, exit 2)
    naming ``folder`` and the setting when it cannot be written."""
    why = unwritable(folder)
    if why:
        raise ValueError(
            f"{what}: kernel cache {folder} cannot be written ({why}); give --cache a writable folder or set {_setting()}"
        )


@contextlib.contextmanager
def folder_lock(folder: Path, exclusive: bool) -> Iterator[None]:
    """Hold ``folder/prune.lock``: shared while a module is written and imported, exclusive while
    pruning (``fcntl.lockf``, which NFS honours). A folder where the lock cannot be made or taken
    (read-only, a lock-less filesystem) is used without it: nobody can prune it from here either."""
    with _IN_PROCESS:
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            yield
            return
        try:
            with contextlib.suppress(OSError):
                fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock
