"""Every value that reaches a SLURM job script is checked before anything is written: one line
of text, numbers in range, SLURM's formats, and no extra directive that contradicts the launcher.
No cluster needed (dry runs), except where a real launch is refused before it starts."""

from __future__ import annotations

import pytest

from workbench.cli import main
from workbench.launch import LaunchError, launch
from workbench.train import TrainConfig


def cli(tmp_path, capsys, *args: str) -> tuple[int, str, str]:
    """``workbench launch --backend slurm --dry-run`` into ``tmp_path``: (exit code, stdout, stderr)."""
    code = main(["launch", "--backend", "slurm", "--dry-run", "--set", f"output_dir={tmp_path}", *args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(tmp_path, capsys, *args: str) -> str:
    """The one-line error of a refused dry run; checks that nothing was printed or written."""
    code, out, err = cli(tmp_path, capsys, *args)
    assert code == 2, (code, out, err)
    assert out == "" and "Traceback" not in err and err.count("\n") == 1 and err.startswith("workbench: error: ")
    assert list(tmp_path.iterdir()) == []
    return err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--account", "chem\n#SBATCH --qos=high"), "account='chem\\n#SBATCH --qos=high': contains the control"),
        (("--partition", "gpu\r"), "partition='gpu\\r': contains the control character"),
        (("--qos", "a\x1bb"), "qos='a\\x1bb': contains the control character"),
        (("--constraint", "a100\tx"), "constraint='a100\\tx': contains the control character"),
        (("--account", ""), "account='': must not be empty"),
        (("--setup", "module load cuda\nexit 1"), "setup line='module load cuda\\nexit 1': contains the control"),
        (("--sbatch=--comment=a\nb",), "sbatch_lines entry='--comment=a\\nb': contains the control"),
    ],
)
def test_control_characters_are_refused(tmp_path, capsys, args, expected):
    assert expected in refused(tmp_path, capsys, *args)


@pytest.mark.parametrize(
    ("flag", "value"), [("--partition", "gpu;rm"), ("--account", "a$(id)"), ("--qos", "a b"), ("--partition", "gpu,")]
)
def test_slurm_names_with_other_characters_are_refused(tmp_path, capsys, flag, value):
    field = flag.removeprefix("--")
    assert f"{field}={value!r}: not a SLURM {field} name; use letters, digits" in refused(tmp_path, capsys, flag, value)


def test_real_slurm_names_pass():
    from workbench.launch.validate import check_slurm_name

    for value in ("gpu", "gpu,cpu", "abc@v100", "proj-123.x_y", "a100+debug"):
        assert check_slurm_name("account", value) == value


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--cpus-per-task", -2, "a positive integer"),
        ("--cpus-per-task", 0, "a positive integer"),
        ("--gpus-per-task", 0, "a positive integer"),
        ("--signal-delay-s", -5, "an integer >= 0"),
        ("--nodes", 0, "a positive integer"),
        ("--gpus-per-node", -1, "a positive integer"),
    ],
)
def test_numbers_out_of_range_are_refused(tmp_path, capsys, flag, value, rule):
    field = flag.removeprefix("--").replace("-", "_")  # the error names the field the flag sets
    assert f"{field}={value}: must be {rule}" in refused(tmp_path, capsys, flag, str(value))


@pytest.mark.parametrize("mem", ["banana", "64 G", "-5", "1.5G", "64X", "G", "64G\n"])
def test_mem_must_be_a_slurm_size(tmp_path, capsys, mem):
    err = refused(tmp_path, capsys, "--mem", mem)
    assert f"mem={mem!r} is not a SLURM memory size" in err and "K, M, G or T suffix" in err


@pytest.mark.parametrize("mem", ["64G", "500", "512M", "1T", "2048k", "0", "64GB"])
def test_slurm_sizes_are_accepted(tmp_path, capsys, mem):
    code, out, err = cli(tmp_path, capsys, "--mem", mem)
    assert code == 0, err
    assert f"#SBATCH --mem={mem}" in out.splitlines()


@pytest.mark.parametrize("time", ["4 hours", "1:2:3:4", "01:60:00", "1-25", "-5", "1h"])
def test_time_must_be_a_slurm_time(tmp_path, capsys, time):
    err = refused(tmp_path, capsys, "--time", time)
    assert f"time={time!r}" in err and "D-HH:MM:SS" in err


