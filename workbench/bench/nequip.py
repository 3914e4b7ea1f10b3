"""``workbench bench nequip``: NequIP and Allegro on the workbench kernels against their own
e3nn/einsum path, on the CPU or a GPU (run it in the NequIP environment, ``.venv-nequip``).

Per family (``nequip``, ``allegro``), config (``tutorial``: the model of nequip's own minimal
test config, and Allegro's defaults; ``large``: wider and higher ``l_max``) and dtype, an MD
step (energy and forces, ``eval()``) and a train step (energy + force loss, its gradient to every
parameter: forces differentiate twice) on a periodic fcc Cu cell, each timed for the family's
own modules and the accelerated copy with the same weights, interleaved, median of ``repeats``.
Each timed step comes right after ``settle`` untimed steps of the same model (default 1), as in
an MD run or a training loop: a step right after another model's pays for that model's caches
and allocator state (measured: ours after nequip's own MD step 14.6 ms, after its own 12.6 ms).
The table gives the speedups against the targets (NequIP 3x, Allegro 2x at the tutorial config
in float32) and, as "bound", the speedup with the replaced ops costing nothing (:func:`free_ops`):
what the rest of the model leaves to gain. On a GPU (``device="cuda"``) the families' own kernel
modifiers join as ``cueq`` (cuEquivariance: NequIP's ``enable_CuEquivariance``, Allegro's
``enable_CuEquivarianceContracter``) and ``oeq`` (OpenEquivariance, NequIP only), and the table
gives their times over ours. ``hot`` (asked for with ``--backends``, on any device) is ours with
the hot op alone, without the companion swaps (the radial basis, SiLU, e3nn's linears): its
time over ours is what the companions give. ``aoti`` (asked for, CPU, MD only) is the family's
own model compiled as ``nequip-compile --mode aotinductor --target ase`` compiles it for MD
(:mod:`~workbench.bench.nequip_compiled`): what a NequIP user runs instead of the eager modules. A backend step that cannot run here (not installed, no such modifier
for the family, a modifier that replaces nothing, one asked for off a GPU, a failing first step)
is recorded as skipped with the reason. The JSON is rewritten after every case.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.bench.nequip_compiled import AOTI, aoti_model
from workbench.bench.table import Column, cpu_name, render, run_versions, verdict, write_json
from workbench.kernels.registry import BACKENDS, DEFAULT_BACKEND, backend_names, contenders

FAMILIES = ("nequip", "allegro")
CONFIGS = ("tutorial", "large")
BUILDERS = {"nequip": "nequip.model.NequIPGNNModel", "allegro": "allegro.model.AllegroModel"}
#: model hyperparameters per family and config (nequip: minimal_toy_emt.yaml's model; allegro: its defaults)
MODELS: dict[tuple[str, str], dict[str, Any]] = {
    ("nequip", "tutorial"): {"l_max": 1, "num_layers": 3, "num_features": 16, "radial_mlp_width": 8},
    ("nequip", "large"): {"l_max": 2, "num_layers": 4, "num_features": 32, "radial_mlp_width": 64},
    ("allegro", "tutorial"): {"l_max": 2, "num_layers": 2, "num_scalar_features": 64, "num_tensor_features": 16},
    ("allegro", "large"): {"l_max": 3, "num_layers": 2, "num_scalar_features": 64, "num_tensor_features": 32},
}
#: rows that are no registered backend: the family's own modules, theirs with the replaced ops
#: costing nothing (:func:`free_ops`), ours with the hot op alone (:func:`hot_op_only`)
NATIVE, FREE, HOT = "native", "free", "hot"
#: the family's own modifier per GPU backend (a pair not here: the family has none)
MODIFIERS = {
    ("nequip", "cueq"): "enable_CuEquivariance",
    ("nequip", "oeq"): "enable_OpenEquivariance",
    ("allegro", "cueq"): "enable_CuEquivarianceContracter",
}
#: the rows every case needs: the reference, ours and the bound
REQUIRED = (NATIVE, DEFAULT_BACKEND, FREE)


def backends() -> tuple[str, ...]:
    """Every row, in table order: the family's own modules, each descriptor backend the registry
    counts as a contender (ours first), the bound, our hot op alone, the family's AOTInductor
    build, and every converter backend
    (a family's own GPU modifier for it: :data:`MODIFIERS`)."""
    ours = [n for n in contenders() if BACKENDS[n].kind == "descriptor"]
    return (NATIVE, *ours, FREE, HOT, AOTI, *backend_names("convert"))


def over_ours() -> tuple[str, ...]:
    """The rows the table shows as their time over ours (above 1: ours is faster)."""
    return tuple(b for b in backends() if b not in (NATIVE, DEFAULT_BACKEND, FREE))


TARGETS = {"nequip": 3.0, "allegro": 2.0}  # tutorial config, float32, MD and train
#: where the ``aoti`` row's compiled models are written
_AOTI_DIR = Path("runs/bench/nequip-aoti")
R_MAX = 5.0


def installed() -> bool:
    """Whether nequip and nequip-allegro import in this environment."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("nequip", "allegro"))


def require_installed() -> None:
    """A ValueError (one line on the command line) when this environment lacks nequip or allegro."""
    import sys

    if not installed():
        raise ValueError(
            f"nequip and nequip-allegro are not installed in this environment ({sys.executable}); run this in the "
            "NequIP environment (.venv-nequip, made by make test-nequip) or pip install 'cfm-workbench[nequip]'"
        )


def build(family: str, config: str, dtype: str) -> Any:
    """The family's model through its own builder (seeded: the same weights on every call with the same dtype)."""
    from hydra.utils import get_method
    from nequip.utils.global_state import set_global_state

    set_global_state()
    args = {"seed": 1, "model_dtype": dtype, "r_max": R_MAX, "type_names": ["Cu"], "avg_num_neighbors": 40.0}
    args.update(per_type_energy_scales=0.5, per_type_energy_shifts=-3.0, **MODELS[(family, config)])
    if family == "allegro":
        args["radial_chemical_embed"] = {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 8}
    return get_method(BUILDERS[family])(**args)


def cu_cell(repeat: int, seed: int = 0):
    """A rattled fcc Cu cell of ``4 * repeat**3`` atoms."""
    import numpy as np
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat)
    atoms.positions += np.random.default_rng(seed).normal(0.0, 0.05, atoms.positions.shape)
    return atoms


