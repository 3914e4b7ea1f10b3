"""The MACE evaluators a user would install instead of ours, timed beside ours by the benches.

Each peer converts the same mace model file with its own tool and gives an ASE calculator. They
are optional (``pip install 'cfm-workbench[peers]'``), never a core dependency: where a peer is
missing, :func:`missing` says so and how to get it, and the bench row reads "skipped".

* ``symmetrix`` - Symmetrix-XL (github bonan-group/symmetrix-xl), a C++ MACE evaluator that
  JIT-compiles each model (``c++ -O3 -march=native`` on first use, then a cache under
  ``~/.cache/symmetrix``). Its converter ``symmetrix_extract_mace`` replaces the radial MLP by a
  spline of ``--num-spline-points`` points, so it agrees with e3nn to about 1e-5 in forces at
  its default and closer with more points. It runs ScaleShiftMACE with l_max 3 only; for a
  model it refuses, :func:`calculator` raises :class:`PeerRefused` with its reason.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PEERS", "Peer", "PeerRefused", "calculator", "convert", "missing"]

#: the extra that installs every peer (pyproject.toml's optional dependencies)
EXTRA = "cfm-workbench[peers]"
#: radial spline points given to Symmetrix's converter: ~1e-8 agreement in forces at its speed
SYMMETRIX_SPLINE_POINTS = 2048


class PeerRefused(RuntimeError):
    """The peer cannot run this model (its converter or its compiler said no); the message says why."""


@dataclass(frozen=True)
class Peer:
    """A peer: the distribution that installs it, the module it imports as, and its two steps."""

    name: str
    distribution: str
    module: str
    convert: Callable[[Path, Path], Path]  # (mace model file, folder) -> the peer's model file
    make: Callable[[Path, str], object]  # (the peer's model file, dtype) -> an ASE calculator
    settings: str = ""  # what else decides the conversion (part of its cache key)


def missing(name: str) -> str | None:
    """None when peer ``name`` can run here, else the row's "skipped" reason, naming the fix."""
    peer = _peer(name)
    if importlib.util.find_spec(peer.module) is None:
        return f"skipped: {peer.distribution} is not installed (pip install '{EXTRA}')"
    return None


def convert(name: str, model: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Peer ``name``'s model file for the mace ``model``, converted once per model content."""
    peer, model = _peer(name), Path(model)
    if not model.is_file():
        raise FileNotFoundError(f"{model}: no such model file to convert for {name}")
    digest = hashlib.sha256(model.read_bytes() + peer.settings.encode()).hexdigest()[:16]
    folder = Path(folder).resolve() / f"{name}-{digest}"  # absolute: the converter runs in this folder
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "converted"
    if done.exists():
        return Path(done.read_text().strip())
    out = peer.convert(model.resolve(), folder)
    done.write_text(str(out))
    return out


def calculator(name: str, converted: str | os.PathLike, dtype: str):
    """An ASE calculator of peer ``name`` for its model file ``converted``, in ``dtype``."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype {dtype!r}: a peer runs float32 or float64")
    return _peer(name).make(Path(converted), dtype)


def _peer(name: str) -> Peer:
    if name not in PEERS:
        raise KeyError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    return PEERS[name]


def _symmetrix_convert(model: Path, folder: Path) -> Path:
    out = folder / "model.json"
    # the converter as a module of this interpreter, arguments as a list: nothing goes through a shell
    cmd = [sys.executable, "-m", "symmetrix.cli.extract_mace", "--model", str(model), "--output", str(out)]
    cmd += ["--num-spline-points", str(SYMMETRIX_SPLINE_POINTS)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerRefused(f"symmetrix_extract_mace refused {model}: {tail[0][:300]}")
    return out


def _symmetrix_calculator(converted: Path, dtype: str):
    from symmetrix import Symmetrix

    try:
        return Symmetrix(str(converted), dtype=dtype)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PeerRefused(f"Symmetrix refused {converted}: {first[:300]}") from None


PEERS: dict[str, Peer] = {
    "symmetrix": Peer(
        "symmetrix",
        "symmetrix-xl",
        "symmetrix",
        _symmetrix_convert,
        _symmetrix_calculator,
        settings=f"num-spline-points={SYMMETRIX_SPLINE_POINTS}",
    )
}
