"""Progress output: a bar on a terminal, a handful of lines in a log."""

from workbench.progress import LineProgress, bar


def test_logs_get_a_handful_of_lines(capsys):
    b = bar(total=1000, desc="work", unit="graph")  # stderr is captured here: not a terminal
    assert isinstance(b, LineProgress)
    with b:
        for _ in range(1000):
            b.update(1)
            b.set_postfix(skipped=0)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert [line.split(":")[1].split()[0] for line in lines] == ["25%", "50%", "75%", "100%"]
    assert lines[-1].endswith("[skipped=0] done") and "1000/1000 graph" in lines[-1]


def test_disabled_bar_prints_nothing(capsys):
    with bar(total=10, desc="x", disable=True) as b:
        b.update(10)
    assert capsys.readouterr().err == ""
