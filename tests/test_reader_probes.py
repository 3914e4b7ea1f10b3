"""Bad input to the readers and to ``workbench pack``: one-line errors naming the file, never a crash."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ase import Atoms

from workbench.cli import main
from workbench.data.errors import StructureError
from workbench.data.formats.extxyz import parse_frames
from workbench.data.io import check_geometry, read_structures

HEAD = 'Properties=species:S:1:pos:R:3 pbc="F F F"\n'


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", "0")  # a cached read would hide the parser's answer


def test_zero_atom_frame_is_an_error_not_a_segfault(tmp_path):
    path = tmp_path / "zero.extxyz"
    path.write_text(f"1\n{HEAD}H 0 0 0\n0\n{HEAD}")
    code = f"from workbench.data.io import read_structures; read_structures({str(path)!r}, require_labels=False)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, (out.returncode, out.stderr[-500:])  # 139 when the C parser saw the frame
    last = out.stderr.strip().splitlines()[-1]
    assert "zero.extxyz, frame 1: the atom count is 0: a frame needs at least one atom" in last
    # prepare's workers get the error in the frame's place (skipped with --on-error skip)
    items = parse_frames(path, 0, [f"1\n{HEAD}H 0 0 0\n".encode(), f"0\n{HEAD}".encode()])
    assert isinstance(items[0][1], Atoms) and isinstance(items[1][1], StructureError)
    assert items[1][0] == 1 and items[1][1].frame == 1


def test_columns_beyond_properties_are_an_error(tmp_path):
    path = tmp_path / "extra.extxyz"
    path.write_text(f"2\n{HEAD}H 0 0 0\nH 1 0 0 1.0 2.0\n")
    with pytest.raises(
        StructureError,
        match=r"extra\.extxyz, frame 0: cannot parse: line 4 of the frame \(atom 1\) has 6 columns, but Properties",
    ):
        read_structures(path, require_labels=False)
    path.write_text(f"1\n{HEAD}H 0 0\n")
    with pytest.raises(StructureError, match=r"frame 0: cannot parse: line 3 of the frame \(atom 0\) has 3 columns"):
        read_structures(path, require_labels=False)


def test_atomic_number_beyond_the_table_names_the_value_and_range():
    with pytest.raises(StructureError, match=r"w\.extxyz, frame 4: atom 1 has atomic number 300 \(no such element\)"):
        check_geometry(Atoms(numbers=[1, 300], positions=[[0, 0, 0], [1, 0, 0]]), path="w.extxyz", frame=4)
    with pytest.raises(StructureError, match=r"only real elements \(1-118\)"):
        check_geometry(Atoms(numbers=[300], positions=[[0, 0, 0]]))


def _mace_file(path, numbers: list[list[int]]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        batch = f.create_group("config_batch_0")
        for i, z in enumerate(numbers):
            g = batch.create_group(f"config_{i}")
            g["atomic_numbers"] = np.array(z)
            g["positions"] = np.array([[1.5 * k, 0.0, 0.0] for k in range(len(z))])
            g["cell"], g["pbc"] = np.zeros((3, 3)), np.array([False] * 3)
            g["config_type"], g["weight"] = "Default", 1.0
            g.create_group("properties")["energy"] = -1.0


def test_mace_h5_bad_atomic_number_and_empty_file(tmp_path):
    import h5py

    from workbench.data.formats.mace_h5 import mace_h5_keys, read_mace_h5

    path = tmp_path / "train_0.h5"
    _mace_file(path, [[1, 8], [300, 1]])
    items = read_mace_h5(path, 0, mace_h5_keys(path))
    assert isinstance(items[0][1], Atoms)
    assert str(items[1][1]) == (
        f"{path}, frame 1: mace configuration config_batch_0/config_1: "
        "atom 0 has atomic number 300, outside the valid range 1-118"
    )
    h5py.File(tmp_path / "empty.h5", "w").close()
    with pytest.raises(StructureError, match=r"empty\.h5: mace HDF5 file holds no configurations"):
        mace_h5_keys(tmp_path / "empty.h5")
    (tmp_path / "text.h5").write_text("not hdf5\n")
    with pytest.raises(StructureError, match=r"text\.h5: cannot read as HDF5"):
        mace_h5_keys(tmp_path / "text.h5")


def test_pack_refuses_sizes_without_atoms_and_non_numpy_files(tmp_path, capsys):
    np.savez(tmp_path / "edges.npz", edges=np.array([10, 20]))
    assert main(["pack", str(tmp_path / "edges.npz")]) == 2
    err = capsys.readouterr().err
    assert "edges.npz: missing key 'atoms' (or 'sizes'): the .npz holds ['edges']" in err
    for name in ("text.npy", "text.npz"):
        (tmp_path / name).write_text("1 2 3\n")
        assert main(["pack", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert f"{name}: not a numpy" in err and "pickle" not in err and len(err.strip().splitlines()) == 1


def test_pack_refuses_negative_epoch(tmp_path, capsys):
    np.save(tmp_path / "sizes.npy", np.array([3, 4, 5]))
    with pytest.raises(SystemExit) as stop:
        main(["pack", str(tmp_path / "sizes.npy"), "--epoch", "-1"])
    assert stop.value.code == 2
    assert "argument --epoch: must be >= 0, got -1" in capsys.readouterr().err
