"""The ``workbench`` command in a subprocess, as a user runs it (shared by the test modules)."""

import subprocess
import sys
from pathlib import Path

#: the ``workbench`` script of this environment
WORKBENCH = str(Path(sys.executable).parent / "workbench")


def workbench_command(*args) -> list[str]:
    """``workbench ARGS`` as an argument list, each argument made a string (paths, numbers)."""
    return [WORKBENCH, *map(str, args)]


def run_workbench(*args, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run ``workbench ARGS`` to the end, its output captured as text."""
    return subprocess.run(workbench_command(*args), capture_output=True, text=True, timeout=timeout, **kw)
