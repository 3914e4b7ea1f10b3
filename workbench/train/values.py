"""Config values the way a user means them: YAML with ``1e-3`` as a number, coercion by type hint,
ranges that name their bounds.

PyYAML follows YAML 1.1, where ``1e-3`` (no dot) is a *string*; every user who writes a learning
rate that way would meet a ``TypeError`` deep in the optimiser. :func:`load_yaml` resolves such
scalars as floats (YAML 1.2). :func:`coerce` turns a value into a field's annotated type or
raises :class:`ConfigError` naming the field, the type it wants and what it got. Hand-written
rather than a validation library: the rules are a short table next to the dataclass, the
dataclass stays a plain dataclass, and the messages follow the CLI's error convention.
"""

from __future__ import annotations

import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the field."""


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"key {key!r} given twice")
        self.key, self.line, self.first_line = key, line, first_line


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3``, ``5E+2`` and ``.5`` as floats (YAML 1.2), and refuses
    a mapping that gives a key twice (PyYAML would keep the last value silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<" merges may be overridden, that is what they are for
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first:
                    raise _DuplicateKey(key, line, first[key])
                first[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)$"),
    list("-+0123456789."),
)


#: A config is a page of settings: a larger file, or a value that aliases expand past this many
#: nodes (a "billion laughs" of a few KB), is refused before anything walks it.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 64
#: the longest list a list field takes (families, radial_mlp); fields may bound it further
MAX_LIST_ITEMS = 4096

_brief = reprlib.Repr()  # keyword arguments only from Python 3.12
_brief.maxlevel, _brief.maxlist, _brief.maxtuple, _brief.maxdict = 2, 8, 8, 8
_brief.maxstring, _brief.maxother, _brief.maxlong = 60, 60, 40


def brief(value: Any) -> str:
    """``repr(value)`` cut to about 80 characters: an error line never prints a whole value."""
    return _brief.repr(value)


def _expanded_size(value: Any, source: str) -> int:
    """Nodes of ``value`` with every alias expanded, counted once per shared object (memo by id)."""
    memo: dict[int, int] = {}

    def size(obj: Any, depth: int) -> int:
        if not isinstance(obj, (list, dict)):
            return 1
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels (a recursive alias?)")
        if id(obj) not in memo:
            items = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj)
            memo[id(obj)] = 1 + sum(size(k, depth + 1) + size(v, depth + 1) for k, v in items)
        return memo[id(obj)]

    return size(value, 0)


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML text; a syntax error becomes a :class:`ConfigError` naming ``source`` and the line.
    Text over :data:`MAX_CONFIG_BYTES`, or aliases expanding past :data:`MAX_CONFIG_NODES`, are refused."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: {len(text):,} characters; a config is at most {MAX_CONFIG_BYTES:,}")
    try:
        data = yaml.load(text, Loader=_Loader)
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{source}, line {exc.line}: key {exc.key!r} is given twice (first on line {exc.first_line}); keep one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}, line {mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    nodes = _expanded_size(data, source)
    if nodes > MAX_CONFIG_NODES:
        raise ConfigError(
            f"{source}: its aliases expand to {nodes:,} values; a config holds at most {MAX_CONFIG_NODES:,}"
        )
    return data


@dataclass(frozen=True)
class Interval:
    """A numeric range; ``None`` is unbounded, ``*_open`` excludes the bound."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return not (self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi))

    def describe(self, kind: str = "a finite number") -> str:
        """``kind`` plus the bounds, e.g. ``an integer >= 1`` or ``a finite number in (0, 15]``."""
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"{kind} in {left}{self.lo:g}, {self.hi:g}{right}"


_NULLS = ("null", "none", "~", "")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _describe(hint) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def coerce(value: Any, hint: Any, field: str) -> Any:
    """``value`` as the type ``hint`` (``int``, ``float``, ``bool``, ``str``, ``list[...]``, ``X | None``)."""

    def bad(want: str) -> ConfigError:
        return ConfigError(f"{field}: expected {want}, got {brief(value)}")

    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULLS):
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) > 1:  # a field of several kinds (TrainConfig.e0s) is checked by its own validator
            return value
        (hint,) = choices
        args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, str):  # families=mptrj,hea or families=mptrj: what the user means is a list
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad(f"a list like [{'64, 64' if args[0] is int else 'a, b'}]")
        if len(value) > MAX_LIST_ITEMS:
            raise ConfigError(f"{field}: {len(value):,} items; a list field takes at most {MAX_LIST_ITEMS:,}")
        return [coerce(v, args[0], f"{field}[{k}]") for k, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad(_describe(bool))
    if hint is int:
        if isinstance(value, bool):
            raise bad(_describe(int))
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
            return int(value)
        if isinstance(value, int):
            return value
        raise bad(_describe(int))
    if hint is float:
        if isinstance(value, bool):
            raise bad(_describe(float))
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad(_describe(float)) from None
        raise bad(_describe(float))
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad(_describe(str))
    return value
