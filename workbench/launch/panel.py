"""``RunPanel``: an ipywidgets view of a run that refreshes itself without blocking the kernel.

A daemon thread re-reads the run every ``refresh_s`` seconds and assigns widget values
(ipykernel sends widget updates from any thread); it stops once the run is done or failed,
or on :meth:`RunPanel.stop`. ``refresh()`` updates synchronously (tests, or manual use).
"""

from __future__ import annotations

import html
import threading

import ipywidgets as widgets

_COLOURS = {"pending": "#8a6d00", "running": "#1f6feb", "done": "#1a7f37", "failed": "#cf222e"}


class RunPanel(widgets.VBox):
    """Status, latest loss, per-rank step time and log tail of a :class:`~workbench.launch.Run`.

    Widgets (for embedding elsewhere): ``header`` (status line), ``loss`` (loss and step),
    ``ranks`` (per-rank step-time table), ``log_tail`` (log tail), ``cancel_button``, ``refresh_button``.
    """

    def __init__(self, run, refresh_s: float = 2.0, log_lines: int = 15, autostart: bool = True) -> None:
        self.run = run
        self.refresh_s = float(refresh_s)
        self.log_lines = int(log_lines)
        self.header = widgets.HTML()
        self.loss = widgets.HTML()
        self.ranks = widgets.HTML()
        self.log_tail = widgets.HTML()
        self.refresh_button = widgets.Button(description="Refresh", icon="refresh")
        self.cancel_button = widgets.Button(description="Cancel run", button_style="danger", icon="stop")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.cancel_button.on_click(lambda _: self._cancel())
        logs_box = widgets.Accordion(children=[self.log_tail])
        logs_box.set_title(0, "Log tail")
        super().__init__(
            [
                self.header,
                widgets.HBox([self.loss, self.ranks]),
                widgets.HBox([self.refresh_button, self.cancel_button]),
                logs_box,
            ]
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status = "pending"
        self.refresh()
        if autostart and self.status not in ("done", "failed"):
            self.start()

    def refresh(self) -> str:
        """Re-read the run and update every widget; returns the status."""
        status, reason = self.run.refresh()
        self.status = status
        colour = _COLOURS.get(status, "#555")
        where = f"SLURM job {self.run.job_id}" if self.run.backend == "slurm" else f"local pid {self.run.pid}"
        self.header.value = (
            f"<b>{html.escape(self.run.name)}</b> &nbsp; {where} &nbsp; "
            f"<span style='color:{colour};font-weight:bold'>{status}</span> "
            f"<span style='color:#555'>{html.escape(reason)}</span>"
        )
        m = self.run.metrics()
        last = m.last_loss
        epoch = m.epochs[-1] if m.epochs else None
        self.loss.value = (
            f"<div style='margin-right:2em'>step <b>{m.global_step}</b><br>"
            f"loss <b>{'—' if last is None else f'{last:.5g}'}</b>"
            + (f"<br>valid F MAE {epoch['valid_f_mae_mev_a']:.1f} meV/Å" if epoch else "")
            + "</div>"
        )
        self.ranks.value = _rank_table(m.step_time_per_rank(), self.run.rank_states())
        self.log_tail.value = f"<pre style='font-size:11px'>{html.escape(self.run.logs(tail=self.log_lines))}</pre>"
        self.cancel_button.disabled = status in ("done", "failed")
        return status

    def start(self) -> None:
        """Refresh in a background thread until the run ends (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"RunPanel-{self.run.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                if self.refresh() in ("done", "failed"):
                    return
            except Exception as exc:  # keep the panel alive through a transient read error
                self.header.value += f"<br><span style='color:#cf222e'>refresh error: {html.escape(str(exc))}</span>"

    def _cancel(self) -> None:
        self.cancel_button.disabled = True
        threading.Thread(target=lambda: (self.run.cancel(), self.refresh()), daemon=True).start()


def _rank_table(times: dict[int, float], states: dict[int, dict]) -> str:
    """rank | node | step time: where each rank runs (several nodes: which one) and how fast."""
    if not times:
        return "<i>no steps yet</i>"
    rows = "".join(
        f"<tr><td>{r}</td><td>{html.escape(str(states.get(r, {}).get('node', '?')))}</td>"
        f"<td style='text-align:right'>{t * 1000:.0f} ms</td></tr>"
        for r, t in times.items()
    )
    return "<table><tr><th>rank</th><th>node</th><th>step time (last 10)</th></tr>" + rows + "</table>"
