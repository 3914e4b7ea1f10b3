"""Model files and checkpoints load without running code from them; ``--trust-model`` is the way
round for others; ``workbench eval``'s device, weight and report checks."""

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench  # noqa: F401
from workbench.cli import main
from workbench.data import read_structures, write_structures
from workbench.data.embedded import EMBEDDED_PATH
from workbench.train.model_file import ModelFileError, check_device, load_model, load_torch_file, refused_globals

BIN = Path(sys.executable).parent


class _Planted:
    """Pickles as a call to ``os.system``: loading it the old way creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _PlantedGraph:
    """Pickles as an fx graph module whose source creates the marker file when executed (torch
    executes the import block as it loads, the forward when called)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        touch = f"__import__('os').system('touch {self.marker}')"
        code = f"def forward(self, x):\n    y = {touch}\n    return x\n"
        return (torch.fx.graph_module.reduce_graph_module, ({"_code": code}, f"import torch\n{touch}\n"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real run of ``workbench train`` (tiny model, 2 steps, numba kernels): its exported
    model.model, its checkpoint and three labelled water clusters."""
    from workbench.train import train
    from workbench.train.presets import tiny_config

    tmp = tmp_path_factory.mktemp("exported")
    cfg = tiny_config(tmp, "m", families=["water_clusters"], max_structures=16, max_steps=2, epochs=1, backend="numba")
    result = train(cfg)
    frames = [a for a in read_structures(EMBEDDED_PATH) if a.info["config_type"] == "water_clusters"][:3]
    return result.model_path, cfg.run_dir / "checkpoint.pt", write_structures(tmp / "set.extxyz", frames)


def test_exported_model_loads_safely_and_predicts_the_same(run, capsys):
    from workbench.train.evaluation import evaluate_file

    model_path, _, data = run
    accelerated = model_path.with_name("model_numba.model")  # the kernel form, workbench modules in it
    assert refused_globals(model_path) == [] and refused_globals(accelerated) == []
    assert type(load_model(accelerated)).__name__ == "ScaleShiftMACE"
    safe = load_model(model_path)
    full = torch.load(model_path, weights_only=False)
    assert safe.state_dict().keys() == full.state_dict().keys()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in safe.state_dict().items())
    # the contraction graphs rebuilt from their source compute what the executed source computes
    assert evaluate_file(model_path, data) == evaluate_file(model_path, data, trust_model=True)
    assert "--trust-model" in capsys.readouterr().err  # the trusted load says what it does


def test_checkpoint_loads_safely(run):
    from workbench.train.checkpoint import load_checkpoint

    _, checkpoint, _ = run
    state, full = load_checkpoint(checkpoint), torch.load(checkpoint, weights_only=False)
    assert state["global_step"] == full["global_step"] == 2
    np.testing.assert_array_equal(state["rng"][0]["numpy"][1], full["rng"][0]["numpy"][1])
    assert state["sampler"] == full["sampler"]


@pytest.mark.parametrize("planted", [_Planted, _PlantedGraph])
@pytest.mark.parametrize("command", ["eval", "md"])
def test_planted_code_is_refused(run, tmp_path, capsys, planted, command):
    marker, model, data = tmp_path / "marker", tmp_path / "evil.model", run[2]
    torch.save({"model": planted(marker)}, model)
    args = [str(data)] if command == "eval" else ["--structure", str(data)]
    assert main([command, str(model), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(model) in err and "--trust-model" in err, err
    assert not marker.exists()


def test_graph_module_source_is_parsed_never_executed(tmp_path):
    from workbench.train.model_file import _graph_module_from_body

    marker = tmp_path / "marker"
    code = "def forward(self, x, y):\n    t = torch.functional.tensordot(x, y, dims = ((1,), (0,)), out = None);  x = y = None\n    return t\n"
    gm = _graph_module_from_body({"_code": code}, f"import os\nos.system('touch {marker}')\n")
    x, y = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, y), x @ y)
    assert not marker.exists()


def test_planted_checkpoint_is_refused(tmp_path):
    from workbench.train.checkpoint import CheckpointError, load_checkpoint

    marker, path = tmp_path / "marker", tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "rng": _Planted(marker)}, path)
    with pytest.raises(CheckpointError, match=r"checkpoint.pt: refused: loading it would call posix.system"):
        load_checkpoint(path)
    assert not marker.exists()


def test_unreadable_files_are_named(tmp_path):
    text, truncated = tmp_path / "notes.model", tmp_path / "cut.model"
    text.write_text("not a model\n")
    torch.save({"w": torch.ones(1000)}, tmp_path / "full.pt")
    truncated.write_bytes((tmp_path / "full.pt").read_bytes()[:2000])
    for path in (text, truncated):
        with pytest.raises(ModelFileError, match=rf"{path.name}: not a loadable model file \("):
            load_torch_file(path)
    with pytest.raises(ModelFileError, match="full.pt: a dict, not a mace-torch model"):
        load_model(tmp_path / "full.pt")


def test_device_errors_name_the_device():
    with pytest.raises(ValueError, match="--device banana: not a torch device"):
        check_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA GPU is available"):
            check_device("cuda")
    assert check_device("cpu") == torch.device("cpu")


def test_eval_device_and_nonfinite_weights(run, tmp_path, capsys):
    model_path, _, data = run
    assert main(["eval", str(model_path), str(data), "--device", "banana"]) == 2
    assert capsys.readouterr().err.strip() == (
        "workbench: error: --device banana: not a torch device (use cpu, cuda or cuda:N)"
    )
    model = torch.load(model_path, weights_only=False)
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    torch.save(model, tmp_path / "nan.model")
    assert main(["eval", str(tmp_path / "nan.model"), str(data)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "nan.model" in warnings[0] and "NaN or inf" in warnings[0]


def test_family_table_html_escapes_user_strings():
    from workbench.train.evaluation import family_table_html

    m = {"e_mae_mev_atom": 1.0, "e_rmse_mev_atom": 2.0, "f_mae_mev_a": 3.0, "f_rmse_mev_a": 4.0, "graphs": 1}
    page = family_table_html({**m, "families": {"<script>alert(1)</script>": m}}, caption="<b>x</b>")
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page


def test_resume_from_a_planted_checkpoint_needs_trust_checkpoint(tmp_path):
    from workbench.train import train
    from workbench.train.checkpoint import CheckpointError
    from workbench.train.presets import small_dataset, tiny_config

    data = small_dataset(tmp_path / "small.xyz", n=24)
    cfg = tiny_config(tmp_path, "planted", dataset=str(data), max_steps=2, export=False)
    marker = tmp_path / "marker"
    cfg.run_dir.mkdir(parents=True)
    torch.save({"model": {}, "rng": _Planted(marker)}, cfg.run_dir / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"refused: .*posix.system.*set trust_checkpoint: true"):
        train(cfg)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"not a workbench checkpoint"):
        train(replace(cfg, trust_checkpoint=True))  # the explicit switch loads the full pickle (and its code)
    assert marker.exists()