def md_step(model, data: dict):
    return model({k: v.clone() for k, v in data.items()})["forces"]


def train_step(model, data: dict):
    model.zero_grad(set_to_none=True)
    out = model({k: v.clone() for k, v in data.items()})
    loss = out["total_energy"].pow(2).mean() + out["forces"].pow(2).mean()
    loss.backward()
    return loss


#: the timed steps, in table order
STEPS = {"md": md_step, "train": train_step}


def _zero_message(self, x, edge_attr, edge_weight, edge_dst, edge_src):
    return x.new_zeros(x.shape[0], self.tp.irreps_out.dim) + 0.0 * (x.sum() + edge_attr.sum() + edge_weight.sum())


def _zero_contraction(self, x1, x2, idxs):
    return x1.new_zeros(x1.shape[0], self.mul, self.base_dim_out) + 0.0 * (x1.sum() + x2.sum() + self.weights.sum())


def free_ops(model: Any, family: str) -> Any:
    """``model`` (in place) with the ops the kernels replace costing next to nothing: NequIP's
    ``TensorProductScatter`` and Allegro's contraction return zeros (still wired to their inputs,
    so every other op's forward and backward runs), and the rest as :func:`accelerate` leaves it
    (its companion swaps: the radial basis, the MLPs' SiLU). Its step time is what no faster
    hot-op kernel can remove: ``native / free`` bounds the speedup such kernels can give."""
    name, fn = ("forward", _zero_message) if family == "nequip" else ("_contract_conv", _zero_contraction)
    swap = _family_swap(family)
    swap.swap_companions(model, DEFAULT_BACKEND)
    for m in model.modules():
        if swap.is_native(m):
            setattr(m, name, fn.__get__(m))
    return model


def hot_op_only(model: Any, family: str) -> Any:
    """``model`` (in place) accelerated without the companion swaps: the hot op alone."""
    from workbench.kernels import accelerate

    accelerate(model, backend=DEFAULT_BACKEND)
    _family_swap(family).unswap_companions(model)
    return model


def _family_swap(family: str):
    if family == "nequip":
        from workbench.kernels.nequip.tp_scatter import SWAP
    else:
        from workbench.kernels.allegro.contracter import SWAP
    return SWAP


def default_backends(device: str) -> tuple[str, ...]:
    """Every row but ``hot`` and ``aoti`` (minutes of C++ build) on a GPU; the three required
    ones on a CPU."""
    return tuple(b for b in backends() if b not in (HOT, AOTI)) if device.startswith("cuda") else REQUIRED


