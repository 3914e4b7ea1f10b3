"""``bench cpu --parts md``: MD steps through ASE calculators, each with its agreement with
e3nn; a peer that is not installed gets a row that says how to get it."""

import math

import pytest

from workbench.bench import peers
from workbench.bench.cpu_md import md_case, md_lines


@pytest.fixture
def ghost(monkeypatch):
    """A peer whose package is not installed anywhere."""
    ghost = peers.Peer("ghost", "ghost-evaluator", "no_such_module_for_workbench", None, None)
    monkeypatch.setitem(peers.PEERS, "ghost", ghost)
    return ghost


def test_md_rows_time_each_calculator_and_skip_a_missing_peer(tmp_path, ghost):
    case = md_case("small", "water-24", "float64", 2, tmp_path, calculators=("e3nn", "ghost"))
    e3nn, skipped = case["rows"]["e3nn"], case["rows"]["ghost"]
    assert case["atoms"] == 24 and e3nn["median_ms"] > 0 and e3nn["cold_s"] > 0
    assert e3nn["force_rel"] == 0.0 and e3nn["energy_rel"] == 0.0  # e3nn against itself, same positions
    assert skipped == {"skipped": "skipped: ghost-evaluator is not installed (pip install 'cfm-workbench[peers]')"}
    assert math.isnan(e3nn.get("vs_numba", math.nan))  # no numba row to compare with
    text = "\n".join(md_lines([case]))
    assert "ghost-evaluator is not installed" in text and "e3nn" in text


def test_a_conversion_runs_once_per_model_and_settings_in_an_absolute_folder(tmp_path, monkeypatch, ghost):
    """The peer's converter gets an absolute folder (it runs there), and a model converted before
    with the same settings is not converted again; other settings convert anew."""
    calls = []

    def convert(model, folder):
        calls.append(folder)
        out = folder / "model.json"
        out.write_text(model.read_text())
        return out

    monkeypatch.setitem(peers.PEERS, "ghost", peers.Peer("ghost", "ghost-evaluator", "json", convert, None, "a"))
    model = tmp_path / "m.model"
    model.write_text("weights")
    monkeypatch.chdir(tmp_path)
    first = peers.convert("ghost", model, "relative")
    assert first.is_absolute() and first.read_text() == "weights" and calls[0].is_absolute()
    assert peers.convert("ghost", model, "relative") == first and len(calls) == 1
    monkeypatch.setitem(peers.PEERS, "ghost", peers.Peer("ghost", "ghost-evaluator", "json", convert, None, "b"))
    assert peers.convert("ghost", model, "relative") != first and len(calls) == 2


def test_the_md_part_runs_one_structure(tmp_path):
    with pytest.raises(ValueError, match="--systems mixed: the md part runs one structure"):
        md_case("small", "mixed", "float64", 1, tmp_path, calculators=("e3nn",))


def test_peer_names_and_dtypes_are_checked(tmp_path):
    with pytest.raises(KeyError, match="unknown peer 'nope'; choose from symmetrix"):
        peers.missing("nope")
    with pytest.raises(ValueError, match="a peer runs float32 or float64"):
        peers.calculator("symmetrix", tmp_path / "m.json", "float16")
    with pytest.raises(FileNotFoundError, match="no such model file to convert for symmetrix"):
        peers.convert("symmetrix", tmp_path / "absent.model", tmp_path)


def test_the_mp0_model_is_shaped_like_mace_mp0_on_a_three_element_crystal(tmp_path):
    """``--models mp0``: 6 Å and an 89-element embedding, on SrTiO3; ours equals e3nn in float64."""
    import torch

    case = md_case("mp0", "perovskite-5", "float64", 1, tmp_path, calculators=("e3nn", "numba"))
    model = torch.load(tmp_path / "mp0-perovskite-5-float64.model", weights_only=False)
    assert float(model.r_max) == 6.0 and model.atomic_numbers.tolist() == list(range(1, 90))
    assert case["atoms"] == 5
    numba = case["rows"]["numba"]
    assert numba["force_rel"] < 1e-10 and numba["energy_rel"] < 1e-10


def test_model_settings_and_systems_reject_what_they_cannot_build():
    from workbench.bench.step_model import base_model
    from workbench.bench.workloads import model_elements, system_structures

    assert model_elements("paper", [8, 1, 8]) == [1, 8]
    with pytest.raises(ValueError, match=r"model 'mp0' has no embedding for atomic numbers \[92\]"):
        model_elements("mp0", [8, 92])
    with pytest.raises(ValueError, match="perovskite-7: a SrTiO3 supercell holds a multiple of 5 atoms"):
        system_structures("perovskite-7")
    with pytest.raises(ValueError, match="model 'mp0' runs in `bench cpu` only; choose from paper, small"):
        base_model("mp0", [1, 8], {"edges_per_atom": 10.0}, "float64", "cpu")


def test_the_md_part_runs_the_rows_asked_for(tmp_path):
    """``--md-calculators``: the rows named, in that order; an unknown name is refused before
    any work, with the choices listed."""
    from workbench.bench.cpu import bench_cpu

    with pytest.raises(ValueError, match="md calculators ghost: the choices are e3nn, numba, symmetrix"):
        bench_cpu(preset="smoke", parts=["md"], md_calculators=["numba", "ghost"], out=tmp_path / "x.json")
    res = bench_cpu(
        preset="smoke",
        parts=["md"],
        models=["small"],
        systems=["water-24"],
        dtypes=["float64"],
        repeats=1,
        md_calculators=["numba"],
        out=tmp_path / "md.json",
        workdir=tmp_path,
    )
    (case,) = res["md"]
    assert res["md_calculators"] == ["numba"] and list(case["rows"]) == ["numba"]
    assert case["rows"]["numba"]["median_ms"] > 0 and "force_rel" not in case["rows"]["numba"]  # no e3nn anchor
    assert "numba" in "\n".join(md_lines([case]))
