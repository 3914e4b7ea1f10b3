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


def test_math_is_mathml_in_the_built_site(site):
    """The docstrings' LaTeX reaches the pages as MathML (docs/mathml_hook.py): no script, no CDN."""
    pages = [p.read_text() for p in site.rglob("*.html")]
    assert sum(p.count("<math ") for p in pages) >= 10
    assert not any('class="arithmatex"' in p for p in pages)
    assert not any("mathjax" in p.lower() or "katex" in p.lower() for p in pages)
    assert not list(site.rglob("*.py"))  # the build's own Python is not published


def test_the_math_hook_names_the_page_of_a_formula_it_cannot_read():
    spec = importlib.util.spec_from_file_location("mathml_hook", ROOT / "docs" / "mathml_hook.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = type("Page", (), {"file": type("File", (), {"src_uri": "guides/x.md"})()})()
    out = hook.on_page_content('a <span class="arithmatex">\\(x_i &lt; 2\\)</span> b', page=page)
    # the escaped "<" reaches latex2mathml as "<" and leaves as a character reference
    assert (
        out.startswith("a <math") and "<mi>x</mi>" in out and "<mo>&#x0003C;</mo>" in out and out.endswith("</math> b")
    )
    block = hook.on_page_content('<div class="arithmatex">\\[\nE = \\sum_i e_i\n\\]</div>', page=page)
    assert (
        block.startswith('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">') and "<mi>E</mi>" in block
    )
    with pytest.raises(ValueError, match=r"guides/x.md: latex2mathml cannot read 'x\^' \(MissingSuperScript"):
        hook.on_page_content('<span class="arithmatex">\\(x^\\)</span>', page=page)
