"""The house rules, checked on the source: sizes, import direction, no circles, no stale references.

Floors (README, "Layout"): imports run downwards only. ``bench`` times what ``train``, ``kernels``
and ``packing`` build; ``viz`` draws what the others write; ``cli`` and ``demo`` sit on top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "workbench"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

#: subpackage (or top-level module) -> floor; a module may import its own floor or below.
FLOORS = {
    "_compat": 0,
    "progress": 0,
    "dtypes": 0,
    "quiet": 0,
    "limits": 0,
    "cli_args": 0,
    "cache_dir": 0,
    "switches": 0,
    "data": 1,
    "kernels": 1,
    "packing": 2,
    "train": 3,
    "launch": 4,
    "bench": 4,
    "viz": 5,
    "demo": 6,
    "cli": 6,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Workbench modules imported anywhere in ``path`` (lazy imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {m for m in found if m in MODULES}


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _floor(module: str) -> tuple[str, int]:
    part = module.split(".")[1] if "." in module else "workbench"
    if part not in FLOORS:
        raise AssertionError(f"{module}: subpackage {part!r} has no floor in tests/test_structure.py FLOORS")
    return part, FLOORS[part]


def test_every_subpackage_has_a_floor():
    for module in MODULES:
        if module != "workbench":
            _floor(module)


def test_imports_run_downwards():
    upward = []
    for module, deps in GRAPH.items():
        if module == "workbench":
            continue
        part, floor = _floor(module)
        for dep in deps:
            dep_part, dep_floor = _floor(dep) if dep != "workbench" else ("workbench", 0)
            if dep_part != part and dep_floor > floor:
                upward.append(f"{module} (floor {floor}) imports {dep} (floor {dep_floor})")
    assert not upward, "imports running back up a floor:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    # A package's __init__ re-exporting its submodules is not a circle; a submodule importing its
    # own package's __init__ back is.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in GRAPH.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_module_and_function_sizes(module):
    path = MODULES[module]
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines (limit {MAX_MODULE_LINES})"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


STALE = [
    (re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE), "an issue number (say the fact instead)"),
    (re.compile(r"DESIGN\.md"), "a DESIGN.md that is not in this repository"),
]


def test_no_issue_numbers_or_missing_documents_in_code():
    found = []
    for path in [*MODULES.values(), *sorted((ROOT / "scripts").glob("*.sh"))]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in STALE:
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
