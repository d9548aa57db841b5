"""Policies: when to save (`Every`) and what to keep (`Keep`).

Both are small frozen value objects with pure decision methods, so they are tested
with plain inputs and the manager only wires them. Step cadences are multiples of the
step (``step % steps == 0``), which keeps the save schedule of a resumed run identical
to an uninterrupted one; time cadences count from the last save.

``Every(auto=True, mtbf=...)`` derives its time cadence from the checkpoint cost and the
mean time between failures (Young 1974, Daly 2006; see ``docs/interval.md``). The cost
changes while a run warms up and the storage gets busier, so it is an argument of
`Every.due` rather than a field: the manager keeps a mutable `CostEstimate` of measured
costs and passes its current value at each call, and the policy stays a frozen value.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_MIN_SECONDS = 1.0
"""Shortest interval `Every(auto=True)` picks, and its interval before any cost is known."""
DEFAULT_MAX_SECONDS = 24 * 3600.0
"""Longest interval `Every(auto=True)` picks."""


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints, ``sqrt(2 C M)``.

    Accurate when C is much smaller than M.

    Args:
        cost_s: C, what one checkpoint costs the job, in seconds (finite, >= 0).
        mtbf_s: M, the mean time between failures, in seconds (finite, > 0).

    Returns:
        The interval, in seconds.

    Raises:
        ValueError: ``cost_s`` or ``mtbf_s`` out of range.
    """
    _check_cost_mtbf(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (Daly 2006):

        sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C    for C < 2 M
        M                                                           for C >= 2 M

    Shorter than Young's estimate for every C > 0.

    Args:
        cost_s: C, what one checkpoint costs the job, in seconds (finite, >= 0).
        mtbf_s: M, the mean time between failures, in seconds (finite, > 0).

    Returns:
        The interval, in seconds.

    Raises:
        ValueError: ``cost_s`` or ``mtbf_s`` out of range.
    """
    _check_cost_mtbf(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return float(mtbf_s)
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def _check_cost_mtbf(cost_s: float, mtbf_s: float) -> None:
    if not (_finite(cost_s) and cost_s >= 0):
        raise ValueError(f"checkpoint cost must be a finite number of seconds >= 0, got {cost_s!r}")
    if not (_finite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"mtbf must be a finite number of seconds > 0, got {mtbf_s!r}")


class CostEstimate:
    """The current checkpoint cost: the median of the last ``window`` observations.

    A median rather than a mean, because the first checkpoint of a run is an outlier
    (worker start-up, first touch of the shared-memory slots, cold page cache) and so is
    a save that met a storage hiccup; a median of five ignores up to two of them, and
    still follows a lasting change of the cost within three saves.

    Not thread-safe: owned by the manager and used from the training thread only.
    """

    def __init__(self, window: int = 5) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"CostEstimate(window=...) must be a positive integer, got {window!r}")
        self._recent: deque[float] = deque(maxlen=window)
        self._count = 0
        self._median: float | None = None  # of ``_recent``, taken once per observation

    @property
    def window(self) -> int:
        maxlen = self._recent.maxlen
        assert maxlen is not None
        return maxlen

    def observe(self, seconds: float) -> None:
        """Record the measured cost of one checkpoint, in seconds (finite, >= 0)."""
        if not (_finite(seconds) and seconds >= 0):
            raise ValueError(
                f"a checkpoint cost must be a finite number of seconds >= 0, got {seconds!r}"
            )
        self._recent.append(float(seconds))
        self._count += 1
        self._median = statistics.median(self._recent)

    @property
    def count(self) -> int:
        """Observations made so far, including those that have left the window."""
        return self._count

    @property
    def value(self) -> float | None:
        """Median of the last ``window`` observations; None before the first. Read at
        every `maybe_save`, so taken once per observation, not at every read."""
        return self._median

    def __repr__(self) -> str:
        return f"CostEstimate(window={self.window}, recent={list(self._recent)!r})"


@dataclass(frozen=True)
class Every:
    """Due when any given condition holds: ``step`` is a multiple of ``steps``, or at
    least ``seconds``/``minutes`` passed since the last save. ``Every(steps=100,
    minutes=30)`` saves on whichever comes first.

    ``Every(auto=True, mtbf=...)`` is due once the optimum interval for the current
    checkpoint cost has passed: `daly_interval` of the cost and ``mtbf`` (seconds),
    clamped to ``[min_seconds, max_seconds]`` (default 1 s and 24 h). Before a cost is
    known the interval is ``min_seconds``, so the first checkpoint, and with it the first
    measurement, comes early. ``auto`` is the only condition of its policy: combining it
    with ``steps``/``seconds``/``minutes`` is rejected, as are ``mtbf``/``min_seconds``/
    ``max_seconds`` without ``auto``.

    Args:
        steps: due at every multiple of this step (a positive integer).
        seconds: due this many seconds after the last save.
        minutes: due this many minutes after the last save.
        auto: pick the time interval from the measured cost and ``mtbf``.
        mtbf: the mean time between failures, in seconds (``auto`` only).
        min_seconds: the shortest interval ``auto`` picks (default 1 s).
        max_seconds: the longest interval ``auto`` picks (default 24 h).

    Raises:
        ValueError: a value out of range, or a combination described above.
    """

    steps: int | None = None
    seconds: float | None = None
    minutes: float | None = None
    auto: bool = False
    mtbf: float | None = None
    min_seconds: float | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.auto, bool):
            raise ValueError(f"Every(auto=...) must be True or False, got {self.auto!r}")
        if self.auto:
            self._check_auto()
        else:
            given = [
                n for n in ("mtbf", "min_seconds", "max_seconds") if getattr(self, n) is not None
            ]
            if given:
                raise ValueError(f"Every({given[0]}=...) is only read with auto=True")
            if self.steps is None and self.seconds is None and self.minutes is None:
                raise ValueError("Every() needs steps=, seconds=, minutes= or auto=True, mtbf=")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"Every(steps=...) must be a positive integer, got {self.steps!r}")
        for name in ("seconds", "minutes"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"Every({name}=...) must be a positive number, got {v!r}")

    def _check_auto(self) -> None:
        fixed = [n for n in ("steps", "seconds", "minutes") if getattr(self, n) is not None]
        if fixed:
            raise ValueError(
                f"Every(auto=True) picks the interval itself and takes no {fixed[0]}=...; "
                "bound it with min_seconds=/max_seconds= instead"
            )
        if self.mtbf is None:
            raise ValueError(
                "Every(auto=True) needs mtbf=..., the mean time between failures in seconds "
                "(e.g. mtbf=24 * 3600 for one failure a day)"
            )
        for name in ("mtbf", "min_seconds", "max_seconds"):
            v = getattr(self, name)
            if v is not None and not (_finite(v) and v > 0):
                raise ValueError(
                    f"Every({name}=...) must be a finite positive number of seconds, got {v!r}"
                )
        if self.bounds[0] > self.bounds[1]:
            raise ValueError(
                f"Every(min_seconds=...) must not exceed max_seconds, got {self.bounds[0]!r} "
                f"> {self.bounds[1]!r}"
            )

    @property
    def bounds(self) -> tuple[float, float]:
        """``(min_seconds, max_seconds)`` with their defaults filled in."""
        lo = DEFAULT_MIN_SECONDS if self.min_seconds is None else float(self.min_seconds)
        hi = DEFAULT_MAX_SECONDS if self.max_seconds is None else float(self.max_seconds)
        return lo, hi

    @property
    def interval_seconds(self) -> float | None:
        """The fixed time interval; None without one (step cadence only, or ``auto``,
        whose interval depends on the cost: see `interval_seconds_for`)."""
        spans = [x for x in (self.seconds, self.minutes and self.minutes * 60) if x]
        return min(spans) if spans else None

    def interval_seconds_for(self, cost_s: float | None) -> float | None:
        """The time interval in force when one checkpoint costs ``cost_s`` seconds.

        Fixed policies ignore the cost. ``auto``: `daly_interval(cost_s, mtbf)` clamped
        to `bounds`, or the lower bound while ``cost_s`` is None (nothing measured yet).

        Args:
            cost_s: the current checkpoint cost in seconds, or None.

        Returns:
            The interval in seconds, or None where the policy has no time condition.
        """
        if not self.auto:
            return self.interval_seconds
        lo, hi = self.bounds
        if cost_s is None:
            return lo
        assert self.mtbf is not None
        return min(hi, max(lo, daly_interval(cost_s, self.mtbf)))

    def due(
        self,
        step: int,
        *,
        last_step: int | None,
        since_last_s: float,
        cost_s: float | None = None,
    ) -> bool:
        """Whether to save at ``step``. Never due at or before ``last_step``.

        Args:
            step: the step about to be reported.
            last_step: the step of the last save, or None before the first.
            since_last_s: seconds since the last save ended (its blocking part).
            cost_s: what one checkpoint costs, in seconds. Read only by ``auto``; None
                before the first measurement.

        Returns:
            True if a save is due.
        """
        if last_step is not None and step <= last_step:
            return False
        if self.steps is not None:
            if step % self.steps == 0 or (last_step is not None and step - last_step >= self.steps):
                return True
        span = self.interval_seconds_for(cost_s)
        return span is not None and since_last_s >= span


@dataclass(frozen=True)
class Entry:
    """What retention knows of one committed checkpoint."""

    step: int
    metrics: Mapping[str, Any]


@dataclass(frozen=True)
class Keep:
    """Which committed checkpoints survive retention: the union of the ``last`` newest,
    the ``best=(metric, "min"|"max", k)`` by a metric, every multiple of
    ``every_steps``, and pinned ones. The newest checkpoint is always kept, so
    retention never leaves zero. ``Keep(last=None)`` with no other rule keeps all.

    Args:
        last: how many of the newest to keep (a positive integer), or None.
        best: ``(metric, "min" or "max", k)``: the ``k`` best by ``metric``.
        every_steps: keep every checkpoint whose step is a multiple of this.

    Raises:
        ValueError: a value of the wrong type or range.
    """

    last: int | None = 3
    best: tuple[str, str, int] | None = None
    every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.last is not None and (not isinstance(self.last, int) or self.last < 1):
            raise ValueError(
                f"Keep(last=...) must be a positive integer or None, got {self.last!r}"
            )
        if self.best is not None:
            if (
                not isinstance(self.best, tuple)
                or len(self.best) != 3
                or not isinstance(self.best[0], str)
                or self.best[1] not in ("min", "max")
                or not isinstance(self.best[2], int)
                or self.best[2] < 1
            ):
                raise ValueError(
                    f'Keep(best=...) must be (metric, "min" or "max", k>=1), got {self.best!r}'
                )
        if self.every_steps is not None and (
            not isinstance(self.every_steps, int) or self.every_steps < 1
        ):
            raise ValueError(
                f"Keep(every_steps=...) must be a positive integer, got {self.every_steps!r}"
            )

    @property
    def keeps_all(self) -> bool:
        return self.last is None and self.best is None and self.every_steps is None

    def retained(self, entries: Iterable[Entry], pinned: Iterable[int] = ()) -> set[int]:
        """Steps to keep among ``entries``.

        Args:
            entries: the committed checkpoints, in any order.
            pinned: steps exempt from retention.

        Returns:
            The steps to keep.
        """
        items = sorted(entries, key=lambda e: e.step)
        steps = [e.step for e in items]
        if not steps or self.keeps_all:
            return set(steps)
        keep = {steps[-1]} | (set(pinned) & set(steps))
        if self.last is not None:
            keep.update(steps[-self.last :])
        if self.every_steps is not None:
            keep.update(s for s in steps if s % self.every_steps == 0)
        if self.best is not None:
            metric, mode, k = self.best
            scored = [
                (float(e.metrics[metric]), e.step) for e in items if _finite(e.metrics.get(metric))
            ]
            sign = 1.0 if mode == "min" else -1.0
            scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
            keep.update(s for _, s in scored[:k])
        return keep

    def to_delete(self, entries: Iterable[Entry], pinned: Iterable[int] = ()) -> list[int]:
        """Steps to delete among ``entries``: those `retained` does not keep.

        Args:
            entries: the committed checkpoints, in any order.
            pinned: steps exempt from retention.

        Returns:
            The steps to delete, ascending.
        """
        entries = list(entries)
        kept = self.retained(entries, pinned)
        return sorted(e.step for e in entries if e.step not in kept)


def _finite(v: Any) -> bool:
    """Whether ``v`` is a number with a finite float value (an integer beyond the range
    of floats is not: ``float()`` of it raises)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
