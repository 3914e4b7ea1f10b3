"""The ``families`` part of ``workbench bench cpu``: NequIP and Allegro rows beside MACE's.

NequIP 0.19 needs e3nn 0.6 and mace-torch pins e3nn 0.4, so the two families live in separate
environments (``.venv`` and ``.venv-nequip``). This part runs :mod:`workbench.bench.nequip`

* in the NequIP environment's own interpreter, ``nequip_python`` (e.g.
  ``.venv-nequip/bin/python``; ``$WORKBENCH_NEQUIP_PYTHON`` on the command line), as a
  subprocess whose JSON is read back;
* in this process when no interpreter is named and nequip and allegro import here;
* not at all otherwise: the result says why, and how to get the rows.

The settings (configs, dtypes, cell size, repeats) come from the ``bench cpu`` preset's
``families`` entry: the full preset times both families at the tutorial and the larger config in
float32 and float64; the smoke preset one tiny cell, tutorial config, float64.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from workbench.bench.table import read_json
from workbench.switches import switch

__all__ = ["NEQUIP_PYTHON_ENV", "check_python", "failure", "family_lines", "named_python", "run_families", "run_python"]

#: names the NequIP environment's interpreter (``bench cpu --nequip-python``'s default, notebook 06's)
NEQUIP_PYTHON_ENV = "WORKBENCH_NEQUIP_PYTHON"
#: a subprocess that runs longer than this is stopped (the full preset takes about 10 minutes)
TIMEOUT_S = 3600


def named_python() -> str | None:
    """``$WORKBENCH_NEQUIP_PYTHON``, or None when it is unset or empty."""
    return switch(NEQUIP_PYTHON_ENV) or None


def check_python(python: str | os.PathLike, source: str = "--nequip-python") -> Path:
    """``python`` as an executable file, or a ValueError naming where it came from (``source``)."""
    if not str(python).strip():
        raise ValueError(f"{source}: empty; name the NequIP environment's python (e.g. .venv-nequip/bin/python)")
    path = Path(python).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"{source}: {str(path)!r} is not an executable file (e.g. .venv-nequip/bin/python)")
    return path


def run_python(python: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python args`` with its text output captured, in this process's environment less what
    points into this one: a Jupyter kernel's ``MPLBACKEND`` names a backend only this environment
    has (nequip's imports reach matplotlib), and ``PYTHONHOME`` / ``PYTHONPATH`` would mix the two
    environments' packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "PYTHONHOME", "PYTHONPATH")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, check=False, env=env)


def _arguments(settings: dict, threads: int, out: Path) -> list[str]:
    cmd = ["-m", "workbench.cli", "bench", "nequip", "--threads", str(threads), "--out", str(out)]
    cmd += ["--configs", ",".join(settings["configs"]), "--dtypes", ",".join(settings["dtypes"])]
    return cmd + ["--repeat", str(settings["repeat"]), "--repeats", str(settings["repeats"])]


def failure(done: subprocess.CompletedProcess) -> str:
    """The one-line ``workbench: error: ...`` of a failed command, else the end of its output."""
    lines = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
    if lines and lines[-1].startswith("workbench: error:"):
        return lines[-1]
    if not lines:
        return "no output" + (" (is it a python with the workbench installed?)" if done.returncode == 0 else "")
    return "\n".join(lines[-25:])


def _subprocess(python: Path, settings: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        out = Path(tmp) / "nequip.json"
        args = _arguments(settings, threads, out)
        cmd = [str(python), *args]
        try:
            done = run_python(python, args, TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"{python}: bench nequip ran over {TIMEOUT_S} s", "command": cmd}
        if done.returncode != 0 or not out.is_file():
            wrote = "" if done.returncode != 0 else f" without writing {out.name}"
            return {"error": f"{python}: bench nequip exited {done.returncode}{wrote}: {failure(done)}", "command": cmd}
        res = read_json(out)
    res.update(python=str(python), command=cmd)
    return res


def run_families(settings: dict, threads: int, nequip_python: str | os.PathLike | None = None) -> dict:
    """NequIP and Allegro MD and train steps against their own path (see the module docstring),
    with ``bench nequip``'s ``settings`` (configs, dtypes, repeat, repeats): its result, or
    ``{"skipped": why}`` / ``{"error": ...}``."""
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
