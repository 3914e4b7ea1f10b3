"""The readers never crash the process: mutated extxyz frames and mace HDF5 files, at random.

Every case must end in parsed structures or a one-line :class:`StructureError` (the one error type
the readers raise for bad input; a missing file is FileNotFoundError, never produced here). Any
other exception, or a signal (the C extxyz parser segfaulted on some inputs), fails the test
with the case's seed. Cases run in worker subprocesses, in chunks, so a signal is reported
rather than killing pytest; ``python tests/test_fuzz_readers.py KIND START STOP`` reruns a range.
"""

from __future__ import annotations

import gzip
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EXTXYZ_CASES = 4200
H5_CASES = 900
CHUNKS = 2  # one per core

_FRAMES = [
    "3\n"
    'Properties=species:S:1:pos:R:3:REF_forces:R:3 REF_energy=-14.2 config_type=water pbc="F F F"\n'
    "O 0.0 0.0 0.0 0.1 0.0 0.0\n"
    "H 0.96 0.0 0.0 -0.05 0.0 0.0\n"
    "H -0.24 0.93 0.0 -0.05 0.0 0.0\n",
    "2\n"
    'Lattice="5.43 0.0 0.0 0.0 5.43 0.0 0.0 0.0 5.43" Properties=species:S:1:pos:R:3:REF_forces:R:3 '
    'REF_energy=-10.8 config_type=bulk pbc="T T T"\n'
    "Si 0.0 0.0 0.0 0.0 0.0 0.0\n"
    "Si 1.36 1.36 1.36 0.0 0.0 0.0\n",
    "2\n"
    'Properties=species:S:1:pos:R:3:tags:I:1:fixed:L:1 labelled=F pbc="F F F"\n'
    "C 0.0 0.0 0.0 1 T\n"
    "C 1.5 0.0 0.0 2 F\n",
]
_TOKENS = ["0", "-1", "1e999", "nan", "inf", "abc", '"', "{", "}", "=", "", "3 4", "99999999999", "X", "\t", "T"]
_HEADERS = [
    "Properties=species:S:1:pos:R:3",
    "Properties=species:S:1:pos:R:2",
    "Properties=species:S:1:pos:R:0",
    "Properties=species:Q:1:pos:R:3",
    "Properties=species:S:1:pos:R:3:extra:R:99999",
    "Properties=pos:R:3",
    "Properties=",
    'Properties="species:S:1:pos:R:3',
    'Lattice="1 0 0 0 1 0"',
    'Lattice="0 0 0 0 0 0 0 0 0"',
    "Lattice=nan",
    'pbc="T T"',
    "pbc=T",
    'REF_energy="x"',
    "REF_energy=1 REF_energy=2",
    "",
]


