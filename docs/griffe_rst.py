"""Griffe extension: the package's docstrings are written with Sphinx roles (e3nn's style);
the site renders Markdown. Rewrites, at load time, only what Markdown would show wrongly:

- ``:class:`~a.b.C``` (and ``func``, ``meth``, ``mod``, ``attr``, ``data``, ``exc``, ``obj``)
  -> an optional cross-reference: a link when the reference documents ``a.b.C`` (a name
  without ``workbench.`` is taken relative to the docstring's module), plain code otherwise
  (no warning: many targets are private helpers);
- ``:math:`x``` and ``.. math::`` blocks -> arithmatex's ``\\( x \\)`` and ``$$ ... $$``;
- a paragraph ending in ``::`` (reStructuredText's literal block) -> one colon.
"""

from __future__ import annotations

import html
import re
import textwrap

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj):`([^`]+)`")
_MATH = re.compile(r":math:`([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<([^>]+)>$")


def _role(match: re.Match, module: str) -> str:
    text = match.group(2).strip()
    titled = _TITLED.match(text)
    if titled:
        title, target = titled.groups()
    else:
        target = text.lstrip("~!")
        title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
    target = target.removesuffix("()")
    if module and not target.startswith("workbench."):
        target = f"{module}.{target}"  # a name relative to the docstring's module
    return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(title)}</code></autoref>'


def _math_blocks(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith(".. math::"):
            indent = len(line) - len(line.lstrip())
            first = line.strip()[len(".. math::") :].strip()
            body, i = ([first] if first else []), i + 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            math = textwrap.dedent("\n".join(body)).strip()
            out += ["", " " * indent + "$$", *(" " * indent + m for m in math.splitlines()), " " * indent + "$$", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def to_markdown(text: str, module: str = "") -> str:
    """The Markdown griffe hands to mkdocstrings for one docstring of ``module``."""
    text = _math_blocks(text)
    text = _MATH.sub(lambda m: f"\\({m.group(1)}\\)", text)
    text = _ROLE.sub(lambda m: _role(m, module), text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)


class SphinxRolesToMarkdown(griffe.Extension):
    """Applies :func:`to_markdown` to every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value, obj.module.path)
