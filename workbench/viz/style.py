"""One look for every view: family colours, algorithm colours and order, a plotly template.

Every figure in :mod:`workbench.viz` colours a chemical family the same way, so a
reader who learned "orange is TMD" in the dataset view reads the bin layout and
the molecule gallery without a legend hunt.
"""

from __future__ import annotations

import html

from workbench.data.chemical_families import FAMILY_NAMES
from workbench.kernels.registry import DEFAULT_BACKEND, labels
from workbench.packing.api import ALGORITHMS

#: Colour of each Table-3 family (colour-blind-safe, Tableau-like; water families in blues).
FAMILY_COLORS: dict[str, str] = {
    "mptrj": "#4C78A8",
    "water_clusters": "#9ECAE9",
    "tmd": "#F58518",
    "liquid_water": "#72B7B2",
    "zeolite": "#54A24B",
    "cuni": "#E45756",
    "hea": "#B279A2",
    "al_hcl": "#EECA3B",
}
UNKNOWN_COLOR = "#9D755D"

#: Human-readable family labels (Table 3 of the paper).
FAMILY_LABELS: dict[str, str] = {
    "mptrj": "MPtrj",
    "water_clusters": "water clusters",
    "tmd": "TMD",
    "liquid_water": "liquid water",
    "zeolite": "zeolite",
    "cuni": "CuNi",
    "hea": "HEA",
    "al_hcl": "Al-HCl(aq)",
}

#: Colour of each registered packing algorithm (:data:`workbench.packing.api.ALGORITHMS`); a
#: test checks that every registered one has its own.
ALGORITHM_COLORS: dict[str, str] = {
    "paper": "#1B9E77",
    "shuffled-paper": "#66A61E",
    "ffd": "#7570B3",
    "dynamic": "#E6AB02",
    "lpt": "#A6761D",
    "fixed-count": "#D95F02",
}
UNKNOWN_ALGORITHM_COLOR = "#333333"

#: Colour of the kernel backends the figures have always shown; any other: :func:`backend_color`.
BACKEND_COLORS: dict[str, str] = {"e3nn": "#D95F02", DEFAULT_BACKEND: "#1B9E77", "cueq": "#7570B3"}
#: Colours for the other registered backends and variants, in registration order.
OTHER_BACKEND_COLORS = ("#E7298A", "#66A61E", "#E6AB02", "#A6761D", "#1F78B4", "#B15928", "#6A3D9A")

TEMPLATE = "plotly_white"
FONT = dict(family="Inter, Helvetica, Arial, sans-serif", size=13)


def backend_color(name: str) -> str:
    """Colour of the backend label ``name``: the fixed ones, else one per registered label in
    registration order (a backend registered at run time gets one too), else grey."""
    if name in BACKEND_COLORS:
        return BACKEND_COLORS[name]
    others = [n for n in labels() if n not in BACKEND_COLORS]
    return OTHER_BACKEND_COLORS[others.index(name) % len(OTHER_BACKEND_COLORS)] if name in others else "#777"


def family_color(name: str) -> str:
    """Colour of family ``name`` (a fixed brown for families outside Table 3)."""
    return FAMILY_COLORS.get(str(name), UNKNOWN_COLOR)


def family_label(name: str) -> str:
    """Display name of family ``name`` (plain text: a widget's option, a caption)."""
    return FAMILY_LABELS.get(str(name), str(name))


def family_html(name: str) -> str:
    """:func:`family_label` for HTML and plotly text (which reads tags): a family name comes from
    the user's file (extxyz ``config_type``), so it is escaped."""
    return html.escape(family_label(name))


def family_order(names) -> list[str]:
    """Families in Table-3 order, unknown names after them, sorted."""
    present = set(map(str, names))
    return [f for f in FAMILY_NAMES if f in present] + sorted(present - set(FAMILY_NAMES))


def algorithm_color(name: str) -> str:
    """Colour of packing algorithm ``name`` (dark grey for a name outside the registry)."""
    return ALGORITHM_COLORS.get(str(name), UNKNOWN_ALGORITHM_COLOR)


def algorithm_order(names) -> list[str]:
    """Algorithms in the registry's order, unknown names after them, sorted."""
    present = set(map(str, names))
    return [a for a in ALGORITHMS if a in present] + sorted(present - set(ALGORITHMS))


def style(fig, title: str | None = None, height: int | None = None):
    """Apply the workbench template, font and margins to a plotly figure (returns it)."""
    kw = dict(template=TEMPLATE, font=FONT, margin=dict(l=60, r=20, t=70, b=50), hoverlabel=dict(font_size=12))
    if title is not None:
        kw["title"] = dict(text=title, x=0.01, xanchor="left")
    if height is not None:
        kw["height"] = height
    fig.update_layout(**kw)
    return fig


def panel_row(titles: tuple[str, ...], widths: list[float] | None = None, spacing: float = 0.1, **kw):
    """A plotly figure of one row of panels titled ``titles`` (``widths``: their shares of the width)."""
    from plotly.subplots import make_subplots

    return make_subplots(
        rows=1, cols=len(titles), column_widths=widths, horizontal_spacing=spacing, subplot_titles=titles, **kw
    )
