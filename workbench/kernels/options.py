"""Kernel choices in one typed object; the ``WORKBENCH_*`` environment variables that override
them are read here and nowhere else.

Every choice a user or a benchmark may want to steer (table-driven or unrolled CUDA kernels,
split sizes, block size, fusion of a pass's outputs, the CPU code generator, ...) is a field of
:class:`KernelOptions`. ``None`` means "the kernel module's own default" (each module owns its
default and documents it). :func:`kernel_options` reads the environment at call time, so a
variable set by a test or a benchmark takes effect at the next kernel plan; :func:`overridden`
sets fields for a block of code through the same variables (child processes, such as the
precompile workers, inherit them), with :func:`environment`, which sets and restores any variables.

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

__all__ = ["ENV", "KernelOptions", "environment", "kernel_options", "overridden"]


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
    "cache": ("WORKBENCH_CACHE", _flag, "0: compile generated kernels in memory only"),
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
    host_fallback: bool = False
    poison: bool = False
    cudasim: bool = False
    precompile: bool = True
    precompile_workers: int | None = None
    kernel_cache: str | None = None
    cache: bool = True


def kernel_options() -> KernelOptions:
    """The defaults with every ``WORKBENCH_*`` override that is set (an empty value counts as unset).
    Re-read on every call, so a variable set at any time counts; parsed again only when one changed
    (a kernel call asks several times)."""
    texts = _environment_texts()
    cached = _PARSED.get(texts)
    if cached is None:
        values = {}
        for (name, (env, parse, _)), raw in zip(ENV.items(), texts):
            text = os.fsdecode(raw)
            if text:
                values[name] = parse(env, text) if parse is not str else text
        cached = KernelOptions(**values)
        if len(_PARSED) > 64:
            _PARSED.clear()
        _PARSED[texts] = cached
    return cached


_PARSED: dict[tuple, KernelOptions] = {}


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


@contextlib.contextmanager
def overridden(**changes: Any) -> Iterator[KernelOptions]:
    """Set fields of :class:`KernelOptions` for the block (through their variables, so processes
    started inside inherit them); ``None`` unsets a field. The previous environment comes back."""
    unknown = sorted(set(changes) - set(ENV))
    if unknown:
        raise ValueError(f"unknown kernel option(s) {unknown}; the options are {', '.join(ENV)}")
    with environment({ENV[k][0]: None if v is None else _render(v) for k, v in changes.items()}):
        yield kernel_options()


@contextlib.contextmanager
def environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables for the block, ``None`` unsetting one; the previous values come back."""
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
