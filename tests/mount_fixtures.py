"""Real unwritable folders for the kernel cache tests: a read-only and a tiny (full) tmpfs mount.

The tests run as root, where ``chmod 0555`` stops nothing, so a mount is the honest way to get
``EROFS`` and ``ENOSPC``. Where mounting is not allowed (no root, no CAP_SYS_ADMIN) the tests that
need one skip, saying why."""

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size_kb: int = 64, read_only: bool = False, fill_kb: int = 0):
    """``path`` as a tmpfs of ``size_kb`` KiB, ``read_only`` or with ``fill_kb`` KiB taken by a file."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kb}k" + (",ro" if read_only else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or 'mount failed'}): needs root")
    try:
        if fill_kb:
            with contextlib.suppress(OSError), open(path / "fill", "wb") as fh:
                fh.write(b"\0" * fill_kb * 1024)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def read_only_dir(tmp_path):
    with tmpfs(tmp_path / "ro", read_only=True) as path:
        yield path


@pytest.fixture
def full_dir(tmp_path):
    """A folder on a filesystem with no byte left."""
    with tmpfs(tmp_path / "full", size_kb=64, fill_kb=64) as path:
        yield path
