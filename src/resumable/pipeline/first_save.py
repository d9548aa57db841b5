"""Warnings said once, at the first save of a run, about a setup that loses work.

Two mistakes look fine until a restore: saving into a root that holds an earlier run's
checkpoints without calling ``restore()`` (this run writes its steps beside them), and
``Keep(best=...)`` ranking by a metric the saves never report (no checkpoint is ever
kept as best). Each is a WARNING, never an error: training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from resumable.commit import list_committed
from resumable.errors import CheckpointError
from resumable.policy import Keep
from resumable.storage import Storage

log = logging.getLogger(__name__)


class FirstSaveChecks:
    """Call order (the facade's, on the training thread): `restored` when ``restore()``
    runs; `before_save` at every snapshot and save (it acts once); `metrics` at every
    save (it acts until the first save reports metrics or lacks the metric)."""

    def __init__(self, storage: Storage, keep: Keep | None, *, rank: int) -> None:
        self._storage = storage
        self._best = keep.best if keep is not None else None
        self._rank = rank
        self._restore_called = False
        self._checked = False
        self._metric_seen: bool | None = None

    def restored(self) -> None:
        self._restore_called = True

    def before_save(self, step: int) -> None:
        """Once: warn if the root holds an earlier run's checkpoints and ``restore()``
        was never called (rank 0 only)."""
        if self._checked:
            return
        self._checked = True
        if self._restore_called or self._rank != 0:
            return
        try:
            committed = list_committed(self._storage)
        except CheckpointError as exc:
            # Only a warning hangs on this listing, and only rank 0 makes it: raising
            # here would leave this rank's save before the coordinated persist, and the
            # other ranks waiting for it until the group's timeout. The persist meets
            # the storage again, on every rank.
            url = self._storage.url
            log.warning("could not list the checkpoints of %s before saving: %s", url, exc)
            return
        if committed:
            log.warning(
                "%s holds checkpoints up to step %d, and restore() was not called before "
                "saving step %d: this run writes its own steps beside them (a step saved "
                "again replaces the earlier one). Call restore() first to continue that "
                "run, or give this run a directory of its own",
                self._storage.url,
                committed[-1],
                step,
            )

    def metrics(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Warn once if ``Keep(best=...)`` ranks by a metric the saves do not report."""
        best = self._best
        if best is None or self._metric_seen is not None:
            return
        if metrics is not None and best[0] in metrics:
            self._metric_seen = True
            return
        self._metric_seen = False
        reported = ", ".join(sorted(metrics)) if metrics else "none"
        log.warning(
            "Keep(best=%r) ranks checkpoints by %r, but the save of step %d reported no such "
            "metric (metrics: %s). A checkpoint without it is never kept as best; pass "
            "metrics={%r: ...} to save() or maybe_save() at the steps where you have it",
            best,
            best[0],
            step,
            reported,
            best[0],
        )
