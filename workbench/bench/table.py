"""The one writer of benchmark output: aligned text tables and JSON result files.

Every ``workbench bench`` command prints tables and writes JSON. A table is a list of rows (dicts,
or anything a column's function reads) and a list of :class:`Column`; :func:`render` aligns it as
text, or as a Markdown table. :func:`write_json` writes a result atomically, so a benchmark that
rewrites its file after every row keeps what it measured when it is stopped, and a reader never
sees half a file. :func:`run_versions` and :func:`cpu_name` are what the results record about the
software and the machine.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: where the recorded benchmark results live, relative to the repository root (the benches run there)
RESULTS_DIR = Path("benchmarks") / "results"

__all__ = [
    "RESULTS_DIR",
    "Column",
    "cpu_name",
    "read_json",
    "recorded_packages",
    "render",
    "run_versions",
    "verdict",
    "write_json",
]


def recorded_packages() -> tuple[str, ...]:
    """The packages whose versions a benchmark result records, besides torch and python: mace-torch
    (the models) and the packages of every registered backend (``Backend.packages``)."""
    from workbench.kernels.registry import BACKENDS

    return tuple(dict.fromkeys(("mace", *(p for b in BACKENDS.values() for p in b.packages))))


@dataclass(frozen=True)
class Column:
    """One column: its ``header``, where a row's value comes from (a key of the row, or a
    function of the row), the format spec of the value (``".2f"``, ``".0%"``), a minimum
    ``width`` (the header and the cells widen it), the alignment (``">"`` or ``"<"``) and the
    text of a missing value (absent key or ``None``). A value that is already a string is
    shown as it is."""

    header: str
    value: str | Callable[[Any], Any]
    fmt: str = ""
    width: int = 0
    align: str = ">"
    missing: str = "-"

    def cell(self, row: Any) -> str:
        """The text of this column for ``row``."""
        if callable(self.value):
            v = self.value(row)
        else:
            v = row.get(self.value) if hasattr(row, "get") else getattr(row, self.value, None)
        if v is None:
            return self.missing
        return v if isinstance(v, str) else format(v, self.fmt)


def render(
    rows: Iterable[Any],
    columns: Sequence[Column],
    *,
    title: str | None = None,
    markdown: bool = False,
    rule: bool = True,
    indent: str = "",
    sep: str = " ",
) -> str:
    """``rows`` as an aligned table under ``title``: a header line, a rule (``rule``) and a line
    per row, each line prefixed by ``indent``; with ``markdown``, a Markdown table instead."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    lines = [title] if title is not None else []
    if markdown:
        lines.append("| " + " | ".join(c.header for c in columns) + " |")
        lines.append("|" + "---|" * len(columns))
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines)
    widths = [max([c.width, len(c.header), *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]

    def join(texts: Sequence[str]) -> str:
        return indent + sep.join(f"{t:{c.align}{w}}" for t, c, w in zip(texts, columns, widths)).rstrip()

    head = join([c.header for c in columns])
    lines.append(head)
    if rule:
        lines.append(indent + "-" * (len(head) - len(indent)))
    lines += [join(line) for line in cells]
    return "\n".join(lines)


def verdict(ok: bool | None, met: str = "met", not_met: str = "NOT met", unknown: str = "n/a") -> str:
    """A target's verdict as a word: ``met``, ``NOT met``, or ``n/a`` when it could not be judged."""
    return unknown if ok is None else (met if ok else not_met)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays, and paths, as JSON values."""
    if hasattr(value, "tolist"):  # numpy scalar or array
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_json(path: str | os.PathLike, data: Any, indent: int = 1) -> Path:
    """Write ``data`` to ``path`` (folders made, a ``.tmp`` file renamed over it); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=_plain) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The JSON in ``path``, or ``default`` when there is no such file."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else default


def run_versions() -> dict[str, str]:
    """``{package: version}`` of torch, python and :func:`recorded_packages`; a package that
    does not import is ``"unavailable: <exception class>"``."""
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in recorded_packages():
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as exc:
            versions[mod] = f"unavailable: {type(exc).__name__}"
    return versions


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :func:`platform.processor` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
