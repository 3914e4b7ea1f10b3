"""The documentation site: it builds strictly, its API reference holds every exported name of the
four core packages, its records are all listed, and the docstring rewriting renders Sphinx roles."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE_PACKAGES = ("workbench.data", "workbench.packing", "workbench.kernels", "workbench.train")


def _griffe_rst():
    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "docs" / "griffe_rst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inventory(path: Path) -> set[str]:
    """Object names of a Sphinx-format ``objects.inv`` (four header lines, then zlib)."""
    raw = path.read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    return {line.split()[0] for line in body.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_reference_documents_every_exported_name(site, package):
    names = _inventory(site / "objects.inv")
    exported = importlib.import_module(package).__all__
    assert len(exported) >= 4
    missing = [n for n in exported if f"{package}.{n}" not in names]
    assert not missing, f"{package}: not in the API reference: {missing}"


def test_roles_become_links_where_the_reference_has_the_target(site):
    page = (site / "reference" / "kernels" / "index.html").read_text()
    # the package docstring says :func:`accelerate`: a link to its entry on the same page
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#workbench\.kernels\.accelerate"', page)
    assert "<autoref" not in page and ":func:`" not in page and ":class:`" not in page


def test_every_record_is_listed_and_dated():
    records = ROOT / "docs" / "records"
    index = (records / "index.md").read_text()
    files = sorted(p.name for p in records.glob("*.md") if p.name != "index.md")
    assert len(files) >= 25
    for name in files:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", name), name
        assert f"]({name})" in index, f"{name} is not listed in docs/records/index.md"


def test_readme_is_a_first_page():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250
    for needed in ("make demo", "make test", "make docs", "docs/guides/", "docs/design.md"):
        assert needed in readme


def test_sphinx_roles_become_optional_references():
    to_markdown = _griffe_rst().to_markdown
    out = to_markdown("See :class:`~workbench.kernels.ops.PolyOp` and :func:`pack`.", "workbench.packing")
    assert '<autoref identifier="workbench.kernels.ops.PolyOp" optional><code>PolyOp</code></autoref>' in out
    assert '<autoref identifier="workbench.packing.pack" optional><code>pack</code></autoref>' in out
    titled = to_markdown(":meth:`the vjp <workbench.kernels.SparsePolynomial.vjp>`")
    assert 'identifier="workbench.kernels.SparsePolynomial.vjp"' in titled and "<code>the vjp</code>" in titled
    assert "<code>x &amp; y</code>" in to_markdown(":data:`x & y`")  # escaped: it lands in HTML


def test_math_and_literal_blocks_become_markdown():
    to_markdown = _griffe_rst().to_markdown
    assert to_markdown("the sum :math:`\\sum_i x_i` here") == "the sum \\(\\sum_i x_i\\) here"
    block = to_markdown("Text.\n\n.. math::\n\n    E = \\sum_i e_i\n\nAfter.")
    assert "$$\nE = \\sum_i e_i\n$$" in block and ".. math::" not in block and block.endswith("After.")
    assert to_markdown("Example::\n\n    code") == "Example:\n\n    code"
