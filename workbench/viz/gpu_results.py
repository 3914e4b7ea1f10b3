"""Measured GPU rows: numba, cuEquivariance (cueq) and e3nn per pass and per train step.

Every *expected* row becomes a record, measured or not. A missing one carries the
reason its JSON gives (a skipped or failed backend, the file's ``stopped`` note, no
such row, no file at all), so the views in :mod:`workbench.viz.gpu_figures` and
:func:`gpu_missing_rows` say what was not measured instead of leaving a silent gap.

Files, newest first by their own timestamp (else their modification time):
``<op>_gpu_*.json`` per (op, hidden irreps) and ``train_step_gpu_*.json``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from workbench.kernels.registry import DEFAULT_BACKEND, contenders
from workbench.viz.kernels import PASS_ORDER, RESULTS_DIR, _lookup, read_kernel_results

#: The two hot ops of MACE, by bench name.
OPS = {"symmetric_contraction": "symmetric contraction", "channelwise_tp": "channelwise TP"}
#: The op's own target; the contraction bench also times whole product blocks (products0).
OP_TARGETS = {"symmetric_contraction": "contraction", "channelwise_tp": None}
#: Hidden irreps we expect a GPU row for, by short name.
CONFIGS = {"paper": "128x0e+128x1o", "128x2e": "128x0e+128x1o+128x2e", "256": "256x0e+256x1o"}
DTYPES = ("float32", "float64")
#: the ratios are ours over each other backend
OURS = DEFAULT_BACKEND


def gpu_backends() -> tuple[str, ...]:
    """The backends a GPU table has a cell for: the registry's contenders for MACE on CUDA, ours first."""
    return contenders("mace", "cuda")


def gpu_step_backends() -> tuple[str, ...]:
    """The train step's rows: :func:`gpu_backends` and the step modes ``bench step``'s gpu preset
    runs (``numba+graph``, ``cueq+fixed``: :mod:`workbench.bench.step_modes`)."""
    from workbench.bench.step import PRESETS

    return tuple(dict.fromkeys((*gpu_backends(), *PRESETS["gpu"]["backends"])))


NOT_MEASURED = "not measured"
NO_FILE = "no result file"
FROM_LOG = "from log"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stamp(path: Path, data: dict) -> str:
    """Comparable ``YYYYmmddHHMMSS``: the file's own timestamp, else its modification time."""
    digits = re.sub(r"\D", "", str(data.get("timestamp") or _lookup(data, "meta", "timestamp") or ""))[:14]
    return digits if len(digits) == 14 else time.strftime("%Y%m%d%H%M%S", time.gmtime(path.stat().st_mtime))


def _newest(paths, gpu: str | None, wanted) -> dict:
    """``{key: (path, data)}``: the newest readable file per ``wanted(data)`` key (``None`` = not a candidate)."""
    best = {}
    for path in sorted(paths):
        if gpu and gpu.lower() not in path.stem.lower():
            continue
        data = _read(path)
        key = wanted(data) if data is not None else None
        if key is None:
            continue
        rank = (_stamp(path, data), path.name)
        if key not in best or rank > best[key][0]:
            best[key] = (rank, path, data)
    return {k: (p, d) for k, (_, p, d) in best.items()}


def config_name(hidden: str) -> str:
    """Short name of a hidden-irreps string (``paper``, ``128x2e``, ``256``), else the string itself."""
    return next((k for k, v in CONFIGS.items() if v == hidden), hidden)


def gpu_pass_files(directory: str | Path | None = None, gpu: str | None = None) -> dict[tuple[str, str], Path]:
    """The newest ``<op>_gpu_*.json`` per (op, hidden irreps); ``gpu`` keeps names containing it (``"h100"``)."""
    directory = Path(directory) if directory is not None else RESULTS_DIR
    out = {}
    for op in OPS:
        found = _newest(
            directory.glob(f"{op}_gpu_*.json"),
            gpu,
            lambda d: (
                str(_lookup(d, "config", "hidden"))
                if isinstance(d.get("runs"), list) and _lookup(d, "config", "hidden")
                else None
            ),
        )
        out.update({(op, hidden): path for hidden, (path, _) in found.items()})
    return out


