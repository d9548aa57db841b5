"""The claim on a checkpoint root: one writer per root, one run id per root.

Before anything is written, rank 0 checks that the root (and the mirror) can hold
checkpoints, takes the root's lock (`resumable.lock`) and reads or creates its run id
(`resumable.runid`); every other rank gets rank 0's outcome, so a refused root fails
every rank at construction. The lock is held until `RootClaim.release`. A mirror that
cannot be used now is only a WARNING: mirror failures never stop a run.
"""

from __future__ import annotations

import logging

from resumable.audit import AuditLog
from resumable.commit import committer_for, refuse_checkpoint_as_root
from resumable.errors import CheckpointError, StorageError
from resumable.group import Group
from resumable.lock import LeaseFence, RootLock, acquire_root
from resumable.runid import ensure_run_id
from resumable.storage import Storage

log = logging.getLogger(__name__)


class RootClaim:
    """This job's hold on ``storage``: the run id and, on rank 0, the root's lock.

    Call order: construction (collective: every rank of ``group`` builds one), then
    `check` before each persist and `fence` for the persist worker, and `release` once
    at close (or when construction of the facade fails). `release` is idempotent.
    """

    def __init__(self, storage: Storage, mirror: Storage | None, group: Group) -> None:
        self._lock: RootLock | None = None
        if group.rank != 0:
            kind, value = group.broadcast(None, "claim-root")
            if kind == "error":
                raise CheckpointError(f"rank 0 could not take the checkpoint root: {value}")
            self.run_id = str(value)
            return
        try:
            refuse_checkpoint_as_root(storage)
            storage.check_root()
            if mirror is not None:
                _check_mirror(mirror)
            self._lock = acquire_root(storage)
            self.run_id = ensure_run_id(storage)
        except BaseException as exc:
            self.release()
            group.broadcast(("error", f"{type(exc).__name__}: {exc}"), "claim-root")
            raise
        group.broadcast(("ok", self.run_id), "claim-root")

    def fence(self) -> LeaseFence | None:
        """What the persist worker checks the lease with before a commit or a delete."""
        return self._lock.fence() if self._lock is not None else None

    def check(self) -> None:
        """Cheap; raises once another job may hold the root."""
        if self._lock is not None:
            self._lock.check()

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def remove_stale(storage: Storage, audit: AuditLog) -> None:
    """Remove the data of commits that never finished (rank 0 only: it owns the attempts
    of a coordinated save). A directory that cannot be removed is a WARNING."""
    for name in committer_for(storage).stale():
        try:
            storage.delete(name)
        except CheckpointError as exc:
            log.warning("could not remove stale %s: %s", name, exc)
            continue
        log.info("removed stale %s (data of a commit that never finished)", name)
        audit.record("stale_removed", name=name)


def _check_mirror(mirror: Storage) -> None:
    """A mirror that cannot be used now is said at once, but does not stop the run:
    mirror failures never do (the local root keeps what was not uploaded)."""
    try:
        mirror.check_root()
    except StorageError as exc:
        log.warning(
            "the mirror %s cannot be used now: %s. Training goes on; local checkpoints "
            "are kept until they are uploaded",
            mirror.url,
            exc,
        )
