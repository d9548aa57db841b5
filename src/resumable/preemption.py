"""Preemption: turn a short warning (a signal, a cloud termination notice) into an
emergency checkpoint at the next step boundary, then a clean exit for requeueing.

Signal handlers only record that a stop was asked for and when: no I/O, no locks, no
allocation worth mentioning. Everything else happens on the training thread at the next
``maybe_save``: the manager persists the newest memory snapshot if it is of that step
(or takes one), waits for the commit within the grace period, sets ``should_stop`` and,
by default, exits with `REQUEUE_EXIT_CODE`. A signal that arrives while evaluating or
while a persist runs stays recorded until that boundary, so it is never lost.

`GraceBudget` decides between a fresh snapshot of the current step and persisting the
newest existing snapshot, from measured snapshot and persist times.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 75
"""Exit code after an emergency checkpoint: EX_TEMPFAIL from sysexits.h ("temporary
failure, the user is invited to retry"). Orchestrators are told to restart on it:
``podFailurePolicy`` ``onExitCodes: [75] -> Ignore`` on Kubernetes, ``scontrol requeue``
in a Slurm batch script, ``torchrun --max-restarts``."""


@dataclass(frozen=True)
class Preemption:
    """How a `Checkpointer` reacts to a stop warning.

    Args:
        signals: signal names whose arrival asks for an emergency checkpoint.
        grace_seconds: the time between the warning and a hard kill (Slurm's
            ``--signal=USR1@90`` gives 90, Kubernetes ``terminationGracePeriodSeconds``,
            2 minutes on AWS spot, 30 s on GCP).
        exit: exit the process with ``exit_code`` after the emergency checkpoint
            committed (otherwise only set ``Checkpointer.should_stop``).
        exit_code: the exit status (default `REQUEUE_EXIT_CODE`).
        watchers: cloud termination-notice watchers (`resumable.watchers`), started with
            the `Checkpointer` and stopped by ``close()``.
    """

    signals: Sequence[str] = ("SIGTERM", "SIGUSR1")
    grace_seconds: float = 30.0
    exit: bool = True
    exit_code: int = REQUEUE_EXIT_CODE
    watchers: Sequence[Any] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in self.signals:
            if not isinstance(getattr(signal, str(name), None), signal.Signals):
                raise ValueError(f"unknown signal {name!r} in Preemption(signals=...)")
        if not (isinstance(self.grace_seconds, (int, float)) and self.grace_seconds > 0):
            raise ValueError(f"grace_seconds must be positive, got {self.grace_seconds!r}")


class PreemptionMonitor:
    """The flag the handlers set, and the handlers' installation. Owned by the manager."""

    def __init__(self, config: Preemption) -> None:
        self.config = config
        self.requested_at: float | None = None
        self.reason: str | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._lock = threading.Lock()
        # Called by the handler (on the main thread) once a signal asked to stop: the
        # owner tells the other ranks at once rather than at the next maybe_save.
        self.on_signal: Callable[[], None] = lambda: None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def remaining_s(self) -> float:
        """Seconds left of the grace period (the full period if nothing was requested)."""
        if self.requested_at is None:
            return float(self.config.grace_seconds)
        return self.config.grace_seconds - (time.monotonic() - self.requested_at)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            self.reason = f"signal {signal.Signals(signum).name}"
            self.on_signal()

    def notice(self, reason: str) -> None:
        """Called by a watcher thread when a termination notice appears."""
        with self._lock:
            if self.requested_at is None:
                self.requested_at = time.monotonic()
                self.reason = reason

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere Python forbids it)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption signals %s not installed: Checkpointer was created outside the "
                "main thread",
                list(self.config.signals),
            )
        else:
            for name in self.config.signals:
                signum = signal.Signals[str(name)]
                self._previous[signum] = signal.signal(signum, self._handle)
        for watcher in self.config.watchers:
            watcher.start(self.notice)

    def reclaim(self) -> None:
        """Install the handlers again over ones installed after ours (a framework's own),
        without changing what `uninstall` restores. Main thread only; elsewhere a no-op."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
        for watcher in self.config.watchers:
            watcher.stop()


@dataclass(frozen=True)
class GraceBudget:
    """Whether a fresh snapshot plus persist fits the time left, from measurements."""

    remaining_s: float
    snapshot_s: float | None
    persist_s: float | None

    @property
    def estimate_s(self) -> float | None:
        if self.persist_s is None:
            return None
        return (self.snapshot_s or 0.0) + self.persist_s

    @property
    def fresh_snapshot_fits(self) -> bool:
        """Unknown costs count as fitting: the first emergency save is measured."""
        est = self.estimate_s
        return est is None or est <= self.remaining_s