def _unmeasured(keys: dict, values: tuple[str, ...], reason: str) -> dict:
    """A row with no timing (yet): its keys, each of ``values`` None, and why."""
    return {**keys, **dict.fromkeys(values), "status": NOT_MEASURED, "reason": reason}


def _cell(op: str, hidden: str, dtype: str, backend: str, kind: str, **kw) -> dict:
    keys = dict(op=op, config=hidden, config_name=config_name(hidden), dtype=dtype, backend=backend)
    row = _unmeasured(keys, ("median_ms", "peak_mem_mb"), NO_FILE)
    row.update(file=None, device_name=None, repeats=[])
    row["pass"] = kind
    row.update(kw)
    return row


def _missing_reason(records: list[dict], backend: str, dtype: str, kind: str, stopped: str | None) -> str:
    """Why (backend, dtype, pass) has no timing: the run's skip or error, else the file's stop note."""
    for r in records:
        if r["median_ms"] is None and (r["backend"], r["dtype"]) == (backend, dtype) and r["pass"] in (None, kind):
            return f"skipped: {r['skipped']}" if r.get("skipped") else f"error: {r.get('error')}"
    return f"no row in the file; the run stopped: {stopped}" if stopped else "no row in the file"


def _file_cells(op: str, hidden: str, path: Path) -> list[dict]:
    records, _ = read_kernel_results(files=[path], include_skipped=True)
    target = OP_TARGETS[op]
    records = [r for r in records if target is None or r["target"] in (target, None)]
    data = _read(path) or {}
    common = dict(file=path.name, device_name=str(data.get("device_name") or data.get("device") or "?"))
    cells = []
    for dtype in DTYPES:
        for backend in gpu_backends():
            for kind in PASS_ORDER:
                got = [
                    r
                    for r in records
                    if r["median_ms"] is not None and (r["backend"], r["dtype"], r["pass"]) == (backend, dtype, kind)
                ]
                if not got:
                    why = _missing_reason(records, backend, dtype, kind, data.get("stopped"))
                    cells.append(_cell(op, hidden, dtype, backend, kind, reason=why, **common))
                    continue
                # A file can hold a row twice (two runs of one step): the first is shown, all are kept.
                first = got[0]
                cells.append(
                    _cell(
                        op,
                        hidden,
                        dtype,
                        backend,
                        kind,
                        median_ms=first["median_ms"],
                        peak_mem_mb=first.get("peak_mem_mb"),
                        status=FROM_LOG if first.get("source") else "measured",
                        reason=first.get("source"),
                        repeats=[r["median_ms"] for r in got],
                        **common,
                    )
                )
    return cells


def gpu_pass_rows(directory: str | Path | None = None, gpu: str | None = None) -> list[dict]:
    """One record per expected (op, config, dtype, backend, pass), measured or not.

    Fields: ``op, config (hidden irreps), config_name, dtype, backend, pass, median_ms
    (None when missing), peak_mem_mb, status ("measured" | "from log" | "not measured"),
    reason (why missing, or the log note), file, device_name, repeats`` (every timing of
    the row in the file). Configs in :data:`CONFIGS` without a file get ``reason`` "no result file".
    """
    files = gpu_pass_files(directory, gpu)
    hiddens = list(CONFIGS.values()) + sorted({h for _, h in files} - set(CONFIGS.values()))
    rows = []
    for op in OPS:
        for hidden in hiddens:
            if (op, hidden) in files:
                rows += _file_cells(op, hidden, files[(op, hidden)])
            elif hidden in CONFIGS.values():
                rows += [_cell(op, hidden, d, b, k) for d in DTYPES for b in gpu_backends() for k in PASS_ORDER]
    return rows


def gpu_step_file(directory: str | Path | None = None, gpu: str | None = None) -> tuple[Path, dict] | None:
    """``(path, data)`` of the newest ``train_step_gpu_*.json`` with a ``steps`` table, else ``None``."""
    directory = Path(directory) if directory is not None else RESULTS_DIR
    found = _newest(
        directory.glob("train_step_gpu_*.json"), gpu, lambda d: "step" if isinstance(d.get("steps"), dict) else None
    )
    return found.get("step")


