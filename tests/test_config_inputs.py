"""Config inputs that used to be accepted silently: a YAML key given twice, an empty path."""

import pytest

import workbench  # noqa: F401
from workbench.cli import main
from workbench.train import TrainConfig
from workbench.train.values import ConfigError, load_yaml


def test_yaml_key_given_twice_is_refused_with_key_and_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.01\ncapacity: 1000\nseed: 1\ncapacity: 2000\n")
    with pytest.raises(ConfigError, match=r"run\.yaml, line 4: key 'capacity' is given twice \(first on line 2\)"):
        TrainConfig.from_yaml(path)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 4: key 'capacity' is given twice" in err


def test_nested_duplicates_are_refused_and_merges_still_override():
    with pytest.raises(ConfigError, match=r"--set families, line 1: key 'a' is given twice"):
        TrainConfig().with_overrides(["families={a: 1, a: 2}"])
    merged = load_yaml("base: &b {lr: 0.01, seed: 1}\nrun:\n  <<: *b\n  lr: 0.02\n", "m.yaml")
    assert merged["run"] == {"lr": 0.02, "seed": 1}


@pytest.mark.parametrize("item", ["dataset=", "valid_dataset=  ", "lr="])
def test_set_with_an_empty_value_names_the_field(item, capsys):
    key = item.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"--set {key}=\s*: no value for {key}"):
        TrainConfig().with_overrides([item])
    assert main(["train", "--set", item]) == 2
    assert f"no value for {key}" in capsys.readouterr().err


def test_empty_path_is_refused_null_is_the_default():
    with pytest.raises(ConfigError, match="TrainConfig.dataset: an empty path"):
        TrainConfig(dataset="")
    with pytest.raises(ConfigError, match="TrainConfig.valid_dataset: an empty path"):
        TrainConfig.from_dict({"valid_dataset": " "})
    assert TrainConfig().with_overrides(["dataset=null"]).dataset is None
