"""Exceptions of :mod:`workbench.launch`."""

from __future__ import annotations

from pathlib import Path


class LaunchError(RuntimeError):
    """The run could not be started or queried: SLURM missing or not answering, sbatch refused it, ..."""


class LaunchRefused(LaunchError, ValueError):
    """The request itself is refused before anything starts (an active run in the directory, a
    ``fresh`` directory that is not a run directory): the user's to fix, so the command line
    treats it as a usage error (exit 2)."""


class RunFailed(RuntimeError):
    """A launched run failed. ``str()`` gives the reason and the failing rank's traceback tail.

    Attributes: ``run_dir``, ``reason`` (one line), ``traceback`` (text, may be empty),
    ``logs`` (the tail of the run's logs).
    """

    def __init__(self, run_dir: Path, reason: str, traceback: str = "", logs: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.reason = reason
        self.traceback = traceback
        self.logs = logs
        text = f"run {self.run_dir} failed: {reason}"
        if traceback:
            text += "\n--- traceback ---\n" + _tail(traceback, 40)
        elif logs:
            text += "\n--- log tail ---\n" + _tail(logs, 30)
        super().__init__(text)


def _tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])
