"""Kernel choices in one typed object; the ``WORKBENCH_*`` environment variables that override
them are read here and nowhere else.

Every choice a user or a benchmark may want to steer (table-driven or unrolled CUDA kernels,
split sizes, block size, fusion of a pass's outputs, the CPU code generator, ...) is a field of
:class:`KernelOptions`. ``None`` means "the kernel module's own default" (each module owns its
default and documents it). The options in effect are, in order of precedence: the values set in
code (:func:`overridden` for a block, :func:`configure` for the rest of the process), the
environment variables (read at call time, so a variable a user or a test sets counts at the next
kernel plan), and the defaults. Code below the entry points (CLI, ``TrainConfig``,
:func:`~workbench.kernels.accelerate`) passes values, never environment variables; a child
process gets the options in effect through :func:`child_environment`.

==============================  ==============================  =====================================
field                           environment variable            meaning
==============================  ==============================  =====================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "ENV",
    "KernelOptions",
    "child_environment",
    "configure",
    "environment",
    "kernel_options",
    "numba_simulator",
    "overridden",
    "variable",
]


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if text not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _positive(kind: type, least: int = 1) -> Callable[[str, str], Any]:
    what = "positive" if least > 0 else "non-negative"

    def parse(name: str, text: str) -> Any:
        try:
            value = kind(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"{name} must be a {what} {kind.__name__}, got {text!r}") from None
        if value < least:
            raise ValueError(f"{name} must be a {what} {kind.__name__}, got {text!r}")
        return value

    return parse


#: field -> (environment variable, parser, what it does); the one list of kernel overrides
ENV: dict[str, tuple[str, Callable[[str, str], Any], str]] = {
    "cuda_kernels": (
        "WORKBENCH_CUDA_KERNELS",
        _choice("auto", "table", "unrolled"),
        "CUDA kernel kind: auto (unrolled where it fits), table-driven, or unrolled everywhere",
    ),
    "fuse_passes": ("WORKBENCH_FUSE_PASSES", _flag, "0: launch a pass's outputs one kernel each"),
    "threads_per_block": ("WORKBENCH_CUDA_TPB", _positive(int), "CUDA threads per block"),
    "unroll_max_terms": ("WORKBENCH_UNROLL_MAX_TERMS", _positive(float), "cost budget of one unrolled kernel"),
    "unroll_parts": (
        "WORKBENCH_UNROLL_PARTS",
        _positive(int, least=0),
        "force this many parts per polynomial (set at all: no automatic split)",
    ),
    "unroll_terms": ("WORKBENCH_UNROLL_TERMS", _positive(int), "force runs of this many terms (atom ops)"),
    "unroll_weight_groups": (
        "WORKBENCH_UNROLL_WEIGHT_GROUPS",
        _positive(int),
        "force parts of about this many terms, grouped by weight component",
    ),
    "pass_max_terms": ("WORKBENCH_PASS_MAX_TERMS", _positive(int), "terms per kernel of a fused atom pass"),
    "segment_lanes": ("WORKBENCH_SEGMENT_LANES", _positive(int), "row lanes per column of the per-species sums"),
    "cpu_kernels": (
        "WORKBENCH_CPU_KERNELS",
        _choice("auto", "interpreter", "generated", "fused"),
        "CPU row passes: auto (fused kernels for small passes), the interpreter, generated bodies, or fused everywhere",
    ),
    "cpu_unroll_max": (
        "WORKBENCH_CPU_UNROLL_MAX",
        _positive(int),
        "largest program run as generated code, or fused under auto",
    ),
    "cpu_serial_work": ("WORKBENCH_CPU_SERIAL_WORK", _positive(int), "below this work a CPU pass runs serially"),
    "cpu_registers": (
        "WORKBENCH_CPU_REGISTERS",
        _positive(int),
        "operands plus accumulators per channel loop of a fused CPU pass (a large value: one loop)",
    ),
    "cpu_merge_edges": (
        "WORKBENCH_CPU_MERGE_EDGES",
        _flag,
        "1/0: a CPU edge op's per-edge outputs join its node pass (default: from 64 channels)",
    ),
    "fold_species": (
        "WORKBENCH_FOLD_SPECIES",
        _flag,
        "1/0: fold the contraction's per-species weights into its coupling coefficients before a call "
        "(default: on CPU tensors)",
    ),
    "frozen_linears": (
        "WORKBENCH_FROZEN_LINEARS",
        _flag,
        "1/0: e3nn linears with frozen weights (MD) run as one map and its transpose (default: 1)",
    ),
    "cpu_harmonics": (
        "WORKBENCH_CPU_HARMONICS",
        _flag,
        "1/0: the MD calculator's spherical harmonics as numba passes on CPU tensors (default: 1)",
    ),
    "table_in_passes": (
        "WORKBENCH_TABLE_IN_PASSES",
        _flag,
        "1/0: the message passes read a tabulated radial network's coefficients in place of its "
        "[edges, J] weights (MD on the CPU; default: 1)",
    ),
    "host_fallback": (
        "WORKBENCH_KERNELS_HOST_FALLBACK",
        _flag,
        "1: CUDA tensors run the CPU kernels on host copies when numba has no CUDA target",
    ),
    "poison": ("WORKBENCH_KERNELS_POISON", _flag, "1: fill uninitialised outputs with NaN (the tests do)"),
    "cudasim": (
        "WORKBENCH_KERNELS_CUDASIM",
        _flag,
        "1 (with NUMBA_ENABLE_CUDASIM=1): CPU tensors run the CUDA kernels in numba's simulator",
    ),
    "precompile": ("WORKBENCH_PRECOMPILE", _flag, "0: accelerate() on a CUDA model does not compile ahead"),
    "precompile_workers": ("WORKBENCH_PRECOMPILE_WORKERS", _positive(int), "processes that compile ahead"),
    "kernel_cache": ("WORKBENCH_KERNEL_CACHE", str, "folder of compiled kernels (may be shared by a job's nodes)"),
    "cache": ("WORKBENCH_KERNEL_DISK_CACHE", _flag, "0: compile generated kernels in memory only"),
}


@dataclass(frozen=True)
class KernelOptions:
    """The kernel choices in effect; ``None``: the owning kernel module's default."""

    cuda_kernels: str = "auto"
    fuse_passes: bool = True
    threads_per_block: int | None = None
    unroll_max_terms: float | None = None
    unroll_parts: int | None = None
    unroll_terms: int | None = None
    unroll_weight_groups: int | None = None
    pass_max_terms: int | None = None
    segment_lanes: int | None = None
    cpu_kernels: str = "auto"
    cpu_unroll_max: int | None = None
    cpu_serial_work: int | None = None
    cpu_registers: int | None = None
    cpu_merge_edges: bool | None = None
    fold_species: bool | None = None
    frozen_linears: bool = True
    cpu_harmonics: bool = True
    table_in_passes: bool = True
    host_fallback: bool = False
    poison: bool = False
    cudasim: bool = False
    precompile: bool = True
    precompile_workers: int | None = None
    kernel_cache: str | None = None
    cache: bool = True