@pytest.mark.parametrize(
    ("line", "option"),
    [
        ("--nodes=3", "--nodes"),
        ("--nodes 3", "--nodes"),
        ("-N 3", "--nodes"),
        ("-N3", "--nodes"),
        ("#SBATCH -N 3", "--nodes"),
        ("--nod=3", "--nod (short for --nodes)"),
        ("--ntasks=8", "--ntasks"),
        ("-n 8", "--ntasks"),
        ("--ntasks-per-node=2", "--ntasks-per-node"),
        ("--gpus=8", "--gpus"),
        ("-G 8", "--gpus"),
        ("--gpus-per-node=2", "--gpus-per-node"),
        ("--gres=gpu:2", "--gres"),
        ("#SBATCH --time=10", "--time"),
        ("-t 10", "--time"),
        ("--requeue", "--requeue"),
        ("--no-requeue", "--no-requeue"),
        ("--signal=USR1@60", "--signal"),
        ("--job-name=other", "--job-name"),
        ("-J other", "--job-name"),
        ("--output=/tmp/o", "--output"),
        ("-o /tmp/o", "--output"),
        ("-e /tmp/e", "--error"),
        ("--open-mode=truncate", "--open-mode"),
        ("-p other", "--partition"),
        ("-c 4", "--cpus-per-task"),
        ("--array=0-3", "--array"),
    ],
)
def test_sbatch_lines_cannot_override_the_launcher(tmp_path, capsys, line, option):
    err = refused(tmp_path, capsys, "--nodes", "1", f"--sbatch={line}")
    assert f"sbatch_lines entry {line!r} (--sbatch): {option} is set by the launcher itself" in err


def test_sbatch_mem_per_cpu_conflicts_with_mem(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--mem", "4G", "--sbatch=--mem-per-cpu=2G")
    assert "--mem-per-cpu conflicts with mem (--mem)" in err
    code, out, _ = cli(tmp_path, capsys, "--sbatch=--mem-per-cpu=2G")  # alone it is fine
    assert code == 0 and "#SBATCH --mem-per-cpu=2G" in out.splitlines()


def test_other_sbatch_lines_still_pass(tmp_path, capsys):
    code, out, err = cli(tmp_path, capsys, "--sbatch=--exclusive", "--sbatch=-x node7", "--sbatch=--reservation=big")
    assert code == 0, err
    lines = out.splitlines()
    assert {"#SBATCH --exclusive", "#SBATCH --exclude=node7", "#SBATCH --reservation=big"} <= set(lines)
    assert "#SBATCH --nodes=1" in lines and "#SBATCH --requeue" in lines
    assert not (tmp_path / "mace").exists()


@pytest.mark.parametrize("line", ["nodes=3", "-", "-%", "--Bad=1", "--a b=c"])
def test_malformed_sbatch_lines_are_refused(tmp_path, capsys, line):
    assert f"sbatch_lines entry {line!r}" in refused(tmp_path, capsys, f"--sbatch={line}")


def test_api_refuses_the_same(tmp_path):
    c = TrainConfig(output_dir=str(tmp_path), device="cpu")
    for kwargs, expected in (
        ({"account": "a\nb"}, "account="),
        ({"job_name": "x\ny"}, "job_name="),
        ({"mem": "lots"}, "mem='lots'"),
        ({"cpus_per_task": "4"}, "cpus_per_task='4': must be a positive integer"),
        ({"sbatch_lines": ["-N 2"]}, "--nodes is set by the launcher"),
        ({"setup": ["ok", "bad\x00"]}, "setup line="),
        ({"env": {"A": "1\n#SBATCH --x"}}, "env['A']="),
        ({"env": {"A; rm -rf /": "1"}}, "env name 'A; rm -rf /'"),
    ):
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("(", r"\(")):
            launch(c, backend="slurm", dry_run=True, **kwargs)
    assert list(tmp_path.iterdir()) == []
    # The run directory names the log files in the #SBATCH lines.
    with pytest.raises(ValueError, match="output_dir='.*\\\\n#SBATCH --x': contains the control character"):
        launch(TrainConfig(output_dir=str(tmp_path / "a\n#SBATCH --x")), backend="slurm", dry_run=True)
    assert list(tmp_path.iterdir()) == []


def test_fresh_refusal_is_a_usage_error(tmp_path, capsys):
    """--fresh on a directory that is not a run directory: nothing deleted, exit 2 as documented."""
    keep = tmp_path / "mace" / "precious.txt"
    keep.parent.mkdir()
    keep.write_text("not a run")
    args = ["launch", "--backend", "local", "--fresh", "--set", f"output_dir={tmp_path}", "--set", "device=cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "fresh=True (--fresh)" in err and "does not look like a run directory" in err and str(keep.parent) in err
    assert keep.read_text() == "not a run"
    with pytest.raises(LaunchError, match="does not look like a run directory"):  # still a LaunchError
        launch(TrainConfig(output_dir=str(tmp_path), device="cpu"), backend="local", fresh=True)
    assert keep.read_text() == "not a run"