def _step_cell(workload: str, dtype: str, backend: str, rec: dict | None, common: dict) -> dict:
    keys = dict(workload=workload, dtype=dtype, backend=backend)
    row = {**_unmeasured(keys, ("step_ms", "step_ms_min", "peak_mem_gb"), f"not run at {dtype}"), **common}
    if rec is None:
        return row
    row.update(atoms=rec.get("atoms"), edges=rec.get("edges"), edges_per_atom=rec.get("edges_per_atom"))
    got = _lookup(rec, "backends", backend) or {}
    if got.get("step_ms_median") is not None:
        row.update(
            step_ms=got["step_ms_median"],
            step_ms_min=got.get("step_ms_min"),
            peak_mem_gb=got.get("peak_mem_gb"),
            status="measured",
            reason=None,
        )
    elif got.get("skipped") or got.get("error") or rec.get("skipped"):
        why = got.get("skipped") or rec.get("skipped")
        row["reason"] = str(why) if why else f"error: {str(got.get('error')).splitlines()[0][:160]}"
    else:
        row["reason"] = "no row in the file"
    return row


def gpu_step_rows(directory: str | Path | None = None, gpu: str | None = None) -> list[dict]:
    """One record per (dtype, workload, backend) of the whole train step, measured or not.

    Fields: ``workload, dtype, backend, atoms, edges, edges_per_atom, step_ms (median,
    None when missing), step_ms_min, peak_mem_gb (torch's allocator), status, reason,
    file, device_name``. A workload the file has at one dtype is expected at every dtype.
    """
    found = gpu_step_file(directory, gpu)
    if found is None:
        return []
    path, data = found
    steps = {d: w for d, w in data["steps"].items() if isinstance(w, dict)}
    common = dict(file=path.name, device_name=str(_lookup(data, "meta", "device_name") or "?"))
    workloads = list(dict.fromkeys(w for wls in steps.values() for w in wls))
    return [
        _step_cell(w, dtype, b, steps.get(dtype, {}).get(w), common)
        for dtype in list(DTYPES) + sorted(set(steps) - set(DTYPES))
        for w in workloads
        for b in gpu_step_backends()
    ]


def gpu_step_profile(directory: str | Path | None = None, gpu: str | None = None) -> dict | None:
    """The step file's profiled numba step (``categories``, ``top5``, ``top_kernels``, ...), with ``device_name``."""
    found = gpu_step_file(directory, gpu)
    prof = found[1].get("profile") if found else None
    if not isinstance(prof, dict) or not isinstance(prof.get("categories"), dict):
        return None
    return dict(prof, device_name=str(_lookup(found[1], "meta", "device_name") or "?"), file=found[0].name)


def gpu_sources(directory: str | Path | None = None, gpu: str | None = None) -> list[str]:
    """The file behind each (op, config) and the train step, its GPU and time, and its own note on how it ran."""
    lines = []
    order = list(CONFIGS.values())
    files = gpu_pass_files(directory, gpu)
    for op, hidden in sorted(
        files, key=lambda k: (list(OPS).index(k[0]), order.index(k[1]) if k[1] in order else len(order), k[1])
    ):
        path, data = files[(op, hidden)], _read(files[(op, hidden)]) or {}
        note = data.get("stopped") or data.get("note")
        lines.append(
            f"{op} {config_name(hidden)}: {path.name} ({data.get('device_name', '?')}, "
            f"{data.get('timestamp') or 'no timestamp'})" + (f"; {note}" if note else "")
        )
    found = gpu_step_file(directory, gpu)
    if found:
        meta = found[1].get("meta") or {}
        lines.append(
            f"train step: {found[0].name} ({meta.get('device_name', '?')}, {meta.get('timestamp', '?')})"
            + (f"; {meta['note']}" if meta.get("note") else "")
        )
    return lines


