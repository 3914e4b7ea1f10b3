r"""e3nn's ``nn.Gate`` as column gathers and one product, in place.

A gate splits its input into scalars :math:`x_s`, gates :math:`x_g` and gated irreps
:math:`y_j` and returns

.. math::

    \phi_s(x_s) \oplus \bigoplus_j \phi_g(x_g)_{k(j)}\, y_j

with ``[N, dim_in] -> [N, dim_out]``. e3nn cuts the input with a generated ``Extract`` and
multiplies with an ``ElementwiseTensorProduct``, several calls each; at a few hundred atoms
those calls are the gate. Here the cut is slices (or one ``index_select``) and the product is
``y * phi_g(x_g)[:, k]`` over every gated column at once. The column maps (which input column
each output reads, which gate scales it, with what factor) are read off e3nn's own modules by
probing them with exact integer and one-hot inputs (:func:`gate_plan`), so they follow e3nn's
ordering in every version; a gate whose product is not of that form is refused and stays
e3nn's. The activations are e3nn's own ``Activation`` modules, called as e3nn calls them.

:data:`SWAP` turns ``e3nn.nn.Gate`` modules into :class:`WorkbenchGate` (a companion of a
family's hot-op swap); it has no parameters or buffers, so the state dict is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.kernels.class_swap import ClassSwap, KeepsOp, probe_copy
from workbench.kernels.e3nn.linear import column_index, take_columns

__all__ = ["SWAP", "GatePlan", "WorkbenchGate", "apply_gate", "gate_plan"]  # noqa: F822 (module __getattr__)


@dataclass(frozen=True)
class GatePlan:
    """Input columns of the ``scalars`` and ``gates`` (slices) and of each gated output column
    (``gated``, a slice when contiguous), the gate column that scales each (``gate_of``) and its
    factor (``coef``, ``None`` when all are 1)."""

    scalars: slice | torch.Tensor
    gates: slice | torch.Tensor
    gated: slice | torch.Tensor
    gate_of: torch.Tensor
    coef: torch.Tensor | None


def _columns(gate: torch.nn.Module) -> tuple[list[int], list[int], list[int]]:
    """The input columns e3nn's cut sends to scalars, gates and gated (probed with their numbers;
    ``gate`` in float64)."""
    probe = torch.arange(gate.irreps_in.dim, dtype=torch.float64)[None]
    return tuple([round(v) for v in part[0].tolist()] for part in gate.sc(probe))


def _product_map(gate: torch.nn.Module, n_gates: int, n_gated: int) -> tuple[list[int], list[int], list[float]]:
    """For each output column of e3nn's product: the gated column it reads, the gate that scales
    it and the factor; a ValueError when the product is not one gate times one column (``gate``
    in float64)."""
    one = torch.ones((), dtype=torch.float64)
    by_gate = gate.mul(one.expand(n_gates, n_gated), torch.eye(n_gates, dtype=torch.float64))
    by_column = gate.mul(torch.eye(n_gated, dtype=torch.float64), one.expand(n_gated, n_gates))
    source, gate_of, coef = [], [], []
    for c in range(by_column.shape[1]):
        rows, gates = by_column[:, c].nonzero().flatten(), by_gate[:, c].nonzero().flatten()
        if len(rows) != 1 or len(gates) != 1:
            raise ValueError(f"output column {c} of the gate's product is not one gate times one column")
        source.append(int(rows[0]))
        gate_of.append(int(gates[0]))
        coef.append(float(by_column[rows[0], c]))
    return source, gate_of, coef


def gate_plan(gate: torch.nn.Module, device: torch.device, probe: torch.nn.Module | None = None) -> GatePlan:
    """The :class:`GatePlan` of e3nn ``nn.Gate`` ``gate``, its index tensors on ``device``
    (``probe``: its :func:`~workbench.kernels.class_swap.probe_copy`, made here if not given;
    only run, never changed)."""
    probe = probe_copy(gate) if probe is None else probe
    scalars, gates, gated = _columns(probe)
    source, gate_of, coef = _product_map(probe, len(gates), len(gated)) if gates else ([], [], [])
    return GatePlan(
        column_index(scalars, device),
        column_index(gates, device),
        column_index([gated[s] for s in source], device),
        torch.tensor(gate_of, dtype=torch.long, device=device),
        None if all(c == 1.0 for c in coef) else torch.tensor(coef, dtype=torch.float64, device=device),
    )


def apply_gate(plan: GatePlan, gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[N, dim_out]``: the gate of ``plan`` (activations ``gate.act_scalars``, ``gate.act_gates``) on ``x`` ``[N, dim_in]``."""
    scalars = gate.act_scalars(take_columns(x, plan.scalars))
    if not len(plan.gate_of):
        return scalars
    gated = take_columns(x, plan.gated) * gate.act_gates(take_columns(x, plan.gates)).index_select(1, plan.gate_of)
    if plan.coef is not None:
        gated = gated * plan.coef.to(x.dtype)
    return torch.cat([scalars, gated], 1)


def _check(m: torch.nn.Module) -> None:
    """A ValueError for the gates this form does not cover (they stay e3nn's)."""
    probe = probe_copy(m)
    plan = gate_plan(m, torch.device("cpu"), probe)
    x = torch.randn(3, m.irreps_in.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    theirs = SWAP.native().forward(probe, x)  # e3nn's forward, whichever class ``m`` has now
    if not torch.allclose(apply_gate(plan, probe, x), theirs, rtol=1e-12, atol=1e-12):
        raise ValueError("the gate's columns do not reproduce e3nn's on a probe")


def _make_class() -> type:
    class WorkbenchGate(KeepsOp, SWAP.native()):
        """e3nn's ``nn.Gate`` as column gathers and one product (module docstring)."""

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            x = features.reshape(-1, self.irreps_in.dim)
            out = apply_gate(self.plan(features.device), self, x)
            return out.reshape(*features.shape[:-1], out.shape[-1])

        def plan(self, device: torch.device) -> GatePlan:
            return self.cached_op(lambda: gate_plan(self, device), lambda plan: plan.gate_of.device == device)

    return WorkbenchGate


SWAP = ClassSwap.companion("e3nn_gate", "e3nn.nn.Gate", globals(), _make_class, _check)
__getattr__ = SWAP.ours.module_getattr
