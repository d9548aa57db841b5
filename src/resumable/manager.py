"""`Checkpointer`: the one object a training script talks to, a facade over the parts.

A *memory snapshot* copies the state into a shared-memory slot: the only part that
blocks training. A *persist* hands a snapshot to the persist worker (a separate
process by default), which writes, commits and applies retention in the background.
``restore()`` finds the newest *valid* state across shared memory and storage,
verifying before touching any live object. The parts (`resumable.pipeline`) do the
work; the options (`resumable.options`) pick them, once, at construction.

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

from resumable.commit import step_dir
from resumable.errors import CheckpointError, NoCheckpointError
from resumable.group import Group, current_group
from resumable.incremental import Incremental
from resumable.monitor import AlertCallback
from resumable.options import DEFAULT_KEEP, CheckpointOptions, Overlap, resolve_options
from resumable.pipeline._worker import worker_nice
from resumable.pipeline.emergency import Emergency
from resumable.pipeline.first_save import FirstSaveChecks
from resumable.pipeline.last_step import Final, LastStep, check_step
from resumable.pipeline.persister import BackgroundPersister
from resumable.pipeline.root_claim import RootClaim, remove_stale
from resumable.pipeline.wiring import build_parts, open_roots, persist_mode
from resumable.policy import Every, Keep
from resumable.preemption import Preemption
from resumable.retention import PINS_DIR
from resumable.storage import Storage

log = logging.getLogger(__name__)


class Checkpointer:
    """Checkpoints ``state`` into ``url`` and puts it back on the next launch.

    Args:
        url: a local directory, ``file://`` URL, ``s3://bucket/prefix`` or
            ``memory://name`` (tests).
        state: named objects with ``state_dict()``/``load_state_dict()``, plain
            containers of tensors and JSON values, or generators.
        options: every other option as one `CheckpointOptions`. Or pass them as keywords
            here instead (``memory_every``, ``persist_every``, ``keep``, ``persist``,
            ``on_busy``, ``mirror``, ``preemption``, ...): the same names, defaults and
            meaning as `CheckpointOptions.from_kwargs`, which describes each. Not both.

    Raises:
        OptionError: an option of the wrong type or range, options that cannot work
            together, or ``options=`` with keywords; before anything is opened.
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
        overlap: Overlap = False,
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
        node_objects: bool = False,
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
        self.storage, self.mirror = open_roots(url, opts)
        self.url = self.storage.url
        self.persist_mode = persist_mode(opts, self.storage, self.mirror)
        self.state = state
        self.save_on_close = opts.persist.save_on_close
        self.should_stop = False
        self._closed = False
        self._skip_flush = False  # close() leaves the newest snapshot in shared memory
        self._supersede()
        self._claim = RootClaim(self.storage, self.mirror, group)
        self.run_id = self._claim.run_id
        try:
            self._seen = LastStep(state)  # what close() checkpoints
            self._checks = FirstSaveChecks(self.storage, opts.retention.keep, rank=self.rank)
            self._parts = parts = build_parts(
                opts,
                state,
                self.storage,
                self.mirror,
                group,
                mode=self.persist_mode,
                claim=self._claim,
            )
            self.audit, self.monitor = parts.audit, parts.monitor
            self._memory, self._persister = parts.memory, parts.persister
            if self.rank == 0:  # rank 0 owns the attempts of a coordinated save
                remove_stale(self.storage, self.audit)
            _live.add(self)
            stop = opts.preemption  # installs signal handlers: the last part built
            self._emergency = Emergency(stop, group, parts.agreement) if stop is not None else None
        except BaseException:
            self._claim.release()
            raise

    @property
    def memory_every(self) -> Every | None:
        return self._parts.schedule.memory_every

    @property
    def persist_every(self) -> Every:
        return self._parts.schedule.persist_every

    # ------------------------------------------------------------------ saving

    def snapshot(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Take a memory snapshot of the state as of ``step`` (no persist).

        Returns once the copy is complete: afterwards the trainer may change every tensor.
        In overlap mode, parameters and optimizer state are still being copied when it
        returns; the next ``optimizer.step()`` waits for that copy. Needs the memory tier
        (any persist mode but ``"sync"``, or ``memory_every`` given)."""
        self._report(step, metrics, "snapshot")
        self._collect_and_snapshot(step, metrics)

    def _collect_and_snapshot(
        self, step: int, metrics: Mapping[str, Any] | None, *, collected: bool = False
    ) -> None:
        """`snapshot` once the step is reported (`_report`); ``collected``: the caller
        has just taken in finished persists (`_collect`)."""
        try:
            if not collected:
                self._collect()
            self._checks.before_save(step)
            self._parts.saver.snapshot(self.state, step, metrics)
        except BaseException:
            self._seen.forget()  # close() must not try this step again
            raise

    @property
    def last_snapshot_s(self) -> float | None:
        """Seconds the last snapshot blocked training (capture and copy)."""
        return self._parts.saver.last_snapshot_s

    @property
    def snapshot_pending(self) -> bool:
        """Whether an overlapped snapshot copy is still running: the next step waits."""
        return self._memory is not None and self._memory.copying

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Checkpoint the state as of ``step`` now: snapshot it (or reuse the memory
        snapshot of this step) and persist it.

        In ``"sync"`` mode it returns after the commit is durable. Otherwise it returns
        after the snapshot copy, and the persist commits in the background (`wait`
        blocks until it did). If the previous persist still runs and ``on_busy`` is
        ``"skip"``, only the memory snapshot is taken, the skip is logged, the persist
        is taken as soon as the worker is free, and this returns False. With ``"wait"``
        the persist queues behind the running one; this waits only if one is queued
        already (or shared memory has no room for a spare slot).

        Raises `StepOrderError` if ``step`` is older than the newest step restored or
        saved (the same step again is allowed: it reuses that step's snapshot).
        """
        self._report(step, metrics, "save")
        try:
            self._collect()
            self._checks.before_save(step)
            self._checks.metrics(step, metrics)
            return self._parts.saver.save(self.state, step, metrics, self.snapshot)
        except BaseException:
            self._seen.forget()  # close() must not try this step again
            raise

    def maybe_save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Persist or snapshot if a policy says so; returns whether a persist started.

        Cheap when nothing is due. A persist deferred because the worker was busy is
        taken at the first call that finds the worker free. Raises `StepOrderError` if
        ``step`` is older than the newest step restored or saved (a loop that counts
        from 0 after ``restore()`` returned a later step); the same step again is a no-op.
        """
        self._report(step, metrics, "maybe_save")
        if self._emergency is not None and not self.should_stop and self._emergency.requested(step):
            self._preempted(step, metrics)
            return True
        self._collect()
        self.monitor.check_age(step)
        if self._parts.schedule.persist_due(step, worker_free=not self._persister.busy):
            t0 = time.perf_counter()
            started = self.save(step, metrics)
            if started:  # the measured cost Every(auto=True) plans with (docs/interval.md)
                self._parts.schedule.observe_cost(time.perf_counter() - t0)
            return started
        if self._parts.schedule.memory_due(step):
            self._collect_and_snapshot(step, metrics, collected=True)  # reported above
        return False

    def _preempted(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Persist the state of ``step`` within the grace period, then stop."""
        assert self._emergency is not None
        self._parts.saver.preempted(self._emergency, step, metrics, self.save)
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
            check_step(step)
        # Called while an exception propagates (an `except`/`finally` clause, a
        # framework's exception hook): the state may be half a step ahead, as above.
        handling = sys.exc_info()[1] is not None and step is None
        self._close(final=not handling, step=step, metrics=metrics)

    def _close(
        self,
        *,
        final: bool,
        step: int | None = None,
        metrics: Mapping[str, Any] | None = None,
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
                self._flush(self._seen.final(step, metrics, self.url) if final else None)
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
            self._seen.close()
            if self._emergency is not None:
                self._emergency.close()
            self._parts.close(ok=ok, rank=self.rank, storage=self.storage)
            self._claim.release()
            self.storage.close()
            if self._group is not None:
                self._group.close()
            if self.mirror is not None:
                self.mirror.close()

    def _flush(self, final: Final | None = None) -> None:
        left_s = self._emergency.left_s if self._emergency is not None else lambda: None
        self._parts.saver.flush(final, self.save, url=self.url, left_s=left_s)

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
            log.error(
                "while handling %r, persisting the last snapshot failed: %s",
                exc,
                close_exc,
            )

    # ------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Steps of committed checkpoints (in ``url`` or the mirror), ascending;
        validity not checked."""
        return sorted(self._parts.restorer.roots_by_step())

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
        self._checks.restored()
        restorer = self._parts.restorer
        # one walk of the state for the memory tier's room check and the restore
        live = restorer.hold_live() if restorer.memory is not None else None
        self._parts.saver.before_restore(self.state, self.storage, rank=self.rank, live=live)
        t0 = time.perf_counter()
        done = self._parts.restorer.restore(
            step,
            map_location=map_location or self.options.capture.map_location,
            tier=tier,
            reset_per_rank=reset_per_rank_state,
            strict=strict,
        )
        if done.step and not quiet and self.rank == 0:
            print(done.summary(self.url, time.perf_counter() - t0), file=sys.stderr)
        self._parts.saver.resumed(done, self.url)
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
        return {**self.monitor.stats, "persist_cost_s": self._parts.schedule.cost.value}

    @property
    def worker_pid(self) -> int | None:
        """The pid of the persist worker process, if one runs (``persist="process"``)."""
        if isinstance(self._persister, BackgroundPersister):
            return self._persister.worker_pid
        return None

    def _report(self, step: int, metrics: Mapping[str, Any] | None, call: str) -> None:
        """What every save call does first: check the step, and note it as seen."""
        self._check_open()
        check_step(step)
        self._parts.schedule.check_order(step, call)
        self._seen.saw(step, metrics)
        self._parts.progress.saw(step)

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
