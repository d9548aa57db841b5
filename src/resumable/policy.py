"""Policies: when to save (`Every`) and what to keep (`Keep`).

Both are small frozen value objects with pure decision methods, so they are tested
with plain inputs and the manager only wires them. Step cadences are multiples of the
step (``step % steps == 0``), which keeps the save schedule of a resumed run identical
to an uninterrupted one; time cadences count from the last save.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Every:
    """Due when any given condition holds: ``step`` is a multiple of ``steps``, or at
    least ``seconds``/``minutes`` passed since the last save. ``Every(steps=100,
    minutes=30)`` saves on whichever comes first."""

    steps: int | None = None
    seconds: float | None = None
    minutes: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None and self.minutes is None:
            raise ValueError("Every() needs steps=, seconds= or minutes=")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"Every(steps=...) must be a positive integer, got {self.steps!r}")
        for name in ("seconds", "minutes"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"Every({name}=...) must be a positive number, got {v!r}")

    @property
    def interval_seconds(self) -> float | None:
        spans = [x for x in (self.seconds, self.minutes and self.minutes * 60) if x]
        return min(spans) if spans else None

    def due(self, step: int, *, last_step: int | None, since_last_s: float) -> bool:
        if last_step is not None and step <= last_step:
            return False
        if self.steps is not None:
            if step % self.steps == 0 or (last_step is not None and step - last_step >= self.steps):
                return True
        span = self.interval_seconds
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
    retention never leaves zero. ``Keep(last=None)`` with no other rule keeps all."""

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
        """Steps to keep among ``entries`` (any order)."""
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
        entries = list(entries)
        kept = self.retained(entries, pinned)
        return sorted(e.step for e in entries if e.step not in kept)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
