"""A kernel cache that is damaged, unwritable or pruned under a running compile: real files, real
numba, real read-only and full mounts (:mod:`mount_fixtures`). Every case recompiles or compiles in
memory instead of raising; what the cache held is replaced, atomically, where it can be."""

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from mount_fixtures import full_dir, read_only_dir, tmpfs  # noqa: F401

import workbench  # noqa: F401
from workbench.kernels.numba import generated
from workbench.kernels.numba.cache_folder import KernelCacheWarning

#: a generated module as the kernels write them: a numba function with the disk cache on
SOURCE = "from numba import njit\n\n\n@njit(cache=True)\ndef run(x):\n    return x * {k} + 1\n"
ROOT = Path(__file__).resolve().parents[1]


def _text(tmp_path: Path, k: int = 2) -> str:
    """A source unique to the test (its module name is its digest: no clash in ``sys.modules``)."""
    return f"# {tmp_path}\n" + SOURCE.format(k=k)


def _load_fresh(text: str):
    """What a new process gets: the module imported again from the cache folder."""
    name = f"workbench_test_{hashlib.sha1(text.encode()).hexdigest()[:20]}"
    sys.modules.pop(name, None)
    return generated.load_module(text, "workbench_test")


def test_a_cached_module_that_is_not_utf8_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(tmp_path))
    text = _text(tmp_path)
    path = Path(_load_fresh(text).__file__)
    for damage in (b"\xff\xfe\x00 not utf-8 \xc3\x28", text.encode()[:20], b""):
        path.write_bytes(damage)
        module = _load_fresh(text)
        assert module.run(3) == 7 and path.read_bytes() == text.encode()
    assert not list(tmp_path.glob("*.tmp"))


_RUN = r"""
import json, sys
from workbench.kernels.numba import generated
module = generated.load_module(sys.argv[1], "workbench_test")
print(json.dumps({"value": module.run(3), "hits": sum(module.run.stats.cache_hits.values())}))
"""


def _run_fresh(text: str, cache: Path) -> dict:
    env = {**os.environ, "WORKBENCH_KERNEL_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", _RUN, text], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "random": lambda data: bytes((i * 97 + 13) % 256 for i in range(len(data))),
    "unregistered extension code": lambda data: b"\x80\x04\x82\x07.",
}


@pytest.mark.parametrize("suffix", [".nbi", ".nbc"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_numba_cache_files_are_recompiled_and_replaced(tmp_path, damage, suffix):
    text = _text(tmp_path)
    assert _run_fresh(text, tmp_path) == {"value": 7, "hits": 0}
    assert _run_fresh(text, tmp_path) == {"value": 7, "hits": 1}  # loaded from numba's files
    (target,) = (tmp_path / "__pycache__").glob(f"*{suffix}")
    target.write_bytes(DAMAGES[damage](target.read_bytes()))
    assert _run_fresh(text, tmp_path) == {"value": 7, "hits": 0}  # recompiled, not raised
    assert _run_fresh(text, tmp_path) == {"value": 7, "hits": 1}  # and the files replaced
    (index,) = (tmp_path / "__pycache__").glob("*.nbi")
    with open(index, "rb") as fh:
        pickle.load(fh)  # numba's version, then the index proper
        pickle.loads(fh.read())


def _assert_in_memory(folder: Path, text: str, caught: list) -> None:
    module = _load_fresh(text)
    assert module.run(3) == 7 and getattr(module, "__file__", None) is None
    _load_fresh(text.replace("# ", "# again "))  # one warning per folder, not one per module
    messages = [str(w.message) for w in caught if issubclass(w.category, KernelCacheWarning)]
    assert len(messages) == 1 and str(folder) in messages[0] and "WORKBENCH_KERNEL_CACHE" in messages[0]


def _watch(monkeypatch, folder: Path) -> None:
    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(folder))
    monkeypatch.setattr("workbench.kernels.numba.cache_folder._WARNED", set())


def test_a_read_only_cache_compiles_in_memory_with_one_warning(read_only_dir, monkeypatch, tmp_path):  # noqa: F811
    _watch(monkeypatch, read_only_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_in_memory(read_only_dir, _text(tmp_path), caught)
    assert "read-only" in str(caught[0].message) and not os.listdir(read_only_dir)


def test_a_full_disk_compiles_in_memory_with_one_warning(full_dir, monkeypatch, tmp_path):  # noqa: F811
    _watch(monkeypatch, full_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_in_memory(full_dir, _text(tmp_path), caught)
    assert "no space" in str(caught[0].message) and not list(full_dir.glob("*.tmp"))


def test_a_disk_that_fills_up_before_numba_saves_keeps_the_kernel_in_memory(tmp_path, monkeypatch):
    """The module's source fits, numba's machine code does not: the save fails, the kernel runs."""
    with tmpfs(tmp_path / "nearly", size_kb=64, fill_kb=56) as folder:
        _watch(monkeypatch, folder)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = _load_fresh(_text(tmp_path))
            assert module.run(3) == 7 and Path(module.__file__).parent == folder
        messages = [str(w.message) for w in caught if issubclass(w.category, KernelCacheWarning)]
        assert len(messages) == 1 and "no space" in messages[0]


@pytest.mark.parametrize("variable", ["WORKBENCH_KERNEL_CACHE", "WORKBENCH_CACHE_DIR"])
def test_a_cache_path_that_is_a_regular_file_compiles_in_memory(tmp_path, monkeypatch, variable):
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    monkeypatch.delenv("WORKBENCH_KERNEL_CACHE", raising=False)
    monkeypatch.setenv(variable, str(path))
    monkeypatch.setattr("workbench.kernels.numba.cache_folder._WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_in_memory(generated.source_dir(), _text(tmp_path), caught)
    assert "regular file" in str(caught[0].message) and path.read_text() == "not a folder"


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("WORKBENCH_KERNEL_DISK_CACHE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCacheWarning)  # off on purpose: no warning
        module = _load_fresh(_text(tmp_path))
    assert module.run(3) == 7 and not (tmp_path / "k").exists()


_PRUNE = r"""
import sys, time
from workbench.kernels.tools.cache import prune
end = time.time() + float(sys.argv[2])
while time.time() < end:
    prune(sys.argv[1], 0)
"""


def test_a_prune_racing_fresh_compiles_breaks_none(tmp_path, monkeypatch):
    """``--prune --older-than 0`` in a loop in another process while this one writes, imports and
    compiles new modules: every module loads and runs (numba once said "no locator available")."""
    monkeypatch.setenv("WORKBENCH_KERNEL_CACHE", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pruner = subprocess.Popen([sys.executable, "-c", _PRUNE, str(tmp_path), "40"], env=env)
    try:
        time.sleep(2.0)  # the pruner is looping
        for k in range(40):
            assert _load_fresh(_text(tmp_path, k)).run(3) == 3 * k + 1
        assert pruner.poll() is None, "the pruner stopped early"
    finally:
        pruner.kill()
        pruner.wait()