def check_backends(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` in table order, or a ValueError naming the unknown ones and the choices."""
    known = backends()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return tuple(b for b in known if b in names or b in REQUIRED)


def variant(native: Any, family: str, backend: str, device: str = "cpu") -> Any:
    """A copy of ``native`` on ``backend`` (``native`` itself for ``"native"``). A LookupError when
    the family has no such modifier, when a GPU modifier is asked for off a GPU, or when the
    modifier leaves the model as it was (Allegro's keeps a single-path contraction); the
    modifier's own error when it cannot run here."""
    if backend == NATIVE:
        return native
    if backend in BACKENDS and BACKENDS[backend].kind == "descriptor":
        from workbench.kernels import accelerate

        return accelerate(copy.deepcopy(native), backend=backend)
    if backend == FREE:
        return free_ops(copy.deepcopy(native), family)
    if backend == HOT:
        return hot_op_only(copy.deepcopy(native), family)
    name = MODIFIERS.get((family, backend))
    if name is None:
        raise LookupError(f"{family} has no {backend} modifier")
    if not device.startswith("cuda"):  # theirs fall back to their own path off a GPU: not a row
        raise LookupError(f"{name} needs a CUDA device")
    from nequip.model.modify_utils import modify

    before = [type(m) for m in native.modules()]
    model = modify(copy.deepcopy(native), [{"modifier": name}])
    if [type(m) for m in model.modules()] == before:
        raise LookupError(f"{name} replaced no module of this model")
    return model


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _models(family: str, config: str, dtype: str, backends: Sequence[str], device: str, data: dict) -> tuple:
    """``({(backend, step): model}, {"<backend>_<step>": why skipped})``: each model on ``device``,
    run once per step (a backend whose build or first step fails is skipped for that step, unless
    it is a required one)."""
    native = build(family, config, dtype)
    models, skipped = {}, {}
    for backend in backends:
        try:
            if backend == AOTI:
                base = aoti_model(native, data, _AOTI_DIR / f"{family}-{config}-{dtype}.nequip.pt2", device)
            else:
                base = variant(native, family, backend, device).to(device)
        except Exception as exc:
            if backend in REQUIRED:
                raise
            skipped.update({f"{backend}_{step}": _reason(exc) for step in STEPS})
            continue
        for step in STEPS:
            if backend == AOTI and step == "train":
                skipped[f"{AOTI}_train"] = "inference only: a compiled model has no parameters to train"
                continue
            try:
                model = base.eval() if step == "md" else copy.deepcopy(base).train()
                _timed(STEPS[step], model, data, device)  # synchronised: a CUDA error is charged here
                models[(backend, step)] = model
            except Exception as exc:
                if backend in REQUIRED:
                    raise
                skipped[f"{backend}_{step}"] = _reason(exc)
    return models, skipped


def _timed(fn, model, data: dict, device: str) -> float:
    from workbench.bench.step_model import sync

    sync(device)
    t = time.perf_counter()
    fn(model, data)
    sync(device)
    return time.perf_counter() - t


def _time(
    family: str, config: str, dtype: str, data: dict, repeats: int, backends=REQUIRED, device="cpu", settle: int = 1
) -> dict:
    models, skipped = _models(family, config, dtype, backends, device, data)
    times: dict[str, list[float]] = {}
    for _ in range(repeats + 1):  # the first round warms up: caches fill, clocks settle
        for step, fn in STEPS.items():
            for backend in backends:
                if (backend, step) in models:
                    for _ in range(settle):  # the same model's steps before the timed one
                        _timed(fn, models[(backend, step)], data, device)
                    times.setdefault(f"{backend}_{step}", []).append(_timed(fn, models[(backend, step)], data, device))
    res: dict[str, Any] = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    for step in STEPS:
        res[f"speedup_{step}"] = res[f"native_{step}"] / res[f"{DEFAULT_BACKEND}_{step}"]
        res[f"bound_{step}"] = res[f"native_{step}"] / res[f"free_{step}"]
        for other in over_ours():
            if f"{other}_{step}" in res:  # theirs over ours: above 1, ours is faster
                res[f"{other}_over_{DEFAULT_BACKEND}_{step}"] = (
                    res[f"{other}_{step}"] / res[f"{DEFAULT_BACKEND}_{step}"]
                )
    if skipped:
        res["skipped"] = skipped
    return res


def check_device(device: str) -> str:
    """``device`` when it is ``cpu`` or an available ``cuda[:N]``; else a ValueError naming --device."""
    import re

    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"--device: {device!r} is not cpu, cuda or cuda:N")
    import torch

    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ValueError(f"--device: {device} is not available here ({torch.cuda.device_count()} CUDA devices)")
    return device


def bench_nequip(
    families: Sequence[str] = FAMILIES,
    configs: Sequence[str] = CONFIGS,
    dtypes: Sequence[str] = ("float32", "float64"),
    repeat: int = 4,
    repeats: int = 5,
    threads: int = 2,
    out: str | Path = "runs/bench/nequip.json",
    device: str = "cpu",
    backends: Sequence[str] | None = None,
    settle: int = 1,
) -> dict:
    """Time every (family, config, dtype) case on ``device`` (``backends``: default
    :func:`default_backends`), each timed step after ``settle`` untimed ones of the same model;
    returns the result the JSON holds."""
    require_installed()
    if settle < 0:
        raise ValueError(f"--settle: {settle} is negative; give 0 or more untimed steps")
    from workbench.bench.harness import set_threads
    from workbench.kernels.nequip.graphs import atomic_data

    device = check_device(device)
    backends = check_backends(default_backends(device) if backends is None else backends)
    set_threads(threads)
    atoms = cu_cell(repeat)
    res: dict[str, Any] = {"machine": _machine(device, threads), "versions": run_versions()}
    res.update(atoms=len(atoms), r_max=R_MAX, repeats=repeats, settle=settle, backends=list(backends), cases=[])
    data = atomic_data([atoms], ["Cu"], R_MAX)
    res["edges"] = int(data["edge_index"].shape[1])
    data = {k: v.to(device) for k, v in data.items()}
    for family in families:
        for config in configs:
            for dtype in dtypes:
                case = {"family": family, "config": config, "dtype": dtype, **MODELS[(family, config)]}
                case.update(_time(family, config, dtype, data, repeats, backends, device, settle))
                res["cases"].append(case)
                write_json(out, res)
    return res


def _machine(device: str, threads: int) -> dict:
    import torch

    machine: dict[str, Any] = {"cpu": cpu_name(), "threads": threads, "device": device}
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return machine


def _met(case: dict) -> str | None:
    if case["config"] != "tutorial" or case["dtype"] != "float32":
        return None
    target = TARGETS[case["family"]]
    return verdict(min(case["speedup_md"], case["speedup_train"]) >= target) + f" ({target:g}x)"


def _theirs(backend: str, step: str):
    """A column's value: ``backend``'s time over ours (a family modifier's, or our hot op alone),
    or why it was skipped."""

    def value(case: dict):
        skipped = case.get("skipped", {}).get(f"{backend}_{step}")
        return "skipped" if skipped else case.get(f"{backend}_over_{DEFAULT_BACKEND}_{step}")

    return value


def format_table(res: dict) -> str:
    """The cases as a table; on a GPU with the family modifiers' times over ours (above 1: ours is
    faster) and, below it, why a backend was skipped."""
    ms = ".1f"
    on_gpu = res["machine"].get("device", "cpu").startswith("cuda")
    theirs = [b for b in over_ours() if b in res.get("backends", ())]
    columns = [Column("family", "family", align="<"), Column("config", "config", align="<")]
    columns.append(Column("dtype", "dtype", align="<"))
    for step, name in (("md", "MD"), ("train", "train")):
        columns += [
            Column(f"{name} own ms", f"native_{step}", ms),
            Column(f"{name} {DEFAULT_BACKEND} ms", f"{DEFAULT_BACKEND}_{step}", ms),
        ]
        columns += [Column(f"{name} x", f"speedup_{step}", ".2f"), Column(f"{name} bound x", f"bound_{step}", ".2f")]
        columns += [Column(f"{name} {b}/{DEFAULT_BACKEND}", _theirs(b, step), ".2f") for b in theirs]
    if not on_gpu:  # the targets are the CPU's
        columns.append(Column("target", _met, align="<"))
    where = f"{res['machine']['gpu']} ({res['machine']['device']})" if on_gpu else res["machine"]["cpu"]
    title = (
        f"NequIP / Allegro on {where}, {res['machine']['threads']} threads: fcc Cu, "
        f"{res['atoms']} atoms, {res['edges']} edges at {res['r_max']} A (median of {res['repeats']}, interleaved, "
        f"{res.get('settle', 0)} settle step(s) before each)"
    )
    notes = [
        f"  {c['family']} {c['config']} {c['dtype']}: {b.replace('_', ' ')} skipped ({why})"
        for c in res["cases"]
        for b, why in c.get("skipped", {}).items()
    ]
    return "\n".join([render(res["cases"], columns, title=title), *notes])
