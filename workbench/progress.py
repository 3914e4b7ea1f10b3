"""Progress bars that suit where the output goes.

On a terminal or in Jupyter, a tqdm bar updated in place. Anywhere else (a CI log, a file,
``make demo | tee``) a handful of plain lines: one at each quarter of the work and one at the
end, so logs stay readable instead of holding thousands of carriage-return updates.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["bar", "interactive"]


def interactive() -> bool:
    """True on a terminal or inside a Jupyter kernel."""
    if "ipykernel" in sys.modules:
        try:
            from IPython import get_ipython

            if get_ipython() is not None:
                return True
        except ImportError:
            pass
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class LineProgress:
    """The tqdm calls the workbench uses (``update``, ``set_postfix``, ``close``), as a few lines."""

    def __init__(
        self, total: float | None, desc: str, unit: str, initial: float = 0, unit_scale: bool = False, quarters: int = 4
    ) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.unit_scale = unit_scale
        self.quarters = quarters
        self._next = 1
        self._postfix = ""
        self._t0 = self._last = time.monotonic()

    def _fmt(self, x: float) -> str:
        if not self.unit_scale:
            return f"{x:.0f}"
        for unit in ("", "k", "M", "G", "T"):
            if abs(x) < 1000:
                return f"{x:.1f}{unit}"
            x /= 1000
        return f"{x:.1f}P"

    def _line(self, final: bool = False) -> None:
        elapsed = time.monotonic() - self._t0
        share = f"{self.n / self.total:4.0%} " if self.total else ""
        of = f"/{self._fmt(self.total)}" if self.total else ""
        rate = f", {self._fmt(self.n / elapsed)} {self.unit}/s" if elapsed > 0 else ""
        post = f" [{self._postfix}]" if self._postfix else ""
        done = " done" if final else ""
        print(
            f"{self.desc}: {share}{self._fmt(self.n)}{of} {self.unit} in {elapsed:.1f} s{rate}{post}{done}",
            file=sys.stderr,
            flush=True,
        )
        self._last = time.monotonic()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self.total:
            while self._next < self.quarters and self.n >= self.total * self._next / self.quarters:
                self._next += 1
                self._line()
        elif time.monotonic() - self._last > 60:
            self._line()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if self.desc is not None:
            self._line(final=True)
            self.desc = None

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def bar(
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    disable: bool = False,
    initial: float = 0,
    unit_scale: bool = False,
):
    """A tqdm bar on a terminal or in Jupyter, else a :class:`LineProgress`; nothing when ``disable``."""
    from tqdm.auto import tqdm

    if disable:
        return tqdm(total=total, disable=True)
    if interactive():
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale)
    return LineProgress(total, desc, unit, initial=initial, unit_scale=unit_scale)
