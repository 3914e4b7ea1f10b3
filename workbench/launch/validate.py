"""Checks of every value that reaches a SLURM job script, before the script is written.

A job script is parsed twice: sbatch reads the ``#SBATCH`` lines up to the first command, and
bash runs the rest. A newline inside a value would end its directive and start a shell line
(and sbatch ignores every ``#SBATCH`` after it), so text must be one printable line; numbers
must be in SLURM's range; and extra directives may not change what the launcher itself sets.
"""

from __future__ import annotations

import re
from typing import Any

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")  # C0 and C1 controls, tab excepted
_TAB = re.compile(r"\t")
_MEM = re.compile(r"\d+(?:[KMGT]B?)?", re.IGNORECASE)
_KEY = re.compile(r"[a-z][a-z0-9-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a SLURM account, partition or qos name, or a comma list of them (sbatch takes several
#: partitions); '@' and '+' occur in real account names (e.g. IDRIS's ``abc@v100``)
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.@+\-]+(?:,[A-Za-z0-9_.@+\-]+)*")

MEM_FORMAT = "megabytes as an integer, or an integer with a K, M, G or T suffix (e.g. 64G; 0 = all of a node's memory)"

# sbatch's short options (``-N 3``), by the long option each stands for.
SHORT_OPTIONS = {
    "A": "account",
    "a": "array",
    "B": "extra-node-info",
    "b": "begin",
    "C": "constraint",
    "c": "cpus-per-task",
    "D": "chdir",
    "d": "dependency",
    "e": "error",
    "F": "nodefile",
    "G": "gpus",
    "H": "hold",
    "I": "immediate",
    "i": "input",
    "J": "job-name",
    "k": "no-kill",
    "L": "licenses",
    "M": "clusters",
    "m": "distribution",
    "N": "nodes",
    "n": "ntasks",
    "O": "overcommit",
    "o": "output",
    "p": "partition",
    "Q": "quiet",
    "q": "qos",
    "S": "core-spec",
    "s": "oversubscribe",
    "t": "time",
    "V": "version",
    "v": "verbose",
    "W": "wait",
    "w": "nodelist",
    "x": "exclude",
}

# Directives the launcher writes itself, with the option that sets each (None: fixed by the launcher).
_GPUS = "gpus_per_node (--gpus-per-node) or gpus_per_task (--gpus-per-task)"
RESERVED = {
    "nodes": "nodes (--nodes)",
    "ntasks": "nodes and gpus_per_node (one task per rank)",
    "ntasks-per-node": "gpus_per_node (--gpus-per-node; one task per rank)",
    "ntasks-per-gpu": "gpus_per_node (--gpus-per-node; one task per rank)",
    "gpus": _GPUS,
    "gpus-per-node": _GPUS,
    "gpus-per-socket": _GPUS,
    "gpus-per-task": _GPUS,
    "gres": _GPUS,
    "cpus-per-task": "cpus_per_task (--cpus-per-task)",
    "mem": "mem (--mem)",
    "time": "time (--time)",
    "signal": "signal_delay_s (--signal-delay-s)",
    "job-name": "job_name, or the config's name (--set name=...)",
    "account": "account (--account)",
    "partition": "partition (--partition)",
    "qos": "qos (--qos)",
    "constraint": "constraint (--constraint)",
    "requeue": None,
    "no-requeue": None,
    "output": None,
    "error": None,
    "open-mode": None,
    "array": None,
}


def check_text(name: str, value: Any, *, tabs: bool = False, empty: bool = False) -> str:
    """``value`` as one line of printable text (non-empty unless ``empty``), or ``ValueError`` naming ``name``."""
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r}: must be a string")
    if not empty and not value.strip():
        raise ValueError(f"{name}={value!r}: must not be empty")
    bad = _CONTROL.search(value) or (None if tabs else _TAB.search(value))
    if bad:
        raise ValueError(
            f"{name}={value!r}: contains the control character {bad.group()!r}; "
            "a value in the job script must be one line of printable text"
        )
    return value


def check_slurm_name(name: str, value: Any) -> str:
    """An account, partition or qos: names of letters, digits and ``_ . - @ +``, comma-separated."""
    check_text(name, value)
    if not _SLURM_NAMES.fullmatch(value):
        raise ValueError(
            f"{name}={value!r}: not a SLURM {name} name; use letters, digits and _ . - @ + "
            "(several separated by commas)"
        )
    return value


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an integer >= ``minimum``, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={value!r}: must be {what}")
    return value


def check_mem(value: Any) -> str:
    """SLURM's ``--mem`` format, or ``ValueError`` listing it."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if not isinstance(value, str) or not _MEM.fullmatch(value):
        raise ValueError(f"mem={value!r} is not a SLURM memory size; expected {MEM_FORMAT}")
    return value


def check_env(env: dict[str, str]) -> None:
    """Names that ``export`` accepts and one-line values."""
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            raise ValueError(f"env name {key!r}: use letters, digits and '_', not starting with a digit")
        check_text(f"env[{key!r}]", value, tabs=True, empty=True)


def check_params(params: dict[str, Any]) -> None:
    """Safety net over the finished submitit parameters: no value may hold a control character."""
    for key, value in params.items():
        if isinstance(value, dict):
            check_params(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                check_text(key, str(item), tabs=key == "setup", empty=True)
        elif isinstance(value, str):
            check_text(key, value, empty=True)


def _split(line: str) -> tuple[str, str | None]:
    """``(long option, value or None)`` of one extra directive."""
    text = line.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH") :].strip()
    if text.startswith("--") and len(text) > 2:
        key, sep, value = text[2:].partition("=")
        if not sep and " " in key:
            key, _, value = key.partition(" ")
            sep = "="
        return key.strip(), value.strip() if sep else None
    if len(text) >= 2 and text[0] == "-" and text[1] in SHORT_OPTIONS:
        value = text[2:].strip()
        return SHORT_OPTIONS[text[1]], value or None
    raise ValueError(
        f"sbatch_lines entry {line!r}: expected '--key=value', '--flag', '-X value' or '#SBATCH --key=value'"
    )


def _check_not_reserved(line: str, key: str, mem_given: bool) -> None:
    where = f"sbatch_lines entry {line!r} (--sbatch)"
    if mem_given and key.startswith("mem-per"):
        raise ValueError(f"{where}: --{key} conflicts with mem (--mem), which is given; SLURM takes one of them")
    # sbatch also takes an unambiguous prefix of a long option (--nod for --nodes).
    hits = [r for r in RESERVED if r == key] or [r for r in RESERVED if r.startswith(key)]
    if not hits:
        return
    name = f"--{hits[0]}" if hits[0] == key else f"--{key} (short for --{hits[0]})"
    how = RESERVED[hits[0]]
    fix = f"set it with {how}" if how else "it cannot be changed"
    raise ValueError(f"{where}: {name} is set by the launcher itself, so an extra directive would contradict it; {fix}")


def extra_directives(lines: list[str], mem_given: bool = False) -> dict[str, Any]:
    """Extra ``#SBATCH`` directives as submitit's ``additional_parameters``; refuses control
    characters and any directive the launcher sets itself (also by short form or abbreviation)."""
    out: dict[str, Any] = {}
    for line in lines:
        check_text("sbatch_lines entry", line)
        key, value = _split(line)
        if not _KEY.fullmatch(key):
            raise ValueError(f"sbatch_lines entry {line!r}: {key!r} is not an sbatch option name")
        _check_not_reserved(line, key, mem_given)
        out[key.replace("-", "_")] = value if value is not None else True
    return out
