"""Compiled polynomials: a :class:`~workbench.kernels.descriptor.TermTable` with its host arrays
and per-device copies (uploaded once, cached), as every backend takes them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from workbench.kernels.descriptor.layout import EDGE_ROWS, row_codes
from workbench.kernels.descriptor.polynomial import SparsePolynomial
from workbench.kernels.descriptor.tables import term_table
from workbench.kernels.numba.gpu.device import cudasim_enabled

__all__ = ["CompiledPolynomial", "TransientCache"]


class TransientCache:
    """A lock and a dict of derived objects that are rebuilt, never pickled."""

    def _init_cache(self) -> None:
        self._cache: dict = {}
        self._lock = threading.Lock()

    def _cached(self, key: Any, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = build()
            return self._cache[key]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"] = {}
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class CompiledPolynomial(TransientCache):
    """Term tables of one output polynomial, ready for the kernels.

    Slot ``q`` reads kernel array ``slot_arr[q]`` (see :func:`~workbench.kernels.descriptor.layout.array_ids`)
    at the row of code ``slot_rows[q]``, element ``slot_off[q] + c * slot_cs[q]``. The output's
    rows say the kernel shape: per atom, per species (per-atom partials summed per species), per
    edge (``reduce_channels``: summed over channels) or per sender / receiver node (scatter-sum
    over a CSR segment). ``covers_output``: every element of an output row is reached by some
    term, so a kernel that stores each computed component writes the whole row.
    """

    def __init__(self, poly: SparsePolynomial, array_ids: Sequence[int]):
        self.poly = poly
        self.array_ids = tuple(array_ids)
        self.table = term_table(poly, array_ids, row_codes(op.rows for op in poly.operands))
        self.output = poly.output
        self.num_slots = self.table.num_slots
        self.num_terms = self.table.num_terms
        self.out_off = self.table.out_off
        self.out_cs = self.table.out_cs
        self.out_size = poly.output.size
        self.out_rows = poly.output.rows
        self.edge = poly.output.rows in EDGE_ROWS
        self.species_output = poly.output.rows == "species"
        self.node_output = poly.output.rows in ("sender", "receiver")
        cs = set(poly.output.cstrides)
        if self.edge and 0 in cs and cs != {0}:
            raise ValueError("an output must be either channelwise or channel-broadcast in every component")
        self.reduce_channels = self.edge and cs == {0}
        self.covers_output = _covers(poly)
        self.accumulators = len({o for o, _ in poly.terms})  # output components a kernel sums into
        self._coef = {"float64": self.table.coef64, "float32": self.table.coef("float32")}
        self._init_cache()

    def split(self, parts: int) -> list:
        """``parts`` term tables over contiguous groups of output components, balanced by terms
        (each evaluates its components of the same output); fewer when there are fewer
        components."""
        return self._cached(("split", parts), lambda: self._split(parts))

    def _split(self, parts: int) -> list:
        per = {}
        for o, _ in self.poly.terms:
            per[o] = per.get(o, 0) + 1
        comps = sorted(per)
        if parts >= len(comps):  # as fine as components go: one each
            return self._tables([[o] for o in comps])
        target = self.num_terms / max(1, min(parts, len(comps)))
        groups, cur, load = [], [], 0
        for o in comps:
            if cur and load + per[o] / 2 > target * (len(groups) + 1) and len(groups) < parts - 1:
                groups.append(cur)
                cur = []
            cur.append(o)
            load += per[o]
        groups.append(cur)
        return self._tables(groups)

    def _tables(self, groups: list[list[int]]) -> list:
        codes = row_codes(op.rows for op in self.poly.operands)
        tables = []
        for g in groups:
            keep = set(g)
            sub = SparsePolynomial(
                self.poly.operands, self.poly.output, {k: v for k, v in self.poly.terms.items() if k[0] in keep}
            )
            tables.append(term_table(sub, self.array_ids, codes))
        return tables

    def split_terms(self, size: int) -> list:
        """Term tables of at most about ``size`` terms each, cutting a component's terms into
        ``ceil(n / size)`` equal runs where it has more (:meth:`split` cannot go below one
        component). Consecutive runs are packed into parts up to ``size`` terms; a part lists in
        ``add_to`` the components whose first run an earlier part stored, so its kernel adds to
        them: launched in order on one stream, the sum is the same on every run."""
        return self._cached(("split_terms", size), lambda: self._split_terms(size))

    def _split_terms(self, size: int) -> list:
        per: dict[int, list] = {}
        for key, coef in sorted(self.poly.terms.items()):
            per.setdefault(key[0], []).append((key, coef))
        return self._pack([run for o in sorted(per) for run in _equal_runs(per[o], size)], size)

    def split_operand(self, size: int, operand: int) -> list:
        """Term tables of about ``size`` terms each, holding whole groups of the terms that share
        their factors of ``operand`` (across output components), groups in order. Where an
        output component's terms read many components of one operand (the species weights of a
        derivative), a part then reads only a few of them, at the price of adding into every
        component an earlier part stored (``add_to``, as in :meth:`split_terms`)."""
        return self._cached(("split_operand", size, operand), lambda: self._split_operand(size, operand))

    def _split_operand(self, size: int, operand: int) -> list:
        groups: dict[tuple, list] = {}
        for key, coef in sorted(self.poly.terms.items()):
            groups.setdefault(tuple(f for f in key[1] if f[0] == operand), []).append((key, coef))
        # a group larger than a part: equal runs, by output component
        return self._pack([run for g in sorted(groups) for run in _equal_runs(groups[g], size)], size)

    def _pack(self, runs: list[list], size: int) -> list:
        """Consecutive runs of ``((o, factors), coefficient)`` packed into parts of up to ``size``
        terms; a part's ``add_to`` lists the components an earlier part stored."""
        from dataclasses import replace

        parts, cur, load = [], [], 0
        for run in runs:
            if cur and load + len(run) > size:
                parts.append(cur)
                cur, load = [], 0
            cur.append(run)
            load += len(run)
        parts.append(cur)
        codes = row_codes(op.rows for op in self.poly.operands)
        tables, stored = [], set()
        for part in parts:
            terms = {k: v for run in part for k, v in run}
            sub = SparsePolynomial(self.poly.operands, self.poly.output, terms)
            t = term_table(sub, self.array_ids, codes)
            mine = {k[0] for k in terms}
            tables.append(replace(t, add_to=tuple(sorted(mine & stored))))
            stored |= mine
        return tables

    def host_tables(self, dtype: str) -> tuple:
        """``(slot_arr, slot_rows, slot_off, slot_cs, t_out, t_fac, t_coef, out_off, out_cs)``."""
        t = self.table
        return (
            t.slot_arr,
            t.slot_rows,
            t.slot_off,
            t.slot_cs,
            t.t_out,
            t.t_fac,
            self._coef[dtype],
            t.out_off,
            t.out_cs,
        )

    def lean_tables(self, dtype: str, device: bool = True) -> tuple:
        """The atom table kernel's arguments in the smallest unsigned integers, so that its term
        loop does no sign checks and reads 2-byte indices: ``(slot_arr uint8, slot_off uint32,
        slot_cs uint32, t_out uint16, t_fac uint16 flattened to [terms * degree], t_coef,
        out_off uint32, out_cs uint32)``; on the current CUDA device unless ``device`` is false
        or under the simulator."""

        def build() -> tuple:
            t = self.table
            if t.num_slots >= 2**16 - 1 or self.output.size >= 2**16:
                raise ValueError(
                    f"{self.output.name}: {t.num_slots} slots or {self.output.size} components do not fit "
                    "the table kernel's 16-bit indices"
                )
            return (
                t.slot_arr.astype(np.uint8),
                t.slot_off.astype(np.uint32),
                t.slot_cs.astype(np.uint32),
                t.t_out.astype(np.uint16),
                np.ascontiguousarray(t.t_fac.astype(np.uint16).reshape(-1)),
                self._coef[dtype],
                t.out_off.astype(np.uint32),
                t.out_cs.astype(np.uint32),
            )

        host = self._cached(("lean", dtype), build)
        return self._on_device(("lean", dtype), host) if device else host

    @property
    def degree(self) -> int:
        """Factors per term in the table (padded with the constant slot): the term loop's inner trip count."""
        return int(self.table.t_fac.shape[1])

    def device_tables(self, dtype: str) -> tuple:
        """:meth:`host_tables` on the current CUDA device; the host arrays under the simulator."""
        return self._on_device(("tables", dtype), self.host_tables(dtype))

    def _on_device(self, key: tuple, host: tuple) -> tuple:
        """``host`` arrays uploaded once per CUDA device (cached under ``key``); themselves under the simulator."""
        if cudasim_enabled():
            return host
        from numba import cuda

        def upload() -> tuple:
            arrays = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in host)
            # the copies ran on the legacy stream: done before a kernel on another stream (a
            # CUDA-graph warm-up's side stream) reads them
            cuda.synchronize()
            return arrays

        return self._cached((*key, cuda.get_current_device().id), upload)


def _covers(poly: SparsePolynomial) -> bool:
    """Every component has a term and the components' elements tile the output row."""
    out = poly.output
    if {o for o, _ in poly.terms} != set(range(out.size)):
        return False
    channels = out.width // out.size if all(cs > 0 for cs in out.cstrides) else 1
    cells = {off + c * cs for off, cs in zip(out.offsets, out.cstrides) for c in range(channels)}
    return cells == set(range(out.width))


def _equal_runs(terms: list, size: int) -> list[list]:
    """``terms`` cut into ``ceil(len / size)`` runs of equal length (the last shorter)."""
    n = -(-len(terms) // -(-len(terms) // size))
    return [terms[i : i + n] for i in range(0, len(terms), n)]
