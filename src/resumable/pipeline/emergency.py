"""The emergency checkpoint: the newest state made durable within a preemption's grace.

A preemption (a signal, a cloud notice: `resumable.preemption`) is noticed at the next
`maybe_save`. With several ranks the notice reaches them at different moments, so every
rank stops at one step, the first at which any rank has it: persisting in the
background, the rank that has it raises a flag in the coordination store (from the
signal handler at once, else at its next `maybe_save`), and the first rank to reach a
step decides for all whether it is the one (`Agreement.any_since`: no collective while
training runs); with ``persist="sync"``, a one-integer all-reduce a step. Then: wait
for a persist already running (within the grace), and persist this
step's memory snapshot if there is one, else a fresh snapshot if its measured cost
fits what is left of the grace (rank 0 decides: timings differ), else the newest older
snapshot. The outcome and whether it fit are recorded in the audit log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from resumable.audit import AuditLog
from resumable.coordination import Agreement
from resumable.errors import PersistError
from resumable.group import Group
from resumable.pipeline.persister import Persister
from resumable.preemption import GraceBudget, Preemption, PreemptionMonitor
from resumable.snapshot import MemorySnapshot

log = logging.getLogger(__name__)


class Emergency:
    """Watches for a preemption and takes the emergency checkpoint.

    Call order (the facade's, on the training thread): construction installs the
    signal handlers and starts the watchers. `requested` at each `maybe_save`; once it
    is true, `checkpoint` once, then `left_s` for what is left of the grace.
    `reclaim_signals` whenever a framework replaced the handlers; `close` once, which
    puts the earlier handlers back. `checkpoint` logs an earlier persist's failure and
    still takes the emergency checkpoint; a failure of its own persist is raised."""

    def __init__(self, config: Preemption, coordination: Group, agreement: Agreement) -> None:
        self.monitor = PreemptionMonitor(config)
        self.group = coordination
        self.agreement = agreement
        self.deadline: float | None = None  # the end of the grace, once preempted
        self.monitor.on_signal = self._tell_others
        self.monitor.install()

    def _tell_others(self) -> None:
        """From the signal handler: raise the stop flag for the other ranks now. A
        failure is left to the next `maybe_save`, which raises the flag again."""
        try:
            self.agreement.raise_flag("stop")
        except Exception as exc:
            log.debug("could not tell the other ranks of the preemption yet: %s", exc)

    @property
    def config(self) -> Preemption:
        return self.monitor.config

    def reclaim_signals(self) -> None:
        self.monitor.reclaim()

    def requested(self, step: int) -> bool:
        """Whether any rank was asked to stop (the same answer on every rank at
        ``step``)."""
        return self.agreement.any_since("stop", step, self.monitor.requested)

    def checkpoint(
        self,
        step: int,
        metrics: Mapping[str, Any] | None,
        *,
        persister: Persister,
        newest: Callable[[], MemorySnapshot | None],
        persist: Callable[[MemorySnapshot], None],
        save: Callable[[int, Mapping[str, Any] | None], object],
        audit: AuditLog,
        snapshot_s: float | None,
        persist_s: float | None,
    ) -> None:
        """Persist the state of ``step`` (or the newest that fits) within the grace."""
        pm = self.monitor
        t0 = time.monotonic()
        remaining = pm.remaining_s()
        log.warning(
            "preemption (%s): emergency checkpoint of step %d, %.1f s of grace left",
            pm.reason,
            step,
            remaining,
        )
        audit.record("preempt", step=step, reason=pm.reason, remaining_s=round(remaining, 3))
        self.deadline = time.monotonic() + remaining
        try:
            persister.wait(timeout=max(0.1, remaining))
        except PersistError as exc:
            log.error("an earlier persist failed before the emergency checkpoint: %s", exc)
        budget = GraceBudget(pm.remaining_s(), snapshot_s, persist_s)
        fits = bool(self.group.broadcast(budget.fresh_snapshot_fits))  # rank 0 decides
        snap = newest()
        if snap is not None and snap.step == step:
            persist(snap)
            how = "persisted the snapshot of this step"
        elif snap is None or fits:
            save(step, metrics)
            how = "snapshot and persist"
        else:
            log.warning(
                "a fresh snapshot and persist (about %.1f s) does not fit the %.1f s left: "
                "persisting the newest snapshot, of step %d",
                budget.estimate_s,
                budget.remaining_s,
                snap.step,
            )
            persist(snap)
            how = f"persisted the older snapshot of step {snap.step}"
        persister.wait(timeout=max(0.1, pm.remaining_s()))
        left = pm.remaining_s()
        audit.record(
            "emergency_commit",
            step=persister.committed,
            how=how,
            duration_s=round(time.monotonic() - t0, 6),
            estimate_s=budget.estimate_s,
            within_grace=left >= 0,
        )
        if left < 0:
            log.error("the emergency checkpoint took %.1f s longer than the grace period", -left)

    def left_s(self) -> float | None:
        """Seconds left of the grace period, once preempted."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def close(self) -> None:
        self.monitor.uninstall()
