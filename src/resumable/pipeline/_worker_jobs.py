"""The persist worker's jobs: write, commit, retention and the mirror, for one storage.

`JobRunner` runs in the worker, a process or a thread (`resumable.pipeline._worker`). It reads a
job's snapshot from its shared-memory slot, writes and commits it (retrying transient
storage errors), records the audit events, applies retention and hands the commit to
the mirror. The trainer's `LeaseFence` is checked right before each commit and retention
delete, so a job that froze past its lease never commits.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumable._shm import COMPLETE, ShmSlot, SlotContent
from resumable.audit import AuditLog
from resumable.commit import Quarantined, committer_for, list_committed
from resumable.errors import CheckpointError, RootInUseError, StorageError
from resumable.incremental import DeltaBase, Incremental
from resumable.lock import LeaseFence
from resumable.nodes import NodeObjects
from resumable.pipeline.messages import (
    Committed,
    Failed,
    Job,
    MirrorFlushed,
    MirrorFlushJob,
    PersistJob,
    Reply,
    Report,
    WorkerConfig,
)
from resumable.pipeline.write import (
    Coordination,
    LateRequest,
    PersistResult,
    WriteRequest,
    rank_share,
    replicated_holders,
    share_prefix,
    write_checkpoint,
    write_distributed,
)
from resumable.policy import Keep
from resumable.retention import apply_retention, retention_entry
from resumable.retrying import retrying
from resumable.snapshot import Arena, Snapshot
from resumable.storage import Storage, open_storage

if TYPE_CHECKING:
    from resumable.pipeline.mirror import Mirror

log = logging.getLogger(__name__)

# Retrying cannot help: full disk, no permission, read-only, another writer committed
# the step, a server that cannot do conditional writes.
_NOT_TRANSIENT = {
    errno.ENOSPC,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EDQUOT,
    errno.EEXIST,
    errno.ENOTSUP,
}


def keep_to_json(keep: Keep | None) -> dict[str, Any] | None:
    if keep is None:
        return None
    return {
        "last": keep.last,
        "best": list(keep.best) if keep.best else None,
        "every_steps": keep.every_steps,
    }


def keep_from_json(d: dict[str, Any] | None) -> Keep | None:
    if d is None:
        return None
    best = tuple(d["best"]) if d.get("best") else None
    return Keep(last=d.get("last"), best=best, every_steps=d.get("every_steps"))


def _bytes_of(slot: ShmSlot, content: SlotContent) -> Snapshot:
    """The snapshot of ``content`` as the bytes of its slot, without a copy (and without
    torch: `resumable._lazy`)."""
    return Snapshot(content.slots, slot.data_view(content.slots[-1].end if content.slots else 0))


def _content(slot: ShmSlot, job: PersistJob) -> SlotContent:
    """The content of ``job``'s snapshot in ``slot``; raises if it was overwritten."""
    content = slot.read()
    if content is None or content.seq != job.seq or content.step != job.step:
        raise _overwritten(job)
    return content


def _overwritten(job: PersistJob) -> CheckpointError:
    return CheckpointError(f"snapshot of step {job.step} was overwritten before it was persisted")


def _unchanged(slot: ShmSlot, job: PersistJob) -> None:
    if not slot.still(job.seq):
        raise CheckpointError("snapshot slot was rewritten while being persisted")


def _request(content: SlotContent, snapshot: Snapshot) -> WriteRequest:
    """What to write of a slot's ``content``: ``snapshot`` (its tensors, or this rank's
    share of them) with the slot's step, tree, metrics and pieces."""
    meta = content.meta
    return WriteRequest(content.step, snapshot, meta.tree, meta.metrics, meta.pieces)


# --------------------------------------------------------------------------- worker side


class TrainerGone(CheckpointError):
    """The trainer died while a job ran: the job is abandoned, not committed."""


