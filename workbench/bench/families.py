"""The ``families`` part of ``workbench bench cpu``: NequIP and Allegro rows beside MACE's.

NequIP 0.19 needs e3nn 0.6 and mace-torch pins e3nn 0.4, so the two families live in separate
environments (``.venv`` and ``.venv-nequip``). This part runs :mod:`workbench.bench.nequip`

* in the NequIP environment's own interpreter, ``nequip_python`` (e.g.
  ``.venv-nequip/bin/python``; ``$WORKBENCH_NEQUIP_PYTHON`` on the command line), as a
  subprocess whose JSON is read back;
* in this process when no interpreter is named and nequip and allegro import here;
* not at all otherwise: the result says why, and how to get the rows.

The settings follow the ``bench cpu`` preset (:data:`SETTINGS`): the full preset times both
families at the tutorial and the larger config in float32 and float64; the smoke preset one
tiny cell, tutorial config, float64.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from workbench.bench.table import read_json

__all__ = [
    "NEQUIP_PYTHON_ENV",
    "SETTINGS",
    "check_python",
    "family_lines",
    "named_python",
    "run_families",
    "subprocess_env",
]

#: per ``bench cpu`` preset, the ``bench nequip`` settings
SETTINGS: dict[str, dict[str, Any]] = {
    "full": {"configs": ("tutorial", "large"), "dtypes": ("float32", "float64"), "repeat": 4, "repeats": 5},
    "smoke": {"configs": ("tutorial",), "dtypes": ("float64",), "repeat": 1, "repeats": 1},
}
#: names the NequIP environment's interpreter (``bench cpu --nequip-python``'s default, notebook 06's)
NEQUIP_PYTHON_ENV = "WORKBENCH_NEQUIP_PYTHON"
#: a subprocess that runs longer than this is stopped (the full preset takes about 10 minutes)
TIMEOUT_S = 3600


def named_python() -> str | None:
    """``$WORKBENCH_NEQUIP_PYTHON``, or None when it is unset or empty."""
    return os.environ.get(NEQUIP_PYTHON_ENV) or None


def check_python(python: str | os.PathLike, source: str = "--nequip-python") -> Path:
    """``python`` as an executable file, or a ValueError naming where it came from (``source``)."""
    path = Path(python).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"{source}: {str(path)!r} is not an executable file (e.g. .venv-nequip/bin/python)")
    return path


def subprocess_env() -> dict[str, str]:
    """This process's environment for the NequIP interpreter, less what points into this one: a
    Jupyter kernel's ``MPLBACKEND`` names a backend only this environment has (nequip's imports
    reach matplotlib), and ``PYTHONHOME`` / ``PYTHONPATH`` would mix the two environments' packages."""
    env = dict(os.environ)
    for name in ("MPLBACKEND", "PYTHONHOME", "PYTHONPATH"):
        env.pop(name, None)
    return env


def _command(python: Path, settings: dict, threads: int, out: Path) -> list[str]:
    cmd = [str(python), "-m", "workbench.cli", "bench", "nequip", "--threads", str(threads), "--out", str(out)]
    cmd += ["--configs", ",".join(settings["configs"]), "--dtypes", ",".join(settings["dtypes"])]
    return cmd + ["--repeat", str(settings["repeat"]), "--repeats", str(settings["repeats"])]


def _why(done: subprocess.CompletedProcess) -> str:
    """The one-line ``workbench: error: ...`` of a failed command, else the end of its output."""
    lines = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
    if lines and lines[-1].startswith("workbench: error:"):
        return lines[-1]
    return "\n".join(lines[-25:])


def _subprocess(python: Path, settings: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        out = Path(tmp) / "nequip.json"
        cmd = _command(python, settings, threads, out)
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=subprocess_env()
            )
        except subprocess.TimeoutExpired:
            return {"error": f"{python}: bench nequip ran over {TIMEOUT_S} s", "command": cmd}
        if done.returncode != 0 or not out.is_file():
            return {"error": f"{python}: bench nequip exited {done.returncode}: {_why(done)}", "command": cmd}
        res = read_json(out)
    res.update(python=str(python), command=cmd)
    return res


def run_families(
    preset: str, threads: int, nequip_python: str | os.PathLike | None = None, settings: dict | None = None
) -> dict:
    """NequIP and Allegro MD and train steps against their own path (see the module docstring):
    ``bench nequip``'s result, or ``{"skipped": why}`` / ``{"error": ...}``. ``settings``
    (configs, dtypes, repeat, repeats) replace the preset's."""
    settings = SETTINGS[preset] if settings is None else settings
    if nequip_python is not None:
        return _subprocess(check_python(nequip_python), settings, threads)
    from workbench.bench.nequip import bench_nequip, installed

    if not installed():
        return {
            "skipped": "nequip and allegro are not installed in this environment; name the NequIP environment's "
            "interpreter with --nequip-python (make bench-cpu passes .venv-nequip/bin/python)"
        }
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        res = bench_nequip(threads=threads, out=Path(tmp) / "nequip.json", **settings)
    return res


def family_lines(res: dict) -> list[str]:
    """The part's table, or the line that says why it has none."""
    if "skipped" in res:
        return ["", f"NequIP / Allegro: skipped ({res['skipped']})"]
    if "error" in res:
        return ["", f"NequIP / Allegro: failed ({res['error']})"]
    from workbench.bench.nequip import format_table

    return ["", format_table(res)]
