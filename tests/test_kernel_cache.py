"""The kernel cache's bookkeeping (:mod:`workbench.kernels.tools.cache`, ``workbench kernels cache``):
loading a module marks it used, pruning removes every file of the modules unused for longer than
asked and the strays, a dry run removes nothing, and bad arguments are refused."""

import os
import sys
import time
from pathlib import Path

import pytest

import workbench  # noqa: F401
from workbench.kernels.numba import generated
from workbench.kernels.tools.cache import DAY, prune, scan

DIGESTS = ("0" * 20, "1" * 20, "2" * 20)


def _module(directory: Path, kind: str, digest: str, age_days: float, now: float) -> list[Path]:
    """A generated module's source and its __pycache__ files, last used ``age_days`` ago."""
    name = f"workbench_{kind}_{digest}"
    pycache = directory / "__pycache__"
    pycache.mkdir(parents=True, exist_ok=True)
    files = [directory / f"{name}.py", pycache / f"{name}.run-12.py311.nbi", pycache / f"{name}.run-12.py311.1.nbc"]
    for i, f in enumerate(files):
        f.write_bytes(b"x" * (100 + i))
    os.utime(files[0], (now - age_days * DAY, now - age_days * DAY))
    return files


def test_scan_and_prune_by_last_use(tmp_path):
    now = time.time()
    old = _module(tmp_path, "cpu", DIGESTS[0], 40, now)
    fresh = _module(tmp_path, "fused", DIGESTS[1], 2, now)
    stray = tmp_path / "__pycache__" / f"workbench_cpu_{DIGESTS[2]}.run-3.py311.nbi"  # its module is gone
    stray.write_bytes(b"y" * 7)
    tmp = tmp_path / f"workbench_cpu_{DIGESTS[2]}.123.456.tmp"  # a crashed writer's
    tmp.write_bytes(b"z" * 5)
    os.utime(tmp, (now - 40 * DAY, now - 40 * DAY))
    (tmp_path / "notes.txt").write_text("not ours")
    modules = scan(tmp_path)
    assert [m.name for m in modules] == [f"workbench_cpu_{DIGESTS[0]}", f"workbench_fused_{DIGESTS[1]}"]
    assert modules[0].size == 303 and modules[0].files[0] == old[0]

    dry = prune(tmp_path, 30, dry_run=True, now=now)
    assert [m.name for m in dry.modules] == [modules[0].name] and set(dry.strays) == {stray, tmp}
    assert dry.size == 303 + 7 + 5 and all(f.exists() for f in old + [stray, tmp])

    done = prune(tmp_path, 30, now=now)
    assert done.size == dry.size
    assert not any(f.exists() for f in old + [stray, tmp])
    assert all(f.exists() for f in fresh) and (tmp_path / "notes.txt").exists()
    assert [m.name for m in scan(tmp_path)] == [f"workbench_fused_{DIGESTS[1]}"]


def test_loading_a_module_marks_it_used(tmp_path, monkeypatch):
    monkeypatch.setenv(generated.KERNEL_CACHE_ENV, str(tmp_path))
    text = "VALUE = 41 + 1\n"
    module = generated.load_module(text, "workbench_test")
    path = Path(module.__file__)
    assert module.VALUE == 42 and path.parent == tmp_path
    long_ago = time.time() - 90 * DAY
    os.utime(path, (long_ago, long_ago))
    del sys.modules[module.__name__]  # a new process would import it again
    generated.load_module(text, "workbench_test")
    assert path.stat().st_mtime > time.time() - DAY
    assert prune(tmp_path, 30).modules == []


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--older-than"):
        prune(tmp_path, -1)
    with pytest.raises(ValueError, match="--older-than"):
        prune(tmp_path, float("nan"))
    assert scan(tmp_path / "missing") == []


def test_command_line(tmp_path, capsys):
    from workbench.cli import main

    now = time.time()
    _module(tmp_path, "cpu", DIGESTS[0], 10, now)
    _module(tmp_path, "cpu", DIGESTS[1], 1, now)
    assert main(["kernels", "cache", "--cache", str(tmp_path), "--prune", "--older-than", "5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"kernel cache {tmp_path}: 2 modules" in out and "would remove 1 modules not loaded for 5 days" in out
    assert main(["kernels", "cache", "--cache", str(tmp_path), "--prune", "--older-than", "5"]) == 0
    assert "removed 1 modules" in capsys.readouterr().out and len(scan(tmp_path)) == 1
