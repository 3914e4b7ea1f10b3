r"""Unrolled numba-CUDA kernels generated per term table (paper §4.2: CG-sparse, unrolled, fused).

The table-driven kernels (:mod:`~workbench.kernels.backends.cuda`, :mod:`~workbench.kernels.backends.edge_cuda`)
walk the term table at run time and keep operand components in shared memory, so every term
costs ~3 dependent shared loads. Here the table is turned into straight-line source instead:

.. code-block:: python

    v0 = x0[b, 0 + c * 16]                # each used operand component: one load, a register
    v1 = x0[b, 1 + c * 16]
    ...
    if go:                                # always true: keeps numba's compile time linear
        p0_0 = v0 * v1 * v17 * 0.2041241452 + v0 * v2 * v18 * -0.35355339 + ...   # <= 16 terms
    ...
    out[b, 0 + c * 1] = p0_0 + p0_1 + ...  # written once per output component

so slot values, partial products and accumulators live in registers, offsets and CG
coefficients are immediates, and the compiler can share common factor prefixes between the
terms of one output (factors are written before the coefficient for that reason). Three
kernel shapes mirror the table-driven ones:

* ``atom``: thread per (atom, channel); species operands are read at the atom's species row,
  a species output (weight gradient) is summed with ``cuda.atomic.add``;
* ``node``: thread per (node, channel) walking the node's CSR segment of edges, accumulators
  kept in registers over the whole segment; one store per component, no atomics;
* ``edge``: thread per (edge, channel), or for a channel-summed output (the gradient of the
  spherical harmonics) ``G`` threads per edge, each summing a strided subset of channels and
  adding it with one ``cuda.atomic.add`` per component.

A generated kernel's compile time grows with its terms (numba types every operation: about
10 s per 1000 terms on one core), so :func:`use_unrolled` keeps the table-driven kernel above
``WORKBENCH_UNROLL_MAX_TERMS`` (default 2000: at the paper configuration the contraction's
forward and weight gradient and every channelwise-TP kernel are unrolled, the larger
input-gradient polynomials are not) or when ``WORKBENCH_CUDA_KERNELS=table``. Each generated
source (which encodes the whole table) is written to a module under :func:`source_dir` and
compiled with numba's on-disk cache, so it compiles once per machine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from workbench.kernels.backends.device import cudasim_enabled
from workbench.kernels.descriptor.tables import TermTable

__all__ = ["kernel_source", "get_unrolled_kernel", "use_unrolled", "DEFAULT_MAX_TERMS"]

DEFAULT_MAX_TERMS = 2000
#: no shared memory, so the block size only sets the granularity; ptxas picks the registers
THREADS_PER_BLOCK = 128
cuda = None  # numba.cuda, bound on first use (after NUMBA_ENABLE_CUDASIM is read)


def use_unrolled(num_terms: int) -> bool:
    """Whether to launch the generated kernel for a polynomial of ``num_terms`` terms."""
    mode = os.environ.get("WORKBENCH_CUDA_KERNELS", "auto")
    if mode not in ("auto", "table", "unrolled"):
        raise ValueError(f"WORKBENCH_CUDA_KERNELS must be auto, table or unrolled, got {mode!r}")
    if mode != "auto":
        return mode == "unrolled"
    return num_terms <= int(os.environ.get("WORKBENCH_UNROLL_MAX_TERMS", DEFAULT_MAX_TERMS))


def _index(off: int, cs: int) -> str:
    if cs == 0:
        return str(off)
    return f"{off} + c" if cs == 1 else f"{off} + c * {cs}"


def _const(value: float, dtype: str) -> str:
    return repr(float(value)) if dtype == "float64" else f"f32({float(value)!r})"


CHUNK = 16  # terms per partial sum


def _sums(table: TermTable, dtype: str, ind: str) -> tuple[list[str], dict[int, str]]:
    """Lines computing every output component as partial sums of at most :data:`CHUNK` terms,
    and per component the expression that adds its partial sums.

    Each partial sum sits in its own ``if go:`` block (``go`` is always true). Without the
    blocks, numba's lowering scans the whole block once per local variable, which is quadratic
    in the number of terms (15 minutes for a 1909-term kernel); with them, compile time is
    linear in the terms, and the branches are uniform and cheap."""
    zero = _const(0.0, dtype)
    by_out: dict[int, list[str]] = {}
    for o, coef, slots in table.monomials():
        by_out.setdefault(o, []).append(" * ".join([f"v{q}" for q in slots] + [_const(coef, dtype)]))
    decl, blocks, exprs = [], [], {}
    for o, terms in sorted(by_out.items()):
        names = []
        for i in range(0, len(terms), CHUNK):
            name = f"p{o}_{i // CHUNK}"
            names.append(name)
            decl.append(f"{ind}{name} = {zero}")
            blocks += [f"{ind}if go:", f"{ind}    {name} = {' + '.join(terms[i:i + CHUNK])}"]
        while len(names) > CHUNK:  # a tree of partial sums keeps every expression short
            groups = [names[i:i + CHUNK] for i in range(0, len(names), CHUNK)]
            names = [f"{g[0]}_" for g in groups]
            blocks += [f"{ind}{n} = {' + '.join(g)}" for n, g in zip(names, groups)]
        exprs[o] = " + ".join(names)
    return decl + blocks, exprs


def kernel_source(table: TermTable, shape: str, dtype: str, *, atomic: bool = False, reduce_channels: bool = False) -> str:
    """Python source of the unrolled kernel ``kernel`` for ``table``.

    ``shape``: ``"atom"`` (arrays ``x0..x9``: 0-5 per atom, 6-9 per species; ``atomic``: the
    output is per species), ``"node"`` or ``"edge"`` (arrays ``x0..x7`` with rows edge /
    sender / receiver; ``reduce_channels``: a channel-summed output)."""
    zero = _const(0.0, dtype)
    body: list[str] = []
    ind = "    "
    if shape == "atom":
        args = ", ".join(f"x{i}" for i in range(10))
        head = [f"def kernel({args}, species, C, out):",
                "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                "if gid >= species.shape[0] * C:", "    return",
                "b = gid // C", "c = gid - b * C", "z = species[b]"]
        rows = {0: "b", 1: "z"}
    elif shape in ("node", "edge"):
        args = ", ".join(f"x{i}" for i in range(8))
        rows = {0: "e", 1: "s", 2: "r"}
        if shape == "node":
            head = [f"def kernel({args}, sender, receiver, seg_ptr, seg_perm, C, out):",
                    "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                    "if gid >= (seg_ptr.shape[0] - 1) * C:", "    return",
                    "n = gid // C", "c = gid - n * C"]
        else:
            head = [f"def kernel({args}, sender, receiver, G, C, out):",
                    "gid = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
                    "if gid >= sender.shape[0] * G:", "    return",
                    "e = gid // G", "g = gid - e * G", "s = sender[e]", "r = receiver[e]"]
    else:
        raise ValueError(f"unknown kernel shape {shape!r}")

    def loads(prefix: str) -> list[str]:
        return [f"{prefix}v{q} = x{a}[{rows[int(k)]}, {_index(int(off), int(cs))}]"
                for q, (a, k, off, cs) in enumerate(zip(table.slot_arr, table.slot_rows, table.slot_off, table.slot_cs))]

    body.append("go = C > 0")
    if shape == "atom":
        body += loads("")
        lines, exprs = _sums(table, dtype, "")
        body += lines
        for o, expr in exprs.items():
            idx = _index(int(table.out_off[o]), int(table.out_cs[o]))
            body.append(f"cuda.atomic.add(out, (z, {idx}), {expr})" if atomic else f"out[b, {idx}] = {expr}")
    elif shape == "node" or reduce_channels:
        # loop-carried accumulators: over the node's edges, or over this thread's channels
        lines, exprs = _sums(table, dtype, ind)
        body += [f"o{o} = {zero}" for o in exprs]
        if shape == "node":
            body += ["for p in range(seg_ptr[n], seg_ptr[n + 1]):",
                     f"{ind}e = seg_perm[p]", f"{ind}s = sender[e]", f"{ind}r = receiver[e]"]
        else:
            body.append("for c in range(g, C, G):")
        body += loads(ind) + lines + [f"{ind}o{o} += {expr}" for o, expr in exprs.items()]
        for o in exprs:
            if shape == "node":
                idx = _index(int(table.out_off[o]), int(table.out_cs[o]))
                body.append(f"cuda.atomic.add(out, (n, {idx}), o{o})" if reduce_channels else f"out[n, {idx}] = o{o}")
            else:
                idx = _index(int(table.out_off[o]), 0)
                body += ["if G == 1:", f"{ind}out[e, {idx}] = o{o}", "else:", f"{ind}cuda.atomic.add(out, (e, {idx}), o{o})"]
    else:  # edge, channelwise output: G == C, one channel per thread
        body += ["c = g"] + loads("")
        lines, exprs = _sums(table, dtype, "")
        body += lines
        for o, expr in exprs.items():
            idx = _index(int(table.out_off[o]), int(table.out_cs[o]))
            body.append(f"out[e, {idx}] = {expr}")
    return "\n".join([head[0]] + [ind + line for line in head[1:] + body]) + "\n"


def source_dir() -> Path:
    """Where generated kernel modules (and numba's on-disk cache of their machine code) live:
    ``$WORKBENCH_CACHE_DIR/kernels`` (default ``~/.cache/cfm-workbench/kernels``)."""
    return Path(os.environ.get("WORKBENCH_CACHE_DIR") or Path.home() / ".cache" / "cfm-workbench") / "kernels"


_HEADER = """# generated by workbench.kernels.unrolled from a term table; safe to delete
import numba
from numba import cuda

f32 = numba.float32


"""


@lru_cache(maxsize=None)
def _compile(source: str) -> Any:
    """The kernel of ``source``, written once to a module file so that numba can cache its
    machine code on disk (``cache=True``): a configuration compiles once per machine, not once
    per process. Under the simulator (or ``WORKBENCH_CACHE=0``) it is built in memory."""
    global cuda  # a module global: the simulator swaps the kernel's global ``cuda`` for its fake
    from numba import cuda

    digest = hashlib.sha1(source.encode()).hexdigest()[:20]
    name = f"workbench_unrolled_{digest}"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or cudasim_enabled() or os.environ.get("WORKBENCH_CACHE") == "0":
        namespace: dict = {}
        exec(compile(_HEADER + source, f"<{name}>", "exec"), namespace)  # noqa: S102 (generated above)
        return cuda.jit(namespace["kernel"])
    path = source_dir() / f"{name}.py"
    text = _HEADER + "@cuda.jit(cache=True)\n" + source
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


@lru_cache(maxsize=None)
def get_unrolled_kernel(table: TermTable, shape: str, dtype: str, *, atomic: bool = False, reduce_channels: bool = False) -> Any:
    """The compiled unrolled kernel for ``table``: cached per table object, so a launch does not
    regenerate the source (tables from another process, e.g. unpickled, share the compiled
    kernel through the per-source cache)."""
    return _compile(kernel_source(table, shape, dtype, atomic=atomic, reduce_channels=reduce_channels))
