"""Molecule views with nglview: one structure, or a gallery per family.

nglview 4.0.1 declares its widgets with frontend version ``"4.0"`` but ships the
JupyterLab extension ``nglview-js-widgets`` 3.1.5, so JupyterLab 4 cannot find a
matching module and draws an error box instead of the viewer. Headless
execution (nbclient) cannot see this; only a browser can (tests/test_browser.py).
:func:`fix_nglview_frontend` makes ``nglview._frontend`` report ``"3.1.5"`` before
nglview is first imported, for that exact nglview version only.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Sequence

import numpy as np

from workbench.viz.style import family_color, family_html, family_label, family_order

BROKEN_NGLVIEW = "4.0.1"
SHIPPED_FRONTEND = "3.1.5"


def fix_nglview_frontend() -> bool:
    """Apply the nglview 4.0.1 frontend-version fix; ``True`` when it was applied (or already was).

    Must run before ``import nglview``: the widget classes read
    ``nglview._frontend.__frontend_version__`` when they are defined. We put a
    module with the right version in ``sys.modules`` so the package's own
    ``from ._frontend import __frontend_version__`` picks it up. If nglview was
    imported already, the trait defaults of its widget classes are corrected
    instead, which fixes every widget created afterwards.
    """
    from importlib import metadata

    try:
        version = metadata.version("nglview")
    except metadata.PackageNotFoundError:
        return False
    if version != BROKEN_NGLVIEW:
        return False
    if "nglview" not in sys.modules:
        mod = types.ModuleType("nglview._frontend")
        mod.__frontend_version__ = SHIPPED_FRONTEND
        mod.__doc__ = (
            f"workbench: nglview {BROKEN_NGLVIEW} ships frontend {SHIPPED_FRONTEND} (see workbench.viz.molecules)"
        )
        sys.modules["nglview._frontend"] = mod
        return True
    fixed = False
    for modname in ("nglview.widget", "nglview.widget_base", "nglview.color", "nglview.widget_molstar"):
        m = sys.modules.get(modname)
        for obj in vars(m).values() if m else ():
            if isinstance(obj, type) and hasattr(obj, "class_traits"):
                for tname in ("_view_module_version", "_model_module_version"):
                    t = obj.class_traits().get(tname)
                    if t is not None and t.default_value == "4.0":
                        t.default_value = SHIPPED_FRONTEND
                        fixed = True
                    # traitlets 5 copies static defaults into a per-class cache at class creation.
                    cache = vars(obj).get("_static_immutable_initial_values")
                    if isinstance(cache, dict) and cache.get(tname) == "4.0":
                        cache[tname] = SHIPPED_FRONTEND
                        fixed = True
    if not fixed and getattr(sys.modules.get("nglview._frontend"), "__frontend_version__", None) != SHIPPED_FRONTEND:
        warnings.warn(
            "nglview 4.0.1 was imported before workbench.viz and could not be patched; "
            "its viewer may show an error box in JupyterLab 4",
            stacklevel=2,
        )
    return True


def _nglview():
    fix_nglview_frontend()
    import nglview

    return nglview


def image_offsets(atoms, images: int | str = "auto", max_atoms: int = 6000) -> np.ndarray:
    """Integer cell offsets of the periodic images to draw (the home cell excluded).

    ``images=k`` draws every image within ``k`` cells along each periodic axis;
    ``"auto"`` picks ``k = 1`` (the full shell of neighbours), falling back to the
    positive half-shell (``+1`` along each axis) or nothing when that would draw
    more than ``max_atoms`` atoms in total, to keep software WebGL responsive.
    """
    pbc = np.asarray(atoms.pbc, bool)
    if not pbc.any() or len(atoms) == 0:
        return np.zeros((0, 3), np.int64)
    rng = [range(-1, 2) if p else range(1) for p in pbc]
    shell = np.array([(i, j, k) for i in rng[0] for j in rng[1] for k in rng[2] if (i, j, k) != (0, 0, 0)])
    if images != "auto":
        k = int(images)
        rng = [range(-k, k + 1) if p else range(1) for p in pbc]
        return np.array(
            [(i, j, l) for i in rng[0] for j in rng[1] for l in rng[2] if (i, j, l) != (0, 0, 0)], dtype=np.int64
        ).reshape(-1, 3)
    if len(atoms) * (1 + len(shell)) <= max_atoms:
        return shell.astype(np.int64)
    half = np.array(
        [
            (i, j, k)
            for i in (0, 1)
            if pbc[0] or i == 0
            for j in (0, 1)
            if pbc[1] or j == 0
            for k in (0, 1)
            if pbc[2] or k == 0
            if (i, j, k) != (0, 0, 0)
        ]
    )
    if len(atoms) * (1 + len(half)) <= max_atoms:
        return half.astype(np.int64)
    return np.zeros((0, 3), np.int64)


def periodic_images(atoms, images: int | str = "auto", max_atoms: int = 6000):
    """The image atoms (an ``ase.Atoms`` without cell), or ``None`` for non-periodic structures."""
    offs = image_offsets(atoms, images, max_atoms)
    if offs.size == 0:
        return None
    shift = offs @ atoms.cell.array
    pos = (atoms.positions[None, :, :] + shift[:, None, :]).reshape(-1, 3)
    out = atoms.__class__(numbers=np.tile(atoms.numbers, len(offs)), positions=pos)
    return out


def describe_structure(atoms) -> str:
    """``"mptrj · Fe2O3 · 5 atoms · periodic"``-style caption."""
    fam = atoms.info.get("config_type", "unknown")
    per = "periodic" if any(atoms.pbc) else "molecule"
    return f"{family_label(fam)} · {atoms.get_chemical_formula()} · {len(atoms)} atoms · {per}"


def molecule_view(
    atoms,
    images: int | str = "auto",
    show_cell: bool = True,
    representation: str = "ball+stick",
    height: str = "360px",
    max_atoms: int = 6000,
):
    """nglview viewer of one structure, coloured by element.

    Periodic structures get their unit cell drawn and their periodic images
    (see :func:`image_offsets`) shown translucent around the home cell.
    """
    nv = _nglview()
    view = nv.show_ase(atoms, default=False)
    view.add_representation(
        representation,
        selection="all",
        color_scheme="element",
        **({"aspectRatio": 1.6} if representation == "ball+stick" else {}),
    )
    if show_cell and any(atoms.pbc):
        view.add_unitcell()
    imgs = periodic_images(atoms, images, max_atoms) if any(atoms.pbc) else None
    if imgs is not None:
        c = view.add_component(nv.ASEStructure(imgs), default=False)
        c.add_representation("spacefill", radiusScale=0.45, color_scheme="element", opacity=0.35)
    view.center()
    view.camera = "orthographic"
    view.layout.height = height
    view.layout.width = "100%"
    view.add_class("wb-molecule-view")
    return view


def _card(atoms, view, caption_extra: str = ""):
    import ipywidgets as W

    fam = atoms.info.get("config_type", "unknown")
    head = W.HTML(
        f"<div style='border-left:6px solid {family_color(fam)};padding-left:8px;font-size:13px'>"
        f"<b>{family_html(fam)}</b><br><span style='color:#555'>{atoms.get_chemical_formula()} · "
        f"{len(atoms)} atoms{caption_extra}</span></div>"
    )
    box = W.VBox([head, view], layout=W.Layout(border="1px solid #e3e3e3", padding="6px", width="100%"))
    box.add_class("wb-molecule-card")
    return box


def pick_examples(structures: Sequence, family: str | None = None, n: int = 4, seed: int = 0) -> list[int]:
    """Indices of structures to show: the first of each family (``family=None``, Table-3 order)
    or ``n`` random ones (sorted) of ``family``."""
    fams = np.array([a.info.get("config_type", "unknown") for a in structures])
    if family is None:
        return [int(np.flatnonzero(fams == f)[0]) for f in family_order(fams)]
    idx = np.flatnonzero(fams == family)
    if idx.size == 0:
        raise KeyError(f"no structures of family {family!r}; present: {', '.join(family_order(fams))}")
    rng = np.random.default_rng(seed)
    return [int(i) for i in np.sort(rng.choice(idx, size=min(n, idx.size), replace=False))]


def family_gallery(
    structures: Sequence,
    family: str | None = None,
    n: int = 4,
    columns: int = 4,
    seed: int = 0,
    height: str = "260px",
    sizes: np.ndarray | None = None,
):
    """A grid of molecule views: one structure per family, or ``n`` structures of ``family``.

    ``sizes``: optional :func:`workbench.data.graph_sizes` of ``structures``, to
    print each structure's edge count under its view.
    """
    import ipywidgets as W

    cards = []
    for i in pick_examples(structures, family, n, seed):
        extra = f" · {int(sizes['edges'][i]):,} edges" if sizes is not None else ""
        cards.append(_card(structures[i], molecule_view(structures[i], height=height), extra))
    grid = W.GridBox(
        cards, layout=W.Layout(grid_template_columns=f"repeat({columns}, minmax(0, 1fr))", grid_gap="8px", width="100%")
    )
    grid.add_class("wb-gallery")
    return grid


def molecule_browser(structures: Sequence, height: str = "420px"):
    """Pick a family and a structure; one large viewer with its caption."""
    import ipywidgets as W

    fams = np.array([a.info.get("config_type", "unknown") for a in structures])
    fam_w = W.Dropdown(options=[(family_label(f), f) for f in family_order(fams)], description="family")
    idx_w = W.IntSlider(min=0, max=0, description="structure", continuous_update=False)
    out = W.Box(layout=W.Layout(width="100%"))
    cap = W.HTML()

    def show(*_):
        members = np.flatnonzero(fams == fam_w.value)
        idx_w.max = members.size - 1
        a = structures[int(members[min(idx_w.value, members.size - 1)])]
        cap.value = f"<b>{describe_structure(a)}</b> (structure #{int(members[min(idx_w.value, members.size - 1)])})"
        out.children = [molecule_view(a, height=height)]

    fam_w.observe(lambda *_: (setattr(idx_w, "value", 0), show()), "value")
    idx_w.observe(show, "value")
    show()
    return W.VBox([W.HBox([fam_w, idx_w]), cap, out])
