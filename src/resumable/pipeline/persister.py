"""The trainer's side of persisting: where a persist runs, and what comes back.

Neither implementation writes a file itself: the bytes and the commit are
`resumable.pipeline.write`'s, run by a `JobRunner` on the training thread or in the
persist worker. One implementation for each way a persist can run:

- `SyncPersister` (``persist="sync"``) writes on the training thread: `persist`
  returns after the commit is durable. Its source is a memory snapshot, or, without the
  memory tier, an in-process copy (`persist_state`).
- `BackgroundPersister` (``"process"``, ``"thread"``) hands each memory snapshot to the
  persist worker (`resumable.pipeline._worker`) and returns; the worker writes, commits, applies
  retention and replies. With several ranks, the ranks' workers meet in a store that
  rank 0's checkpointer hosts (`resumable.coordination`): the training processes take
  part in no collective while a persist runs.

Call order (the facade's): `start` once (optional: it warms a worker process up),
then any number of `persist`, `collect` at every call of the facade, `wait` and
`flush_mirror` when asked, `close` once. A failure, whenever it happened, is raised as
`PersistError` by the next `collect` or `wait`: never swallowed. On an object store the
root is held by a lease (`resumable.lock`); its `LeaseFence` goes to whatever commits
(the worker, or `JobRunner` here), and a persist refused because the lease was lost
is raised as `RootInUseError`, as is a lost lease at `wait`.

The same code serves one process and several ranks: the coordination given (a
`resumable.group.Group`, of one process or of the job's ranks) makes the
difference. With several ranks a synchronous persist is collective (every rank calls
it at the same step) and a background one is coordinated by the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from resumable import capture as capture_mod
from resumable.audit import AuditLog
from resumable.coordination import CoordinationStore
from resumable.errors import PersistError, RootInUseError
from resumable.format import json_metrics
from resumable.group import Group
from resumable.incremental import Incremental
from resumable.lock import LeaseFence
from resumable.monitor import Monitor
from resumable.nodes import NodeObjects
from resumable.pieces import owned_tensors
from resumable.pipeline._worker import JobRunner, PersistWorker, keep_to_json
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.messages import (
    Committed,
    Failed,
    Mirrored,
    MirrorFailed,
    MirrorFlushed,
    MirrorFlushJob,
    PersistJob,
    Reply,
    Report,
    WorkerConfig,
)
from resumable.pipeline.write import WriteRequest, rank_share, replicated_holders
from resumable.policy import Keep
from resumable.snapshot import Arena, MemorySnapshot
from resumable.storage import Storage

log = logging.getLogger(__name__)


class Persister:
    """What the two implementations share: accounting of each persist (audit, monitor,
    the newest committed step), the mirror's reports, and raising failures.

    Call order (the facade's, on the training thread): `start` once, `persist` any
    number of times (`wait_for_turn` before one that would queue too deep), `collect`
    at every call of the facade, `wait` and `flush_mirror` when asked, `close` once,
    after `wait`."""

    def __init__(
        self,
        storage: Storage,
        *,
        coordination: Group,
        memory: MemoryTier | None,
        audit: AuditLog,
        monitor: Monitor,
        mirror: Storage | None,
        fence: LeaseFence | None = None,
    ) -> None:
        """``fence``: the root lock's (`RootLock.fence`), for the commits and deletes."""
        self.storage = storage
        self.fence = fence
        self.group = coordination
        self.memory = memory
        self.audit = audit
        self.monitor = monitor
        self.mirror = mirror
        self.committed: int | None = None  # the newest step known committed
        self._errors: list[str] = []
        self._flushed: MirrorFlushed | None = None

    @property
    def mirror_url(self) -> str | None:
        """The mirror this rank uploads to, if any. With several ranks rank 0 commits, so
        it alone uploads."""
        return self.mirror.url if self.mirror is not None and self.group.rank == 0 else None

    @property
    def busy(self) -> bool:
        """Whether a persist is still running (a new one would queue behind it)."""
        return False

    def running(self) -> list[int]:
        """Steps of the persists still running."""
        return []

    def start(self) -> None:
        """Get ready to persist (start the worker), if that takes time."""

    def persist(self, snap: MemorySnapshot, snapshot_s: float | None) -> None:
        raise NotImplementedError

    def collect(self) -> None:
        """Take in what finished; raise the first failure as `PersistError`."""
        self._take([])

    def wait_for_turn(self, queue: int) -> None:
        """Block until fewer than ``queue`` persists are outstanding (the oldest ones
        finished); raise a failure as `PersistError`."""
        self.wait()

    def forgo(self, reason: str) -> None:
        """This rank cannot take part in the persist every rank agreed to start now
        (several ranks, in the background; a no-op otherwise)."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until every persist finished; raise a failure as `PersistError`, or
        `RootInUseError` once the root's lease is lost."""
        self._take([])
        self._check_root()

    def _check_root(self) -> None:
        """Raise `RootInUseError` if this job lost the root (its persists and retention
        were refused from then on)."""
        if self.fence is not None and self.fence.lost:
            raise RootInUseError(self._root_lost(), url=self.storage.url)

    def _root_lost(self) -> str:
        assert self.fence is not None
        if not self.fence.lost:
            return (
                f"The lease of this job on {self.storage.url} lapsed (the job was stopped "
                "or starved for longer than the lease, or the storage was unreachable)"
            )
        return self.fence.reason or f"This job gave the checkpoint root {self.storage.url} back"

    def flush_mirror(self, timeout: float | None = None, *, strict: bool = True) -> None:
        """Wait until the newest commit is mirrored; raise `PersistError` if it could
        not be (``strict``), or log it."""
        if self.mirror is None:
            return
        self._flushed = None
        if not self._request_flush(timeout):
            return
        error = self._flushed.error if self._flushed is not None else None
        if not error:
            return
        if strict:
            raise PersistError(
                f"{error}. The checkpoint is committed in {self.storage.url}; it is not in "
                f"{self.mirror.url}"
            )
        log.warning("not mirrored: %s", error)

    def _request_flush(self, timeout: float | None) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        """Stop what runs in the background (after `wait`)."""

    # ------------------------------------------------------------ accounting

    def _take(self, messages: list[Reply | Report]) -> list[Reply]:
        """Account for finished persists and mirror reports; raise the first failure."""
        replies: list[Reply] = []
        for msg in messages:
            if isinstance(msg, Mirrored):
                self.monitor.mirrored(msg.step, msg.seconds)
            elif isinstance(msg, MirrorFailed):
                self.monitor.mirror_failed(msg.step, msg.error)
            elif isinstance(msg, MirrorFlushed):
                self._flushed = msg
                replies.append(msg)
            elif isinstance(msg, Committed):
                self.committed = max(msg.step, self.committed or 0)
                self.monitor.committed(msg.step, msg.seconds)
                replies.append(msg)
            elif isinstance(msg, Failed):
                self._errors.append(
                    f"persisting step {msg.step} to {self.storage.url} failed: {msg.error}"
                )
                self.monitor.failed(msg.step, msg.error)
                replies.append(msg)
        if self._errors:
            first = self._errors[0]
            self._errors.clear()
            if self.fence is not None and self.fence.lapsed:  # refused by the fence
                raise RootInUseError(f"{first}. {self._root_lost()}", url=self.storage.url)
            raise PersistError(first)
        return replies

    def _started(self, step: int, nbytes: int, snapshot_s: float | None) -> None:
        self.audit.record("save_start", step=step, bytes=nbytes, snapshot_s=snapshot_s)
        self.monitor.persist_started()


class SyncPersister(Persister):
    """Persists on the training thread; returns once the commit is durable."""

    def __init__(
        self,
        storage: Storage,
        *,
        keep: Keep | None,
        mirror_keep: Keep | None,
        incremental: Incremental | None = None,
        nodes: NodeObjects | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(storage, **kw)
        self.nodes = nodes  # one object per node (`resumable.nodes`), or None
        self._reports: list[Report] = []  # from the mirror thread, taken at `collect`
        rank = self.group.rank
        self.runner = JobRunner(
            storage,
            WorkerConfig(
                url=storage.url,
                keep=keep_to_json(keep),
                rank=rank,
                audit=rank == 0,
                mirror=self.mirror_url,
                mirror_keep=keep_to_json(mirror_keep),
                incremental=incremental.to_json() if incremental is not None else None,
            ),
            notify=self._reports.append,
            mirror_storage=self.mirror,
            fence=self.fence,
        )
        self._arena = Arena()  # this rank's share, or a snapshot without the memory tier

    def collect(self, *also: Reply) -> None:
        """Take in the mirror thread's reports (and ``also``)."""
        reports, self._reports[:] = list(self._reports), []
        self._take([*reports, *also])

    def wait(self, timeout: float | None = None) -> None:
        self.collect()
        self._check_root()

    def persist(self, snap: MemorySnapshot, snapshot_s: float | None) -> None:
        assert self.memory is not None
        content = self.memory.readable(snap)
        if content is None:
            raise PersistError(f"memory snapshot of step {snap.step} is gone")
        meta = content.meta
        data = self.memory.data(snap)
        holders: dict[str, int] = {}
        if self.group.world_size > 1:  # this rank's share, copied out of its slot
            group = self.group
            sizes = {t.name: t.nbytes for t in data.slots}
            holders = replicated_holders(sizes, meta.replicated, group.rank, group.world_size)
            data = rank_share(self._arena, data, meta.replicated, group.rank, group.world_size)
        request = WriteRequest(snap.step, data, meta.tree, meta.metrics, meta.pieces, holders)
        self._write(request, snapshot_s)

    def persist_state(
        self,
        state: Mapping[str, Any],
        step: int,
        metrics: Mapping[str, Any] | None,
        *,
        rng: bool,
    ) -> float:
        """Without the memory tier: copy the state into this process's arena and persist
        that; returns the seconds the copy took."""
        t0 = time.perf_counter()
        rank, world = self.group.rank, self.group.world_size
        captured = capture_mod.capture(state, include_rng=rng, rank=rank, world_size=world)
        tensors = owned_tensors(captured.tensors, captured.replicated, rank, world)
        snap = self._arena.snapshot(tensors)
        snapshot_s = time.perf_counter() - t0
        sizes = {n: t.numel() * t.element_size() for n, t in captured.tensors.items()}
        request = WriteRequest(
            step,
            snap,
            captured.tree,
            json_metrics(metrics or {}),
            captured.pieces,
            replicated_holders(sizes, captured.replicated, rank, world),
        )
        self._write(request, snapshot_s)
        return snapshot_s

    def _write(self, request: WriteRequest, snapshot_s: float | None) -> None:
        step = request.step
        self._started(step, request.snapshot.nbytes, snapshot_s)
        persist: Callable[[], Committed]
        if self.group.world_size > 1:
            group = self.group

            def persist() -> Committed:
                return self.runner.persist_group(group, request, nodes=self.nodes)
        else:

            def persist() -> Committed:
                return self.runner.persist_snapshot(request)[0]

        try:
            reply = persist()
        except KeyboardInterrupt:  # the user's decision, not a failure: no alert
            self.audit.record("interrupted", step=step)
            log.warning("the persist of step %d was interrupted; nothing of it committed", step)
            raise
        except BaseException as exc:
            self.audit.record("failure", step=step, error=repr(exc)[:500])
            self.monitor.failed(step, repr(exc))
            raise
        self._take([reply])

    def _request_flush(self, timeout: float | None) -> bool:
        if self.runner.mirror is None:  # another rank than 0: rank 0 uploads
            return False
        self.collect(self.runner.mirror.flush(timeout))
        return True

    def close(self) -> None:
        self.runner.close()


class BackgroundPersister(Persister):
    """Hands memory snapshots to the persist worker (a process, or a thread for
    in-process backends) and returns."""

    def __init__(
        self,
        storage: Storage,
        *,
        mode: str,
        keep: Keep | None,
        mirror_keep: Keep | None,
        storage_options: dict[str, Any] | None,
        mirror_options: dict[str, Any] | None,
        store: CoordinationStore | None,
        incremental: Incremental | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(storage, **kw)
        self.mode = mode
        self.keep = keep
        self.mirror_keep = mirror_keep
        self.incremental = incremental
        self.storage_options = storage_options
        self.mirror_options = mirror_options
        self._worker: PersistWorker | None = None
        self._jobs: dict[int, tuple[int, int]] = {}  # job id -> (slot index, step)
        self._job_keys: dict[int, str] = {}  # job id -> its coordinated persist's key
        # Several ranks: their workers meet in the store that rank 0 hosts (None for
        # one process). Closed by the owner, which also agrees on decisions through it.
        self._store = store

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.busy

    def running(self) -> list[int]:
        return sorted(step for _, step in self._jobs.values())

    @property
    def worker_pid(self) -> int | None:
        """The pid of the persist worker process, if one runs."""
        if self._worker is None or self._worker.mode != "process" or not self._worker.alive:
            return None
        return self._worker.pid

    def start(self) -> None:
        if self.mode == "process":
            self._ensure_worker()  # its interpreter warms up while the trainer works

    def _ensure_worker(self) -> PersistWorker:
        if self._worker is None or not self._worker.alive:
            thread = self.mode == "thread"
            self._worker = PersistWorker(
                url=self.storage.url,
                mode=self.mode,
                keep=self.keep,
                storage=self.storage if thread else None,
                storage_options=self.storage_options,
                mirror=self.mirror_url,
                mirror_keep=self.mirror_keep,
                mirror_options=self.mirror_options,
                incremental=self.incremental,
                mirror_storage=self.mirror if thread else None,
                fence=self.fence,
                world_size=self.group.world_size,
            )
        return self._worker

    def persist(self, snap: MemorySnapshot, snapshot_s: float | None) -> None:
        assert self.memory is not None
        worker = self._ensure_worker()
        self._started(snap.step, snap.nbytes, snapshot_s)
        self.memory.lock(snap)
        group = self._store.next_job() if self._store is not None else None
        job = worker.submit(
            PersistJob(slot=self.memory.path(snap), seq=snap.seq, step=snap.step, group=group)
        )
        self._jobs[job.id] = (snap.index, snap.step)
        if group is not None:
            self._job_keys[job.id] = group["key"]

    def forgo(self, reason: str) -> None:
        """Take this rank's key of the persist the other ranks just started, so that
        the keys of every later persist stay the same on every rank, and report
        ``reason`` in this rank's place, so that their workers stop waiting now."""
        if self._store is not None:
            self._store.give_up(self._store.next_job()["key"], reason)

    def collect(self) -> None:
        messages: list[Reply | Report] = []
        if self._worker is not None:
            try:
                messages = self._worker.poll()
            except PersistError as exc:
                self._lost(exc)
        self._finish(messages)

    def wait(self, timeout: float | None = None) -> None:
        if self._worker is None:
            return
        try:
            messages = self._worker.wait_all(timeout)
        except PersistError as exc:
            self._lost(exc)
        self._finish(messages)
        self._check_root()

    def wait_for_turn(self, queue: int) -> None:
        if self._worker is None:
            return
        try:
            messages = self._worker.wait_all(leave=max(0, queue - 1))
        except PersistError as exc:
            self._lost(exc)
        self._finish(messages)

    def _finish(self, messages: list[Reply | Report]) -> None:
        """`_take`, releasing every finished job's slot (also when one failed)."""
        try:
            self._take(messages)
        finally:
            for reply in messages:
                if not isinstance(reply, (Committed, Failed, MirrorFlushed)):
                    continue
                index, _ = self._jobs.pop(reply.id, (None, None))
                self._job_keys.pop(reply.id, None)
                if index is not None and self.memory is not None:
                    self.memory.unlock(index)

    def _lost(self, exc: PersistError) -> None:
        """The worker is gone with its jobs: release their slots, tell the other ranks'
        workers, waiting for this rank's part of a coordinated persist, to stop waiting,
        and raise."""
        if self.memory is not None:
            self.memory.unlock()
        self._jobs.clear()
        if self._store is not None:
            for key in self._job_keys.values():
                self._store.give_up(key, str(exc))
        self._job_keys.clear()
        self._worker = None
        self.monitor.failed(None, str(exc))
        raise exc

    def _request_flush(self, timeout: float | None) -> bool:
        if self._worker is None:
            return False  # nothing was persisted by this Checkpointer
        self._worker.submit(MirrorFlushJob(timeout=timeout))
        self.wait()
        return True

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
