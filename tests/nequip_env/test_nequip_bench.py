"""``workbench bench nequip`` end to end on a tiny cell: the CLI prints the table and writes the JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_nequip_cli_writes_table_and_json(tmp_path):
    out = tmp_path / "nequip.json"
    cmd = [sys.executable, "-m", "workbench.cli", "bench", "nequip", "--configs", "tutorial", "--dtypes", "float64"]
    cmd += ["--repeat", "1", "--repeats", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fcc Cu, 4 atoms" in done.stdout and f"wrote {out}" in done.stdout
    res = json.loads(out.read_text())
    assert [(c["family"], c["config"], c["dtype"]) for c in res["cases"]] == [
        ("nequip", "tutorial", "float64"),
        ("allegro", "tutorial", "float64"),
    ]
    for case in res["cases"]:
        for key in ("native_md", "numba_md", "native_train", "numba_train"):
            assert case[key] > 0
        assert case["speedup_md"] == case["native_md"] / case["numba_md"]
    assert res["edges"] > 0 and res["versions"]