class JobRunner:
    """Executes jobs against one storage; lives in the worker (process or thread).

    With ``config.mirror`` (a URL) it also runs a `Mirror` thread that uploads each
    committed checkpoint there; ``notify`` carries that thread's reports to the trainer.
    ``fence``: the trainer's lease, checked before each commit and retention delete.
    """

    retries = 2  # of a transient storage error, per persist
    mirror_retries = 2
    mirror_backoff_s = 0.5

    def _quarantined(self, q: Quarantined) -> None:
        self.audit.record("quarantined", step=q.step, name=q.name, moved_to=q.moved_to)

    def __init__(
        self,
        storage: Storage,
        config: WorkerConfig,
        *,
        notify: Callable[[Report], None] | None = None,
        mirror_storage: Storage | None = None,
        background: bool = False,
        fence: LeaseFence | None = None,
    ) -> None:
        self.storage = storage
        self.fence = fence.check if fence is not None else None
        # A worker (``background``) removes the directories of checkpoints retention
        # deleted on a thread of its own: they are un-committed (renamed aside, the
        # rename durable) before, so the next commit need not wait for the unlinks.
        self._discards: queue.Queue[str | None] | None = None
        self._discarder: threading.Thread | None = None
        if background:  # started now, so the worker's threads do not change later
            self._discards = queue.Queue()
            self._discarder = threading.Thread(
                target=self._discard_loop, name="resumable-discard", daemon=True
            )
            self._discarder.start()
        self.audit = AuditLog(storage, rank=config.rank, enabled=config.audit)
        self.committer = committer_for(storage, on_quarantine=self._quarantined, fence=self.fence)
        self.keep = keep_from_json(config.keep)
        self.parent_pid = config.parent_pid
        self.slots: dict[str, ShmSlot] = {}
        self._stores: dict[tuple[str, int], Any] = {}  # coordination store clients
        self._arena = Arena()  # this rank's share of a coordinated persist
        self.metrics_cache: dict[int, dict[str, Any]] = {}  # retention's, per step
        inc = Incremental.from_json(config.incremental)
        self.delta = DeltaBase(inc) if inc is not None else None  # incremental persists
        self._retention_lock = threading.Lock()
        self.mirror: Mirror | None = None
        if config.mirror:
            from resumable.pipeline.mirror import Mirror

            remote = mirror_storage or open_storage(config.mirror, config.mirror_options or None)
            self.mirror = Mirror(
                storage,
                remote,
                keep=keep_from_json(config.mirror_keep),
                audit=self.audit,
                notify=notify or (lambda msg: None),
                on_mirrored=lambda step: self._retain(step),
                retries=self.mirror_retries,
                backoff_s=self.mirror_backoff_s,
            )
            # Catch up: an earlier launch may have died before its newest commit was
            # uploaded (an identical remote copy is detected and not sent again).
            try:
                local = list_committed(storage)
            except CheckpointError as exc:
                log.warning("could not list %s to catch the mirror up: %s", storage.url, exc)
                local = []
            if local:
                self.mirror.submit(local[-1])

    def _slot(self, path: str) -> ShmSlot:
        slot = self.slots.get(path)
        if slot is not None and not slot.linked():
            # The trainer replaced the slot (a larger state): the old mapping holds an
            # older snapshot whose seq may equal the new one's.
            slot.close()
            del self.slots[path]
            slot = None
        if slot is None:
            slot = ShmSlot.attach(Path(path))
            slot.set_worker(os.getpid())
            self.slots[path] = slot
        return slot

    def _check_parent(self) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid:
            raise TrainerGone("the training process died; leaving this snapshot to its next launch")

    def handle(self, job: Job) -> Reply:
        step = job.step if isinstance(job, PersistJob) else None
        try:
            if isinstance(job, PersistJob):
                return dataclasses.replace(self._persist(job), id=job.id)
            if isinstance(job, MirrorFlushJob):
                if self.mirror is None:
                    return MirrorFlushed(newest=None, error=None, id=job.id)
                return dataclasses.replace(self.mirror.flush(job.timeout), id=job.id)
            raise CheckpointError(f"the persist worker cannot do {job!r}")
        except Exception as exc:
            self.audit.record("failure", step=step, error=repr(exc)[:500])
            return Failed(
                step=step,
                error=f"{type(exc).__name__}: {exc}",
                errno=getattr(exc, "errno", None),
                traceback=traceback.format_exc()[-4000:],
                id=job.id,
            )

    def _persist(self, job: PersistJob) -> Committed:
        slot = self._slot(job.slot)
        if job.group:
            c = slot.control()
            if c.seq != job.seq or c.state != COMPLETE or c.step != job.step:
                raise _overwritten(job)
            return self._persist_coordinated(slot, job)
        content = _content(slot, job)
        reply, sums = self.persist_snapshot(_request(content, _bytes_of(slot, content)))
        _unchanged(slot, job)
        slot.write_checksums(content.seq, sums)
        return reply

    def persist_snapshot(self, request: WriteRequest) -> tuple[Committed, list[str]]:
        """Write, commit (retrying transient storage errors), audit and apply retention.
        Returns the reply and the per-tensor checksums in layout order."""
        t0 = time.perf_counter()
        step = request.step

        def on_retry(exc: StorageError, n: int) -> None:
            log.warning("persist of step %d failed (%s), retry %d", step, exc, n)
            self.audit.record("retry", step=step, error=repr(exc)[:300])

        result = retrying(
            lambda: write_checkpoint(
                self.storage,
                self.committer,
                request,
                before_commit=self._check_parent,
                base=self.delta,
            ),
            retries=self.retries,
            backoff_s=0.4,
            permanent=_NOT_TRANSIENT,
            on_retry=on_retry,
        )
        manifest = result.manifest
        assert manifest is not None  # write_checkpoint's caller built it
        reply = self._committed(result, time.perf_counter() - t0)
        sums = [manifest["tensors"][s.name]["xxh3_64"] for s in request.snapshot.slots]
        return reply, sums

    def _persist_coordinated(self, slot: ShmSlot, job: PersistJob) -> Committed:
        """This rank's share of a coordinated persist, from its shared-memory snapshot,
        then the exchanges of `write_distributed` through the coordination store.

        No rank's worker does more than check its slot's control block before every
        rank's worker holds its job (`StoreCoordinator.all_ready`), its trainer's
        snapshot taken; the snapshot's metadata is read and this rank's share found
        once the attempt is open (a `LateRequest`): reading the metadata (a JSON object
        naming every tensor and its piece) took CPU the ranks still taking their
        snapshots need (4 ranks on 2 cores; ``docs/decisions.md``, "Ranks write once
        every snapshot is taken").

        The share is the tensors of the snapshot but the replicated ones another rank
        writes, which the trainer lays out last (`resumable.format.plan_layout`): the
        share is then the slot's first bytes, written from shared memory as a single
        process's persist writes (the trainer keeps the slot locked until this job's
        reply), and the slot is checked unchanged before this rank reports its part
        written. A share laid out otherwise is copied out first (``docs/decisions.md``,
        "A rank's share written from shared memory")."""
        from resumable.coordination import StoreCoordinator

        assert job.group is not None
        coordinator = StoreCoordinator.connect(job.group, self._stores)
        coordinator.all_ready()  # no work while another rank still takes its snapshot
        in_place = False

        def make() -> WriteRequest:
            nonlocal in_place
            content = _content(slot, job)
            holders = replicated_holders(
                {t.name: t.nbytes for t in content.slots},
                content.meta.replicated,
                coordinator.rank,
                coordinator.world_size,
            )
            whole = _bytes_of(slot, content)
            prefix = share_prefix(content.slots, holders)
            if prefix is not None:
                snap = Snapshot(prefix, whole.buffer)
                in_place = True
            else:
                snap = rank_share(
                    self._arena,
                    whole,
                    content.meta.replicated,
                    coordinator.rank,
                    coordinator.world_size,
                )
                _unchanged(slot, job)
            return dataclasses.replace(_request(content, snap), holders=holders)

        def check() -> None:
            self._check_parent()
            if in_place:
                _unchanged(slot, job)

        request = LateRequest(job.step, make)
        return self.persist_group(coordinator, request, nodes=coordinator.nodes, check=check)

    def persist_group(
        self,
        group: Coordination,
        request: WriteRequest | LateRequest,
        *,
        nodes: NodeObjects | None = None,
        check: Callable[[], None] | None = None,
    ) -> Committed:
        """The coordinated commit of several ranks (`write_distributed`; with ``nodes``,
        one object per node), then, on rank 0, the audit entry and retention. Not
        retried: a retry would need every rank. ``check`` runs before this rank reports
        its part written (by default: whether the trainer is alive)."""
        result = write_distributed(
            group,
            self.storage,
            self.committer,
            request,
            check=check or self._check_parent,
            base=self.delta,
            nodes=nodes,
        )
        return self._committed(result, result.seconds, ranks=group.world_size)

    def _committed(self, result: PersistResult, seconds: float, **audit: Any) -> Committed:
        """The reply to a commit that took ``seconds``. Where this rank holds the manifest
        (the only rank, or rank 0), first the audit entry (``audit``: its extra fields),
        retention, and the mirror's upload of the whole checkpoint."""
        step, manifest = result.step, result.manifest
        deleted: list[int] = []
        if manifest is not None:
            self.audit.record(
                "commit",
                step=step,
                bytes=result.nbytes,
                duration_s=round(seconds, 6),
                replaced=result.replaced,
                **audit,
                metrics=manifest["metrics"],
            )
            self.metrics_cache[step] = retention_entry(manifest)
            deleted = self._retain(step)
            if self.mirror is not None:
                self.mirror.submit(step)
        return Committed(
            step=step,
            seconds=seconds,
            bytes=result.nbytes,
            replaced=result.replaced,
            deleted=deleted,
        )

    def _retain(self, just_written: int) -> list[int]:
        """Apply ``keep`` locally (never to a checkpoint not mirrored yet)."""
        if self.keep is None or self.keep.keeps_all:
            return []
        with self._retention_lock:
            try:
                return apply_retention(
                    self.storage,
                    self.keep,
                    self.audit,
                    just_written=just_written,
                    cache=self.metrics_cache,
                    protect=[self.delta.step] if self.delta and self.delta.step is not None else (),
                    deletable=self.mirror.may_delete_local if self.mirror is not None else None,
                    discard=self._discard if self._discards is not None else None,
                    fence=self.fence,
                )
            except RootInUseError as exc:  # the trainer hears of it from its lock
                log.error("retention after step %d deleted nothing more: %s", just_written, exc)
                self.audit.record(
                    "failure", step=just_written, stage="retention", error=repr(exc)[:500]
                )
                return []
            except Exception as exc:  # the step is committed; retention retries next time
                log.warning("retention after step %d failed: %s", just_written, exc)
                self.audit.record(
                    "failure", step=just_written, stage="retention", error=repr(exc)[:500]
                )
                return []

    def _discard(self, trash: str) -> None:
        assert self._discards is not None
        self._discards.put(trash)

    def _discard_loop(self) -> None:
        assert self._discards is not None
        while (trash := self._discards.get()) is not None:
            try:
                self.storage.delete(trash)
            except Exception as exc:  # left for the start-up clean-up of a later launch
                log.warning("could not remove %s: %s", trash, exc)
                self.audit.record("failure", stage="retention", error=repr(exc)[:500])

    def close(self) -> None:
        if self._discarder is not None and self._discards is not None:
            self._discards.put(None)
            self._discarder.join()
            self._discarder = None
        if self.mirror is not None:
            self.mirror.close()
        for slot in self.slots.values():
            slot.close()
        self.slots.clear()
        self._stores.clear()
