"""Config inputs that used to be accepted silently or slowly: a YAML key given twice, an empty path, an alias
bomb, a huge file or list, a value too long to print."""

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


def _alias_bomb(levels: int = 8) -> str:
    """A few hundred bytes whose aliases expand to 9**levels values (the "billion laughs")."""
    lines = ["radial_mlp:", "  - &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_quickly_in_one_short_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert path.stat().st_size < 2048
    with pytest.raises(ConfigError, match=r"bomb\.yaml: its aliases expand to [\d,]+ values; a config holds at most"):
        TrainConfig.from_yaml(path)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 300
    # the same aliases used moderately still read, expanded
    small = load_yaml("w: &w 64\nradial_mlp: [*w, *w, *w]\n", "ok.yaml")
    assert TrainConfig.from_dict({"radial_mlp": small["radial_mlp"]}).radial_mlp == [64, 64, 64]


def test_a_recursive_alias_is_refused_naming_the_source():
    with pytest.raises(ConfigError, match=r"r\.yaml: nested deeper than \d+ levels"):
        load_yaml("a: &a [1, *a]\n", "r.yaml")


def test_huge_configs_and_list_fields_are_bounded(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("radial_mlp: [" + ", ".join(["64"] * 400_000) + "]\n")  # 1.6 MB
    with pytest.raises(ConfigError, match=r"big\.yaml: [\d,]+ bytes; a config is at most"):
        TrainConfig.from_yaml(big)
    assert main(["train", "--config", str(big)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match=r"TrainConfig\.families: 5,000 items; a list field takes at most"):
        TrainConfig(families=[f"f{i}" for i in range(5000)])
    with pytest.raises(ConfigError, match=r"radial_mlp: must be 1 to 16 layer widths in \[1, 16384\]"):
        TrainConfig(radial_mlp=[64] * 17)
    with pytest.raises(ConfigError, match=r"radial_mlp: must be .*got \[64, 10000000\]"):
        TrainConfig(radial_mlp=[64, 10_000_000])
    with pytest.raises(ConfigError, match=r"hidden_irreps: '1000000x0e': a multiplicity above 16384"):
        TrainConfig(hidden_irreps="1000000x0e")


def test_errors_never_print_a_whole_value(capsys):
    long = "x" * 100_000
    for value in ([[1] * 1000] * 3, {"a": long}, long):
        with pytest.raises(ConfigError) as info:
            TrainConfig.from_dict({"radial_mlp": value})
        assert len(str(info.value)) < 300
    assert main(["train", "--set", f"device={long}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 300 and "TrainConfig.device" in err


def test_a_config_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"lr: 0.01\nname: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: not UTF-8 text \(byte 15\)"):
        TrainConfig.from_yaml(path)
