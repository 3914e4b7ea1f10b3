r"""Parity of NequIP and Allegro models on the workbench kernels with their own path.

For a model :math:`f` and its accelerated copy :math:`g` (same weights), the worst relative
error over a quantity's elements,

.. math::

    \varepsilon = \frac{\max_i |g_i - f_i|}{\max_i |f_i|},

of the energy, the forces, the stress (periodic frames) and the gradient of a loss on all three
to every parameter: float64 against float64 (the kernels' contract: :math:`\le 10^{-10}`) and the
accelerated float32 model against the float64 one (:math:`\le 10^{-5}`).

``python -m workbench.bench.nequip_parity [--tiny]`` prints the report as JSON: what notebook
06 reads from the NequIP environment, whose e3nn cannot share the notebook's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence

import torch

from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["FLOAT32_TOL", "FLOAT64_TOL", "outputs", "parity", "parity_report", "rel"]

FLOAT64_TOL = 1e-10
FLOAT32_TOL = 1e-5


def outputs(model: torch.nn.Module, data: dict) -> dict[str, torch.Tensor]:
    """Energy, forces, stress (periodic frames only) and the gradient of
    :math:`E^2 + |F|^2 + |\\sigma|^2` (summed) to every trainable parameter (``grad:<name>``)."""
    out = model(dict(data))
    periodic = ~torch.isnan(out["stress"].reshape(out["stress"].shape[0], -1)).any(dim=1)
    stress = out["stress"][periodic]
    loss = (out["total_energy"] ** 2).sum() + (out["forces"] ** 2).sum() + (stress**2).sum()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    res = {"energy": out["total_energy"].detach(), "forces": out["forces"].detach(), "stress": stress.detach()}
    res.update({f"grad:{n}": g for (n, _), g in zip(named, grads) if g is not None})
    return res


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst relative error of ``a`` against the reference ``b`` (see the module docstring)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _worst(got: dict, ref: dict) -> dict[str, float]:
    """Per quantity (energy, forces, stress, and the worst over all parameter gradients)."""
    errs = {k: rel(got[k], ref[k]) for k in ref}
    worst = {k: v for k, v in errs.items() if not k.startswith("grad:")}
    worst["parameter gradients"] = max((v for k, v in errs.items() if k.startswith("grad:")), default=0.0)
    return worst


def parity(family: str, config: str, frames: Sequence) -> dict:
    """Float64 and float32 parity of ``family``'s ``config`` model (:func:`workbench.bench.nequip.build`)
    on one batch of ``frames``."""
    from workbench.bench.nequip import R_MAX, build
    from workbench.kernels import accelerate
    from workbench.kernels.nequip.graphs import atomic_data

    ref64 = build(family, config, "float64")
    data = atomic_data(frames, ref64.type_names, R_MAX)
    want = outputs(ref64, data)
    got64 = outputs(accelerate(copy.deepcopy(ref64), backend=DEFAULT_BACKEND), data)
    f32 = build(family, config, "float32")
    f32.load_state_dict(ref64.state_dict())  # the builder's seed gives other weights in another dtype
    got32 = outputs(accelerate(f32, backend=DEFAULT_BACKEND), data)
    row = {"family": family, "config": config, "atoms": int(data["pos"].shape[0]), "frames": len(frames)}
    row["float64"] = _worst(got64, want)
    row["float32_vs_float64"] = _worst(got32, want)
    row["ok"] = max(row["float64"].values()) <= FLOAT64_TOL and max(row["float32_vs_float64"].values()) <= FLOAT32_TOL
    return row


def _frames(tiny: bool) -> list:
    """A rattled periodic fcc Cu cell and a Cu cluster (no cell), as one two-frame batch."""
    import numpy as np
    from ase.cluster import Octahedron

    from workbench.bench.nequip import cu_cell

    cluster = Octahedron("Cu", 3 if tiny else 4)
    cluster.positions += np.random.default_rng(1).normal(0.0, 0.05, cluster.positions.shape)
    return [cu_cell(1 if tiny else 2), cluster]


def parity_report(families: Sequence[str] = ("nequip", "allegro"), tiny: bool = False) -> dict:
    """:func:`parity` of every family at its tutorial config, with the tolerances."""
    from workbench.bench.nequip import require_installed

    require_installed()
    rows = [parity(family, "tutorial", _frames(tiny)) for family in families]
    return {"tolerances": {"float64": FLOAT64_TOL, "float32_vs_float64": FLOAT32_TOL}, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.bench.nequip_parity", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="smaller frames (tests)")
    args = parser.parse_args(argv)
    json.dump(parity_report(tiny=args.tiny), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