def _grouped(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _missing_lines(head: str, cells: list[dict], name: str, every: int) -> list[str]:
    """``head name[, ...]: not measured (reason)`` per reason; the names are left out when all ``every`` miss."""
    lines = []
    for (reason,), same in _grouped([c for c in cells if c["status"] == NOT_MEASURED], ("reason",)).items():
        names = "" if len(same) == every else " " + ", ".join(str(c[name]) for c in same)
        lines.append(f"{head}{names}: {reason}" if reason == NO_FILE else f"{head}{names}: {NOT_MEASURED} ({reason})")
    return lines


def gpu_missing_rows(directory: str | Path | None = None, gpu: str | None = None) -> list[str]:
    """Every expected-but-missing GPU row in words, e.g.
    ``channelwise_tp 256x0e+256x1o float32: no result file`` or
    ``train step water-768 float32 numba, cueq, e3nn: not measured (time budget)``.
    """
    lines = []
    for (op, hidden, dtype), cells in _grouped(gpu_pass_rows(directory, gpu), ("op", "config", "dtype")).items():
        head = f"{op} {hidden} {dtype}"
        if all(c["status"] == NOT_MEASURED for c in cells) and len({c["reason"] for c in cells}) == 1:
            lines += _missing_lines(head, cells, "backend", len(cells))
            continue
        for (backend,), mine in _grouped(cells, ("backend",)).items():
            lines += _missing_lines(f"{head} {backend}", mine, "pass", len(PASS_ORDER))
    steps = gpu_step_rows(directory, gpu)
    if not steps:
        return lines + [f"train step: {NO_FILE} (train_step_gpu_*.json)"]
    for (workload, dtype), cells in _grouped(steps, ("workload", "dtype")).items():
        lines += _missing_lines(f"train step {workload} {dtype}", cells, "backend", 0)
    if gpu_step_profile(directory, gpu) is None:
        lines.append(f"train step profile: {NOT_MEASURED}")
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _table_row(what: str, dtype: str, kind: str, ms: dict, note: str) -> dict:
    return {
        "what": what,
        "dtype": dtype,
        "pass": kind,
        **{f"{b} ms": ms.get(b) for b in gpu_backends()},
        **{f"{OURS}/{b}": _ratio(ms.get(OURS), ms.get(b)) for b in gpu_backends() if b != OURS},
        "note": note,
    }


def gpu_results_table(directory: str | Path | None = None, gpu: str | None = None) -> list[dict]:
    """The measured GPU rows, one per (op, config, dtype, pass) and per (workload, dtype) of the step.

    Keys: ``what, dtype, pass, numba ms, cueq ms, e3nn ms, numba/cueq, numba/e3nn, note``
    (a ratio below 1 means numba is faster; ``None`` where a side is missing).
    """
    out = []
    for (op, hidden, dtype, kind), cells in _grouped(
        gpu_pass_rows(directory, gpu), ("op", "config", "dtype", "pass")
    ).items():
        ms = {c["backend"]: c["median_ms"] for c in cells if c["median_ms"] is not None}
        if ms:
            logged = [c["backend"] for c in cells if c["status"] == FROM_LOG]
            notes = [f"{FROM_LOG}: {', '.join(logged)}"] if logged else []
            notes += [f"{c['backend']} {len(c['repeats'])} rows, first shown" for c in cells if len(c["repeats"]) > 1]
            out.append(_table_row(f"{op} {config_name(hidden)}", dtype, kind, ms, "; ".join(notes)))
    for (workload, dtype), cells in _grouped(gpu_step_rows(directory, gpu), ("workload", "dtype")).items():
        ms = {c["backend"]: c["step_ms"] for c in cells if c["step_ms"] is not None}
        if ms:
            peak = ", ".join(f"{c['backend']} {c['peak_mem_gb']:.1f}" for c in cells if c["peak_mem_gb"] is not None)
            out.append(_table_row(f"train step {workload}", dtype, "step", ms, f"peak GB {peak}" if peak else ""))
    return out


def _text(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def format_gpu_table(rows: list[dict]) -> str:
    """Fixed-width text of :func:`gpu_results_table` rows: numbers right-aligned, 3 significant digits."""
    if not rows:
        return "no measured GPU rows"
    cols = list(rows[0])
    numeric = [all(r.get(c) is None or isinstance(r[c], (int, float)) for r in rows) for c in cols]
    cells = [[_text(r.get(c)) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, width, numeric)).rstrip()

    head = line(cols)
    return "\n".join([head, "-" * len(head)] + [line(row) for row in cells])
