r"""Energy and force errors of a model on a set of graphs, overall and per family (``config_type``).

For graphs :math:`g` with :math:`N_g` atoms, predicted energy :math:`\hat E_g` and forces
:math:`\hat F_{gi}`:

* energy MAE / RMSE per atom: over graphs of :math:`|\hat E_g - E_g| / N_g`;
* force MAE: over atoms of the mean over the 3 components of :math:`|\hat F_{gi} - F_{gi}|`
  (mace-torch's ``MAE_F``); force RMSE: over all components of :math:`(\hat F - F)^2`.

Reported in meV/atom and meV/Å, as mace_run_train prints them, for the whole set (the keys
``e_mae_mev_atom`` ... ) and, under ``families``, for each ``config_type`` present.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workbench.dtypes import default_dtype

METRICS = ("e_mae_mev_atom", "e_rmse_mev_atom", "f_mae_mev_a", "f_rmse_mev_a")


@dataclass
class _Sums:
    graphs: int = 0
    atoms: int = 0
    e_abs: float = 0.0
    e_sq: float = 0.0
    f_abs: float = 0.0  # sum over atoms of the mean |dF| over components
    f_sq: float = 0.0  # sum over components of dF^2

    def add(self, e_err: np.ndarray, f_abs: np.ndarray, f_sq: np.ndarray, atoms: int) -> None:
        self.graphs += int(e_err.size)
        self.atoms += atoms
        self.e_abs += float(np.abs(e_err).sum())
        self.e_sq += float((e_err**2).sum())
        self.f_abs += float(f_abs.sum())
        self.f_sq += float(f_sq.sum())

    def metrics(self) -> dict:
        nan = float("nan")
        g, a = max(self.graphs, 1), max(self.atoms, 1)
        return {
            "e_mae_mev_atom": 1000 * self.e_abs / g if self.graphs else nan,
            "e_rmse_mev_atom": 1000 * math.sqrt(self.e_sq / g) if self.graphs else nan,
            "f_mae_mev_a": 1000 * self.f_abs / a if self.atoms else nan,
            "f_rmse_mev_a": 1000 * math.sqrt(self.f_sq / (3 * a)) if self.atoms else nan,
            "graphs": self.graphs,
        }


def evaluate(
    model,
    data,
    device: torch.device | str = "cpu",
    batch_size: int = 16,
    num_workers: int = 0,
    families: Sequence[str] | None = None,
    loss_fn=None,
) -> dict:
    r"""Errors of ``model`` on ``data`` (a list of ``AtomicData`` or a dataset that builds them).

    ``families``: the ``config_type`` of each graph of ``data``, in order; the result then has
    a ``families`` entry with the same metrics per family. Returns the overall metrics
    (:data:`METRICS`, meV/atom and meV/Å, plus ``graphs``). With ``loss_fn`` (a mace loss) it
    also returns ``loss``: the mean of the losses :math:`L_b` of its batches (``batch_size``
    graphs each, in order). mace_run_train prints :math:`\sum_b L_b / \sum_b n_b` over the same
    batches, a constant multiple of it on a given set, so both rank epochs alike.
    """
    from mace.tools.torch_geometric import DataLoader

    total = _Sums()
    per: dict[str, _Sums] = {}
    loss_sum, batches = 0.0, 0
    extra = lambda: {} if loss_fn is None else {"loss": loss_sum / batches if batches else float("nan")}  # noqa: E731
    if not len(data):
        return {**total.metrics(), **extra(), "families": {}}
    names = None if families is None else np.asarray(families, dtype=str)
    model.eval()
    at = 0
    for batch in DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers):
        batch = batch.to(device)
        out = model(batch.to_dict(), training=False, compute_force=True)
        if loss_fn is not None:
            loss_sum += float(loss_fn(pred=out, ref=batch).detach())
            batches += 1
        n = batch.ptr[1:] - batch.ptr[:-1]
        e_err = ((out["energy"].detach() - batch.energy) / n.to(out["energy"].dtype)).cpu().double().numpy()
        df = (out["forces"].detach() - batch.forces).cpu().double().numpy()
        graph_of_atom = batch.batch.cpu().numpy()
        k = e_err.size
        f_abs = np.bincount(graph_of_atom, weights=np.abs(df).mean(axis=1), minlength=k)
        f_sq = np.bincount(graph_of_atom, weights=(df**2).sum(axis=1), minlength=k)
        counts = n.cpu().numpy()
        total.add(e_err, f_abs, f_sq, int(counts.sum()))
        if names is not None:
            mine = names[at : at + k]
            for fam in np.unique(mine):
                sel = mine == fam
                per.setdefault(str(fam), _Sums()).add(e_err[sel], f_abs[sel], f_sq[sel], int(counts[sel].sum()))
        at += k
    return {**total.metrics(), **extra(), "families": {f: per[f].metrics() for f in sorted(per)}}


def format_table(result: dict) -> str:
    """Per-family and overall errors as a fixed-width table (meV/atom, meV/Å)."""
    head = f"{'config_type':<16}{'graphs':>8}{'E MAE':>9}{'E RMSE':>9}{'F MAE':>9}{'F RMSE':>9}"
    unit = f"{'':<16}{'':>8}{'meV/atom':>9}{'meV/atom':>9}{'meV/Å':>9}{'meV/Å':>9}"
    rows = [*result.get("families", {}).items(), ("all", result)]
    lines = [head, unit, "-" * len(head)]
    for name, m in rows:
        if name == "all":
            lines.append("-" * len(head))
        lines.append(f"{name:<16}{m['graphs']:>8}" + "".join(f"{m[k]:>9.1f}" for k in METRICS))
    return "\n".join(lines)


def evaluate_file(
    model_path,
    structures_path,
    *,
    energy_key: str = "REF_energy",
    forces_key: str = "REF_forces",
    batch_size: int = 16,
    device: str = "cpu",
    trust_model: bool = False,
) -> dict:
    """Errors of a saved mace-torch model (``torch.save`` of the module, e.g. ``model.model``)
    on the labelled frames of a structure file, per ``config_type``. The model file is loaded
    without running code from it (:mod:`workbench.train.model_file`) unless ``trust_model``."""
    from mace.tools import AtomicNumberTable

    from workbench.data.atomic_data import to_atomic_data
    from workbench.data.io import read_structures
    from workbench.train.model_file import check_device, load_model

    dev = check_device(device)
    # loaded on the CPU, then moved: e3nn's TorchScript parts load there whatever map_location says
    model = load_model(model_path, trust=trust_model, map_location="cpu").to(dev)
    _warn_nonfinite(model, model_path)
    structures = [
        a
        for a in read_structures(structures_path, energy_key=energy_key, forces_key=forces_key)
        if a.info.get("labelled", True)
    ]
    if not structures:
        raise ValueError(f"{structures_path}: no labelled structures to evaluate on")
    dtype = next(model.parameters()).dtype
    with default_dtype(dtype):
        z_table = AtomicNumberTable([int(z) for z in model.atomic_numbers])
        data = to_atomic_data(
            structures, cutoff=float(model.r_max), z_table=z_table, energy_key=energy_key, forces_key=forces_key
        )
        families = [str(a.info.get("config_type", "Default")) for a in structures]
        return evaluate(model, data, dev, batch_size=batch_size, families=families)


def _warn_nonfinite(model: torch.nn.Module, path) -> None:
    """One line on stderr when the model holds NaN/inf weights: every error it reports will be NaN."""
    import sys

    from workbench.train.model_file import nonfinite_parameters

    bad = nonfinite_parameters(model)
    if bad:
        print(
            f"workbench: warning: {path}: {len(bad)} parameter tensor(s) hold NaN or inf (first: {bad[0]}); "
            "its predictions and errors will not be finite",
            file=sys.stderr,
        )


def family_table_html(result: dict, caption: str = "Validation errors per config_type") -> str:
    """:func:`format_table` as an HTML table (class ``wb-family-errors``) for reports and widgets.
    Family names and the caption come from user data: they are HTML-escaped."""
    rows = [*result.get("families", {}).items(), ("all", result)]
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "config_type",
            "graphs",
            "E MAE<br>meV/atom",
            "E RMSE<br>meV/atom",
            "F MAE<br>meV/Å",
            "F RMSE<br>meV/Å",
        )
    )
    body = "".join(
        f"<tr{' class=wb-total' if name == 'all' else ''}><td>{html.escape(str(name))}</td>"
        f"<td>{html.escape(str(m['graphs']))}</td>" + "".join(f"<td>{_cell(m.get(k))}</td>" for k in METRICS) + "</tr>"
        for name, m in rows
    )
    return (
        f"<table class='wb-family-errors' style='border-collapse:collapse;font-size:13px;text-align:right'>"
        f"<caption style='text-align:left;font-weight:600'>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"
    )


def _cell(value) -> str:
    """A metric as table text: a number to 0.1, anything else (from a hand-edited record) escaped."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1f}"
    return html.escape(str(value))


def last_validation(epochs: list[dict]) -> dict | None:
    """The latest epoch record's validation errors in :func:`evaluate`'s shape, or None."""
    for e in reversed(epochs):
        if e.get("valid_families") is not None and e.get("valid_e_mae_mev_atom") is not None:
            return {
                "e_mae_mev_atom": e["valid_e_mae_mev_atom"],
                "f_mae_mev_a": e["valid_f_mae_mev_a"],
                "e_rmse_mev_atom": e.get("valid_e_rmse_mev_atom", float("nan")),
                "f_rmse_mev_a": e.get("valid_f_rmse_mev_a", float("nan")),
                "graphs": sum(f["graphs"] for f in e["valid_families"].values()),
                "families": e["valid_families"],
                "epoch": e["epoch"],
            }
    return None
