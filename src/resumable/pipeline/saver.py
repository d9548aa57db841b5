"""The save path behind the facade: snapshot, agree, persist or defer.

A save reuses the memory snapshot of its step or takes one, then persists it, unless
the previous persist still runs: with ``on_busy="skip"`` the persist is deferred (all
ranks agree on it: one rank's busy worker defers every rank's), with ``"wait"`` it
queues behind the running one, and a save waits only while one is queued already or
shared memory has no room for another slot. Without the memory tier
(``persist="sync"`` alone) a save copies and writes on the training thread. At close,
`Saver.flush` makes the final state, else the newest snapshot, durable if it is newer
than the last commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from resumable.audit import AuditLog, ProgressNotes
from resumable.capture import Captured
from resumable.commit import warn_uncommitted
from resumable.coordination import Agreement, Pending
from resumable.errors import CheckpointError
from resumable.group import Group
from resumable.monitor import Monitor
from resumable.options import CheckpointOptions, PersistMode
from resumable.pipeline.emergency import Emergency
from resumable.pipeline.last_step import Final
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import Persister, SyncPersister
from resumable.pipeline.restorer import Restored
from resumable.pipeline.root_claim import RootClaim
from resumable.pipeline.schedule import Schedule
from resumable.snapshot import MemorySnapshot
from resumable.storage import Storage

log = logging.getLogger(__name__)

SnapshotCall = Callable[[int, Mapping[str, Any] | None], None]

# With on_busy="wait": how many persists may be outstanding (one running, one queued)
# before a save waits. Each holds a shared-memory slot until it is done; of the three
# slots (`resumable.snapshot.ShmArena`) one is left for the snapshots taken meanwhile.
QUEUE = 2


class Saver:
    """Takes the snapshots and starts the persists the facade asks for.

    Call order (the facade's, on the training thread, after it checked the step):
    `before_restore` and `resumed` around a restore; `snapshot` and `save` at each save
    (`preempted` for a preemption's); `flush` once at close. A failed persist surfaces
    at the next call that collects the persister.
    """

    def __init__(
        self,
        options: CheckpointOptions,
        *,
        mode: PersistMode,
        group: Group,
        claim: RootClaim,
        memory: MemoryTier | None,
        persister: Persister,
        agreement: Agreement,
        schedule: Schedule,
        audit: AuditLog,
        monitor: Monitor,
        progress: ProgressNotes,
    ) -> None:
        self._on_busy = options.schedule.on_busy
        self._rng = options.capture.capture_rng
        self._timeout_s = options.distributed.seconds
        self._mode = mode
        self._group, self._claim = group, claim
        self._memory, self._persister = memory, persister
        self._agreement, self._schedule = agreement, schedule
        self._audit, self._monitor, self._progress = audit, monitor, progress
        self.last_snapshot_s: float | None = None

    def snapshot(
        self, state: Mapping[str, Any], step: int, metrics: Mapping[str, Any] | None
    ) -> None:
        """Copy the state as of ``step`` into shared memory (the memory tier's)."""
        if self._memory is None:
            raise CheckpointError(
                "memory snapshots need the memory tier; create the Checkpointer with "
                "memory_every=... or a persist mode other than 'sync'"
            )
        if self._memory.full():  # the spare slot a queued persist counted on was not made
            self._persister.wait_for_turn(QUEUE)
        seconds, overlapped = self._memory.take(state, step, metrics, rng=self._rng)
        self.last_snapshot_s = seconds
        self._monitor.snapshot(seconds, overlapped)
        self._progress.snapshot(seconds)
        self._schedule.snapshotted(step)

    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
        snapshot: SnapshotCall,
    ) -> bool:
        """Persist the state as of ``step``, taking its snapshot through ``snapshot``
        (the facade's) unless memory holds it; False if the persist was deferred."""
        if self._memory is None:  # sync without the memory tier: copy, then write here
            assert isinstance(self._persister, SyncPersister)
            self.last_snapshot_s = self._persister.persist_state(
                state, step, metrics, rng=self._rng
            )
            self._progress.snapshot(self.last_snapshot_s)
            self._schedule.persisted(step)
            return True
        # "wait": every due persist commits. One may queue behind the running one (the
        # worker takes them in turn): a save blocks only while two are outstanding (until
        # the older ends) or shared memory has no slot left for the snapshots taken
        # meanwhile.
        if self._on_busy == "wait" and len(self._persister.running()) >= QUEUE:
            self._persister.wait_for_turn(QUEUE)  # the oldest persist ends
        # All ranks persist this step, or none: the first rank to ask decides for all,
        # from whether its worker is busy. The question goes out before the snapshot
        # copy and is answered after it (the copy hides the store's round trips); a
        # worker busy when asked may be free by then, so this rank's answer errs
        # towards deferring, never towards a persist its worker cannot take. (With
        # one process, or ``persist="sync"``, the answer is taken after the copy.)
        busy: Pending | bool = False
        if self._on_busy == "skip" and self._mode != "sync":
            busy = self._agreement.decide_later("busy", step, lambda: self._persister.busy)
        snap = self._memory.current(step)
        if snap is None:  # the snapshot is taken either way
            try:
                snapshot(step, metrics)
                self._memory.settle()  # a persist needs the whole copy
            except BaseException:
                if isinstance(busy, Pending):
                    busy.settle()
                raise
            snap = self._memory.current(step)
            assert snap is not None
        # A rank told to persist while its own worker still finishes the previous
        # persist waits for it: that persist has ended on the rank that decided, so it
        # is about to end here too.
        if isinstance(busy, Pending):
            busy = busy.result()
            if not busy and self._persister.busy:
                self._finish_before(step)
        if busy:
            self._defer(step)
            return False
        if self._on_busy == "wait" and self._persister.busy:
            if not self._memory.room_to_queue(snap):
                self._persister.wait()
        self.persist(snap)
        return True

    def _defer(self, step: int) -> None:
        running = self._persister.running()
        what = f"step(s) {running}" if running else "another rank's previous persist"
        self._audit.record("skip", step=step, reason=f"persist of {what} still running")
        log.info("persist of step %d deferred: %s still persisting", step, what)
        self._monitor.skipped(step, f"{what} still persisting")
        self._schedule.deferred()

    def _finish_before(self, step: int) -> None:
        """Told to persist ``step`` by a rank whose worker is free while this rank's
        still runs: wait for it, at most half of ``dist_timeout_s`` (it should end at
        once: the deciding rank's part of the same persist has). If it fails or does
        not end, this rank forgoes its part of the persist of ``step`` and raises
        `PersistError`: the other ranks' workers, which wait up to ``dist_timeout_s``
        for that part, stop waiting then, and every later persist keeps its key."""
        try:
            self._persister.wait(self._timeout_s / 2)
        except BaseException as exc:
            self._persister.forgo(
                f"its previous persist did not finish before step {step}'s: {exc}"
            )
            raise

    def persist(self, snap: MemorySnapshot) -> None:
        """Hand ``snap`` to the persister (after checking the root is still this job's)."""
        self._claim.check()  # cheap; raises once another job may hold the root
        self._schedule.persisted(snap.step)
        self._persister.persist(snap, self.last_snapshot_s)

    def flush(
        self,
        final: Final | None,
        save: Callable[[int, Mapping[str, Any] | None], bool],
        *,
        url: str,
        left_s: Callable[[], float | None],
    ) -> None:
        """Make the final state (``final``: its step and metrics, saved through ``save``),
        else the newest memory snapshot, durable if it is newer than the last commit;
        then upload to the mirror, within ``left_s()`` if a preemption's grace runs."""
        if self._memory is not None:
            self._memory.settle()
        self._persister.wait()
        committed = self._persister.committed
        wanted = (
            final[0] if final is not None and (committed is None or final[0] > committed) else None
        )
        if final is not None and committed is not None and final[0] < committed:
            log.warning(
                "closing %s at step %d: not checkpointed, because the root holds a newer "
                "checkpoint (step %d), which the next restore() loads. Keep counting from "
                "the step restore() returns, or close(step=...) with the step the state is at",
                url,
                final[0],
                committed,
            )
        # A collective save: only if every rank closes at that step.
        offers = self._group.all_gather(wanted)
        if final is not None and wanted is not None and all(o == wanted for o in offers):
            save(wanted, final[1])
            self._persister.wait()
        newest = self._memory.newest if self._memory is not None else None
        committed = self._persister.committed
        due = newest is not None and (committed is None or newest.step > committed)
        offers = self._group.all_gather(newest.step if due and newest is not None else None)
        if due and newest is not None and all(o == offers[0] for o in offers):
            self.persist(newest)
            self._persister.wait()
        left = left_s()
        if left is None:
            self._persister.flush_mirror()
        elif left > 0:  # within the grace period, best effort
            self._persister.flush_mirror(left, strict=False)

    def before_restore(
        self,
        state: Mapping[str, Any],
        storage: Storage,
        *,
        rank: int,
        live: Captured | None = None,
    ) -> None:
        """Before a restore: note uncommitted leftovers (rank 0), check that the state
        fits the memory tier (``live``: a capture of it made just before, see
        `MemoryTier.preflight`), and start the persister (a recovered snapshot is
        persisted right after the restore)."""
        if rank == 0:
            for name in warn_uncommitted(storage):
                self._audit.record("uncommitted", name=name)
        if self._memory is not None:
            self._memory.preflight(state, rng=self._rng, live=live)
        self._persister.start()

    def preempted(
        self,
        emergency: Emergency,
        step: int,
        metrics: Mapping[str, Any] | None,
        save: Callable[[int, Mapping[str, Any] | None], bool],
    ) -> None:
        """Take ``emergency``'s checkpoint of ``step`` within the grace period."""
        memory = self._memory
        emergency.checkpoint(
            step,
            metrics,
            persister=self._persister,
            newest=lambda: memory.newest if memory is not None else None,
            persist=self.persist,
            save=save,
            audit=self._audit,
            snapshot_s=self.last_snapshot_s,
            persist_s=self._monitor.stats["last_persist_s"],
        )

    def resumed(self, done: Restored, url: str) -> None:
        """Take in what a restore found: the newest commit, the step the schedule counts
        from, and a memory snapshot newer than every commit, which is persisted now."""
        committed = done.newest_committed
        if committed is not None:
            self._persister.committed = max(committed, self._persister.committed or 0)
        elif self._group.world_size == 1:
            # restore(tier="memory") lists no checkpoint: what this process committed
            # itself is known (one process: with several, each rank takes its persists'
            # replies in its own time, and they must not decide apart)
            committed = self._persister.committed
        if done.step:
            self._schedule.restored(done.step)
        log.info("%s", done.describe(url))
        if done.partial:
            partial = "; ".join(done.partial)
            log.warning("restored step %d of %s partially: %s", done.step, url, partial)
        if done.snapshot is not None and (committed is None or done.step > committed):
            log.info("persisting step %d recovered from shared memory", done.step)
            self.persist(done.snapshot)
