r"""Energy, force and stress errors of a model on a set of graphs, overall and per family (``config_type``).

For graphs :math:`g` with :math:`N_g` atoms, predicted energy :math:`\hat E_g` and forces
:math:`\hat F_{gi}`:

* energy MAE / RMSE per atom: over graphs of :math:`|\hat E_g - E_g| / N_g`;
* force MAE: over atoms of the mean over the 3 components of :math:`|\hat F_{gi} - F_{gi}|`
  (mace-torch's ``MAE_F``); force RMSE: over all components of :math:`(\hat F - F)^2`;
* stress MAE / RMSE: over the 9 components of :math:`\hat\sigma_g - \sigma_g` of the graphs with a
  stress label (mace's ``MAE_stress``), and the virials' per atom likewise, when the model
  computes them (``compute_stress``).

Reported in meV/atom, meV/Å and meV/Å³, as mace_run_train prints them, for the whole set (the
keys ``e_mae_mev_atom`` ... ) and, under ``families``, for each ``config_type`` present.
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
#: stress (meV/Å³) and virials per atom (meV/atom); absent where no graph had the label or none was computed
TENSOR_METRICS = ("s_mae_mev_a3", "s_rmse_mev_a3", "v_mae_mev_atom", "v_rmse_mev_atom")


@dataclass
class _Sums:
    graphs: int = 0
    atoms: int = 0
    e_abs: float = 0.0
    e_sq: float = 0.0
    f_abs: float = 0.0  # sum over atoms of the mean |dF| over components
    f_sq: float = 0.0  # sum over components of dF^2
    s_n: int = 0  # graphs with a stress label, and the sums of their 9 components' errors
    s_abs: float = 0.0
    s_sq: float = 0.0
    v_n: int = 0
    v_abs: float = 0.0
    v_sq: float = 0.0

    def add(self, e_err: np.ndarray, f_abs: np.ndarray, f_sq: np.ndarray, atoms: int) -> None:
        self.graphs += int(e_err.size)
        self.atoms += atoms
        self.e_abs += float(np.abs(e_err).sum())
        self.e_sq += float((e_err**2).sum())
        self.f_abs += float(f_abs.sum())
        self.f_sq += float(f_sq.sum())

    def add_tensor(self, name: str, err: np.ndarray) -> None:
        """Errors ``[graphs, 3, 3]`` of the labelled graphs of ``name`` (``"s"`` or ``"v"``)."""
        setattr(self, f"{name}_n", getattr(self, f"{name}_n") + int(err.shape[0]))
        setattr(self, f"{name}_abs", getattr(self, f"{name}_abs") + float(np.abs(err).sum()))
        setattr(self, f"{name}_sq", getattr(self, f"{name}_sq") + float((err**2).sum()))

    def metrics(self) -> dict:
        nan = float("nan")
        g, a = max(self.graphs, 1), max(self.atoms, 1)
        out = {
            "e_mae_mev_atom": 1000 * self.e_abs / g if self.graphs else nan,
            "e_rmse_mev_atom": 1000 * math.sqrt(self.e_sq / g) if self.graphs else nan,
            "f_mae_mev_a": 1000 * self.f_abs / a if self.atoms else nan,
            "f_rmse_mev_a": 1000 * math.sqrt(self.f_sq / (3 * a)) if self.atoms else nan,
            "graphs": self.graphs,
        }
        for name, unit in (("s", "mev_a3"), ("v", "mev_atom")):  # only where some graph had the label
            n = 9 * getattr(self, f"{name}_n")
            if n:
                out[f"{name}_mae_{unit}"] = 1000 * getattr(self, f"{name}_abs") / n
                out[f"{name}_rmse_{unit}"] = 1000 * math.sqrt(getattr(self, f"{name}_sq") / n)
        out["stress_graphs"] = self.s_n
        return out


def _tensor_errors(out: dict, batch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"s": (errors, labelled), "v": ...}``: stress errors and virial errors per atom, and which
    graphs carry the label (weight > 0), for the outputs the model computed."""
    found = {}
    n = (batch.ptr[1:] - batch.ptr[:-1]).view(-1, 1, 1)
    for name, key, per in (("s", "stress", None), ("v", "virials", n)):
        if out.get(key) is None:
            continue
        err = out[key].detach() - batch[key]
        err = err if per is None else err / per.to(err.dtype)
        mask = (batch[f"{key}_weight"] * batch.weight) > 0
        found[name] = (err.cpu().double().numpy(), mask.cpu().numpy())
    return found


