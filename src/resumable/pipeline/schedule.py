"""When to snapshot and when to persist: the two cadences of `Checkpointer.maybe_save`.

A persist that falls due while the previous one still runs is *owed*: taken at the
first step that finds the worker free, once, however many persists fell due meanwhile
(those are *absorbed* into it and counted as skipped). The measured cost of a persist
(its blocking time, a median of the last few) is what ``Every(auto=True)`` plans with
(`docs/interval.md`).

With several ranks every decision must be the same on every rank, or ranks would
snapshot different steps: step-based cadences are, clock-based ones are not (clocks and
costs differ between ranks), so those, and whether the worker is free to take an owed
persist, are agreed (`resumable.coordination.Agreement`: the first rank to ask decides
for all, without waiting for the others). With one process a rank's own answer stands.

Steps only go forward: a step older than the newest one restored or saved is refused
(`check_order`), since its checkpoint would never be the one restored.
"""

from __future__ import annotations

import time

from resumable.coordination import Agreement
from resumable.errors import StepOrderError
from resumable.policy import CostEstimate, Every


class Schedule:
    """Decides, at each `maybe_save`, whether a persist or a snapshot is due.

    Used from the training thread only. The facade tells it what happened
    (`snapshotted`, `persisted`, `deferred`, `restored`, `observe_cost`).

    Call order (the facade's): `on_absorbed` set once after construction;
    `restored` after each restore that loaded a step. At each `maybe_save`:
    `check_order`, then `persist_due`. If it is true, `persisted` when the persist
    starts, or `deferred` when the worker is busy; `observe_cost` after a persist
    started. Otherwise `memory_due`, then `snapshotted` once the snapshot is taken.
    A pure state machine: no I/O; its clock is ``time.monotonic``."""

    def __init__(
        self, memory_every: Every | None, persist_every: Every, agreement: Agreement
    ) -> None:
        self.memory_every = memory_every
        self.persist_every = persist_every
        self._agreement = agreement
        self.last_persist: int | None = None
        self.last_memory: int | None = None
        self._persist_clock = self._memory_clock = time.monotonic()
        self.owed = False
        self._last_absorbed = -1
        self._absorbed_clock = float("-inf")
        self.cost = CostEstimate()
        self.on_absorbed = lambda step: None  # set by the owner: count a skipped persist
        self.newest: int | None = None  # the newest step restored, snapshotted or persisted
        self._newest_restored = False  # whether ``newest`` is the step restore() returned

    def check_order(self, step: int, call: str) -> None:
        """Refuse (`StepOrderError`) a ``call`` of ``step`` older than the newest step
        restored or saved. The same step again is allowed (a save after the snapshot of
        its step, a framework's final save at the step it saved last)."""
        newest = self.newest
        if newest is None or step >= newest:
            return
        if self._newest_restored:
            what = f"restore() returned step {newest}"
        else:
            what = f"step {newest} was saved already"
        raise StepOrderError(
            f"{call}({step}) after {what}: steps must not go back. A checkpoint of step "
            f"{step} would never be the one restored (step {newest} is newer), so the "
            "training since would be lost at the next launch. Count steps from the step "
            "restore() returned (start = ckpt.restore(); for step in range(start, total): "
            "...; ckpt.maybe_save(step + 1)); to go back to an older checkpoint on "
            "purpose, call restore(step=N) first"
        )

    def persist_due(self, step: int, *, worker_free: bool) -> bool:
        """Whether `maybe_save(step)` persists: a policy due, or an owed persist that the
        (now free) worker can take."""
        if self.owed:
            worker_free = self._agreement.decide("free", step, worker_free)  # all or none
        last = self.last_persist
        if self._last_absorbed >= 0:
            last = max(last or 0, self._last_absorbed)
        policy = self.persist_every
        if _timed(policy):
            since = time.monotonic() - max(self._persist_clock, self._absorbed_clock)
            policy_due = policy.due(
                step, last_step=last, since_last_s=since, cost_s=self.cost.value
            )
            policy_due = self._agreement.decide("due", step, policy_due)  # one rank's clock
        else:  # steps only: neither the clock nor the cost is read
            policy_due = policy.due(step, last_step=last, since_last_s=0.0)
        if not self.owed:
            return policy_due
        if not worker_free and policy_due:
            self._last_absorbed, self._absorbed_clock = step, time.monotonic()
            self.on_absorbed(step)
        return worker_free

    def memory_due(self, step: int) -> bool:
        if self.memory_every is None:
            return False
        return self.memory_every.due(
            step, last_step=self.last_memory, since_last_s=time.monotonic() - self._memory_clock
        )

    def snapshotted(self, step: int) -> None:
        self.last_memory = step
        self._saw(step)
        self._memory_clock = time.monotonic()

    def persisted(self, step: int) -> None:
        """A persist of ``step`` started (or, synchronously, committed)."""
        self.owed = False
        self.last_persist = step
        self._persist_clock = time.monotonic()
        self._saw(step)

    def deferred(self) -> None:
        """A persist was due but the worker was busy: owe one. A clock cadence's interval
        starts again here, so the next busy step does not count as one more skipped."""
        self.owed = True
        self._absorbed_clock = time.monotonic()

    def restored(self, step: int) -> None:
        """The state is now that of ``step`` (an older one too: ``restore(step=N)``)."""
        self.last_persist = self.last_memory = step
        self._persist_clock = self._memory_clock = time.monotonic()
        self.newest, self._newest_restored = step, True

    def _saw(self, step: int) -> None:
        if self.newest is None or step > self.newest:
            self.newest, self._newest_restored = step, False

    def observe_cost(self, seconds: float) -> None:
        self.cost.observe(seconds)


def _timed(policy: Every) -> bool:
    """Whether ``policy`` depends on the clock (then ranks must agree on each decision)."""
    return policy.auto or policy.seconds is not None or policy.minutes is not None