def kernel_options() -> KernelOptions:
    """The options in effect: the defaults, then every ``WORKBENCH_*`` variable that is set (an
    empty value counts as unset), then the values set in code (:func:`configure`,
    :func:`overridden`). Re-read on every call, so a variable set at any time counts; parsed again
    only when something changed (a kernel call asks several times)."""
    key = (_environment_texts(), _SET)
    cached = _PARSED.get(key)
    if cached is None:
        values = {}
        for (name, (env, parse, _)), raw in zip(ENV.items(), key[0]):
            text = os.fsdecode(raw)
            if text:
                values[name] = parse(env, text) if parse is not str else text
        values.update(_SET)
        cached = KernelOptions(**values)
        if len(_PARSED) > 64:
            _PARSED.clear()
        _PARSED[key] = cached
    return cached


_PARSED: dict[tuple, KernelOptions] = {}
#: the values set in code, as a hashable tuple of (field, value) pairs; replaced, never mutated
_SET: tuple = ()


def _environment_texts() -> tuple:
    """The option variables' raw values: on POSIX straight from ``os.environ``'s byte mapping
    (20 ``os.environ.get`` calls cost ~20 us, more than some kernel calls)."""
    raw = getattr(os.environ, "_data", None)
    if isinstance(raw, dict) and os.name == "posix":
        return tuple(raw.get(key, b"") for key in _RAW_KEYS)
    return tuple(os.environ.get(env, "") for env in _NAMES)


