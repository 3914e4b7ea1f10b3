r"""The loss terms of :mod:`workbench.train.losses`, on a mace batch (``ref``) and the model's
output (``pred``). Definitions as in mace-torch's ``mace/modules/loss.py`` (v0.3.16), written here.

For graphs :math:`g` of :math:`N_g` atoms with per-graph weights :math:`w_g` (``config_weight``)
and per-label weights :math:`w^E_g, w^F_g, w^\sigma_g, w^W_g` (0 where the label is missing):

.. math::

    L_E = \langle w_g w^E_g ((E_g - \hat E_g)/N_g)^2 \rangle_g, \quad
    L_F = \langle w_g w^F_g (F_{ia} - \hat F_{ia})^2 \rangle_{i,a}, \quad
    L_\sigma = \langle w_g w^\sigma_g (\sigma_{g,ab} - \hat\sigma_{g,ab})^2 \rangle_{g,a,b}, \quad
    L_W = \langle w_g w^W_g ((W_{g,ab} - \hat W_{g,ab})/N_g)^2 \rangle_{g,a,b}

(means over every graph, atom or component of the batch, masked ones included, as mace takes
them; a fixed-shape batch's ghost graphs and atoms, :mod:`workbench.train.padding`, are left
out of both the sums and the counts), and a loss is :math:`\lambda_E L_E + \lambda_F L_F + \lambda_\sigma L_\sigma` with the
config's ``energy_weight``, ``forces_weight``, ``stress_weight`` (``virials_weight``). The Huber
losses replace each square by :math:`h_\delta` (``huber_delta``); ``universal`` scales each
force's :math:`\delta` by 1, 0.7, 0.4 or 0.1 for reference forces below 100, 200, 300 eV/Å and
above (MACE-MP's recipe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: reference force magnitudes (eV/Å) at which universal's Huber threshold steps down, and the factors
FORCE_STEPS = (100.0, 200.0, 300.0)
FORCE_FACTORS = (1.0, 0.7, 0.4, 0.1)


def atoms_per_graph(ref) -> torch.Tensor:
    """Atoms of each graph; at least 1, so that a padded batch's empty ghost graphs divide by 1."""
    return (ref.ptr[1:] - ref.ptr[:-1]).clamp(min=1)


def real_rows(ref, per: str) -> torch.Tensor | None:
    """A padded batch's mask of real graphs (``per="graph"``) or atoms (``"atom"``), True where
    real; None for a batch without ghosts. Built on the device, without a host sync."""
    real = getattr(ref, "real_graphs", None)
    if real is None:
        return None
    rows = torch.arange(ref.ptr.numel() - 1 if per == "graph" else ref.batch.numel(), device=ref.ptr.device)
    # a 0-d index would be read on the host: index with a 1-element tensor
    return rows < (real if per == "graph" else ref.ptr.index_select(0, real.view(1)))


def masked_mean(values: torch.Tensor, ref, per: str) -> torch.Tensor:
    """The mean of ``values`` (a row per graph or per atom: ``per``) over a batch's real rows."""
    mask = real_rows(ref, per)
    if mask is None:
        return values.mean()
    mask = mask.view(-1, *(1,) * (values.dim() - 1))
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() / (mask.sum() * values[0].numel()).to(values.dtype)


def per_atom(values: torch.Tensor, ref) -> torch.Tensor:
    """A per-graph quantity repeated for each of the graph's atoms, as a column ``[atoms, 1]``."""
    return values[ref.batch].unsqueeze(-1)  # a gather: no host sync for the output's size


def energy_mse(ref, pred) -> torch.Tensor:
    err = ref.weight * ref.energy_weight * torch.square((ref["energy"] - pred["energy"]) / atoms_per_graph(ref))
    return masked_mean(err, ref, "graph")


def forces_mse(ref, pred) -> torch.Tensor:
    w = per_atom(ref.weight, ref) * per_atom(ref.forces_weight, ref)
    return masked_mean(w * torch.square(ref["forces"] - pred["forces"]), ref, "atom")


def stress_mse(ref, pred) -> torch.Tensor:
    w = ref.weight.view(-1, 1, 1) * ref.stress_weight.view(-1, 1, 1)
    return masked_mean(w * torch.square(ref["stress"] - pred["stress"]), ref, "graph")


def virials_mse(ref, pred) -> torch.Tensor:
    w = ref.weight.view(-1, 1, 1) * ref.virials_weight.view(-1, 1, 1)
    n = atoms_per_graph(ref).view(-1, 1, 1)
    return masked_mean(w * torch.square((ref["virials"] - pred["virials"]) / n), ref, "graph")


