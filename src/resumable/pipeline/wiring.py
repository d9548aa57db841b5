"""The wiring of a `resumable.Checkpointer`: its parts, built once from its options.

`build_parts` turns a `CheckpointOptions` into the parts the facade calls: the audit
log and monitor, the coordination of several ranks, the schedule, the memory tier
(with its replication), the persister, the restorer and the save path.
Which class serves each part is decided here, once: a persist mode or a number of
ranks picks an object, not an ``if`` in every method of the facade.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumable import settings
from resumable._shm import run_key_for
from resumable.audit import PROGRESS_EVERY_S, AuditLog, ProgressNotes
from resumable.coordination import Agreement, CoordinationStore
from resumable.errors import CheckpointError, OptionError
from resumable.group import Group
from resumable.monitor import Monitor
from resumable.nodes import STALE_STAGING_S, NodeObjects, Staging
from resumable.options import CheckpointOptions, PersistMode, Url
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import BackgroundPersister, Persister, SyncPersister
from resumable.pipeline.restorer import Restorer
from resumable.pipeline.root_claim import RootClaim, remove_stale
from resumable.pipeline.saver import Saver
from resumable.pipeline.schedule import Schedule
from resumable.replicas.peers import Replication
from resumable.storage import MemoryStorage, Storage, check_storage_options, open_storage

log = logging.getLogger(__name__)


def open_roots(url: Url, options: CheckpointOptions) -> tuple[Storage, Storage | None]:
    """The root at ``url`` and the mirror ``options`` name, opened (nothing written).

    Raises:
        OptionError: the mirror is the root itself.
        CheckpointError: ``storage_options`` were given and neither the root nor the
            mirror is an object-store URL (refused, not dropped).
    """
    check_storage_options(url, options.root.storage_options, mirror=options.root.mirror)
    storage = open_storage(url, options.root.for_url(url))
    mirror_url = options.root.mirror
    if mirror_url is None:
        return storage, None
    mirror = open_storage(mirror_url, options.root.for_url(mirror_url))
    if mirror.url == storage.url:
        raise OptionError(f"mirror must be another root than {storage.url}")
    return storage, mirror


def persist_mode(
    options: CheckpointOptions, storage: Storage, mirror: Storage | None
) -> PersistMode:
    """The persist mode asked for, ``"auto"`` resolved: a separate process keeps the
    persist (hashing, syscalls, HTTP) off the trainer's GIL; in-process stores
    (``memory://``) can only be reached by a thread."""
    mode = options.persist.mode
    if mode != "auto":
        return mode
    in_process = isinstance(storage, MemoryStorage) or isinstance(mirror, MemoryStorage)
    return "thread" if in_process else "process"


@dataclass
class Parts:
    """What the facade calls, built by `build_parts`. `close` stops the parts that run
    threads or processes, in the order they depend on each other."""

    audit: AuditLog
    progress: ProgressNotes
    monitor: Monitor
    store: CoordinationStore | None
    agreement: Agreement
    schedule: Schedule
    memory: MemoryTier | None
    persister: Persister
    restorer: Restorer
    saver: Saver

    def close(self, *, ok: bool, rank: int, storage: Storage) -> None:
        """Record the close, stop the persister, the agreement and the store, and close
        the memory tier. ``ok``: the close made the state durable, so shared memory is
        freed and what an unfinished persist left in the root is removed."""
        self.progress.flush(final=True)
        self.audit.record("close", step=self.progress.step, clean=ok)
        self.persister.close()
        self.agreement.close()
        if self.store is not None:
            self.store.close()
        if ok and rank == 0:
            # What the persist worker left unfinished (one that had to be killed at stop,
            # say): its trash and staging directories, removed now, not at the next launch.
            try:
                remove_stale(storage, self.audit)
            except CheckpointError as exc:
                log.warning("could not look for stale directories in %s: %s", storage.url, exc)
        if self.memory is not None:
            self.memory.close(unlink=ok)


def build_parts(
    options: CheckpointOptions,
    state: Mapping[str, Any],
    storage: Storage,
    mirror: Storage | None,
    group: Group,
    *,
    mode: PersistMode,
    claim: RootClaim,
) -> Parts:
    """The parts for ``options``, on every rank of ``group`` (collective: with several
    ranks persisting in the background, rank 0 hosts the store their workers meet in).

    On failure, what was started is the caller's to release (the root's claim); the
    parts built so far hold no process or thread that outlives them.
    """
    rank, world_size = group.rank, group.world_size
    audit = AuditLog(storage, rank=rank, enabled=rank == 0)
    audit.record("launch", persist=mode, memory=options.memory_tier, world_size=world_size)
    monitor = Monitor(
        alert=options.monitor.alert,
        max_commit_age_s=options.monitor.max_commit_age_s,
        prometheus_registry=options.monitor.prometheus_registry,
        url=storage.url,
    )
    timeout_s = options.distributed.seconds
    # The trainers agree on each due persist through the store too.
    nodes = NodeObjects.from_env() if options.distributed.node_objects and world_size > 1 else None
    if nodes is not None and nodes.leader == rank:  # what ranks killed while staging left
        for name in Staging.sweep(nodes.staging, max(STALE_STAGING_S, 4 * timeout_s)):
            log.warning("removed a stale staged persist %s from %s", name, nodes.staging)
    store = (
        CoordinationStore(group, timeout_s, nodes=nodes)
        if mode != "sync" and world_size > 1
        else None
    )
    agreement = Agreement(group, store)
    schedule = Schedule(options.schedule.memory_every, options.schedule.persist_every, agreement)
    schedule.on_absorbed = lambda step: monitor.skipped(
        step, "the previous persist is still running"
    )
    memory = (
        _memory_tier(options, storage, group, claim.run_id, audit, monitor)
        if options.memory_tier
        else None
    )
    parts: dict[str, Any] = {
        "coordination": group,
        "memory": memory,
        "audit": audit,
        "monitor": monitor,
        "mirror": mirror,
        "fence": claim.fence(),  # commits and retention deletes check the root's lease there
        "keep": options.retention.keep,
        "mirror_keep": options.retention.mirror_keep,
        "incremental": options.persist.writer,
    }
    persister: Persister = (
        SyncPersister(storage, nodes=nodes, **parts)
        if mode == "sync"
        else BackgroundPersister(
            storage,
            mode=mode,
            storage_options=options.root.for_url(storage.url),
            mirror_options=options.root.for_url(mirror.url) if mirror is not None else None,
            store=store,
            **parts,
        )
    )
    restorer = Restorer(
        state,
        storage,
        mirror=mirror,
        memory=memory,
        coordination=group,
        audit=audit,
        verdicts=store.verdicts() if store is not None else None,
    )
    progress = ProgressNotes(audit, progress_every_s())
    saver = Saver(
        options,
        mode=mode,
        group=group,
        claim=claim,
        memory=memory,
        persister=persister,
        agreement=agreement,
        schedule=schedule,
        audit=audit,
        monitor=monitor,
        progress=progress,
    )
    return Parts(
        audit, progress, monitor, store, agreement, schedule, memory, persister, restorer, saver
    )


def _memory_tier(
    options: CheckpointOptions,
    storage: Storage,
    group: Group,
    run_id: str,
    audit: AuditLog,
    monitor: Monitor,
) -> MemoryTier:
    """The memory tier, replicated to ``replicas - 1`` other nodes when asked."""
    memory = MemoryTier(
        storage,
        rank=group.rank,
        world_size=group.world_size,
        shm_dir=options.memory.shm_dir,
        overlap=options.memory.overlap,
        audit=audit,
        run_id=run_id,
    )
    replicas = options.memory.replicas
    if replicas > 1:
        memory.replication = Replication(
            replicas,
            group=group,
            run_id=run_id,
            directory=memory.arena.directory,
            key=run_key_for(storage.location),
            audit=audit,
            monitor=monitor,
            arena=memory.arena,
        )
        # A peer's replica of a rank may be one snapshot behind the rank's newest:
        # every rank keeps its two newest while copying the next.
        memory.arena.keep = 2
    return memory


def progress_every_s() -> float:
    """Seconds between ``progress`` audit entries, ``RESUMABLE_PROGRESS_EVERY_S``
    overriding `resumable.audit.PROGRESS_EVERY_S` (0: one at every step, for tests)."""
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
