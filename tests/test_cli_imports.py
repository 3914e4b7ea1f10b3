"""Building the command line imports no torch: ``workbench pack --help`` and ``workbench pack`` on a
sizes file start without it (torch costs seconds to import), and so does every command's parser.

Each check runs in a fresh interpreter (this one has torch loaded already). When torch does get
imported, the failure names the chain of workbench modules that pulled it in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

#: run in the child: record who imports torch first, run BODY, report as JSON on the last line
_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys, traceback

    chain = []

    class Watch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" and not chain:
                chain.extend(
                    f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "workbench" in f.filename
                )
            return None

    sys.meta_path.insert(0, Watch())
    code = None
    try:
        BODY
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules, "chain": chain}))
    """
)


def _child(body: str) -> dict:
    """Run ``body`` (statements) in a fresh interpreter; its exit code, whether torch got
    imported, and the import chain that did it."""
    code = _CHILD.replace("    BODY", textwrap.indent(textwrap.dedent(body).strip(), "    "))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _no_torch(res: dict) -> None:
    assert not res["torch"], "torch was imported via:\n  " + "\n  ".join(res["chain"])


def test_building_the_parser_imports_no_torch():
    res = _child(
        """
        from workbench.cli import build_parser
        build_parser()
        """
    )
    _no_torch(res)


def test_pack_help_imports_no_torch():
    res = _child(
        """
        from workbench.cli import main
        main(["pack", "--help"])
        """
    )
    assert res["code"] == 0
    _no_torch(res)


@pytest.mark.parametrize("command", ["bench", "kernels"])
def test_group_help_imports_no_torch(command):
    res = _child(
        f"""
        from workbench.cli import main
        main([{command!r}, "--help"])
        """
    )
    assert res["code"] == 0
    _no_torch(res)


def test_pack_on_a_sizes_file_imports_no_torch(tmp_path):
    sizes = np.zeros(200, dtype=[("atoms", np.int64), ("edges", np.int64)])
    sizes["atoms"] = np.random.default_rng(0).integers(1, 300, 200)
    sizes["edges"] = 30 * sizes["atoms"]
    np.save(tmp_path / "sizes.npy", sizes)
    out = tmp_path / "packing.npz"
    res = _child(
        f"""
        from workbench.cli import main
        sys.exit(main(["pack", {str(tmp_path / "sizes.npy")!r}, "--capacity", "1024", "--replicas", "2",
                       "--out", {str(out)!r}]))
        """
    )
    assert res["code"] == 0 and out.exists()
    _no_torch(res)
