"""``workbench pack`` and ``workbench bench packing`` (tiny sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.cli import main
from workbench.packing import Packing
from workbench.packing.cli import load_sizes


@pytest.fixture
def sizes_file(tmp_path):
    rng = np.random.default_rng(0)
    arr = np.zeros(400, dtype=[("atoms", np.int64), ("edges", np.int64)])
    arr["atoms"] = rng.integers(1, 500, 400)
    arr["edges"] = arr["atoms"] * 30
    path = tmp_path / "sizes.npy"
    np.save(path, arr)
    return path


def test_pack_cli_writes_npz_and_summary(sizes_file, tmp_path, capsys):
    out = tmp_path / "packing.npz"
    assert main(["pack", str(sizes_file), "--capacity", "3072", "--replicas", "4", "--out", str(out), "--json"]) == 0
    text = capsys.readouterr().out
    summary = json.loads(text[: text.rindex("}") + 1])
    assert summary["n_bins"] % 4 == 0 and summary["algorithm"] == "paper"
    p = Packing.load(out)
    assert sorted(np.concatenate(p.batches).tolist()) == list(range(400))


def test_pack_cli_cost_choices_and_errors(sizes_file, tmp_path, capsys):
    out = str(tmp_path / "p.npz")
    assert (
        main(
            [
                "pack",
                str(sizes_file),
                "--cost",
                "edges",
                "--capacity",
                "100000",
                "--replicas",
                "2",
                "--algorithm",
                "shuffled-paper",
                "-o",
                out,
            ]
        )
        == 0
    )
    assert main(["pack", str(sizes_file), "--cost", "model", "--capacity", "0.3", "--no-randomness", "-o", out]) == 0
    assert main(["pack", str(sizes_file), "--capacity", "100", "-o", out]) == 2  # oversize graphs: clear error, exit 2
    assert "exceed capacity" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "missing.npy")]) == 2


def test_pack_cli_graphs_per_batch_for_count_based_algorithms(sizes_file, tmp_path, capsys):
    out = tmp_path / "lpt.npz"
    args = ["pack", str(sizes_file), "--replicas", "2", "--no-randomness", "-o", str(out)]
    assert main([*args, "--algorithm", "lpt", "--graphs-per-batch", "5"]) == 0
    assert Packing.load(out).batch_sizes().reshape(-1, 2).sum(axis=1).max() <= 10  # lpt: 5 per rank, per step
    assert main([*args, "--algorithm", "paper", "--graphs-per-batch", "5"]) == 2  # packs to capacity: refused
    assert "--graphs-per-batch: paper packs to capacity; it applies to lpt, fixed-count" in capsys.readouterr().err


def test_load_sizes_formats(tmp_path):
    np.save(tmp_path / "plain.npy", np.array([3, 4, 5]))
    assert load_sizes(tmp_path / "plain.npy")["atoms"].tolist() == [3, 4, 5]
    np.savez(tmp_path / "ae.npz", atoms=np.array([1, 2]), edges=np.array([5, 6]))
    s = load_sizes(tmp_path / "ae.npz")
    assert s["edges"].tolist() == [5, 6]
    # what `workbench data sizes` writes: SIZES_DTYPE, whose family column is a label
    from workbench.data.sizes import SIZES_DTYPE

    written = np.array([(3, 40, "water_clusters"), (8, 200, "hea")], dtype=SIZES_DTYPE)
    np.save(tmp_path / "sizes.npy", written)
    assert load_sizes(tmp_path / "sizes.npy").tolist() == written.tolist()
    np.savez(tmp_path / "float.npz", atoms=np.array([1.5, 2.0]))
    assert load_sizes(tmp_path / "float.npz")["atoms"].tolist() == [1.5, 2.0]  # costs keep their values
    with pytest.raises(ValueError, match="unknown format"):
        (tmp_path / "x.csv").write_text("1\n")
        load_sizes(tmp_path / "x.csv")


@pytest.mark.parametrize(
    ("name", "save", "message"),
    [
        ("neg.npy", lambda p: np.save(p, np.array([3, 5, -2])), "neg.npy: graph 2 has atoms -2; sizes must be finite"),
        ("nan.npy", lambda p: np.save(p, np.array([3.0, np.nan])), "nan.npy: graph 1 has atoms nan"),
        ("empty.npy", lambda p: np.save(p, np.array([], dtype=np.int64)), "empty.npy: holds no graphs"),
        ("text.npy", lambda p: np.save(p, np.array(["a", "b"])), "text.npy: atoms has dtype <U1; sizes must be"),
        (
            "objects.npy",
            lambda p: np.save(p, np.array([{"atoms": 1}], dtype=object), allow_pickle=True),
            "objects.npy: holds Python objects, which are never unpickled",
        ),
        (
            "objects.npz",
            lambda p: np.savez(p, atoms=np.array([{"atoms": 1}], dtype=object)),
            "objects.npz: holds Python objects",
        ),
        (
            "lengths.npz",
            lambda p: np.savez(p, atoms=np.array([1, 2, 3]), edges=np.array([4, 5])),
            r"lengths.npz: 'atoms' and 'edges' must be 1-D, one entry per graph; shapes \{'atoms': \(3,\), 'edges': \(2,\)\}",
        ),
        (
            "scalar.npy",
            lambda p: np.save(p, np.zeros((), dtype=[("atoms", np.int64)])),
            r"scalar.npy: expected a 1-D array of sizes, one entry per graph, got shape \(\)",
        ),
        (
            "pairs.npy",
            lambda p: np.save(p, np.zeros(3, dtype=[("atoms", np.int64, (2,))])),
            r"pairs.npy: atoms must hold one number per graph, not arrays of shape \(2,\)",
        ),
        (
            "edges.npz",
            lambda p: np.savez(p, atoms=np.array([1, 2]), edges=np.array([4.0, np.inf])),
            "edges.npz: graph 1 has edges inf",
        ),
    ],
)
def test_bad_sizes_files_are_named(tmp_path, capsys, name, save, message):
    """Each bad sizes file: one line naming the file, the field and the graph; exit code 2."""
    save(tmp_path / name)
    with pytest.raises(ValueError, match=message):
        load_sizes(tmp_path / name)
    assert main(["pack", str(tmp_path / name), "--capacity", "100", "--out", str(tmp_path / "o.npz")]) == 2
    assert name in capsys.readouterr().err


def test_bench_cli_small(tmp_path, sizes_file, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "packing",
                "--n",
                "3000",
                "--replicas",
                "8",
                "--pyg-n",
                "500",
                "--repeats",
                "1",
                "--no-sweep",
                "--real",
                str(sizes_file),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    from workbench.packing import ALGORITHMS

    assert {r["algorithm"] for r in result["synthetic"]} == set(ALGORITHMS)  # the bench's rows follow the registry
    assert result["pyg_dynamic_batch_sampler"].get("identical_batches", True)
    assert len(result["real"]["rows"]) == len(result["synthetic"])
    assert "| paper |" in capsys.readouterr().out