def _mutate_lines(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    k = rng.randrange(len(lines))
    op = rng.choices(range(7), weights=(1, 4, 3, 5, 1, 1, 1))[0]  # mostly within lines: deeper parsing
    if op == 0:  # atom count
        lines[k] = rng.choice(["0", "-1", "1", "5", "1000000000", "abc", "", "2 2"])
    elif op == 1:  # header: a comment line
        k = rng.choice([j for j, line in enumerate(lines) if "=" in line] or [k])
        lines[k] = rng.choice(_HEADERS) + " " + (lines[k] if rng.random() < 0.5 else "")
    elif op == 2:  # add or drop a column
        k = rng.choice([j for j, line in enumerate(lines) if len(line.split()) >= 4] or [k])
        words = lines[k].split()
        if words and rng.random() < 0.5:
            words.pop(rng.randrange(len(words)))
        else:
            words.insert(rng.randrange(len(words) + 1), rng.choice(_TOKENS))
        lines[k] = " ".join(words)
    elif op == 3:  # replace a value
        words = lines[k].split() or [""]
        words[rng.randrange(len(words))] = rng.choice(_TOKENS)
        lines[k] = " ".join(words)
    elif op == 4:
        lines.insert(k, lines[rng.randrange(len(lines))])
    elif op == 5:
        del lines[k]
    else:
        j = rng.randrange(len(lines))
        lines[k], lines[j] = lines[j], lines[k]
    return "\n".join(lines)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        k = rng.randrange(len(data))
        op = rng.randrange(4)
        if op == 0:
            data[k] = rng.randrange(256)
        elif op == 1:
            data.insert(k, rng.randrange(256))
        elif op == 2:
            del data[k]
        else:
            data = data[:k]  # truncated
    return bytes(data)


def extxyz_case(seed: int) -> tuple[str, bytes]:
    """A file name and its bytes: valid frames, then one to three mutations."""
    rng = random.Random(seed)
    text = "".join(rng.choice(_FRAMES) for _ in range(rng.randint(1, 3)))
    for _ in range(rng.choices((0, 1, 2, 3), weights=(1, 12, 4, 2))[0]):
        text = _mutate_lines(rng, text)
    data = text.encode()
    if rng.random() < 0.15:
        data = _mutate_bytes(rng, data)
    if rng.random() < 0.1:
        data = gzip.compress(data, mtime=0)
        data = _mutate_bytes(rng, data) if rng.random() < 0.5 else data
        return "case.extxyz.gz", data
    return "case.extxyz", data


def _run_extxyz(seed: int, folder: Path) -> None:
    from workbench.data.io import read_structures

    name, data = extxyz_case(seed)
    path = folder / name
    path.write_bytes(data)
    read_structures(path, require_labels=seed % 2 == 0)


def _h5_config(rng: random.Random) -> dict:
    import numpy as np

    n = rng.choice([1, 2, 3])
    cfg = {
        "atomic_numbers": np.array([rng.choice([1, 6, 8]) for _ in range(n)]),
        "positions": np.array([[1.2 * k, 0.0, 0.0] for k in range(n)]),
        "cell": np.eye(3) * 10.0,
        "pbc": np.array([False] * 3),
        "weight": 1.0,
        "config_type": "Default",
        "properties/energy": -1.0,
        "properties/forces": np.zeros((n, 3)),
        "property_weights/energy": 1.0,
    }
    bad = {
        "atomic_numbers": [np.array([300] * n), np.array([0]), np.array([-5] * n), np.array([2**40]), np.array([])],
        "positions": [np.zeros((n, 2)), np.full((n, 3), np.nan), np.zeros((0, 3)), "x", np.zeros(n)],
        "cell": [np.zeros((2, 3)), np.full((3, 3), np.inf), "None", np.zeros(3)],
        "pbc": [np.array([True] * 3), np.array([True, False]), "None", np.array(7)],
        "weight": ["x", np.zeros(3)],
        "config_type": [np.zeros(2), b"\xff\xfe"],
        "properties/energy": ["None", "x", np.zeros(4), np.nan],
        "properties/forces": ["None", np.zeros((n + 1, 3)), np.full((n, 3), 1e300), np.zeros(2)],
    }
    for _ in range(rng.randint(0, 2)):
        key = rng.choice(sorted(bad))
        if rng.random() < 0.2:
            cfg.pop(key, None)
        else:
            cfg[key] = rng.choice(bad[key])
    return cfg


def h5_case(seed: int, path: Path) -> None:
    """Write a mace ``preprocess_data``-style file at ``path``: mutated values, groups, bytes."""
    import h5py

    rng = random.Random(seed)
    layout = rng.choice(["ok"] * 7 + ["empty", "stray_group", "empty_batch", "dataset_batch"])
    with h5py.File(path, "w") as f:
        if layout == "stray_group":
            f.create_group("something_else")
        elif layout == "dataset_batch":
            f["config_batch_0"] = 1.0
        elif layout != "empty":
            batch = f.create_group("config_batch_0")
            for i in range(0 if layout == "empty_batch" else rng.randint(1, 3)):
                group = batch.create_group(f"config_{i}")
                for key, value in _h5_config(rng).items():
                    group[key] = value
    if rng.random() < 0.15:
        path.write_bytes(_mutate_bytes(rng, path.read_bytes()))


def _run_h5(seed: int, folder: Path) -> None:
    from workbench.data.errors import StructureError
    from workbench.data.formats.mace_h5 import mace_h5_keys, read_mace_h5
    from workbench.data.prepare_worker import Settings, measure

    path = folder / "case.h5"
    h5_case(seed, path)
    keys = mace_h5_keys(path)  # list, read, then validate and measure as ``workbench data prepare`` does
    for frame, item in read_mace_h5(path, 0, keys):
        if isinstance(item, StructureError):
            raise item
        measure(item, Settings(), path, frame)


def _worker(kind: str, start: int, stop: int) -> None:
    """Run seeds ``start..stop``: ``case SEED`` before each (the last one names a crash), then
    ``bad SEED message`` for every case that ends in anything but a one-line StructureError."""
    from workbench.data.errors import StructureError

    run = _run_extxyz if kind == "extxyz" else _run_h5
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(start, stop):
            print(f"case {seed}", flush=True)
            try:
                run(seed, Path(tmp))
            except StructureError as exc:
                if "\n" in str(exc) or not exc.path:
                    print(f"bad {seed} message not one line naming the file: {str(exc)!r}", flush=True)
            except Exception as exc:  # any other type is the failure being hunted
                print(f"bad {seed} {type(exc).__name__}: {str(exc)[:200]!r}", flush=True)


def _chunk(kind: str, start: int, stop: int) -> list[str]:
    env = dict(os.environ, WORKBENCH_DATA_CACHE="0", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="")
    cmd = [sys.executable, __file__, kind, str(start), str(stop)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    problems = [line for line in lines if line.startswith("bad ")]
    if out.returncode != 0:
        last = next((line for line in reversed(lines) if line.startswith("case ")), "case ?")
        problems.append(f"{kind} seed {last.split()[1]}: worker died (exit {out.returncode}): {out.stderr[-300:]}")
    return [f"{kind} {p}" for p in problems]


def test_readers_survive_fuzzed_inputs(capsys):
    t0 = time.perf_counter()
    jobs = []
    for kind, total in (("extxyz", EXTXYZ_CASES), ("h5", H5_CASES)):
        step = -(-total // CHUNKS)
        jobs += [(kind, s, min(s + step, total)) for s in range(0, total, step)]
    with ThreadPoolExecutor(CHUNKS) as pool:
        problems = [p for found in pool.map(lambda job: _chunk(*job), jobs) for p in found]
    seconds = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nfuzz readers: {EXTXYZ_CASES + H5_CASES} cases in {seconds:.1f} s, {len(problems)} problem(s)")
    assert not problems, "\n".join(problems[:20])


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