class _Weighted(torch.nn.Module):
    """The weights of the terms, kept as buffers in the default dtype (as mace keeps them)."""

    def __init__(
        self,
        energy_weight: float = 1.0,
        forces_weight: float = 1.0,
        stress_weight: float = 0.0,
        virials_weight: float = 0.0,
        huber_delta: float = 0.01,
    ) -> None:
        super().__init__()
        for name, value in (
            ("energy_weight", energy_weight),
            ("forces_weight", forces_weight),
            ("stress_weight", stress_weight),
            ("virials_weight", virials_weight),
        ):
            self.register_buffer(name, torch.tensor(value, dtype=torch.get_default_dtype()))
        self.huber_delta = float(huber_delta)
        self.trains_stress = stress_weight > 0  # decided here, not per step: no host sync in the step

    def extra_repr(self) -> str:
        names = ("energy_weight", "forces_weight", "stress_weight", "virials_weight")
        return ", ".join(f"{n}={float(getattr(self, n)):.3g}" for n in names) + f", huber_delta={self.huber_delta:g}"


class EnergyForcesLoss(_Weighted):
    def forward(self, ref, pred, ddp: bool | None = None) -> torch.Tensor:
        return self.energy_weight * energy_mse(ref, pred) + self.forces_weight * forces_mse(ref, pred)


class EnergyForcesStressLoss(_Weighted):
    def forward(self, ref, pred, ddp: bool | None = None) -> torch.Tensor:
        loss = self.energy_weight * energy_mse(ref, pred) + self.forces_weight * forces_mse(ref, pred)
        return loss + self.stress_weight * stress_mse(ref, pred)


class EnergyForcesVirialsLoss(_Weighted):
    def forward(self, ref, pred, ddp: bool | None = None) -> torch.Tensor:
        loss = self.energy_weight * energy_mse(ref, pred) + self.forces_weight * forces_mse(ref, pred)
        return loss + self.virials_weight * virials_mse(ref, pred)


class HuberLoss(_Weighted):
    """Huber errors, unweighted per graph as in mace, except that graphs without a stress label
    are masked out of the stress term (the module docstring of :mod:`workbench.train.losses`)."""

    def forward(self, ref, pred, ddp: bool | None = None) -> torch.Tensor:
        n, d = atoms_per_graph(ref), self.huber_delta
        h_e = F.huber_loss(ref["energy"] / n, pred["energy"] / n, reduction="none", delta=d)
        h_f = F.huber_loss(ref["forces"], pred["forces"], reduction="none", delta=d)
        loss = self.energy_weight * masked_mean(h_e, ref, "graph") + self.forces_weight * masked_mean(h_f, ref, "atom")
        if self.trains_stress:  # else the model computes no stress (losses.outputs_needed)
            mask = (ref.stress_weight > 0).to(pred["stress"].dtype).view(-1, 1, 1)
            h = F.huber_loss(ref["stress"], pred["stress"], reduction="none", delta=d)
            loss = loss + self.stress_weight * masked_mean(mask * h, ref, "graph")
        return loss


def conditional_huber_forces(
    ref_f: torch.Tensor, pred_f: torch.Tensor, delta: float, steps: torch.Tensor, factors: torch.Tensor
) -> torch.Tensor:
    """Per component Huber (``[atoms, 3]``), its threshold ``delta`` times the factor (``factors``,
    one more than ``steps``) of the band of reference force sizes that ``steps`` cut; elementwise,
    so no mask sizes anything, and the constants are the caller's device tensors (a CUDA graph
    can copy nothing from the host)."""
    size = torch.linalg.vector_norm(ref_f, dim=-1)
    band = torch.bucketize(size, steps.to(size.dtype), right=True)
    d = (delta * factors.to(ref_f.dtype)[band]).unsqueeze(-1)  # a gather: [atoms, 1]
    err = (ref_f - pred_f).abs()
    return torch.where(err < d, 0.5 * err * err, d * (err - 0.5 * d))


class UniversalLoss(_Weighted):
    """Huber errors of the weighted labels, with the force-size factors (MACE-MP's loss)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # buffers: they move with the loss to its device once, not in every step
        self.register_buffer("force_steps", torch.tensor(FORCE_STEPS, dtype=torch.float64), persistent=False)
        self.register_buffer("force_factors", torch.tensor(FORCE_FACTORS, dtype=torch.float64), persistent=False)

    def forward(self, ref, pred, ddp: bool | None = None) -> torch.Tensor:
        n, d = atoms_per_graph(ref), self.huber_delta
        we, wf = ref.energy_weight, per_atom(ref.forces_weight, ref)
        h_e = F.huber_loss(we * ref["energy"] / n, we * pred["energy"] / n, reduction="none", delta=d)
        h_f = conditional_huber_forces(wf * ref["forces"], wf * pred["forces"], d, self.force_steps, self.force_factors)
        loss = self.energy_weight * masked_mean(h_e, ref, "graph") + self.forces_weight * masked_mean(h_f, ref, "atom")
        if self.trains_stress:  # else the model computes no stress (losses.outputs_needed)
            ws = ref.stress_weight.view(-1, 1, 1)
            h_s = F.huber_loss(ws * ref["stress"], ws * pred["stress"], reduction="none", delta=d)
            loss = loss + self.stress_weight * masked_mean(h_s, ref, "graph")
        return loss
