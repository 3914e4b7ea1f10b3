"""mkdocs hook: the pages' LaTeX becomes MathML when the site is built.

``pymdownx.arithmatex`` (generic mode) leaves ``\\( ... \\)`` in ``<span class="arithmatex">`` and
``\\[ ... \\]`` in ``<div class="arithmatex">``, for a script to typeset in the browser. Converting
them here with latex2mathml instead means the site loads no script and names no CDN host; every
current browser renders MathML. A formula latex2mathml cannot read fails the build, naming the page.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*(?:\\\((?P<inline>.*?)\\\)|\\\[(?P<block>.*?)\\\])\s*</(?P=tag)>', re.S
)


def _mathml(match: re.Match, page: str) -> str:
    block = match["block"] is not None
    latex = html.unescape(match["block"] if block else match["inline"]).strip()
    try:
        return convert(latex, display="block" if block else "inline")
    except Exception as exc:
        raise ValueError(f"{page}: latex2mathml cannot read {latex!r} ({type(exc).__name__}: {exc})") from exc


def on_page_content(content: str, page, **kwargs) -> str:
    return _MATH.sub(lambda m: _mathml(m, page.file.src_uri), content)
