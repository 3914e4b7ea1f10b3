"""Kernel options are values: the environment is read in one module (``kernels/options.py``), code
sets them with ``configure``/``overridden``, child processes get them through
``child_environment``; every other ``WORKBENCH_*`` variable is a listed process-level switch."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.kernels import options
from workbench.kernels.options import ENV, child_environment, configure, kernel_options, overridden
from workbench.switches import SWITCHES, switch

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"
#: the two modules that may read WORKBENCH_* variables from the environment
READERS = {"kernels/options.py", "switches.py"}
#: the variables the package sets for the libraries it runs (see each module for why)
THIRD_PARTY = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "LOCAL_RANK", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_code_wins_over_the_environment_and_a_block_restores(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CUDA_KERNELS", "unrolled")
    monkeypatch.setenv("WORKBENCH_CUDA_TPB", "64")
    assert (kernel_options().cuda_kernels, kernel_options().threads_per_block) == ("unrolled", 64)
    with overridden(cuda_kernels="table", unroll_parts=3) as inside:
        assert (inside.cuda_kernels, inside.unroll_parts, inside.threads_per_block) == ("table", 3, 64)
        with overridden(cuda_kernels=None):  # unset in code: the variable counts again
            assert kernel_options().cuda_kernels == "unrolled"
        assert kernel_options().cuda_kernels == "table"
    assert (kernel_options().cuda_kernels, kernel_options().unroll_parts) == ("unrolled", None)
    assert os.environ["WORKBENCH_CUDA_KERNELS"] == "unrolled"  # nothing was written


def test_configure_holds_for_the_process_and_reaches_children(monkeypatch, tmp_path):
    monkeypatch.delenv("WORKBENCH_KERNEL_CACHE", raising=False)
    saved = options._SET
    try:
        configure(kernel_cache=str(tmp_path), fuse_passes=False)
        assert kernel_options().kernel_cache == str(tmp_path) and "WORKBENCH_KERNEL_CACHE" not in os.environ
        env = child_environment()
        assert env["WORKBENCH_KERNEL_CACHE"] == str(tmp_path) and env["WORKBENCH_FUSE_PASSES"] == "0"
        code = (
            "from workbench.kernels.options import kernel_options as k; o = k(); print(o.kernel_cache, o.fuse_passes)"
        )
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [str(tmp_path), "False"]
        configure(fuse_passes=None)
        assert kernel_options().fuse_passes is True and "WORKBENCH_FUSE_PASSES" not in child_environment()
    finally:
        options._SET = saved


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cuda_kernels": "fast"}, "kernel option 'cuda_kernels' must be one of auto, table, unrolled, got 'fast'"),
        ({"threads_per_block": 0}, "kernel option 'threads_per_block' must be a positive int, got '0'"),
        ({"fuse_passes": "yes"}, "kernel option 'fuse_passes' must be 0 or 1, got 'yes'"),
        ({"tile": 4}, r"unknown kernel option\(s\) \['tile'\]; the options are cuda_kernels, fuse_passes"),
    ],
)
def test_bad_values_name_the_option_and_change_nothing(changes, message):
    before = kernel_options()
    with pytest.raises(ValueError, match=message), overridden(**changes):
        pass
    with pytest.raises(ValueError, match=message):
        configure(**changes)
    assert kernel_options() == before


def test_the_two_caches_have_two_switches(monkeypatch, tmp_path):
    from workbench.data.cache import cache_path

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    assert cache_path(b"x", tmp_path / "a.xyz", ()) is not None and kernel_options().cache
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", "0")
    assert cache_path(b"x", tmp_path / "a.xyz", ()) is None and kernel_options().cache
    monkeypatch.delenv("WORKBENCH_DATA_CACHE")
    monkeypatch.setenv("WORKBENCH_KERNEL_DISK_CACHE", "0")
    assert cache_path(b"x", tmp_path / "a.xyz", ()) is not None and not kernel_options().cache


def test_every_workbench_variable_is_a_kernel_option_or_a_listed_switch():
    options_env = {env for env, _, _ in ENV.values()}
    assert not options_env & set(SWITCHES)
    for name, switch_ in SWITCHES.items():
        owner = PACKAGE.joinpath(*switch_.owner.split(".")[1:]).with_suffix(".py")
        assert name in owner.read_text(), f"{name}: its owner {switch_.owner} does not name it"
    for rel, text in _modules():
        for name in set(re.findall(r"\bWORKBENCH_[A-Z0-9_]*[A-Z0-9]\b", text)):
            assert name in options_env or name in SWITCHES, f"workbench/{rel} names {name}, listed nowhere"
    page = (PACKAGE.parent / "docs" / "reference" / "environment.md").read_text()
    for name in (*options_env, *SWITCHES):  # the reference page lists both, one row each
        assert page.count(f"| `{name}` |") == 1, f"docs/reference/environment.md: {name}"
    with pytest.raises(KeyError, match="WORKBENCH_NOPE is not a process-level switch"):
        switch("WORKBENCH_NOPE")


def _environ_uses(tree: ast.AST):
    """``(node, key, writes)`` for each ``os.environ[...]``, ``os.environ.get/setdefault/pop(...)``
    and ``os.getenv(...)``; ``key`` is the first argument's node."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            yield node, node.slice, isinstance(node.ctx, ast.Store | ast.Del)
        elif isinstance(node, ast.Call) and node.args:
            f = ast.unparse(node.func)
            if f in ("os.environ.get", "os.getenv", "os.environ.setdefault", "os.environ.pop"):
                yield node, node.args[0], f.endswith(("setdefault", "pop"))


def test_no_module_reads_a_workbench_variable_or_writes_one_for_another():
    for rel, text in _modules():
        if rel in READERS:
            continue
        for node, key, writes in _environ_uses(ast.parse(text)):
            where = f"workbench/{rel}:{node.lineno}"
            if not isinstance(key, ast.Constant):  # a parameter (toolkit's PTXAS) passes; a constant would hide ours
                assert ast.unparse(key).islower(), f"{where}: os.environ[{ast.unparse(key)}]: name the variable"
                continue
            assert not str(key.value).startswith("WORKBENCH_"), f"{where}: reads {key.value} (use switch() or options)"
            if writes:  # only variables other programs read (OpenMP, gloo, torch): never one of ours
                assert key.value in THIRD_PARTY, where
