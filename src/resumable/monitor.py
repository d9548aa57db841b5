"""Counters, durations and alerts for operating checkpointing.

`Monitor` is told by the manager what happened (a snapshot, a persist started, a commit,
a skip, a failure) and keeps counters and the last durations (``Checkpointer.stats``).
It raises *alerts* — a WARNING log plus the user's callback — when a save fails, when
no checkpoint has committed for longer than ``max_commit_age_s``, and when persists are
skipped several times in a row because storage is too slow. With a
``prometheus_client`` registry it also exports the counters and gauges there.

Alert callbacks run on the training thread; an exception in one is logged, never
raised into training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

AlertCallback = Callable[[str, str, dict[str, Any]], None]

ALERT_SAVE_FAILED = "save_failed"
ALERT_STALE = "no_recent_commit"
ALERT_SKIPS = "persists_skipped"
ALERT_MIRROR = "mirror_failed"


class Monitor:
    def __init__(
        self,
        *,
        alert: AlertCallback | None = None,
        max_commit_age_s: float | None = None,
        skip_alert_after: int = 3,
        prometheus_registry: Any = None,
        url: str = "",
    ) -> None:
        self.alert_callback = alert
        self.max_commit_age_s = max_commit_age_s
        self.skip_alert_after = skip_alert_after
        self.url = url
        self.started = time.monotonic()
        self.last_commit: float | None = None
        self.consecutive_skips = 0
        self._stale_alerted = False
        self.stats: dict[str, Any] = {
            "snapshots": 0,
            "persists_started": 0,
            "commits": 0,
            "skips": 0,
            "failures": 0,
            "last_snapshot_s": None,
            "last_snapshot_overlapped_bytes": 0,
            "last_persist_s": None,
            "last_commit_step": None,
            "alerts": 0,
            "mirrored": 0,
            "mirror_failures": 0,
            "last_mirror_step": None,
            "last_mirror_s": None,
        }
        self._prom = _PrometheusExport(prometheus_registry) if prometheus_registry else None

    # ---------------------------------------------------------------- events

    def snapshot(self, seconds: float, overlapped_bytes: int = 0) -> None:
        self.stats["snapshots"] += 1
        self.stats["last_snapshot_s"] = seconds
        self.stats["last_snapshot_overlapped_bytes"] = overlapped_bytes
        if self._prom:
            self._prom.snapshot(seconds)

    def persist_started(self) -> None:
        self.stats["persists_started"] += 1
        self.consecutive_skips = 0

    def committed(self, step: int, seconds: float | None) -> None:
        self.stats["commits"] += 1
        self.stats["last_commit_step"] = step
        if seconds is not None:
            self.stats["last_persist_s"] = seconds
        self.last_commit = time.monotonic()
        self._stale_alerted = False
        if self._prom:
            self._prom.committed(step, seconds)

    def skipped(self, step: int, reason: str) -> None:
        self.stats["skips"] += 1
        self.consecutive_skips += 1
        if self._prom:
            self._prom.skipped()
        if self.stats["commits"] == 0:
            # The first persist of a launch waits for the persist process to start (an
            # interpreter importing torch: seconds). Persists deferred behind it say
            # nothing about the storage's speed; a worker that never comes up fails.
            self.consecutive_skips = 0
            return
        if self.consecutive_skips == self.skip_alert_after:
            last = self.stats["last_persist_s"]
            took = f"the last commit took {last:.2f} s, " if last is not None else ""
            self.alert(
                ALERT_SKIPS,
                f"{self.consecutive_skips} persists in a row were deferred because the "
                f"previous one was still running ({reason}): {took}longer than the "
                "training between two persists — persist less often (persist_every) or "
                "use faster storage",
                step=step,
                consecutive=self.consecutive_skips,
            )

    def failed(self, step: int | None, error: str) -> None:
        self.stats["failures"] += 1
        if self._prom:
            self._prom.failed()
        self.alert(ALERT_SAVE_FAILED, f"saving step {step} failed: {error}", step=step)

    def mirrored(self, step: int, seconds: float | None) -> None:
        self.stats["mirrored"] += 1
        self.stats["last_mirror_step"] = step
        self.stats["last_mirror_s"] = seconds

    def mirror_failed(self, step: int | None, error: str) -> None:
        self.stats["mirror_failures"] += 1
        self.alert(ALERT_MIRROR, error, step=step)

    def check_age(self, step: int) -> None:
        """Alert once per stale period if nothing committed for too long."""
        if self.max_commit_age_s is None or self._stale_alerted:
            return
        since = self.last_commit if self.last_commit is not None else self.started
        age = time.monotonic() - since
        if age > self.max_commit_age_s:
            self._stale_alerted = True
            self.alert(
                ALERT_STALE,
                f"no checkpoint of {self.url} committed for {age:.0f} s "
                f"(limit {self.max_commit_age_s:.0f} s)",
                step=step,
                age_s=age,
            )

    # ---------------------------------------------------------------- alerts

    def alert(self, kind: str, message: str, **details: Any) -> None:
        self.stats["alerts"] += 1
        log.warning("resumable alert %s: %s", kind, message)
        if self.alert_callback is None:
            return
        try:
            self.alert_callback(kind, message, details)
        except Exception as exc:  # a broken callback must not break training
            log.error("the alert callback raised %r", exc)


class _PrometheusExport:
    """Counters and gauges in a ``prometheus_client`` registry (imported lazily)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.snapshots = Histogram(
            "resumable_snapshot_seconds", "Blocking time of memory snapshots", registry=registry
        )
        self.persist = Gauge(
            "resumable_last_persist_seconds", "Duration of the last persist", registry=registry
        )
        self.commits = Counter("resumable_commits", "Committed checkpoints", registry=registry)
        self.skips = Counter("resumable_skipped_persists", "Deferred persists", registry=registry)
        self.failures = Counter("resumable_failed_saves", "Failed saves", registry=registry)
        self.step = Gauge(
            "resumable_last_commit_step", "Step of the last commit", registry=registry
        )
        self.time = Gauge(
            "resumable_last_commit_timestamp_seconds", "Time of the last commit", registry=registry
        )

    def snapshot(self, seconds: float) -> None:
        self.snapshots.observe(seconds)

    def committed(self, step: int, seconds: float | None) -> None:
        self.commits.inc()
        self.step.set(step)
        self.time.set_to_current_time()
        if seconds is not None:
            self.persist.set(seconds)

    def skipped(self) -> None:
        self.skips.inc()

    def failed(self) -> None:
        self.failures.inc()
