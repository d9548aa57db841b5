"""`Checkpointer`: the one object a training script talks to.

It wires the layers. A *memory snapshot* captures the state and copies it into a
shared-memory slot (`snapshot.ShmArena`); that copy is the only part that blocks
training. A *persist* hands a snapshot to the persist worker (`worker.PersistWorker`, a
separate process by default), which writes, commits and applies retention in the
background. Two cadences drive them (``memory_every``, ``persist_every``), and a
persist reuses the memory snapshot of the same step instead of copying again.

On ``restore()`` it finds the newest *valid* state across tiers: the shared-memory
snapshot left by a crashed launch of this run (persisted right away if it is newer
than storage) and the committed checkpoints, verifying before touching any live object.
Corrupt checkpoints are skipped with a WARNING; if checkpoints exist and none is valid,
it raises rather than starting over.

Persist modes: ``"process"`` (default for local storage), ``"thread"`` (default for
in-process backends such as ``memory://``), and ``"sync"``, which writes on the
training thread and needs no shared memory (for machines with a tiny ``/dev/shm``).
``RESUMABLE_PERSIST`` in the environment overrides the default.

Threading contract: every public method is called from the training thread (the one
that owns ``state``). A background failure is raised by the next ``save``,
``maybe_save``, ``snapshot``, ``wait`` or ``close``: it is never swallowed.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch

from resumable import settings
from resumable.audit import PROGRESS_EVERY_S, AuditLog, ProgressNotes
from resumable.commit import (
    committer_for,
    list_committed,
    refuse_checkpoint_as_root,
    step_dir,
    warn_uncommitted,
)
from resumable.coordination import Agreement, CoordinationStore, Pending
from resumable.errors import CheckpointError, NoCheckpointError, OptionError, StorageError
from resumable.group import Group, current_group
from resumable.incremental import Incremental
from resumable.lock import RootLock, acquire_root
from resumable.monitor import AlertCallback, Monitor
from resumable.options import DEFAULT_KEEP, CheckpointOptions, PersistMode, resolve_options
from resumable.pipeline.emergency import Emergency
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import BackgroundPersister, Persister, SyncPersister
from resumable.pipeline.restorer import Restorer
from resumable.pipeline.schedule import Schedule
from resumable.policy import Every, Keep
from resumable.preemption import Preemption
from resumable.replicas.peers import Replication
from resumable.retention import PINS_DIR
from resumable.runid import ensure_run_id
from resumable.shm import run_key_for
from resumable.snapshot import MemorySnapshot
from resumable.storage import MemoryStorage, Storage, check_storage_options, open_storage
from resumable.worker import worker_nice

log = logging.getLogger(__name__)


class Checkpointer:
    """Checkpoints ``state`` into ``url`` and puts it back on the next launch.

    Args:
        url: a local directory, ``file://`` URL, ``s3://bucket/prefix`` or
            ``memory://name`` (tests).
        state: named objects with ``state_dict()``/``load_state_dict()``, plain
            containers of tensors and JSON values, or generators.
        memory_every: cadence of memory snapshots taken by `maybe_save` (default none).
        persist_every: cadence of persists taken by `maybe_save` (default every 100 steps).
        keep: retention applied after each commit (default the 3 newest); ``None`` keeps all.
        map_location: device (or callable mapping a recorded device string to one) for
            tensors that are rebuilt rather than copied into existing ones.
        capture_rng: also capture Python, NumPy, torch CPU and CUDA random streams.
        persist: ``"auto"``, ``"process"``, ``"thread"`` or ``"sync"`` (see module doc).
        on_busy: when a persist is due while the previous one still runs: ``"skip"``
            (default; logged, and the persist is taken as soon as the worker is free)
            or ``"wait"``.
        shm_dir: the shared-memory directory (default ``/dev/shm``); slots live in this
            user's private ``resumable-<uid>`` directory inside it.
        overlap: copy parameters and optimizer state in the background during the next
            forward/backward; an optimizer step pre-hook waits for the copy before the
            optimizer changes them. Until ``optimizer.step()`` runs, nothing else may
            change parameters or optimizer state in place.
        preemption: signals and cloud notices that trigger an emergency checkpoint at
            the next `maybe_save`, then `should_stop` (and by default an exit with
            `REQUEUE_EXIT_CODE`); see `resumable.preemption`.
        alert: ``callback(kind, message, details)`` called (besides a WARNING log) when
            a save fails, when nothing committed for ``max_commit_age_s``, and when
            persists are deferred repeatedly.
        prometheus_registry: a ``prometheus_client`` registry to export counters to.
        storage_options: options for the ``s3://`` root(s): ``endpoint_url``,
            credentials, ``part_size``, ``max_concurrency``, timeouts, ``max_attempts``
            (see `resumable.storage.s3.S3Storage`); unset ones come from the standard
            AWS configuration.
        mirror: a second, usually remote, root (``s3://...``): every checkpoint
            committed in ``url`` is uploaded there in the background, local retention
            keeps what is not mirrored yet, and restore takes the newest valid
            checkpoint of either root (see `resumable.tiering`).
        mirror_keep: retention in ``mirror`` (default: keep all).
        dist_timeout_s: with several ranks (``torch.distributed`` initialised), how long
            a rank waits for the others during a coordinated save or restore before it
            gives up with `PersistError` (default 600 s); see `resumable.group`.
        incremental: write only what changed since the writer's last checkpoint (an
            `Incremental`; the default writes incrementally when that avoids at least a
            quarter of the bytes, and every checkpoint whole otherwise); ``False``
            writes every checkpoint whole. See ``docs/incremental.md``.
        save_on_close: whether `close` checkpoints the final state (default True). The
            integrations pass False: their framework decides every save, the last one
            included (Transformers' ``save_strategy="no"`` saves nothing).
        replicas: copies of each node's newest memory snapshot, its own included, kept
            in the memory of that many distinct nodes (default 1: none elsewhere). With
            2, a replaced node's ranks fetch their snapshots from a peer and lose no
            steps; each node then holds one snapshot's worth of its peers' (two while
            a newer one arrives) and keeps one more of its own. Needs the memory tier
            and as many nodes (torchrun ``GROUP_RANK``); see ``docs/replicas.md``.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Storage,
        state: Mapping[str, Any],
        *,
        memory_every: Every | None = None,
        persist_every: Every | None = None,
        keep: Keep | None = DEFAULT_KEEP,
        map_location: Any = None,
        capture_rng: bool = True,
        persist: str = "auto",
        on_busy: str = "skip",
        shm_dir: str | os.PathLike[str] | None = None,
        overlap: bool = False,
        preemption: Preemption | None = None,
        alert: AlertCallback | None = None,
        max_commit_age_s: float | None = None,
        prometheus_registry: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        mirror: str | os.PathLike[str] | Storage | None = None,
        mirror_keep: Keep | None = None,
        dist_timeout_s: float | None = None,
        incremental: Incremental | bool = True,
        save_on_close: bool = True,
        replicas: int = 1,
        options: CheckpointOptions | None = None,
    ) -> None:
        opts = resolve_options(options, locals())
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict of named objects, found {type(state).__name__}")
        self.options = opts
        worker_nice()  # RESUMABLE_WORKER_NICE checked before the root is touched
        # What every part agrees through: the ranks' group, or one process alone (whose
        # exchanges return at once): the same code serves both.
        self._group = current_group(opts.distributed.timeout_s)
        group = self._group or Group(0, 1)
        self.rank, self.world_size = group.rank, group.world_size
        # options that neither the root nor the mirror can use are refused, not dropped
        check_storage_options(url, opts.root.storage_options, mirror=opts.root.mirror)
        self.storage = open_storage(url, opts.root.for_url(url))
        self.url = self.storage.url
        mirror_url = opts.root.mirror
        self.mirror: Storage | None = (
            open_storage(mirror_url, opts.root.for_url(mirror_url))
            if mirror_url is not None
            else None
        )
        if self.mirror is not None and self.mirror.url == self.url:
            raise OptionError(f"mirror must be another root than {self.url}")
        mode = opts.persist.mode
        if mode == "auto":
            # A separate process keeps the persist (hashing, syscalls, HTTP) off the
            # trainer's GIL; in-process stores (memory://) can only be reached by a thread.
            in_process = isinstance(self.storage, MemoryStorage) or isinstance(
                self.mirror, MemoryStorage
            )
            mode = "thread" if in_process else "process"
        self.persist_mode: PersistMode = mode
        self.state = state
        self.save_on_close = opts.persist.save_on_close
        self._dist_timeout_s = opts.distributed.seconds
        self.should_stop = False
        self.last_snapshot_s: float | None = None
        self._closed = False
        self._skip_flush = False  # close() leaves the newest snapshot in shared memory
        self._restore_called = False
        self._first_save_checked = False
        self._best_metric_seen: bool | None = None  # Keep(best=...)'s metric reported?
        self._root_lock: RootLock | None = None
        self.run_id = self._claim_root(group)
        try:
            self._seen = _LastStep(state)  # what close() checkpoints

            self.audit = AuditLog(self.storage, rank=self.rank, enabled=self.rank == 0)
            self.audit.record(
                "launch",
                persist=mode,
                memory=opts.memory_tier,
                world_size=self.world_size,
            )
            self._progress = ProgressNotes(self.audit, _progress_every_s())
            self.monitor = Monitor(
                alert=opts.monitor.alert,
                max_commit_age_s=opts.monitor.max_commit_age_s,
                prometheus_registry=opts.monitor.prometheus_registry,
                url=self.url,
            )
            # Several ranks persisting in the background: their workers meet in a store
            # that rank 0 hosts, created now, collectively (every rank builds its
            # Checkpointer); the trainers agree on each due persist through it too.
            self._store = (
                CoordinationStore(group, self._dist_timeout_s)
                if mode != "sync" and self.world_size > 1
                else None
            )
            self._agreement = Agreement(group, self._store)
            self._schedule = Schedule(
                opts.schedule.memory_every,
                opts.schedule.persist_every,
                self._agreement,
            )
            self._schedule.on_absorbed = lambda step: self.monitor.skipped(
                step, "the previous persist is still running"
            )
            self._memory: MemoryTier | None = None
            if opts.memory_tier:
                self._memory = MemoryTier(
                    self.storage,
                    rank=self.rank,
                    world_size=self.world_size,
                    shm_dir=opts.memory.shm_dir,
                    overlap=opts.memory.overlap,
                    audit=self.audit,
                    run_id=self.run_id,
                )
                if opts.memory.replicas > 1:
                    self._memory.replication = Replication(
                        opts.memory.replicas,
                        group=group,
                        run_id=self.run_id,
                        directory=self._memory.arena.directory,
                        key=run_key_for(self.storage.location),
                        audit=self.audit,
                        monitor=self.monitor,
                        arena=self._memory.arena,
                    )
                    # A peer's replica of a rank may be one snapshot behind the rank's
                    # newest: every rank keeps its two newest while copying the next.
                    self._memory.arena.keep = 2
            parts: dict[str, Any] = {
                "coordination": group,
                "memory": self._memory,
                "audit": self.audit,
                "monitor": self.monitor,
                "mirror": self.mirror,
                # commits and retention deletes check the root's lease where they run
                "fence": self._root_lock.fence() if self._root_lock is not None else None,
            }
            self._persister: Persister = (
                SyncPersister(
                    self.storage,
                    keep=opts.retention.keep,
                    mirror_keep=opts.retention.mirror_keep,
                    incremental=opts.persist.writer,
                    **parts,
                )
                if mode == "sync"
                else BackgroundPersister(
                    self.storage,
                    mode=mode,
                    keep=opts.retention.keep,
                    mirror_keep=opts.retention.mirror_keep,
                    incremental=opts.persist.writer,
                    storage_options=opts.root.for_url(self.url),
                    mirror_options=(
                        opts.root.for_url(self.mirror.url) if self.mirror is not None else None
                    ),
                    store=self._store,
                    **parts,
                )
            )
            self._restorer = Restorer(
                state,
                self.storage,
                mirror=self.mirror,
                memory=self._memory,
                coordination=group,
                audit=self.audit,
            )
            self._remove_stale()
            _live.add(self)
            self._emergency = (
                Emergency(opts.preemption, group, self._agreement)
                if opts.preemption is not None
                else None
            )
        except BaseException:
            self._release_root()
            raise

    @property
    def memory_every(self) -> Every | None:
        return self._schedule.memory_every

    @property
    def persist_every(self) -> Every:
        return self._schedule.persist_every

    # ------------------------------------------------------------------ saving

    def snapshot(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Take a memory snapshot of the state as of ``step`` (no persist).

        Returns once the copy is complete: afterwards the trainer may change every
        tensor. In overlap mode, parameters and optimizer state are still being copied
        when it returns; the next ``optimizer.step()`` waits for that copy. Needs the
        memory tier (any persist mode but ``"sync"``, or ``memory_every`` given).
        """
        self._check_open()
        _check_step(step)
        self._schedule.check_order(step, "snapshot")
        self._seen.saw(step, metrics)
        self._progress.saw(step)
        try:
            self._snapshot(step, metrics)
        except BaseException:
            self._seen.forget()  # close() must not try this step again
            raise

    def _snapshot(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        self._collect()
        self._before_first_save(step)
        if self._memory is None:
            raise CheckpointError(
                "memory snapshots need the memory tier; create the Checkpointer with "
                "memory_every=... or a persist mode other than 'sync'"
            )
        rng = self.options.capture.capture_rng
        seconds, overlapped = self._memory.take(self.state, step, metrics, rng=rng)
        self.last_snapshot_s = seconds
        self.monitor.snapshot(seconds, overlapped)
        self._progress.snapshot(seconds)
        self._schedule.snapshotted(step)

    @property
    def snapshot_pending(self) -> bool:
        """Whether an overlapped snapshot copy is still running (``overlap=True``): the
        next ``optimizer.step()``, or any call here, waits for it."""
        return self._memory is not None and self._memory.copying

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Checkpoint the state as of ``step`` now: snapshot it (or reuse the memory
        snapshot of this step) and persist it.

        In ``"sync"`` mode it returns after the commit is durable. Otherwise it returns
        after the snapshot copy, and the persist commits in the background (`wait`
        blocks until it did). If the previous persist still runs and ``on_busy`` is
        ``"skip"``, only the memory snapshot is taken, the skip is logged, the persist
        is taken as soon as the worker is free, and this returns False.

        Raises `StepOrderError` if ``step`` is older than the newest step restored or
        saved (the same step again is allowed: it reuses that step's snapshot).
        """
        self._check_open()
        _check_step(step)
        self._schedule.check_order(step, "save")
        self._seen.saw(step, metrics)
        self._progress.saw(step)
        try:
            return self._save(step, metrics)
        except BaseException:
            self._seen.forget()  # close() must not try this step again
            raise

    def _save(self, step: int, metrics: Mapping[str, Any] | None) -> bool:
        self._collect()
        self._before_first_save(step)
        self._check_best_metric(step, metrics)
        if self._memory is None:  # sync without the memory tier: copy, then write here
            assert isinstance(self._persister, SyncPersister)
            self.last_snapshot_s = self._persister.persist_state(
                self.state, step, metrics, rng=self.options.capture.capture_rng
            )
            self._progress.snapshot(self.last_snapshot_s)
            self._schedule.persisted(step)
            return True
        if self.options.schedule.on_busy == "wait" and self._persister.busy:
            self._persister.wait()
        # All ranks persist this step, or none: the first rank to ask decides for all,
        # from whether its worker is busy. The question goes out before the snapshot
        # copy and is answered after it (the copy hides the store's round trips); a
        # worker busy when asked may be free by then, so this rank's answer errs
        # towards deferring, never towards a persist its worker cannot take. (With
        # one process, or ``persist="sync"``, the answer is taken after the copy.)
        busy: Pending | bool = False
        if self.options.schedule.on_busy == "skip" and self.persist_mode != "sync":
            busy = self._agreement.decide_later("busy", step, lambda: self._persister.busy)
        snap = self._memory.current(step)
        if snap is None:  # the snapshot is taken either way
            try:
                self.snapshot(step, metrics)
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
            running = self._persister.running()
            what = f"step(s) {running}" if running else "another rank's previous persist"
            self.audit.record("skip", step=step, reason=f"persist of {what} still running")
            log.info("persist of step %d deferred: %s still persisting", step, what)
            self.monitor.skipped(step, f"{what} still persisting")
            self._schedule.deferred()
            return False
        self._persist(snap)
        return True

    def _finish_before(self, step: int) -> None:
        """Told to persist ``step`` by a rank whose worker is free while this rank's
        still runs: wait for it, at most half of ``dist_timeout_s`` (it should end at
        once: the deciding rank's part of the same persist has). If it fails or does
        not end, this rank forgoes its part of the persist of ``step`` and raises
        `PersistError`: the other ranks' workers, which wait up to ``dist_timeout_s``
        for that part, stop waiting then, and every later persist keeps its key."""
        try:
            self._persister.wait(self._dist_timeout_s / 2)
        except BaseException as exc:
            self._persister.forgo(
                f"its previous persist did not finish before step {step}'s: {exc}"
            )
            raise

    def _before_first_save(self, step: int) -> None:
        """Once, at the first snapshot or save: warn if the root holds an earlier run's
        checkpoints and `restore` was never called (this run would write its steps
        beside them)."""
        if self._first_save_checked:
            return
        self._first_save_checked = True
        if self._restore_called or self.rank != 0:
            return
        try:
            committed = list_committed(self.storage)
        except CheckpointError as exc:
            # Only a warning hangs on this listing, and only rank 0 makes it: raising
            # here would leave this rank's save before the coordinated persist, and the
            # other ranks waiting for it until the group's timeout. The persist meets
            # the storage again, on every rank.
            log.warning("could not list the checkpoints of %s before saving: %s", self.url, exc)
            return
        if committed:
            log.warning(
                "%s holds checkpoints up to step %d, and restore() was not called before "
                "saving step %d: this run writes its own steps beside them (a step saved "
                "again replaces the earlier one). Call restore() first to continue that "
                "run, or give this run a directory of its own",
                self.url,
                committed[-1],
                step,
            )

    def _check_best_metric(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Warn once if ``Keep(best=...)`` ranks by a metric the saves do not report."""
        keep = self.options.retention.keep
        best = keep.best if keep is not None else None
        if best is None or self._best_metric_seen is not None:
            return
        if metrics is not None and best[0] in metrics:
            self._best_metric_seen = True
            return
        self._best_metric_seen = False
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

    def _persist(self, snap: MemorySnapshot) -> None:
        if self._root_lock is not None:
            self._root_lock.check()  # cheap; raises once another job may hold the root
        self._schedule.persisted(snap.step)
        self._persister.persist(snap, self.last_snapshot_s)

    def maybe_save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Persist or snapshot if a policy says so; returns whether a persist started.

        Cheap when nothing is due. A persist deferred because the worker was busy is
        taken at the first call that finds the worker free. Raises `StepOrderError` if
        ``step`` is older than the newest step restored or saved (a loop that counts
        from 0 after ``restore()`` returned a later step); the same step again is a no-op.
        """
        self._check_open()
        _check_step(step)
        self._schedule.check_order(step, "maybe_save")
        self._seen.saw(step, metrics)
        self._progress.saw(step)
        if self._emergency is not None and not self.should_stop and self._emergency.requested(step):
            self._preempted(step, metrics)
            return True
        self._collect()
        self.monitor.check_age(step)
        if self._schedule.persist_due(step, worker_free=not self._persister.busy):
            t0 = time.perf_counter()
            started = self.save(step, metrics)
            if started:  # the measured cost Every(auto=True) plans with (docs/interval.md)
                self._schedule.observe_cost(time.perf_counter() - t0)
            return started
        if self._schedule.memory_due(step):
            self.snapshot(step, metrics)
        return False

    def _preempted(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Persist the state of ``step`` within the grace period, then stop."""
        assert self._emergency is not None
        self._emergency.checkpoint(
            step,
            metrics,
            persister=self._persister,
            newest=lambda: self._memory.newest if self._memory is not None else None,
            persist=self._persist,
            save=self.save,
            audit=self.audit,
            snapshot_s=self.last_snapshot_s,
            persist_s=self.monitor.stats["last_persist_s"],
        )
        self.should_stop = True
        config = self._emergency.config
        if config.exit:
            self.close()
            log.warning("exiting with code %d for requeue", config.exit_code)
            raise SystemExit(config.exit_code)

    def reclaim_signals(self) -> None:
        """Install the preemption signal handlers again, over handlers a framework
        installed after this `Checkpointer` was opened (Lightning installs its own SIGTERM
        handler when ``fit`` starts, and would otherwise end training with exit code 0
        before the emergency checkpoint). `close` still restores the handlers that were
        there before the `Checkpointer`. A no-op without ``preemption=``."""
        self._check_open()
        if self._emergency is not None:
            self._emergency.reclaim_signals()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending persist committed (and, with a mirror, was
        uploaded); raise `PersistError` if one failed."""
        self._check_open()
        self._settle()
        self._persister.wait(timeout)
        self._persister.flush_mirror(timeout)

    def close(self, step: int | None = None, metrics: Mapping[str, Any] | None = None) -> None:
        """End the run's checkpointing: make its final state durable, wait for pending
        persists, stop the worker, release the root and remove this run's shared memory.

        The final state is the state as of ``step`` if given, else as of the last step
        passed to `maybe_save`, `save` or `snapshot`, provided no optimizer in ``state``
        has stepped since that call (then the state is that step's; otherwise it is ahead
        of it, and a WARNING says to pass ``step``). It is checkpointed if it is newer
        than the newest commit, so a finished run always ends with its last step
        committed. The context manager does the same on a normal exit; after an
        exception (the context manager's exit with one, a call from an ``except`` or
        ``finally`` clause while one propagates, interpreter exit) only the newest
        memory snapshot is made durable, never a state that may be half a step ahead.
        After a preemption (`should_stop` set) the emergency checkpoint stands: close
        takes no new capture unless ``step`` is passed.

        Raises `PersistError` if a persist failed; the shared-memory snapshot is then
        kept so the next launch can recover it. Idempotent.
        """
        if step is not None:
            _check_step(step)
        # Called while an exception propagates (an `except`/`finally` clause, a
        # framework's exception hook): the state may be half a step ahead, as above.
        handling = sys.exc_info()[1] is not None and step is None
        self._close(final=not handling, step=step, metrics=metrics)

    def _close(
        self, *, final: bool, step: int | None = None, metrics: Mapping[str, Any] | None = None
    ) -> None:
        if self._closed:
            return
        ok = False
        try:
            if not self._skip_flush:
                final = final and (self.save_on_close or step is not None)
                # After a preemption the emergency checkpoint already chose what fits
                # the grace period; close() takes no new capture on top of it.
                final = final and not (self.should_stop and step is None)
                self._flush(self._final_step(step, metrics) if final else None)
            ok = not self._skip_flush
        except KeyboardInterrupt:
            # Ctrl-C while the last state is made durable: the user chose to stop, so
            # its shared memory is freed too, not kept for a next launch.
            ok = True
            log.warning(
                "interrupted while closing %s: the newest checkpoint is step %s; what was "
                "not committed yet is dropped",
                self.url,
                self._persister.committed,
            )
            raise
        finally:
            self._closed = True
            _live.discard(self)
            self._progress.flush(final=True)
            self.audit.record("close", step=self._progress.step, clean=ok)
            self._seen.close()
            if self._emergency is not None:
                self._emergency.close()
            self._persister.close()
            self._agreement.close()
            if self._store is not None:
                self._store.close()
            if ok:
                # What the persist worker left unfinished (one that had to be killed at
                # stop, say): its trash and staging directories, removed now rather than
                # at the next launch.
                try:
                    self._remove_stale()
                except CheckpointError as exc:
                    log.warning("could not look for stale directories in %s: %s", self.url, exc)
            if self._memory is not None:
                self._memory.close(unlink=ok)
            self._release_root()
            self.storage.close()
            if self._group is not None:
                self._group.close()
            if self.mirror is not None:
                self.mirror.close()

    def _final_step(
        self, step: int | None, metrics: Mapping[str, Any] | None
    ) -> tuple[int, Mapping[str, Any] | None] | None:
        """The step (and metrics) whose state close() checkpoints, or None."""
        if step is not None:
            return step, metrics
        seen = self._seen
        if seen.step is None:
            return None
        if seen.stepped:
            log.warning(
                "closing %s: an optimizer stepped after the last maybe_save()/save() "
                "(step %d), so the state is ahead of that step and is not checkpointed "
                "at close; the newest checkpoint is the last one taken. Call "
                "maybe_save(step) after each optimizer step, or close(step=...) with the "
                "step the state is at",
                self.url,
                seen.step,
            )
            return None
        return seen.step, seen.metrics

    def _flush(self, final: tuple[int, Mapping[str, Any] | None] | None = None) -> None:
        """Make the final state (``final``: its step and metrics), else the newest memory
        snapshot, durable if it is newer than the last commit."""
        self._settle()
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
                self.url,
                final[0],
                committed,
            )
        # A collective save: only if every rank closes at that step.
        offers = self._restorer.group.gather(wanted)
        if final is not None and wanted is not None and all(o == wanted for o in offers):
            self.save(wanted, final[1])
            self._persister.wait()
        newest = self._memory.newest if self._memory is not None else None
        committed = self._persister.committed
        due = newest is not None and (committed is None or newest.step > committed)
        offers = self._restorer.group.gather(newest.step if due and newest is not None else None)
        if due and newest is not None and all(o == offers[0] for o in offers):
            self._persist(newest)
            self._persister.wait()
        left = self._emergency.left_s() if self._emergency is not None else None
        if left is None:
            self._persister.flush_mirror()
        elif left > 0:  # within the grace period, best effort
            self._persister.flush_mirror(left, strict=False)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # Training raised: make the newest snapshot durable, but never mask the error.
        # With several ranks a persist is collective and the others are not closing:
        # the snapshot stays in shared memory for the next launch instead.
        if self.world_size > 1:
            self._skip_flush = True
        try:
            self._close(final=False)
        except Exception as close_exc:
            log.error("while handling %r, persisting the last snapshot failed: %s", exc, close_exc)

    # ------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Steps of committed checkpoints (in ``url`` or the mirror), ascending;
        validity not checked."""
        return sorted(self._restorer.roots_by_step())

    def restore(
        self,
        step: int | None = None,
        *,
        map_location: Any = None,
        tier: str = "auto",
        reset_per_rank_state: bool = False,
        strict: bool = True,
        quiet: bool = False,
    ) -> int:
        """Load the newest valid state (or ``step``) into ``state``; returns its step.

        ``tier`` is ``"auto"`` (newest across shared memory and storage), ``"memory"``
        or ``"storage"``. Returns 0 when there is nothing to restore. A memory snapshot
        newer than every committed checkpoint is persisted right after it is restored.
        Corrupt checkpoints are skipped with a WARNING; if checkpoints exist and none is
        valid, raises `CorruptCheckpointError` rather than starting over. When it resumed
        from a checkpoint, prints one line to stderr (rank 0; ``quiet=True`` keeps it
        silent) with the step, the tier and the seconds it took, like Lightning's and the
        Trainer's; a fresh start prints nothing. Logs one INFO line saying which step came
        from which tier, and what was skipped. With
        ``tier="memory"``, a snapshot that fails its check while it is copied raises
        `CorruptCheckpointError` (the state then holds part of it).

        With several ranks every rank calls it: they agree on the newest step all of
        them can read, and model and optimizer state reshard to this job's world size.
        Per-rank state (random streams, data position) cannot reshard; after a world-size
        change that is an error unless ``reset_per_rank_state`` (then it keeps this
        launch's values, with a WARNING).

        ``strict=False`` is a partial restore, for a state that grew or shrank since the
        checkpoint (a new head, a new entry in ``state``): state keys and module
        parameters the checkpoint lacks are left as constructed, checkpoint entries the
        state lacks are ignored, and a WARNING lists both. Shapes and classes must still
        fit (an optimizer over other parameters does not: construct it fresh and leave
        it out of the checkpoint's keys, or start a new directory).
        """
        self._check_open()
        if tier not in ("auto", "memory", "storage"):
            raise ValueError(f"tier must be 'auto', 'memory' or 'storage', got {tier!r}")
        self._collect()
        self._restore_called = True
        if self.rank == 0:
            for name in warn_uncommitted(self.storage):
                self.audit.record("uncommitted", name=name)
        if self._memory is not None:
            self._memory.preflight(self.state, rng=self.options.capture.capture_rng)
        self._persister.start()
        t0 = time.perf_counter()
        done = self._restorer.restore(
            step,
            map_location=map_location or self.options.capture.map_location,
            tier=tier,
            reset_per_rank=reset_per_rank_state,
            strict=strict,
        )
        committed = done.newest_committed
        if committed is not None:
            self._persister.committed = max(committed, self._persister.committed or 0)
        if done.step:
            self._schedule.restored(done.step)
            if not quiet and self.rank == 0:
                print(done.summary(self.url, time.perf_counter() - t0), file=sys.stderr)
        log.info("%s", done.describe(self.url))
        if done.partial:
            log.warning(
                "restored step %d of %s partially: %s", done.step, self.url, "; ".join(done.partial)
            )
        if done.snapshot is not None and (committed is None or done.step > committed):
            log.info("persisting step %d recovered from shared memory", done.step)
            self._persist(done.snapshot)
        return done.step

    # ------------------------------------------------------------------ pinning

    def pin(self, step: int) -> None:
        """Exempt a committed checkpoint from retention."""
        if step not in self.steps():
            raise NoCheckpointError(f"no committed checkpoint for step {step} in {self.url}")
        self.storage.write(f"{PINS_DIR}/{step_dir(step)}", [b""])
        self.audit.record("pin", step=step)

    def unpin(self, step: int) -> None:
        """Make a pinned checkpoint subject to retention again."""
        self.storage.delete(f"{PINS_DIR}/{step_dir(step)}")
        self.audit.record("unpin", step=step)

    # ------------------------------------------------------------------ internals

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and last durations (snapshots, persists, commits, skips, failures),
        and ``persist_cost_s``, the measured cost ``Every(auto=True)`` plans with."""
        return {**self.monitor.stats, "persist_cost_s": self._schedule.cost.value}

    @property
    def worker_pid(self) -> int | None:
        """The pid of the persist worker process, if one runs (``persist="process"``)."""
        if isinstance(self._persister, BackgroundPersister):
            return self._persister.worker_pid
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer for {self.url} is closed")

    def _settle(self) -> None:
        if self._memory is not None:
            self._memory.settle()

    def _collect(self) -> None:
        """Finish an overlapped copy, take in finished persists; raise the first failure."""
        self._settle()
        self._persister.collect()

    def _claim_root(self, group: Group) -> str:
        """Before anything is written: check that the root (and the mirror) can hold
        checkpoints, take the root for this job (rank 0 holds `resumable.lock`'s lock
        until `close`), and read or create its run id (`resumable.runid`). Every rank
        gets rank 0's outcome, so a refused root fails every rank at construction."""
        self._supersede()
        if group.rank != 0:
            kind, value = group.broadcast(None, "claim-root")
            if kind == "error":
                raise CheckpointError(f"rank 0 could not take the checkpoint root: {value}")
            return str(value)
        try:
            refuse_checkpoint_as_root(self.storage)
            self.storage.check_root()
            if self.mirror is not None:
                self._check_mirror(self.mirror)
            self._root_lock = acquire_root(self.storage)
            run_id = ensure_run_id(self.storage)
        except BaseException as exc:
            self._release_root()
            group.broadcast(("error", f"{type(exc).__name__}: {exc}"), "claim-root")
            raise
        group.broadcast(("ok", run_id), "claim-root")
        return run_id

    def _supersede(self) -> None:
        """Close a Checkpointer of the same root still open in this process (a notebook
        cell run again, a script that opens a second one to restore): one writer per
        root, and the newer one is the one in use. Another process's is refused."""
        for other in list(_live):
            if other is self or other._closed or other.url != self.url:
                continue
            log.warning(
                "a Checkpointer of %s was still open in this process: closing it first "
                "(one writer per root; close() it, or use `with`, to avoid this)",
                self.url,
            )
            try:
                other._close(final=False)
            except Exception as exc:
                log.error("closing the earlier Checkpointer of %s failed: %s", self.url, exc)

    def _check_mirror(self, mirror: Storage) -> None:
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

    def _release_root(self) -> None:
        lock, self._root_lock = self._root_lock, None
        if lock is not None:
            lock.release()

    def _remove_stale(self) -> None:
        if self.rank != 0:  # rank 0 owns the attempts of a coordinated save
            return
        for name in committer_for(self.storage).stale():
            try:
                self.storage.delete(name)
            except CheckpointError as exc:
                log.warning("could not remove stale %s: %s", name, exc)
                continue
            log.info("removed stale %s (data of a commit that never finished)", name)
            self.audit.record("stale_removed", name=name)


def _progress_every_s() -> float:
    """Seconds between ``progress`` audit entries, ``RESUMABLE_PROGRESS_EVERY_S``
    overriding `PROGRESS_EVERY_S` (0: one at every step, for tests)."""
    text = settings.PROGRESS_EVERY_S.read()
    if text is None:
        return PROGRESS_EVERY_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"RESUMABLE_PROGRESS_EVERY_S must be a number >= 0, got {text!r}")
    return value


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


class _LastStep:
    """The last step the training loop reported, and whether an optimizer of the state
    stepped since (then the state is ahead of that step): what `Checkpointer.close`
    may checkpoint as the final state."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.step: int | None = None
        self.metrics: Mapping[str, Any] | None = None
        self.stepped = False
        ref = weakref.ref(self)

        def mark(*_: Any) -> None:
            seen = ref()
            if seen is not None:
                seen.stepped = True

        self._handles: list[Any] = []
        for obj in state.values():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            inner = getattr(obj, "optimizer", None)  # wrappers (accelerate, Lightning)
            target = inner if isinstance(inner, torch.optim.Optimizer) else obj
            try:
                self._handles.append(target.register_step_post_hook(mark))
            except AttributeError:  # a subclass that skipped Optimizer.__init__: not watched
                pass

    def saw(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        self.step, self.metrics, self.stepped = step, metrics, False

    def forget(self) -> None:
        """The save or snapshot of the step seen failed: nothing to checkpoint at close."""
        self.step, self.metrics = None, None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """At interpreter exit (normal, or after an uncaught exception), make every open
    Checkpointer's newest snapshot durable and release its resources."""
    for ckpt in list(_live):
        if ckpt.world_size > 1:
            ckpt._skip_flush = True  # a collective persist would wait for the other ranks
        try:
            ckpt._close(final=False)  # maybe after an exception: no new capture
        except KeyboardInterrupt:  # a second Ctrl-C: said once above, no traceback
            pass
        except Exception as exc:
            log.error("closing the checkpointer of %s at exit failed: %s", ckpt.url, exc)
