"""Stop a training run cleanly when the scheduler says so, so that a requeued job resumes exactly.

SLURM tells a job it is about to lose its allocation with a signal: SIGTERM when it is
cancelled, requeued (``scontrol requeue``) or preempted (then SIGKILL ``KillWait`` seconds
later), and the ``--signal=USR2@N`` the launcher asks for N seconds before the time limit.
Each rank gets the signal at a slightly different moment, in the middle of a step, so
acting in the handler would leave the ranks at different steps and a collective hanging.
Instead the handler only records the signal; at every step boundary the trainer calls
:func:`requested`, which all-reduces (max) the recorded signal number over the ranks, so
every rank sees the same answer at the same step. The trainer then writes its normal
mid-epoch checkpoint (all ranks' sampler positions and RNG states, written by rank 0) and
raises :class:`Preempted`. The step that was running when the signal came completes and is
logged before the checkpoint, so a resumed run neither loses nor repeats a step.

The guard is opt-in: it is active only while ``train(preempt_signals=...)`` or, when that is
None, ``WORKBENCH_PREEMPT_SIGNALS`` names signals (``workbench.launch`` asks its workers for
``TERM,USR2``) and only in the main thread
(Python can install signal handlers nowhere else). ``train()`` run directly, or under a
bare ``torchrun``, keeps the default behaviour of dying on SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from workbench.switches import switch

ENV_VAR = "WORKBENCH_PREEMPT_SIGNALS"
#: ``workbench train`` exits with this after a preemption checkpoint (sysexits' EX_TEMPFAIL: retry).
PREEMPTED_EXIT = 75


class Preempted(Exception):
    """Raised by ``train()`` after it checkpointed at a step boundary because of a signal.

    ``signal_name`` is the signal some rank received (``"TERM"``, ``"USR2"``, ...); when
    several ranks got different ones, the highest signal number wins (TERM over USR2), and
    it is the same on every rank. ``global_step`` is the last completed (and saved) step.
    """

    def __init__(self, signal_name: str, global_step: int) -> None:
        super().__init__(
            f"stopped by SIG{signal_name} after step {global_step}; "
            f"the checkpoint holds step {global_step} and a relaunch resumes from it"
        )
        self.signal_name = signal_name
        self.global_step = global_step


class _Guard:
    def __init__(self, signums: list[int]) -> None:
        self.signums = signums
        self.received = 0  # signal number, 0 when none
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        # Only record: the trainer acts at the next step boundary, on all ranks together.
        self.received = max(self.received, signum)

    def install(self) -> None:
        for s in self.signums:
            self._previous[s] = signal.signal(s, self._handler)

    def uninstall(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()


_active: _Guard | None = None


def _parse(names: str) -> list[int]:
    out = []
    for raw in names.replace(" ", "").split(","):
        if not raw:
            continue
        name = raw.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if not hasattr(signal, name):
            raise ValueError(f"preempt signals {names!r}: {raw!r} is not a signal name (use e.g. TERM,USR2)")
        out.append(int(getattr(signal, name)))
    return out


@contextlib.contextmanager
def guard(names: str | None = None) -> Iterator[None]:
    """While active, record the signals ``names`` (``"TERM,USR2"``; None: ``$WORKBENCH_PREEMPT_SIGNALS``)
    instead of dying.

    Restores the previous handlers on exit. A no-op when no signal is named, or outside the
    main thread.
    """
    global _active
    signums = _parse(switch(ENV_VAR) if names is None else names)
    if not signums or threading.current_thread() is not threading.main_thread() or _active is not None:
        yield
        return
    guard = _Guard(signums)
    guard.install()
    _active = guard
    try:
        yield
    finally:
        _active = None
        guard.uninstall()


def requested(world: int, device) -> str | None:
    """At a step boundary: the signal name if any rank got one since the guard started, else None.

    Collective when ``world > 1`` and the guard is active: call it at the same step on every
    rank. Every rank has the same environment, so every rank either has a guard or has none.
    """
    if _active is None:
        return None
    received = _active.received
    if world > 1:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        received = int(flag.item())
    if not received:
        return None
    return signal.Signals(received).name.removeprefix("SIG")