def evaluate(
    model,
    data,
    device: torch.device | str = "cpu",
    batch_size: int = 16,
    num_workers: int = 0,
    families: Sequence[str] | None = None,
    loss_fn=None,
    compute_stress: bool = False,
    compute_virials: bool = False,
) -> dict:
    r"""Errors of ``model`` on ``data`` (a list of ``AtomicData`` or a dataset that builds them).

    ``families``: the ``config_type`` of each graph of ``data``, in order; the result then has
    a ``families`` entry with the same metrics per family. Returns the overall metrics
    (:data:`METRICS`, meV/atom and meV/Å, plus ``graphs``). With ``loss_fn`` (a mace loss) it
    also returns ``loss``: the mean of the losses :math:`L_b` of its batches (``batch_size``
    graphs each, in order). mace_run_train prints :math:`\sum_b L_b / \sum_b n_b` over the same
    batches, a constant multiple of it on a given set, so both rank epochs alike.
    ``compute_stress`` / ``compute_virials`` add their errors (:data:`TENSOR_METRICS`), over the
    graphs that carry the label.
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
    outputs = {"compute_stress": compute_stress, "compute_virials": compute_virials}
    for batch in DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers):
        batch = batch.to(device)
        out = model(batch.to_dict(), training=False, compute_force=True, **outputs)
        if loss_fn is not None:
            loss_sum += float(loss_fn(pred=out, ref=batch).detach())
            batches += 1
        k = int(batch.num_graphs)
        mine = names[at : at + k] if names is not None else None
        _add_batch(total, per, mine, out, batch)
        at += k
    return {**total.metrics(), **extra(), "families": {f: per[f].metrics() for f in sorted(per)}}


def _add_batch(total: _Sums, per: dict, mine: np.ndarray | None, out: dict, batch) -> None:
    """One batch's errors into the overall sums and, with ``mine`` (its graphs' families), each family's."""
    n = batch.ptr[1:] - batch.ptr[:-1]
    e_err = ((out["energy"].detach() - batch.energy) / n.to(out["energy"].dtype)).cpu().double().numpy()
    df = (out["forces"].detach() - batch.forces).cpu().double().numpy()
    graph_of_atom = batch.batch.cpu().numpy()
    k = e_err.size
    f_abs = np.bincount(graph_of_atom, weights=np.abs(df).mean(axis=1), minlength=k)
    f_sq = np.bincount(graph_of_atom, weights=(df**2).sum(axis=1), minlength=k)
    counts = n.cpu().numpy()
    tensors = _tensor_errors(out, batch)
    groups = [(total, np.ones(k, dtype=bool))]
    if mine is not None:
        groups += [(per.setdefault(str(fam), _Sums()), mine == fam) for fam in np.unique(mine)]
    for sums, sel in groups:
        sums.add(e_err[sel], f_abs[sel], f_sq[sel], int(counts[sel].sum()))
        for name, (err, labelled) in tensors.items():
            sums.add_tensor(name, err[sel & labelled])


#: (metric, header, unit) of the tables; the stress columns show where any graph had a stress label
COLUMNS = (
    ("e_mae_mev_atom", "E MAE", "meV/atom"),
    ("e_rmse_mev_atom", "E RMSE", "meV/atom"),
    ("f_mae_mev_a", "F MAE", "meV/Å"),
    ("f_rmse_mev_a", "F RMSE", "meV/Å"),
)
STRESS_COLUMNS = (("s_mae_mev_a3", "S MAE", "meV/Å³"), ("s_rmse_mev_a3", "S RMSE", "meV/Å³"))


def _columns(result: dict) -> tuple:
    return COLUMNS + (STRESS_COLUMNS if result.get("stress_graphs") else ())


