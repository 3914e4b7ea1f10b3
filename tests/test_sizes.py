"""graph_sizes agrees with mace-torch's own graph construction; synthetic_sizes follows Table 3."""

import subprocess
import sys

import numpy as np
import pytest
from ase.build import bulk, molecule

from workbench.data import graph_sizes, to_atomic_data
from workbench.data.chemical_families import FAMILIES, FAMILY_NAMES, PAPER_TOTAL, family_counts, sample_natoms


def _structures():
    rng = np.random.default_rng(5)
    out = []
    for a in (
        bulk("Cu", "fcc", a=3.6),
        bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2),
        molecule("CH3CH2OH"),
        bulk("NaCl", "rocksalt", a=5.6).repeat((1, 2, 3)),
        molecule("H2O"),
    ):
        a = a.copy()
        a.positions += rng.normal(0, 0.05, a.positions.shape)
        a.info["config_type"] = "mptrj"
        out.append(a)
    single = molecule("H2O")[:1]  # isolated atom: no edges
    single.info["config_type"] = "water_clusters"
    return out + [single]


def test_graph_sizes_matches_mace_neighbourhood():
    structs = _structures()
    sizes = graph_sizes(structs, cutoff=4.5)
    data = to_atomic_data(structs, cutoff=4.5)
    assert sizes["atoms"].tolist() == [len(a) for a in structs]
    assert sizes["edges"].tolist() == [int(d.edge_index.shape[1]) for d in data]
    # A one-atom periodic fcc cell has 12 + 6 + 24 neighbours within 4.5 Å (shells at a/√2, a, a√(3/2)).
    assert sizes["edges"][0] == 42
    assert sizes["edges"][-1] == 0
    assert sizes["family"].tolist() == ["mptrj"] * 5 + ["water_clusters"]


def test_family_counts_sum_and_proportions():
    for n in (7, 100, 2000, 2_650_000):
        c = family_counts(n)
        assert sum(c.values()) == n
        if n >= 2000:
            for f in FAMILIES:
                assert (
                    abs(c[f.name] / n - f.paper_count / PAPER_TOTAL)
                    <= 0.01 * max(f.paper_count / PAPER_TOTAL, 1 / n) + 1 / n
                )
    assert family_counts(10, ["cuni", "hea"]) == {"cuni": 7, "hea": 3}
    assert family_counts(0, {"cuni": 5}) == {"cuni": 5}
    with pytest.raises(KeyError, match="unknown family 'gold'.*mptrj"):
        family_counts(10, ["gold"])


def test_sample_natoms_in_range():
    rng = np.random.default_rng(0)
    for f in FAMILIES:
        n = sample_natoms(f.name, 5000, rng)
        assert n.min() >= f.atoms_min and n.max() <= f.atoms_max, f.name
    assert set(np.unique(sample_natoms("water_clusters", 2000, rng) % 3)) == {0}


def test_e3nn_imports_without_user_setup():
    """The e3nn 0.4.4 / torch >= 2.6 import failure is handled inside the package."""
    code = (
        "import os; os.environ.pop('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', None)\n"
        "import workbench, e3nn.o3 as o3, mace.modules\n"
        "print(o3.wigner_3j(1, 1, 0).shape)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([3, 3, 1])" in out.stdout
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected" not in out.stderr


def test_synthetic_sizes_follow_table3_and_measured_edges():
    from workbench.data import synthetic_sizes
    from workbench.data.sizes import load_edge_stats

    stats = load_edge_stats()
    assert stats["cutoff"] == 4.5 and set(stats["families"]) == set(FAMILY_NAMES)
    big = synthetic_sizes(265_000, seed=1)
    assert big.size == 265_000
    for f in FAMILIES:
        sel = big[big["family"] == f.name]
        share = sel.size / big.size
        assert abs(share - f.paper_count / PAPER_TOTAL) <= 0.01 * f.paper_count / PAPER_TOTAL + 1 / big.size, f.name
        assert sel["atoms"].min() >= f.atoms_min and sel["atoms"].max() <= f.atoms_max
        # Edges per atom come from the measured values of the real generated structures of that family.
        epa = sel["edges"] / sel["atoms"]
        fam = stats["families"][f.name]
        slack = 0.5 / sel["atoms"] + 1e-3  # edges are rounded to whole numbers
        assert np.all(epa >= fam["edges_per_atom_min"] - slack) and np.all(epa <= fam["edges_per_atom_max"] + slack)
        assert abs(epa.mean() - fam["edges_per_atom_mean"]) < 0.05 * fam["edges_per_atom_mean"]
    # Deterministic per seed, different across seeds.
    assert np.array_equal(synthetic_sizes(1000, seed=3), synthetic_sizes(1000, seed=3))
    assert not np.array_equal(synthetic_sizes(1000, seed=3)["atoms"], synthetic_sizes(1000, seed=4)["atoms"])
