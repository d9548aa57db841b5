"""`Schedule` alone (issue 46 item 5): a pure state machine, driven here as the facade
drives it, with an injected clock. The cadences by steps and by clock, an owed persist
taken at the first free step, persists absorbed into an owed one, `restored` resetting
both cadences, and the measured cost that ``Every(auto=True)`` plans with. The step
order (`Schedule.check_order`) is tested in ``test_step_order.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable.coordination import Agreement
from resumable.group import Group
from resumable.pipeline import schedule as schedule_mod
from resumable.pipeline.schedule import Schedule
from resumable.policy import Every, daly_interval


@dataclass
class Clock:
    """Stands in for the `time` module the schedule reads ``monotonic`` from."""

    now: float = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(schedule_mod, "time", c)
    return c


def make(persist: Every, memory: Every | None = None) -> Schedule:
    return Schedule(memory, persist, Agreement(Group(0, 1), None))


@dataclass
class Driver:
    """Drives a schedule as `Checkpointer.maybe_save` does with ``on_busy="skip"``: a due
    persist starts if the worker is free, else it is deferred (owed)."""

    schedule: Schedule
    persists: list[int] = field(default_factory=list)
    deferrals: list[int] = field(default_factory=list)
    absorbed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.schedule.on_absorbed = self.absorbed.append

    def step(self, step: int, *, busy: bool = False) -> None:
        s = self.schedule
        if s.persist_due(step, worker_free=not busy):
            if busy:
                s.deferred()
                self.deferrals.append(step)
            else:
                s.persisted(step)
                self.persists.append(step)


# ------------------------------------------------------------------ cadences


def test_a_step_cadence_persists_at_each_multiple(clock: Clock) -> None:
    d = Driver(make(Every(steps=10)))
    for step in range(1, 36):
        clock.now += 1000.0  # the clock does not matter to a step cadence
        d.step(step)
    assert d.persists == [10, 20, 30]


def test_a_clock_cadence_persists_once_the_interval_passed(clock: Clock) -> None:
    d = Driver(make(Every(seconds=60)))
    d.step(1)
    clock.now += 59.0
    d.step(2)
    assert d.persists == []
    clock.now += 1.0
    d.step(3)
    assert d.persists == [3]
    clock.now += 59.0  # measured from the persist, not from the start
    d.step(4)
    assert d.persists == [3]
    clock.now += 1.0
    d.step(5)
    assert d.persists == [3, 5]


def test_steps_or_minutes_whichever_comes_first(clock: Clock) -> None:
    d = Driver(make(Every(steps=100, minutes=1)))
    clock.now += 61.0
    d.step(7)
    for step in range(8, 101):
        d.step(step)
    assert d.persists == [7, 100]


def test_the_memory_cadence_is_its_own(clock: Clock) -> None:
    s = make(Every(steps=100), memory=Every(steps=5))
    due = []
    for step in range(1, 16):
        if s.memory_due(step):
            s.snapshotted(step)
            due.append(step)
    assert due == [5, 10, 15]
    assert s.last_memory == 15 and s.last_persist is None
    assert not make(Every(steps=1)).memory_due(1)  # no memory cadence: never


def test_the_memory_cadence_by_clock(clock: Clock) -> None:
    s = make(Every(steps=100), memory=Every(seconds=10))
    assert not s.memory_due(1)
    clock.now += 10.0
    assert s.memory_due(2)
    s.snapshotted(2)
    assert not s.memory_due(3)


# ------------------------------------------------------------------ owed persists


def test_a_deferred_persist_is_owed_and_taken_at_the_first_free_step(clock: Clock) -> None:
    d = Driver(make(Every(steps=10)))
    d.step(10, busy=True)
    assert d.deferrals == [10] and d.schedule.owed
    d.step(11, busy=True)
    d.step(12, busy=True)
    assert d.persists == []
    d.step(13)  # free: the owed persist, though no policy is due at 13
    assert d.persists == [13] and not d.schedule.owed
    d.step(14)
    assert d.persists == [13]  # owed once, taken once


def test_persists_due_while_one_is_owed_are_absorbed_into_it(clock: Clock) -> None:
    d = Driver(make(Every(steps=10)))
    for step in range(10, 36):
        d.step(step, busy=step < 35)
    assert d.deferrals == [10]
    assert d.absorbed == [20, 30]  # counted as skipped, once each
    assert d.persists == [35]
    for step in range(36, 41):
        d.step(step)
    assert d.persists == [35, 40]


def test_clock_persists_absorbed_while_one_is_owed_are_an_interval_apart(clock: Clock) -> None:
    d = Driver(make(Every(seconds=10)))
    clock.now += 10.0
    d.step(1, busy=True)
    for step in range(2, 40):
        clock.now += 1.0
        d.step(step, busy=True)
    assert d.deferrals == [1] and d.persists == []
    assert d.absorbed == [11, 21, 31]  # one per 10 s, from the deferral
    clock.now += 1.0
    d.step(40)
    assert d.persists == [40] and not d.schedule.owed


def test_a_deferred_clock_persist_is_not_skipped_again_at_the_next_step(clock: Clock) -> None:
    d = Driver(make(Every(seconds=10)))
    clock.now += 10.0
    d.step(1, busy=True)
    clock.now += 1.0
    d.step(2, busy=True)
    assert d.deferrals == [1]
    assert d.absorbed == []


# ------------------------------------------------------------------ restore


def test_restored_resets_both_cadences(clock: Clock) -> None:
    d = Driver(make(Every(steps=10), memory=Every(steps=5)))
    d.schedule.restored(95)
    assert d.schedule.newest == 95
    for step in range(96, 101):
        d.step(step)
    assert d.persists == [100]
    assert not d.schedule.memory_due(95)
    assert d.schedule.memory_due(100)


def test_restored_restarts_the_clock(clock: Clock) -> None:
    d = Driver(make(Every(seconds=60)))
    clock.now += 500.0  # long since construction: due ...
    d.schedule.restored(7)  # ... but a restore starts the interval again
    clock.now += 30.0
    d.step(8)
    assert d.persists == []
    clock.now += 30.0
    d.step(9)
    assert d.persists == [9]


def test_restored_to_an_older_step_persists_again_from_there(clock: Clock) -> None:
    d = Driver(make(Every(steps=10)))
    for step in range(1, 31):
        d.step(step)
    d.schedule.restored(12)  # restore(step=12)
    for step in range(13, 21):
        d.step(step)
    assert d.persists == [10, 20, 30, 20]


# ------------------------------------------------------------------ cost


def test_the_measured_cost_sets_the_auto_interval(clock: Clock) -> None:
    policy = Every(auto=True, mtbf=3600.0)
    d = Driver(make(policy))
    assert d.schedule.cost.value is None
    clock.now += policy.bounds[0]  # nothing measured: the lower bound
    d.step(1)
    assert d.persists == [1]
    for seconds in (50.0, 10.0, 12.0):  # the median of the last few
        d.schedule.observe_cost(seconds)
    assert d.schedule.cost.value == 12.0
    interval = daly_interval(12.0, 3600.0)
    clock.now += interval - 1.0
    d.step(2)
    assert d.persists == [1]
    clock.now += 2.0
    d.step(3)
    assert d.persists == [1, 3]


def test_an_invalid_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="finite number of seconds"):
        make(Every(steps=1)).observe_cost(float("nan"))


# ------------------------------------------------------------------ properties


@settings(max_examples=150, deadline=None)
@given(
    every=st.integers(min_value=1, max_value=12),
    busy=st.lists(st.booleans(), min_size=1, max_size=120),
)
def test_step_cadence_persists_exactly_at_the_first_free_step_of_each_multiple(
    every: int, busy: list[bool]
) -> None:
    """Never more often than the policy, and no due persist lost: the persists are the
    first free step at or after each multiple of ``every`` (one for several multiples
    that fall in the same busy stretch)."""
    d = Driver(make(Every(steps=every)))
    steps = range(1, len(busy) + 1)
    for step in steps:
        d.step(step, busy=busy[step - 1])
    free = [s for s in steps if not busy[s - 1]]
    expected = sorted(
        {min((f for f in free if f >= m), default=0) for m in steps if m % every == 0} - {0}
    )
    assert d.persists == expected
    assert len(d.persists) <= len(busy) // every


@settings(max_examples=150, deadline=None)
@given(
    seconds=st.integers(min_value=1, max_value=50),
    ticks=st.lists(
        st.tuples(st.integers(min_value=0, max_value=30), st.booleans()), min_size=1, max_size=80
    ),
)
def test_clock_cadence_never_persists_sooner_than_its_interval(
    seconds: int, ticks: list[tuple[int, bool]]
) -> None:
    """Persists are at least ``seconds`` apart (and from the start); a free worker with
    nothing owed persists at the first step the interval has passed."""
    clock = Clock(now=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule_mod, "time", clock)
        at = drive_clock(Driver(make(Every(seconds=seconds))), clock, ticks, seconds)
    gaps = [b - a for a, b in zip([0.0, *at], at)]
    assert all(g >= seconds for g in gaps)


def drive_clock(
    d: Driver, clock: Clock, ticks: list[tuple[int, bool]], seconds: int
) -> list[float]:
    """The times of the persists; checks that a free step that does not persist comes
    before the interval has passed."""
    at: list[float] = []
    last = 0.0
    for step, (dt, busy) in enumerate(ticks, start=1):
        clock.now += dt
        before = len(d.persists)
        d.step(step, busy=busy)
        if len(d.persists) > before:
            at.append(clock.now)
        elif not busy and not d.schedule.owed:
            assert clock.now - last < seconds  # not due: the interval has not passed
        if at:
            last = at[-1]
    return at
