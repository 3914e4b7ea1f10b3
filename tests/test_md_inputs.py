"""``workbench md`` refuses bad inputs with one line naming the option or file, stops a run whose
temperature runs away, and mace-torch's cuequivariance notice stays off the console."""

import math
import os
import subprocess
import sys

import ase.io
import pytest
import torch
from kernel_fixtures import build_model, save_md_model

import workbench  # noqa: F401
from workbench.cli import main
from workbench.quiet import NOTICE
from workbench.train.md import MDRunaway, run_md, temperature_limit


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random H/O mace model saved as mace saves models, a water cluster, and broken variants."""
    from workbench.data import load_embedded

    d = tmp_path_factory.mktemp("md_inputs")
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 2, 2, dtype=torch.float64)
    model.atomic_numbers = torch.tensor([1, 8])
    torch.save(model, d / "tiny.model")
    frames = load_embedded()
    cluster = next(a for a in frames if a.info["config_type"] == "water_clusters")
    ase.io.write(d / "cluster.xyz", cluster)
    close = cluster.copy()
    close.positions[1] = close.positions[0] + [0.05, 0.0, 0.0]
    ase.io.write(d / "close.xyz", close)
    ase.io.write(d / "metal.xyz", next(a for a in frames if a.info["config_type"] == "hea"))
    (d / "notes.model").write_text("these are notes, not a model\n")
    raw = (d / "tiny.model").read_bytes()
    (d / "cut.model").write_bytes(raw[: len(raw) // 3])
    (d / "afile").write_text("x")
    return d


def _md(files, capsys, *args, model="tiny.model", structure="cluster.xyz") -> str:
    """The one-line error of ``workbench md`` with ``args`` (exit code 2 asserted; a progress bar
    line may come before it)."""
    code = main(["md", str(files / model), "--structure", str(files / structure), "--steps", "3", *args])
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("workbench: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("option", ["--timestep", "--temperature"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5"])
def test_timestep_and_temperature_must_be_finite_and_positive(files, capsys, option, value):
    err = _md(files, capsys, option, value)
    assert f"{option} {value}: must be a finite number" in err


def test_close_atoms_are_refused_like_training_data(files, capsys):
    err = _md(files, capsys, structure="close.xyz")
    assert "close.xyz, frame 0: atoms 0 and 1 are 0.050 Å apart (< 0.5 Å)" in err


def test_element_missing_from_the_model_is_named(files, capsys):
    err = _md(files, capsys, structure="metal.xyz")
    assert "tiny.model: the model has no element" in err and "(Z=28)" in err and "it knows H, O" in err


@pytest.mark.parametrize("model", ["notes.model", "cut.model"])
def test_unreadable_model_files_are_named(files, capsys, model):
    assert f"{model}: not a loadable model file (" in _md(files, capsys, model=model)


def test_trajectory_under_a_file_is_named(files, capsys):
    err = _md(files, capsys, "--trajectory", str(files / "afile" / "md.xyz"))
    assert f"--trajectory {files / 'afile' / 'md.xyz'}: {files / 'afile'} is a file, not a folder" in err


def test_runaway_temperature_stops_the_run(files, capsys):
    assert temperature_limit(300.0) == 4000.0
    with pytest.raises(MDRunaway, match=r"temperature reached .* K at step 1 \(limit 4000 K.*smaller --timestep"):
        run_md(files / "tiny.model", files / "cluster.xyz", steps=5, timestep_fs=1e5, backend="e3nn", progress=False)
    assert "the dynamics is unstable" in _md(files, capsys, "--timestep", "100000", "--backend", "e3nn")


def test_a_sane_run_is_not_stopped(files):
    result = run_md(files / "tiny.model", files / "cluster.xyz", steps=5, timestep_fs=0.25, backend="e3nn")
    assert max(result.temperature_k) < temperature_limit(300.0)


@pytest.mark.parametrize("show", ["", "1"])
def test_mace_cuequivariance_notice_is_hidden_unless_asked(show):
    code = "from workbench.quiet import quiet_mace; quiet_mace(); import mace.tools.cg; print('imported')"
    env = dict(os.environ, WORKBENCH_SHOW_MACE_NOTICES=show)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "imported" in res.stdout, res.stderr[-2000:]
    assert (NOTICE in res.stdout) == bool(show)


@pytest.fixture(scope="module")
def cu_model(tmp_path_factory):
    """A random H/Cu mace model (for a copper cell and a lone atom)."""
    return save_md_model(tmp_path_factory.mktemp("md_one_atom") / "hcu.model", (1, 29))


@pytest.mark.parametrize("ensemble", ["nve", "nvt"])
@pytest.mark.parametrize("structure", ["bulk Cu", "H atom"])
def test_one_atom_runs(cu_model, ensemble, structure):
    """ase.build.bulk("Cu") is a 1-atom cell (the atom sees its images) and a lone atom is one too:
    no NaN temperature from removing the only motion there is (issue 47, PH13-15). The atom starts
    at exactly --temperature (3 degrees of freedom) and, with no force on it, keeps its energy."""
    from ase import Atoms
    from ase.build import bulk

    atoms = bulk("Cu") if structure == "bulk Cu" else Atoms("H", positions=[[0.0, 0.0, 0.0]])
    result = run_md(cu_model, atoms, steps=5, ensemble=ensemble, timestep_fs=0.5, backend="e3nn", progress=False)
    assert result.atoms == 1 and len(result.temperature_k) == 6
    assert all(math.isfinite(t) and t > 0 for t in result.temperature_k)
    assert result.temperature_k[0] == pytest.approx(300.0, rel=1e-9)
    if ensemble == "nve":
        assert result.max_excursion_ev_atom < 1e-9


def test_one_atom_cell_on_the_command_line(cu_model, tmp_path, capsys):
    from ase.build import bulk

    ase.io.write(tmp_path / "cu.xyz", bulk("Cu"))
    code = main(["md", str(cu_model), "--structure", str(tmp_path / "cu.xyz"), "--steps", "3"])
    out = capsys.readouterr()
    assert code == 0 and "NVE 3 steps of 0.5 fs, 1 atoms, backend numba" in out.out, out.err[-2000:]


def test_non_finite_starting_velocities_are_not_blamed_on_the_timestep(files):
    import ase.build

    atoms = ase.build.molecule("H2O")
    atoms.set_masses([0.0, 1.0, 1.0])
    with pytest.raises(MDRunaway, match=r"temperature of nan K before any step, so no timestep will help"):
        run_md(files / "tiny.model", atoms, steps=2, backend="e3nn", progress=False)
