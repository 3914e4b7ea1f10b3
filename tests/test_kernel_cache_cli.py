"""The commands on a kernel cache that is damaged, unwritable or off, as a user runs them: ``md``
and ``train`` go on (one warning where the folder cannot be written), the cache's own commands
refuse an unusable folder in one line, and ``kernels cache`` counts and prunes numba's files
wherever numba keeps them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fixtures import run_workbench
from md_fixtures import tiny_model  # noqa: F401
from mount_fixtures import read_only_dir  # noqa: F401

import workbench  # noqa: F401
from workbench.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _md(model, structure, env: dict) -> subprocess.CompletedProcess:
    return run_workbench("md", model, "--structure", structure, "--steps", 2, timeout=600, env={**os.environ, **env})


def _one_line_error(code: int, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(w in lines[0] for w in words), lines[0]


def test_md_repairs_a_damaged_cache(tiny_model, tmp_path):  # noqa: F811
    model, structure = tiny_model
    env = {"WORKBENCH_KERNEL_CACHE": str(tmp_path / "k")}
    assert _md(model, structure, env).returncode == 0
    sources = list((tmp_path / "k").glob("workbench_*.py"))
    numba_files = list((tmp_path / "k" / "__pycache__").glob("*.nb[ic]"))
    assert sources and numba_files
    for f in sources:
        f.write_bytes(b"\xff\xfe" + f.read_bytes()[:40])  # not UTF-8, and cut short
    for f in numba_files:
        f.write_bytes(f.read_bytes()[:17])
    res = _md(model, structure, env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert all(f.read_bytes()[:2] != b"\xff\xfe" for f in sources)


def test_md_on_a_read_only_cache_warns_once(tiny_model, read_only_dir):  # noqa: F811
    model, structure = tiny_model
    res = _md(model, structure, {"WORKBENCH_KERNEL_CACHE": str(read_only_dir)})
    assert res.returncode == 0, res.stderr[-3000:]
    warned = [line for line in res.stderr.splitlines() if "KernelCacheWarning" in line]
    assert len(warned) == 1 and str(read_only_dir) in warned[0] and "read-only" in warned[0]


def test_md_with_the_cache_off_writes_nothing_under_the_cache_folder(tiny_model, tmp_path):  # noqa: F811
    model, structure = tiny_model
    res = _md(model, structure, {"WORKBENCH_KERNEL_DISK_CACHE": "0", "WORKBENCH_CACHE_DIR": str(tmp_path / "c")})
    assert res.returncode == 0 and "KernelCacheWarning" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*"))


def test_train_on_a_read_only_kernel_cache_trains(tmp_path, read_only_dir):  # noqa: F811
    from train_fixtures import run_cli, tiny

    cfg = tiny(
        tmp_path, "train_ro_cache", backend="numba", max_steps=2, checkpoint_every=0, kernel_cache=str(read_only_dir)
    )
    res = run_cli(cfg, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "KernelCacheWarning" in res.stderr


def test_precompile_refuses_an_unusable_cache_in_one_line(tmp_path, read_only_dir, capsys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("WORKBENCH_KERNEL_CACHE", raising=False)
    options = ["kernels", "precompile", "--hidden", "4x0e+4x1o", "--max-ell", "1", "--target", "ptx"]
    _one_line_error(main([*options, "--cache", str(read_only_dir)]), capsys.readouterr().err, str(read_only_dir))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _one_line_error(main([*options, "--cache", str(a_file)]), capsys.readouterr().err, "regular file", "--cache")
    monkeypatch.setenv("WORKBENCH_KERNEL_DISK_CACHE", "0")
    _one_line_error(
        main([*options, "--cache", str(tmp_path / "k")]), capsys.readouterr().err, "WORKBENCH_KERNEL_DISK_CACHE=0"
    )
    assert not (tmp_path / "k").exists()


def test_kernels_cache_refuses_a_file_and_a_read_only_prune(tmp_path, read_only_dir, capsys):  # noqa: F811
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _one_line_error(main(["kernels", "cache", "--cache", str(a_file)]), capsys.readouterr().err, "regular file")
    assert main(["kernels", "cache", "--cache", str(read_only_dir)]) == 0  # a report reads only
    prune = ["kernels", "cache", "--cache", str(read_only_dir), "--prune"]
    _one_line_error(main(prune), capsys.readouterr().err, str(read_only_dir), "read-only")


_COMPILE = r"""
import sys
from workbench.kernels.numba import generated
module = generated.load_module("from numba import njit\n\n\n@njit(cache=True)\ndef run(x):\n    return x + 1\n", "workbench_test")
assert module.run(1) == 2
"""


def test_kernels_cache_counts_and_prunes_numba_files_under_numba_cache_dir(tmp_path):
    """With ``NUMBA_CACHE_DIR`` numba keeps the machine code outside the kernel folder: the
    report counts it with its module, and a prune removes it with its module."""
    env = {**os.environ, "WORKBENCH_KERNEL_CACHE": str(tmp_path / "k"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-c", _COMPILE], env=env, check=True, timeout=300)
    numba_files = [f for f in (tmp_path / "numba").rglob("*") if f.is_file()]
    assert numba_files and not (tmp_path / "k" / "__pycache__").exists()
    scan = "from workbench.kernels.tools.cache import scan; import sys; print(sum(m.size for m in scan(sys.argv[1])))"
    size = subprocess.run(
        [sys.executable, "-c", scan, str(tmp_path / "k")], env=env, capture_output=True, text=True, check=True
    )
    source = next((tmp_path / "k").glob("workbench_test_*.py"))
    assert int(size.stdout) == source.stat().st_size + sum(f.stat().st_size for f in numba_files)
    res = run_workbench("kernels", "cache", "--prune", "--older-than", "0", env=env)
    assert res.returncode == 0 and "removed 1 modules" in res.stdout, res.stderr
    assert not source.exists() and not any(f.exists() for f in numba_files)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--elements", "0"], ["--elements 0", "1 to 118"]),
        (["--max-ell", "-1"], ["--max-ell -1", "1 to 4"]),
        (["--max-ell", "0", "--hidden", "8x0e+8x1o+8x2e"], ["--max-ell 0", "1 to 4"]),
        (["--correlation", "0"], ["--correlation 0", "1 to 5"]),
        (["--correlation", "9"], ["--correlation 9", "1 to 5"]),
        (["--cc", "1.0"], ["--cc 1.0", "9.0"]),
        (["--cc", "nine"], ["--cc 'nine'", "MAJOR.MINOR"]),
        (["--workers", "0"], ["--workers 0", ">= 1"]),
        (["--hidden", "8x1o"], ["--hidden '8x1o'", "0e"]),
        (["--hidden", "8x0e+4x1o"], ["--hidden", "same number of channels"]),
        (["--hidden", "not irreps"], ["--hidden 'not irreps'", "128x0e+128x1o"]),
        (["--modules", ","], ["--modules ','", "prefixes"]),
        (["--modules", "nothing.", "--hidden", "4x0e+4x1o", "--max-ell", "1"], ["--modules nothing.", "products.0"]),
        (["--json", "/no/such/folder/out.json"], ["--json", "does not exist"]),
    ],
)
def test_precompile_options_are_checked_before_compiling(args, words, tmp_path, capsys):
    _one_line_error(
        main(["kernels", "precompile", "--target", "ptx", "--cache", str(tmp_path / "k"), *args]),
        capsys.readouterr().err,
        *words,
    )
    assert not list((tmp_path / "k").glob("ready/*/*"))  # nothing compiled


def test_train_config_refuses_max_ell_0_naming_the_range():
    from workbench.train.config import TrainConfig
    from workbench.train.values import ConfigError

    with pytest.raises(ConfigError, match=r"TrainConfig\.max_ell: .*1.*4.*got 0"):
        TrainConfig(max_ell=0)
    assert TrainConfig(max_ell=1).max_ell == 1