_NAMES = tuple(env for env, _, _ in ENV.values())
_RAW_KEYS = tuple(os.fsencode(env) for env in _NAMES)


def _render(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def _checked(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` validated by the same parsers as the variables; ``None`` values are kept (unset)."""
    unknown = sorted(set(changes) - set(ENV))
    if unknown:
        raise ValueError(f"unknown kernel option(s) {unknown}; the options are {', '.join(ENV)}")
    out = {}
    for name, value in changes.items():
        parse = ENV[name][1]
        if value is None or parse is str:
            out[name] = None if value is None else str(value)
        else:
            out[name] = parse(f"kernel option {name!r}", _render(value))
    return out


def _merged(changes: Mapping[str, Any]) -> tuple:
    values = dict(_SET)
    for name, value in changes.items():
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
    return tuple(sorted(values.items()))


def configure(**changes: Any) -> KernelOptions:
    """Set fields of :class:`KernelOptions` for the rest of this process (an entry point's choice:
    ``TrainConfig.kernel_cache``, ``workbench kernels --cache``); ``None`` unsets one. Values win
    over the environment. The options now in effect are returned."""
    global _SET
    _SET = _merged(_checked(changes))
    return kernel_options()


@contextlib.contextmanager
def overridden(**changes: Any) -> Iterator[KernelOptions]:
    """Set fields of :class:`KernelOptions` for the block (``None`` unsets one, so the variable or
    the default counts again); the previous values come back. Processes started inside get them
    through :func:`child_environment`."""
    global _SET
    saved, _SET = _SET, _merged(_checked(changes))
    try:
        yield kernel_options()
    finally:
        _SET = saved


def child_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the variables of the options set in
    code, so that a child process (a compile worker, a benchmark's subprocess) runs the kernels
    this one would."""
    env = dict(os.environ if base is None else base)
    env.update({ENV[name][0]: _render(value) for name, value in _SET})
    return env


def variable(name: str) -> str:
    """The environment variable of the option ``name`` (``"kernel_cache"``: ``WORKBENCH_KERNEL_CACHE``),
    for messages that tell a user what to set."""
    return ENV[name][0]


def numba_simulator() -> bool:
    """numba's own switch ``NUMBA_ENABLE_CUDASIM=1``: its CUDA target is the simulator."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@contextlib.contextmanager
def environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables for the block, ``None`` unsetting one; the previous values come
    back. For tests and for processes started inside the block; kernel options are set with
    :func:`overridden`."""
    saved = {env: os.environ.get(env) for env in changes}
    try:
        for env, value in changes.items():
            _put(env, value)
        yield
    finally:
        for env, old in saved.items():
            _put(env, old)


def _put(env: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(env, None)
    else:
        os.environ[env] = value


if __doc__:  # python -OO strips docstrings
    __doc__ += "\n".join(f"{name:<30}  {env:<30}  {doc}" for name, (env, _, doc) in ENV.items())
    __doc__ += (
        "\n==============================  ==============================  =====================================\n"
    )
assert {f.name for f in fields(KernelOptions)} == set(ENV), "every option has one variable"