def _text(value) -> str:
    return f"{value:>9.1f}" if isinstance(value, (int, float)) else f"{'-':>9}"


def format_table(result: dict) -> str:
    """Per-family and overall errors as a fixed-width table (meV/atom, meV/Å; meV/Å³ for stress)."""
    cols = _columns(result)
    head = f"{'config_type':<16}{'graphs':>8}" + "".join(f"{h:>9}" for _, h, _ in cols)
    unit = f"{'':<16}{'':>8}" + "".join(f"{u:>9}" for _, _, u in cols)
    rows = [*result.get("families", {}).items(), ("all", result)]
    lines = [head, unit, "-" * len(head)]
    for name, m in rows:
        if name == "all":
            lines.append("-" * len(head))
        lines.append(f"{name:<16}{m['graphs']:>8}" + "".join(_text(m.get(k)) for k, _, _ in cols))
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
    stress_key: str = "REF_stress",
    virials_key: str = "REF_virials",
    head: str | None = None,
) -> dict:
    """Errors of a saved mace-torch model (``torch.save`` of the module, e.g. ``model.model``)
    on the labelled frames of a structure file or folder (any format of
    :mod:`workbench.data.formats`), per ``config_type``; stress and virial errors too where
    frames carry those labels. The model file is loaded without running code from it
    (:mod:`workbench.train.model_file`) unless ``trust_model``. ``head``: the head a multihead
    model predicts through (:func:`~workbench.train.heads.select_head`)."""
    from mace.tools import AtomicNumberTable

    from workbench.data.atomic_data import to_atomic_data
    from workbench.data.io import read_structures
    from workbench.train.heads import select_head
    from workbench.train.model_file import check_device, load_model

    dev = check_device(device)
    # loaded on the CPU, then moved: e3nn's TorchScript parts load there whatever map_location says
    model = select_head(load_model(model_path, trust=trust_model, map_location="cpu"), head, model_path)[1].to(dev)
    _warn_nonfinite(model, model_path)
    keys = {"energy_key": energy_key, "forces_key": forces_key, "stress_key": stress_key, "virials_key": virials_key}
    structures = [a for a in read_structures(structures_path, **keys) if a.info.get("labelled", True)]
    if not structures:
        raise ValueError(f"{structures_path}: no labelled structures to evaluate on")
    dtype = next(model.parameters()).dtype
    with default_dtype(dtype):
        z_table = AtomicNumberTable([int(z) for z in model.atomic_numbers])
        data = to_atomic_data(structures, cutoff=float(model.r_max), z_table=z_table, **keys)
        families = [str(a.info.get("config_type", "Default")) for a in structures]
        return evaluate(
            model,
            data,
            dev,
            batch_size=batch_size,
            families=families,
            compute_stress=any(stress_key in a.info for a in structures),
            compute_virials=any(virials_key in a.info for a in structures),
        )


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
    cols = _columns(result)
    head = "".join(f"<th>{h}</th>" for h in ("config_type", "graphs", *(f"{h}<br>{u}" for _, h, u in cols)))
    body = "".join(
        f"<tr{' class=wb-total' if name == 'all' else ''}><td>{html.escape(str(name))}</td>"
        f"<td>{html.escape(str(m['graphs']))}</td>"
        + "".join(f"<td>{_cell(m.get(k))}</td>" for k, _, _ in cols)
        + "</tr>"
        for name, m in rows
    )
    return (
        f"<table class='wb-family-errors' style='border-collapse:collapse;font-size:13px;text-align:right'>"
        f"<caption style='text-align:left;font-weight:600'>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"
    )


def _cell(value) -> str:
    """A metric as table text: a number to 0.1, none measured as a dash, anything else (from a
    hand-edited record) escaped."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.1f}"
    return "-" if value is None else html.escape(str(value))


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
                "s_mae_mev_a3": e.get("valid_s_mae_mev_a3"),
                "s_rmse_mev_a3": e.get("valid_s_rmse_mev_a3"),
                "stress_graphs": sum(f.get("stress_graphs", 0) for f in e["valid_families"].values()),
                "families": e["valid_families"],
                "epoch": e["epoch"],
            }
    return None
