"""The pinned environment: requirements.lock, environment.yml and pyproject agree, and the venv matches."""

import importlib.metadata as md
import importlib.util
import os
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lock", ROOT / ".ci" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("dev", "lab", "mace"):
        reqs += project["optional-dependencies"][extra]
    return {_canonical(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}


def test_lock_pins_every_dependency_exactly():
    pins = {_canonical(k): v for k, v in lock.read_lock().items()}
    missing = _requirement_names() - set(pins)
    assert not missing, f"pyproject dependencies not pinned in requirements.lock: {sorted(missing)}"
    for name in (
        "torch",
        "mace-torch",
        "e3nn",
        "numba",
        "numba-cuda",
        "numpy",
        "ase",
        "vesin",
        "tblite",
        "jupyterlab",
        "plotly",
        "pip",
    ):
        assert re.fullmatch(r"\d+(\.\d+)*(\.post\d+)?", pins[name]), (name, pins[name])
    assert pins["torch"] == "2.13.0"  # the CPU wheel on disk; no local label in the lock


def test_environment_yml_says_the_same_versions():
    assert lock.read_environment_pins() == {k: v for k, v in lock.read_lock().items() if k != "pip"}
    text = (ROOT / "environment.yml").read_text()
    assert f"pip={lock.read_lock()['pip']}" in text and "-e .[dev,lab,mace,docs]" in text


def test_lock_script_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LOCK", tmp_path / "requirements.lock")
    monkeypatch.setattr(lock, "ENVIRONMENT", tmp_path / "environment.yml")
    pins = {"numpy": "2.4.6", "torch": "2.13.0", "pip": "26.3", "PyYAML": "6.0.4"}
    lock.write(pins)
    assert lock.read_lock(lock.LOCK) == pins
    assert lock.read_environment_pins(lock.ENVIRONMENT) == {k: v for k, v in pins.items() if k != "pip"}


@pytest.mark.skipif(not os.environ.get("WORKBENCH_LOCK"), reason="installed without the lock (make test LOCK=)")
def test_installed_versions_are_the_locked_ones():
    pins = lock.read_lock(ROOT / os.environ["WORKBENCH_LOCK"])
    wrong = {}
    for name, version in pins.items():
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            continue  # a platform-specific pin that this machine does not need
        if got.split("+")[0] != version:
            wrong[name] = (version, got)
    assert not wrong, f"installed versions differ from the lock: {wrong}"
