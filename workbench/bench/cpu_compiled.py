"""``workbench bench cpu --parts compiled``: ``torch.compile`` of the accelerated model against the
same model eager, on a CPU.

For each (model, system, dtype), one random ``ScaleShiftMACE`` on the numba kernels runs eagerly
and made ready by :func:`~workbench.kernels.compiling.compile_ready`, then compiled with
``fullgraph=True`` (``compiler``: ``inductor``, or ``aot_eager`` for a quick check). Two steps:

* ``md``: energy and forces with frozen parameters (the compiled call passes ``training=True``,
  which the traced forces need; the eager one runs mace's inference path);
* ``train``: an energy + force loss and its gradient to every parameter.

Each step's first compiled call is timed alone (``cold_s``: tracing and compiling), then eager
and compiled calls alternate and the median of ``repeats`` is kept. Each row gives the graph
breaks dynamo counts (``torch._dynamo.explain``) and its agreement with eager: the largest force
(and, for ``train``, parameter-gradient) difference relative to the largest eager value.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from workbench.bench.table import Column, render
from workbench.kernels.registry import DEFAULT_BACKEND

__all__ = ["COMPILERS", "compiled_case", "compiled_lines"]

COMPILERS = ("inductor", "aot_eager")


def _inputs(batch: dict) -> dict:
    d = {k: v.clone() for k, v in batch.items()}
    d["positions"].requires_grad_(True)  # dynamo does not see mace's own requires_grad_ on an input
    return d


def _md(model, training: bool) -> Callable[[dict], list]:
    def step(batch: dict) -> list:
        return [model(_inputs(batch), training=training, compute_force=True)["forces"].detach()]

    return step


def _train(model) -> Callable[[dict], list]:
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict) -> list:
        model.zero_grad(set_to_none=True)
        out = model(_inputs(batch), training=True, compute_force=True)
        (out["energy"].pow(2).mean() + out["forces"].pow(2).mean()).backward()
        return [out["forces"].detach(), *(p.grad.detach().clone() for p in params if p.grad is not None)]

    return step


def _rel(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) / max(float(x.abs().max()), 1e-300) for x, y in zip(a, b))


def _breaks(model, batch: dict) -> int:
    import torch

    def forces(d):
        return model(d, training=True, compute_force=True)["forces"]

    return int(torch._dynamo.explain(forces)(_inputs(batch)).graph_break_count)


def _row(eager: Callable, compiled: Callable, batch: dict, repeats: int) -> dict[str, Any]:
    want = eager(batch)
    t0 = time.perf_counter()
    got = compiled(batch)
    row: dict[str, Any] = {"cold_s": time.perf_counter() - t0, "rel_diff": _rel(want, got)}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for name, fn in (("eager", eager), ("compiled", compiled)):
            t = time.perf_counter()
            fn(batch)
            times[name].append(1e3 * (time.perf_counter() - t))
    row["eager_ms"], row["compiled_ms"] = (statistics.median(times[k]) for k in ("eager", "compiled"))
    row["compiled_over_eager"] = row["compiled_ms"] / row["eager_ms"]
    return row


def compiled_case(model: str, system: str, dtype: str, repeats: int, compiler: str = "inductor") -> dict[str, Any]:
    """The module docstring's two rows for ``model`` on ``system`` in ``dtype``."""
    import torch

    from workbench.bench.harness import with_backend
    from workbench.bench.workloads import MODELS, model_cutoff, system_batch
    from workbench.dtypes import default_dtype
    from workbench.kernels.compiling import compile_ready
    from workbench.kernels.tools.models import random_scaleshift_mace

    if compiler not in COMPILERS:
        raise ValueError(f"compiler {compiler!r}: choose one of {', '.join(COMPILERS)}")
    with default_dtype(dtype):
        batch, zs, info = system_batch(system, dtype, model=model)
        hidden, ell, corr = MODELS[model]
        neighbours = info["edges"] / max(info["atoms"], 1)
        base = random_scaleshift_mace(
            hidden, ell, corr, zs, neighbours, getattr(torch, dtype), "cpu", r_max=model_cutoff(model)
        )
        case: dict[str, Any] = {"model": model, "system": system, "dtype": dtype, "atoms": int(info["atoms"])}
        case["compiler"], case["rows"] = compiler, {}
        for step in ("md", "train"):
            eager = with_backend(base, DEFAULT_BACKEND)
            ready = copy.deepcopy(eager)
            compile_ready(ready, DEFAULT_BACKEND)
            if step == "md":
                for m in (eager, ready):
                    m.requires_grad_(False)
            compiled = torch.compile(ready, fullgraph=True, backend=compiler)
            fns = (_md(eager, False), _md(compiled, True)) if step == "md" else (_train(eager), _train(compiled))
            case["rows"][step] = {"graph_breaks": _breaks(ready, batch), **_row(*fns, batch, repeats)}
            torch._dynamo.reset()  # the next step compiles anew, and no cache outlives the case
    return case


def compiled_lines(cases: list[dict]) -> list[str]:
    """The ``compiled`` part as text: per case and step, eager and compiled medians, their
    ratio, the graph breaks, the agreement and the compile time."""
    rows = [
        {**{k: c[k] for k in ("model", "system", "dtype", "atoms", "compiler")}, "step": step, **r}
        for c in cases
        for step, r in c["rows"].items()
    ]
    from workbench.bench.cpu_md import case_columns

    columns = [
        *case_columns(),
        Column("compiler", "compiler", width=9, align="<"),
        Column("step", "step", width=5, align="<"),
        Column("eager ms", "eager_ms", ".1f", 9),
        Column("compiled ms", "compiled_ms", ".1f", 11),
        Column("c / e", "compiled_over_eager", ".2f", 5),
        Column("breaks", "graph_breaks", "d", 6),
        Column("vs eager", "rel_diff", ".1e", 8),
        Column("cold s", "cold_s", ".1f", 6),
    ]
    title = "\ntorch.compile of the accelerated model (numba kernels) against eager, interleaved medians"
    return [render(rows, columns, title=title, rule=False)]
