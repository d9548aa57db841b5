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
import errno
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch

from resumable import capture as capture_mod
from resumable.audit import AuditLog
from resumable.commit import committer_for, list_committed, step_dir
from resumable.coordination import CoordinationStore
from resumable.distributed import (
    DEFAULT_TIMEOUT_S,
    GlobalLoader,
    Group,
    current_group,
    is_dtensor,
    owned_tensors,
    pieces_from_json,
    pieces_to_json,
    shaped_like,
)
from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    PersistError,
    StateMismatchError,
    StorageError,
)
from resumable.format import _json_metrics, checksum
from resumable.monitor import AlertCallback, Monitor
from resumable.policy import CostEstimate, Every, Keep
from resumable.preemption import GraceBudget, Preemption, PreemptionMonitor
from resumable.reader import CheckpointReader
from resumable.retention import PINS_DIR
from resumable.shm import remove_dead_segments, run_key_for, shm_free_bytes
from resumable.snapshot import Arena, MemorySnapshot, ShmArena, Snapshot
from resumable.storage import MemoryStorage, Storage, open_storage
from resumable.worker import JobRunner, PersistWorker

log = logging.getLogger("resumable")

DEFAULT_KEEP = Keep(last=3)
PERSIST_MODES = ("auto", "process", "thread", "sync")
STALE_SHM_S = 24 * 3600.0


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
            gives up with `PersistError` (default 600 s); see `resumable.distributed`.
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
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict of named objects, found {type(state).__name__}")
        if persist not in PERSIST_MODES:
            raise ValueError(f"persist must be one of {PERSIST_MODES}, got {persist!r}")
        if on_busy not in ("skip", "wait"):
            raise ValueError(f"on_busy must be 'skip' or 'wait', got {on_busy!r}")
        self._group = current_group(dist_timeout_s)
        # What the restore paths agree through: the ranks' group, or one process alone.
        self._coordination = self._group or Group(0, 1)
        self.rank = self._group.rank if self._group is not None else 0
        self.world_size = self._group.world_size if self._group is not None else 1
        self.storage_options = dict(storage_options) if storage_options else None
        self.storage = open_storage(url, _options_for(url, self.storage_options))
        self.url = self.storage.url
        self.mirror: Storage | None = (
            open_storage(mirror, _options_for(mirror, self.storage_options))
            if mirror is not None
            else None
        )
        self.mirror_keep = mirror_keep
        if self.mirror is not None and self.mirror.url == self.url:
            raise ValueError(f"mirror must be another root than {self.url}")
        self.state = state
        self.memory_every = memory_every
        self.persist_every = persist_every if persist_every is not None else Every(steps=100)
        self.keep = keep
        self.map_location = map_location
        self.capture_rng = capture_rng
        self.on_busy = on_busy
        if persist == "auto":
            persist = os.environ.get("RESUMABLE_PERSIST", "auto")
            if persist not in PERSIST_MODES:
                raise ValueError(
                    f"RESUMABLE_PERSIST must be one of {PERSIST_MODES}, got {persist!r}"
                )
        if persist == "auto":
            # A separate process keeps the persist (hashing, syscalls, HTTP) off the
            # trainer's GIL; in-process stores (memory://) can only be reached by a thread.
            shareable = not isinstance(self.storage, MemoryStorage) and not isinstance(
                self.mirror, MemoryStorage
            )
            persist = "process" if shareable else "thread"
        self.persist_mode = persist
        # Several ranks persisting in the background: their workers meet in a store that
        # rank 0 hosts (`resumable.coordination`), created now, collectively.
        self._coord: CoordinationStore | None = (
            CoordinationStore(self._group, dist_timeout_s or DEFAULT_TIMEOUT_S)
            if self._group is not None and persist != "sync"
            else None
        )
        self.audit = AuditLog(self.storage, rank=self.rank, enabled=self.rank == 0)
        self._committer = committer_for(self.storage)
        self._notes: list[dict[str, Any]] = []  # reports of a sync-mode mirror thread
        self._runner = JobRunner(
            self.storage,
            {
                "keep": _keep_json(keep),
                "rank": self.rank,
                "audit": self.rank == 0,
                "mirror": (
                    self.mirror.url
                    if self.mirror is not None and persist == "sync" and self.rank == 0
                    else None
                ),
                "mirror_keep": _keep_json(mirror_keep),
            },
            notify=self._notes.append,
            mirror_storage=self.mirror,
        )
        self._shm: ShmArena | None = None
        self._arena: Arena | None = None
        if persist != "sync" or memory_every is not None:
            from pathlib import Path

            self._shm = ShmArena(
                run_key_for(self.storage.location),
                rank=self.rank,
                shm_dir=Path(shm_dir) if shm_dir is not None else None,
                root=self.storage.url,
            )
            for path in remove_dead_segments(self._shm.shm_dir, older_than_s=STALE_SHM_S):
                log.info("removed shared-memory snapshot %s left by a dead run", path)
                self.audit.record("stale_removed", name=str(path))
        else:
            self._arena = Arena()
        self.overlap = overlap
        if overlap and self._shm is None:
            raise ValueError("overlap=True needs the memory tier (not persist='sync' alone)")
        self._overlap_exec = (
            ThreadPoolExecutor(1, thread_name_prefix="resumable-overlap") if overlap else None
        )
        self._pending: Future[MemorySnapshot] | None = None
        self._hooks: list[Any] = []
        self._worker: PersistWorker | None = None
        self._jobs: dict[int, tuple[int, int]] = {}  # job id -> (slot index, step)
        self._job_keys: dict[int, str] = {}  # job id -> its coordinated persist's key
        self._errors: list[str] = []
        self._adopted = False
        self._last_persist: int | None = None
        self._last_memory: int | None = None
        self._persist_clock = time.monotonic()
        self._memory_clock = time.monotonic()
        self._committed: int | None = None
        self._owed = False
        self._closed = False
        self.last_snapshot_s: float | None = None
        self.monitor = Monitor(
            alert=alert,
            max_commit_age_s=max_commit_age_s,
            prometheus_registry=prometheus_registry,
            url=self.url,
        )
        self.should_stop = False
        self._persist_cost = CostEstimate()
        self._last_absorbed = -1
        self._mirror_flushed: dict[str, Any] | None = None
        self._reset_per_rank = False
        self._skip_flush = False
        self._emergency_deadline: float | None = None
        self._absorbed_clock = float("-inf")
        self._remove_stale()
        self._atexit = _register_atexit(self)
        self._preempt = PreemptionMonitor(preemption) if preemption is not None else None
        if self._preempt is not None:
            self._preempt.install()

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
        self._collect()
        if self._shm is None:
            raise CheckpointError(
                "memory snapshots need the memory tier; create the Checkpointer with "
                "memory_every=... or a persist mode other than 'sync'"
            )
        self._adopt()
        t0 = time.perf_counter()
        captured = capture_mod.capture(
            self.state, include_rng=self.capture_rng, rank=self.rank, world_size=self.world_size
        )
        meta: dict[str, Any] = {
            "step": step,
            "tree": captured.tree,
            "metrics": _json_metrics(metrics or {}),
            "created": time.time(),
        }
        if captured.pieces:  # several ranks: what a coordinated persist needs
            meta["world_size"] = self.world_size
            meta["pieces"] = pieces_to_json(captured.pieces)
            meta["replicated"] = sorted(captured.replicated)
        deferred: set[str] = set()
        if self.overlap:
            owned = self._optimizer_owned()
            deferred = {n for n, t in captured.tensors.items() if t.data_ptr() in owned}
        future = self._shm.snapshot(
            step, captured.tensors, meta, deferred=deferred, executor=self._overlap_exec
        )
        if deferred:
            self._pending = future  # resolved by the next optimizer.step() or call here
        else:
            future.result()
        self.last_snapshot_s = time.perf_counter() - t0
        overlapped = sum(
            captured.tensors[n].numel() * captured.tensors[n].element_size() for n in deferred
        )
        self.monitor.snapshot(self.last_snapshot_s, overlapped)
        self._last_memory = step
        self._memory_clock = time.monotonic()

    def _optimizer_owned(self) -> set[int]:
        """Data pointers of tensors only ``optimizer.step()`` changes (parameters and
        optimizer state); installs the pre-hooks that wait for an overlapped copy."""
        ptrs: set[int] = set()
        for obj in self.state.values():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            if not any(h[0] is obj for h in self._hooks):
                ref = weakref.ref(self)

                def wait_for_copy(*_: Any, ref: Any = ref) -> None:
                    ckpt = ref()
                    if ckpt is not None:
                        ckpt._settle()

                self._hooks.append((obj, obj.register_step_pre_hook(wait_for_copy)))
            for group in obj.param_groups:
                ptrs.update(_storage_ptr(p) for p in group["params"])
            for st in obj.state.values():
                ptrs.update(_storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _settle(self) -> None:
        """Wait for an overlapped snapshot copy; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Checkpoint the state as of ``step`` now: snapshot it (or reuse the memory
        snapshot of this step) and persist it.

        In ``"sync"`` mode it returns after the commit is durable. Otherwise it returns
        after the snapshot copy, and the persist commits in the background (`wait`
        blocks until it did). If the previous persist still runs and ``on_busy`` is
        ``"skip"``, only the memory snapshot is taken, the skip is logged, the persist
        is taken as soon as the worker is free, and this returns False.
        """
        self._check_open()
        _check_step(step)
        self._collect()
        if self.persist_mode == "sync" and self._shm is None:
            return self._save_sync_arena(step, metrics)
        busy = self._worker is not None and self._worker.busy
        if busy and self.on_busy == "wait":
            self._wait_worker()
            busy = False
        if self._coord is not None and self._group is not None:
            busy = self._group.any(busy)  # all ranks persist this step, or none
        newest = self._shm.newest if self._shm is not None else None
        if (
            newest is None
            or newest.step != step
            or (self._shm and newest.index in self._shm.locked)
        ):
            self.snapshot(step, metrics)
            self._settle()  # a persist needs the whole copy
            newest = self._shm.newest if self._shm is not None else None
        assert newest is not None
        if busy:
            running = sorted(s for _, s in self._jobs.values())
            self.audit.record(
                "skip", step=step, reason=f"persist of step(s) {running} still running"
            )
            log.info("persist of step %d deferred: step(s) %s still persisting", step, running)
            self.monitor.skipped(step, f"step(s) {running} still persisting")
            self._owed = True
            return False
        self._persist_snapshot(newest)
        return True

    def maybe_save(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Persist or snapshot if a policy says so; returns whether a persist started.

        Cheap when nothing is due. A persist deferred because the worker was busy is
        taken at the first call that finds the worker free.
        """
        self._check_open()
        if self._preempt is not None and not self.should_stop:
            requested = self._preempt.requested
            if self._group is not None:
                # A signal reaches the ranks at different moments: all stop at the first
                # step at which any rank has it, together (one small all-reduce a step).
                requested = self._group.any(requested)
            if requested:
                self._emergency(step, metrics)
                return True
        self._collect()
        self.monitor.check_age(step)
        now = time.monotonic()
        worker_free = self._worker is None or not self._worker.busy
        if self._owed and self._coord is not None and self._group is not None:
            worker_free = not self._group.any(not worker_free)  # taken on all ranks at once
        policy_due = self.persist_every.due(
            step,
            last_step=(
                self._last_persist
                if self._last_absorbed < 0
                else max(self._last_persist or 0, self._last_absorbed)
            ),
            since_last_s=now - max(self._persist_clock, self._absorbed_clock),
            cost_s=self._persist_cost.value,
        )
        if self._group is not None and _timed(self.persist_every):
            # Clocks differ between ranks: rank 0 decides, so all save at the same step.
            policy_due = bool(self._group.broadcast(policy_due))
        if self._owed:
            # A deferred persist is owed once and taken when the worker is free; a
            # persist falling due meanwhile is absorbed into it, and counted as skipped.
            due = worker_free
            if not worker_free and policy_due:
                self._last_absorbed, self._absorbed_clock = step, now
                self.monitor.skipped(step, "the previous persist is still running")
        else:
            due = policy_due
        if due:
            t0 = time.perf_counter()
            started = self.save(step, metrics)
            if started:  # the measured cost Every(auto=True) plans with (docs/interval.md)
                self._persist_cost.observe(time.perf_counter() - t0)
            return started
        if self.memory_every is not None and self.memory_every.due(
            step, last_step=self._last_memory, since_last_s=now - self._memory_clock
        ):
            self.snapshot(step, metrics)
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending persist committed (and, with a mirror, was
        uploaded); raise `PersistError` if one failed."""
        self._check_open()
        self._wait_worker(timeout)
        self._wait_mirror(timeout)

    def close(self) -> None:
        """Persist the newest memory snapshot if it is newer than the last commit, wait
        for pending persists, stop the worker and remove this run's shared memory.

        Raises `PersistError` if a persist failed; the shared-memory snapshot is then
        kept so the next launch can recover it. Idempotent.
        """
        if self._closed:
            return
        ok = False
        try:
            if not self._skip_flush:
                self._flush()
            ok = not self._skip_flush
        finally:
            self._closed = True
            _unregister_atexit(self._atexit)
            if self._preempt is not None:
                self._preempt.uninstall()
            for _, handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            if self._overlap_exec is not None:
                self._overlap_exec.shutdown(wait=True)
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            if self._shm is not None:
                self._shm.close(unlink=ok)
            self._runner.close()
            self.storage.close()
            if self._coord is not None:
                self._coord.close()
            if self._group is not None:
                self._group.close()
            if self.mirror is not None:
                self.mirror.close()

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
        if self._group is not None:
            self._skip_flush = True
        try:
            self.close()
        except Exception as close_exc:
            log.error("while handling %r, persisting the last snapshot failed: %s", exc, close_exc)

    # ------------------------------------------------------------------ restoring

    def steps(self) -> list[int]:
        """Steps of committed checkpoints (in ``url`` or the mirror), ascending;
        validity not checked."""
        return sorted(self._roots_by_step())

    def _roots_by_step(self) -> dict[int, list[Storage]]:
        """For each committed step, the roots holding it (``url`` first)."""
        out: dict[int, list[Storage]] = {}
        for root in (self.storage, self.mirror):
            if root is not None:
                for s in list_committed(root):
                    out.setdefault(s, []).append(root)
        return out

    def restore(
        self,
        step: int | None = None,
        *,
        map_location: Any = None,
        tier: str = "auto",
        reset_per_rank_state: bool = False,
    ) -> int:
        """Load the newest valid state (or ``step``) into ``state``; returns its step.

        ``tier`` is ``"auto"`` (newest across shared memory and storage), ``"memory"``
        or ``"storage"``. Returns 0 when there is nothing to restore. A memory snapshot
        newer than every committed checkpoint is persisted right after it is restored.
        Corrupt checkpoints are skipped with a WARNING; if checkpoints exist and none is
        valid, raises `CorruptCheckpointError` rather than starting over.

        With several ranks every rank calls it: they agree on the newest step all of
        them can read, and model and optimizer state reshard to this job's world size.
        Per-rank state (random streams, data position) cannot reshard; after a world-size
        change that is an error unless ``reset_per_rank_state`` (then it keeps this
        launch's values, with a WARNING).
        """
        self._reset_per_rank = reset_per_rank_state
        self._check_open()
        if tier not in ("auto", "memory", "storage"):
            raise ValueError(f"tier must be 'auto', 'memory' or 'storage', got {tier!r}")
        self._collect()
        self._preflight()
        if self.persist_mode == "process":
            self._ensure_worker()  # start it now: its interpreter warms up while we load
        loc = map_location or self.map_location
        roots = self._roots_by_step() if tier != "memory" else {}
        steps = sorted(roots)
        self._committed = steps[-1] if steps else None
        if tier != "storage" and self._shm is not None:
            restored = self._restore_memory(steps, step, loc, tier)
            if restored is not None:
                return restored
            if tier == "memory":
                if step is not None:
                    where = "on every rank" if self.world_size > 1 else f"for {self.url}"
                    raise NoCheckpointError(f"no memory snapshot of step {step} {where}")
                return 0
        return self._restore_storage(roots, step, loc)

    def _verified(self, snap: MemorySnapshot) -> tuple[Any, dict[str, torch.Tensor]]:
        """The content and tensor views of a memory snapshot, checked complete and (where
        the persist worker recorded them) against its checksums."""
        assert self._shm is not None
        content = self._shm.content(snap.index)
        if content is None or content.seq != snap.seq:
            raise CorruptCheckpointError("the snapshot is incomplete or was overwritten")
        views = self._shm.tensors(snap.index, content)
        if content.checksums is not None:
            data = Snapshot(content.slots, views_base(self._shm, snap.index)).memory()
            for sl, want in zip(content.slots, content.checksums):
                if checksum(data[sl.begin : sl.end]) != want:
                    raise CorruptCheckpointError(f"checksum mismatch in tensor {sl.name!r}")
        return content, views

    def _restore_memory(
        self, steps: list[int], step: int | None, loc: Any, tier: str
    ) -> int | None:
        """Restore every rank from its own shared-memory snapshot, if every rank has one
        of the same step (newer than the newest checkpoint, unless asked for), agreed
        through the coordination (nothing to agree with one process); otherwise None,
        and every rank falls back to storage together."""
        g = self._coordination
        assert self._shm is not None
        self._adopt()
        newest = self._shm.newest
        mine = None
        if newest is not None:
            content = self._shm.content(newest.index)
            if content is None or content.seq != newest.seq:
                self._skip_memory(newest.step, "the snapshot is incomplete or was overwritten")
            elif content.meta.get("world_size", 1) == self.world_size:
                mine = newest.step
        offers = g.gather(mine)
        s = offers[0]
        if s is None or any(o != s for o in offers):
            return None
        wanted = (
            step == s if step is not None else (tier == "memory" or not steps or s >= steps[-1])
        )
        if not wanted:
            return None
        assert newest is not None
        t0 = time.perf_counter()
        problem = None
        values: dict[str, Any] = {}
        try:
            values = self._decode_memory(newest, loc)
        except CorruptCheckpointError as exc:
            problem = f"rank {self.rank}: {exc}" if self.world_size > 1 else str(exc)
        problems = [p for p in g.gather(problem) if p]
        if problems:
            self._skip_memory(s, "; ".join(problems))
            return None
        # Borrowed: the slot is rewritten by later snapshots, so whatever the live state
        # would keep a reference to is copied out.
        capture_mod.restore(self.state, values, borrowed=True)
        self.audit.record(
            "restore",
            step=s,
            tier="memory",
            bytes=newest.nbytes,
            ranks=self.world_size,
            duration_s=round(time.perf_counter() - t0, 6),
        )
        self._mark_restored(s)
        if self._committed is None or s > self._committed:
            log.info("persisting step %d recovered from shared memory", s)
            self._persist_snapshot(newest)
        return int(s)

    def _skip_memory(self, step: int, reason: str) -> None:
        log.warning("skipping the shared-memory snapshot of step %d: %s", step, reason)
        self.audit.record("skip", step=step, tier="memory", reason=reason[:500])

    def _restore_storage(self, roots: dict[int, list[Storage]], step: int | None, loc: Any) -> int:
        """Restore from the newest committed step every rank can read (each from the
        local root, or else the mirror), trying older ones in turn; every rank decides
        alike, through the coordination (nothing to agree with one process)."""
        g = self._coordination
        steps = sorted(roots)
        if step is not None and step not in steps:
            raise NoCheckpointError(
                f"no committed checkpoint for step {step} in {self.url}; "
                f"committed steps: {steps[-10:] or 'none'}"
            )
        candidates = [step] if step is not None else list(reversed(steps))
        if not candidates:
            self.audit.record("restore", step=0, fresh=True)
            return 0
        problems: list[str] = []
        last: CorruptCheckpointError | None = None
        for s in candidates:
            t0 = time.perf_counter()
            root: Storage | None = None
            reader: CheckpointReader | None = None
            values: dict[str, Any] = {}
            skip: set[str] = set()
            problem: tuple[str, str] | None = None
            seen: list[str] = []
            for candidate in roots[s]:
                try:
                    reader = CheckpointReader(candidate, s)
                    values, skip = self._decode(reader, loc)
                    root = candidate
                    break
                except CorruptCheckpointError as exc:
                    last = exc
                    seen.append(f"{candidate.url}/{step_dir(s)}: {exc}")
                    log.warning(
                        "skipping corrupt checkpoint %s in %s: %s", step_dir(s), candidate.url, exc
                    )
                    self.audit.record("skip", step=s, url=candidate.url, reason=str(exc)[:500])
                except StateMismatchError as exc:
                    if self.world_size == 1:
                        raise
                    problem = ("mismatch", f"rank {self.rank}: {exc}")
                    break
            if root is None and problem is None:
                problem = ("corrupt", f"rank {self.rank}: " + "; ".join(seen))
            verdicts = [p for p in g.gather(problem) if p is not None]
            if any(kind == "mismatch" for kind, _ in verdicts):
                raise StateMismatchError("; ".join(msg for _, msg in verdicts))
            if verdicts:
                problems += seen if self.world_size == 1 else [m for _, m in verdicts]
                continue
            assert root is not None and reader is not None
            applied: tuple[str, str] | None = None
            try:
                # Raises CorruptCheckpointError or StateMismatchError only before
                # touching a live object.
                self._apply(values, skip, borrowed=reader.mapped)
            except CorruptCheckpointError as exc:
                last = exc
                log.warning("skipping corrupt checkpoint %s in %s: %s", step_dir(s), root.url, exc)
                self.audit.record("skip", step=s, url=root.url, reason=str(exc)[:500])
                applied = ("corrupt", f"rank {self.rank}: {root.url}/{step_dir(s)}: {exc}")
            except StateMismatchError as exc:
                if self.world_size == 1:
                    raise
                applied = ("mismatch", f"rank {self.rank}: {exc}")
            failures = [f for f in g.gather(applied) if f is not None]
            if any(kind == "mismatch" for kind, _ in failures):
                raise StateMismatchError("; ".join(msg for _, msg in failures))
            if failures:
                problems += [m for _, m in failures]
                continue
            self.audit.record(
                "restore",
                step=s,
                tier="storage" if root is self.storage else "mirror",
                url=root.url,
                bytes=sum(f["size"] for f in reader.manifest["files"].values()),
                ranks=self.world_size,
                saved_ranks=reader.manifest.get("world_size", 1),
                duration_s=round(time.perf_counter() - t0, 6),
            )
            self._mark_restored(s)
            return s
        if step is not None and last is not None and self.world_size == 1:
            raise last
        raise CorruptCheckpointError(
            f"{len(candidates)} checkpoint(s) in {' and '.join(r.url for r in self._roots())} "
            "and none is valid (readable by every rank); refusing to start over silently. "
            "Inspect them with `resumable verify`, or move the directory away to start "
            "fresh. Problems: " + "; ".join(problems)
        )

    # ------------------------------------------------------------------ several ranks

    def _decode(self, reader: CheckpointReader, loc: Any) -> tuple[dict[str, Any], set[str]]:
        """Read, verify and decode this rank's values from ``reader`` without touching a
        live object; returns them and the state keys to leave as they are."""
        reader.check_files()
        m = reader.manifest  # validated: one tree per rank of world_size
        saved_world = m["world_size"]
        trees = [r["tree"] for r in m["ranks"]]
        live = capture_mod.capture(
            self.state, include_rng=False, rank=self.rank, world_size=self.world_size
        )
        plain = saved_world == 1 and self.world_size == 1 and not live.pieces
        if plain and not any(True for _ in capture_mod.global_refs(trees[0])):
            tensors = reader.tensors(verify=True)
            return capture_mod.decode(trees[0], tensors, loc), set()
        global_keys = {k for k, v in self.state.items() if capture_mod.is_global_object(v)}
        skip: set[str] = set()
        if saved_world == self.world_size:
            tree = trees[self.rank]
        else:
            tree = trees[0]
            per_rank = self._per_rank_keys(reader, trees, global_keys)
            if per_rank and not self._reset_per_rank:
                raise StateMismatchError(
                    f"{reader.where} was saved by {saved_world} rank(s); this job has "
                    f"{self.world_size}. Per-rank state {sorted(per_rank)} cannot be "
                    "resharded (each rank had its own). Model and optimizer state reshard; "
                    "pass restore(reset_per_rank_state=True) to keep this launch's fresh "
                    "values for the per-rank state"
                )
            skip = per_rank
            tree = {"dict": [p for p in tree["dict"] if p[0] not in skip]}
        if any(is_dtensor(t) for t in live.live.values()):
            self._init_optimizer_state()
            live = capture_mod.capture(
                self.state, include_rng=False, rank=self.rank, world_size=self.world_size
            )
        tree = capture_mod.globalize(tree, global_keys)
        loader = GlobalLoader(reader, live.live)
        loader.prepare(list(dict.fromkeys(capture_mod.global_refs(tree))))
        names = list(dict.fromkeys(name for _, name in capture_mod.iter_tensor_refs(tree)))
        tensors = reader.tensors(names, verify=True) if names else {}
        return capture_mod.decode(tree, tensors, loc, resolve=loader.value), skip

    def _per_rank_keys(
        self, reader: CheckpointReader, trees: list[Any], global_keys: set[str]
    ) -> set[str]:
        """Top-level keys that are each rank's own: the random streams, data loaders,
        and anything the saved ranks disagree on."""
        index = reader.manifest["tensors"]

        def by_content(node: Any) -> Any:  # tensor names replaced by their checksums
            if isinstance(node, dict):
                for tag in ("tensor", "ndarray", "torch_generator"):
                    if isinstance(node.get(tag), str):
                        return {**node, tag: index[node[tag]]["xxh3_64"]}
                return {k: by_content(v) for k, v in node.items()}
            if isinstance(node, list):
                return [by_content(v) for v in node]
            return node

        def norm(node: Any) -> str:
            return json.dumps(by_content(node), sort_keys=True)

        keys: set[str] = set()
        by_key = [dict((p[0], p[1]) for p in t.get("dict", [])) for t in trees]
        for key in by_key[0]:
            if key in global_keys:
                continue
            obj = self.state.get(key)
            if (
                key == capture_mod.RNG_KEY
                or getattr(obj, "resumable_per_rank", False)
                or len({norm(t.get(key)) for t in by_key}) > 1
            ):
                keys.add(key)
        return keys

    def _init_optimizer_state(self) -> None:
        """Give a fresh optimizer its state tensors (DTensors like its parameters), so a
        restore has targets to shard into."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        for obj in self.state.values():
            if isinstance(obj, torch.optim.Optimizer):
                _init_optim_state(obj)

    def _decode_memory(self, snap: MemorySnapshot, loc: Any) -> dict[str, Any]:
        """This rank's values from its shared-memory snapshot (same world size)."""
        content, views = self._verified(snap)
        live = capture_mod.capture(
            self.state, include_rng=False, rank=self.rank, world_size=self.world_size
        )
        if any(is_dtensor(t) for t in live.live.values()):
            self._init_optimizer_state()
            live = capture_mod.capture(
                self.state, include_rng=False, rank=self.rank, world_size=self.world_size
            )
        by_fqn = {str(f): n for n, (f, _, _) in content.meta.get("pieces", {}).items()}

        def resolve(fqn: str) -> torch.Tensor:
            target: Any = live.live.get(fqn)
            if fqn in by_fqn:
                local = views[by_fqn[fqn]]
            elif target is not None and is_dtensor(target):
                local = torch.empty_like(target.to_local())  # an empty shard
            else:
                raise CorruptCheckpointError(f"the snapshot has no tensor {fqn!r}")
            if target is not None and is_dtensor(target):
                return shaped_like(local.clone(), target)  # the slot is reused later
            return local

        return capture_mod.decode(content.meta["tree"], views, loc, resolve=resolve)

    def _apply(self, values: dict[str, Any], skip: set[str], *, borrowed: bool) -> None:
        """Restore decoded ``values`` into the live state, leaving the ``skip`` keys."""
        if not skip:
            capture_mod.restore(self.state, values, borrowed=borrowed)
            return
        log.warning("restore leaves per-rank state %s as this launch made it", sorted(skip))
        part = {k: v for k, v in self.state.items() if k not in skip}
        capture_mod.restore(part, values, borrowed=borrowed)
        if isinstance(self.state, dict):
            self.state.update(part)

    def _roots(self) -> list[Storage]:
        return [r for r in (self.storage, self.mirror) if r is not None]

    def _mark_restored(self, step: int) -> None:
        self._last_persist = self._last_memory = step
        self._persist_clock = self._memory_clock = time.monotonic()

    # ------------------------------------------------------------------ pinning

    def pin(self, step: int) -> None:
        """Exempt a committed checkpoint from retention."""
        if step not in self.steps():
            raise NoCheckpointError(f"no committed checkpoint for step {step} in {self.url}")
        self.storage.write(f"{PINS_DIR}/{step_dir(step)}", [b""])
        self.audit.record("pin", step=step)

    def unpin(self, step: int) -> None:
        self.storage.delete(f"{PINS_DIR}/{step_dir(step)}")
        self.audit.record("unpin", step=step)

    # ------------------------------------------------------------------ internals

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and last durations (snapshots, persists, commits, skips, failures)."""
        return dict(self.monitor.stats)

    def _emergency(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Persist the state of ``step`` within the grace period, then stop."""
        pm = self._preempt
        assert pm is not None
        t0 = time.monotonic()
        remaining = pm.remaining_s()
        log.warning(
            "preemption (%s): emergency checkpoint of step %d, %.1f s of grace left",
            pm.reason,
            step,
            remaining,
        )
        self.audit.record("preempt", step=step, reason=pm.reason, remaining_s=round(remaining, 3))
        self._emergency_deadline = time.monotonic() + remaining
        try:
            self._wait_worker(timeout=max(0.1, remaining))
        except PersistError as exc:
            log.error("an earlier persist failed before the emergency checkpoint: %s", exc)
        budget = GraceBudget(
            pm.remaining_s(), self.last_snapshot_s, self.monitor.stats["last_persist_s"]
        )
        newest = self._shm.newest if self._shm is not None else None
        fits = budget.fresh_snapshot_fits
        if self._group is not None:  # timings differ between ranks: rank 0 decides
            fits = bool(self._group.broadcast(fits))
        if newest is not None and newest.step == step:
            self._persist_snapshot(newest)
            how = "persisted the snapshot of this step"
        elif newest is None or fits:
            self.save(step, metrics)
            how = "snapshot and persist"
        else:
            log.warning(
                "a fresh snapshot and persist (about %.1f s) does not fit the %.1f s left: "
                "persisting the newest snapshot, of step %d",
                budget.estimate_s,
                budget.remaining_s,
                newest.step,
            )
            self._persist_snapshot(newest)
            how = f"persisted the older snapshot of step {newest.step}"
        self._wait_worker(timeout=max(0.1, pm.remaining_s()))
        left = pm.remaining_s()
        self.audit.record(
            "emergency_commit",
            step=self._committed,
            how=how,
            duration_s=round(time.monotonic() - t0, 6),
            estimate_s=budget.estimate_s,
            within_grace=left >= 0,
        )
        if left < 0:
            log.error("the emergency checkpoint took %.1f s longer than the grace period", -left)
        self.should_stop = True
        if pm.config.exit:
            self.close()
            log.warning("exiting with code %d for requeue", pm.config.exit_code)
            raise SystemExit(pm.config.exit_code)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer for {self.url} is closed")

    def _preflight(self) -> None:
        """Fail before training starts if shared memory cannot hold two snapshots."""
        if self._shm is None:
            return
        captured = capture_mod.capture(self.state, include_rng=self.capture_rng)
        need = 2 * sum(t.numel() * t.element_size() for t in captured.tensors.values())
        have = shm_free_bytes(self._shm.directory) + self._shm.existing_bytes()
        if need > have:
            raise StorageError(
                errno.ENOSPC,
                f"shared memory {self._shm.directory} has {have / 2**20:.0f} MiB available, "
                f"two snapshots of this state need {need / 2**20:.0f} MiB; enlarge /dev/shm "
                "(e.g. docker --shm-size) or use persist='sync' without memory_every",
            )

    def _adopt(self) -> None:
        """Once per Checkpointer: take over the memory tier left by a dead launch."""
        if self._adopted or self._shm is None:
            return
        self._adopted = True
        found = self._shm.adopt()
        if found:
            log.info(
                "found a shared-memory snapshot of step %d from an earlier launch", found[0][1].step
            )

    def _save_sync_arena(self, step: int, metrics: Mapping[str, Any] | None) -> bool:
        assert self._arena is not None
        t0 = time.perf_counter()
        captured = capture_mod.capture(
            self.state, include_rng=self.capture_rng, rank=self.rank, world_size=self.world_size
        )
        tensors = self._owned(captured.tensors, captured.replicated)
        snap = self._arena.snapshot(tensors)
        self.last_snapshot_s = time.perf_counter() - t0
        if self._group is not None:
            self._persist_group(
                snap, step, captured.tree, captured.pieces, _json_metrics(metrics or {})
            )
        else:
            self._persist_now(
                snap, step, captured.tree, _json_metrics(metrics or {}), captured.pieces
            )
        return True

    def _owned(self, tensors: dict[str, torch.Tensor], replicated: Any) -> dict[str, torch.Tensor]:
        """The tensors this rank writes (`owned_tensors`)."""
        return owned_tensors(tensors, replicated, self.rank, self.world_size)

    def _persist_group(
        self, snap: Snapshot, step: int, tree: Any, pieces: Any, metrics: Any
    ) -> None:
        """The coordinated save of several ranks (every rank calls it at the same step)."""
        assert self._group is not None
        group = self._group
        self._on_training_thread(
            snap,
            step,
            lambda: self._runner.persist_group(
                group, snap, step=step, tree=tree, pieces=pieces, metrics=metrics
            ),
        )

    def _persist_now(
        self, snap: Snapshot, step: int, tree: Any, metrics: Any, pieces: Any = None
    ) -> None:
        """Persist on the training thread (sync mode)."""
        self._on_training_thread(
            snap,
            step,
            lambda: self._runner.persist_snapshot(
                snap, step=step, tree=tree, metrics=metrics, pieces=pieces
            )[0],
        )

    def _on_training_thread(
        self, snap: Snapshot, step: int, persist: Callable[[], dict[str, Any]]
    ) -> None:
        """Run ``persist`` here and account for it (audit, monitor, policy clocks)."""
        self.audit.record(
            "save_start", step=step, bytes=snap.nbytes, snapshot_s=self.last_snapshot_s
        )
        self.monitor.persist_started()
        try:
            reply = persist()
        except BaseException as exc:
            self.audit.record("failure", step=step, error=repr(exc)[:500])
            self.monitor.failed(step, repr(exc))
            raise
        self.monitor.committed(step, reply.get("seconds"))
        self._committed = max(step, self._committed or step)
        self._last_persist = step
        self._persist_clock = time.monotonic()

    def _persist_snapshot(self, snap: MemorySnapshot) -> None:
        """Persist a published memory snapshot: in the background, or now in sync mode."""
        assert self._shm is not None
        self._owed = False
        if self.persist_mode == "sync":
            content = self._shm.content(snap.index)
            if content is None or content.seq != snap.seq:
                raise CheckpointError(f"memory snapshot of step {snap.step} is gone")
            slot = self._shm.slots[snap.index]
            assert slot is not None
            if self._group is not None:
                # This rank's share, copied out of its shared-memory snapshot.
                views = self._shm.tensors(snap.index, content)
                meta = content.meta
                own = self._owned(views, meta.get("replicated", []))
                if self._arena is None:
                    self._arena = Arena()
                pieces = pieces_from_json(meta.get("pieces"))
                self._persist_group(
                    self._arena.snapshot(own),
                    snap.step,
                    meta["tree"],
                    pieces,
                    meta.get("metrics", {}),
                )
                return
            self._persist_now(
                Snapshot(content.slots, slot.data_tensor()),
                snap.step,
                content.meta["tree"],
                content.meta.get("metrics", {}),
                pieces_from_json(content.meta.get("pieces")),
            )
            return
        worker = self._ensure_worker()
        self.audit.record(
            "save_start", step=snap.step, bytes=snap.nbytes, snapshot_s=self.last_snapshot_s
        )
        self._shm.locked.add(snap.index)
        self.monitor.persist_started()
        request: dict[str, Any] = {
            "kind": "persist",
            "slot": str(self._shm.paths[snap.index]),
            "seq": snap.seq,
            "step": snap.step,
        }
        if self._coord is not None:
            request["group"] = self._coord.next_job()
        job = worker.submit(request)
        self._jobs[job["id"]] = (snap.index, snap.step)
        if self._coord is not None:
            self._job_keys[job["id"]] = request["group"]["key"]
        self._last_persist = snap.step
        self._persist_clock = time.monotonic()

    def _ensure_worker(self) -> PersistWorker:
        if self._worker is None or not self._worker.alive:
            thread = self.persist_mode == "thread"
            self._worker = PersistWorker(
                url=self.url,
                mode=self.persist_mode,
                keep=self.keep,
                storage=self.storage if thread else None,
                storage_options=_options_for(self.url, self.storage_options),
                # With several ranks, rank 0's worker commits, so it alone uploads.
                mirror=self.mirror.url if self.mirror is not None and self.rank == 0 else None,
                mirror_keep=self.mirror_keep,
                mirror_options=(
                    _options_for(self.mirror.url, self.storage_options)
                    if self.mirror is not None
                    else None
                ),
                mirror_storage=self.mirror if thread else None,
            )
        return self._worker

    def _collect(self, replies: list[dict[str, Any]] | None = None) -> None:
        """Finish an overlapped copy, take in finished jobs; raise the first failure."""
        self._settle()
        if self._worker is not None and replies is None:
            try:
                replies = self._worker.poll()
            except PersistError as exc:
                self._fail_all_jobs(str(exc))
                self._worker = None
                self.monitor.failed(None, str(exc))
                raise exc
        if self._notes:
            replies = [*(replies or []), *self._notes]
            self._notes.clear()
        for r in replies or []:
            if self._mirror_report(r):
                continue
            index, step = self._jobs.pop(r.get("id", -1), (None, r.get("step")))
            self._job_keys.pop(r.get("id", -1), None)
            if index is not None and self._shm is not None:
                self._shm.locked.discard(index)
            if r.get("kind") == "committed":
                self._committed = max(int(r["step"]), self._committed or 0)
                self.monitor.committed(int(r["step"]), r.get("seconds"))
            elif r.get("kind") == "failed":
                self._errors.append(
                    f"persisting step {step} to {self.url} failed: {r.get('error')}"
                )
                self.monitor.failed(step, str(r.get("error")))
        if self._errors:
            msg = self._errors.pop(0)
            self._errors.clear()
            raise PersistError(msg)

    def _mirror_report(self, r: dict[str, Any]) -> bool:
        """Take in a report of the mirror thread; False if ``r`` is not one."""
        kind = r.get("kind")
        if kind == "mirrored":
            self.monitor.mirrored(int(r["step"]), r.get("seconds"))
        elif kind == "mirror_failed":
            self.monitor.mirror_failed(r.get("step"), str(r.get("error")))
        elif kind == "mirror_flushed":
            self._mirror_flushed = r
        else:
            return False
        return True

    def _wait_mirror(self, timeout: float | None = None, *, strict: bool = True) -> None:
        """Wait until the newest local checkpoint is mirrored; raise `PersistError` if
        it could not be (``strict``) or log it."""
        if self.mirror is None:
            return
        self._mirror_flushed = None
        if self.persist_mode == "sync":
            if self._runner.mirror is None:  # another rank than 0: rank 0 uploads
                return
            self._collect([self._runner.mirror.flush(timeout)])
        elif self._worker is not None:
            self._worker.submit({"kind": "mirror_flush", "timeout": timeout})
            self._wait_worker()
        else:
            return  # nothing was persisted by this Checkpointer
        flushed: dict[str, Any] = self._mirror_flushed or {}
        error = flushed.get("error")
        if error:
            if strict:
                raise PersistError(
                    f"{error}. The checkpoint is committed in {self.url}; it is not in "
                    f"{self.mirror.url}"
                )
            log.warning("not mirrored: %s", error)

    def _fail_all_jobs(self, reason: str) -> None:
        """The worker is gone with its jobs: release their slots, and tell the other
        ranks' workers, waiting for this rank's part of a coordinated persist, to stop
        waiting."""
        if self._shm is not None:
            self._shm.locked.clear()
        self._jobs.clear()
        if self._coord is not None:
            for key in self._job_keys.values():
                self._coord.give_up(key, reason)
        self._job_keys.clear()

    def _wait_worker(self, timeout: float | None = None) -> None:
        if self._worker is None:
            self._collect([])
            return
        try:
            replies = self._worker.wait_all(timeout)
        except PersistError as exc:
            self._fail_all_jobs(str(exc))
            self._worker = None
            self.monitor.failed(None, str(exc))
            raise
        self._collect(replies)

    def _flush(self) -> None:
        """Make the newest memory snapshot durable if it is newer than the last commit."""
        self._wait_worker()
        newest = self._shm.newest if self._shm is not None else None
        due = newest is not None and (self._committed is None or newest.step > self._committed)
        if self._group is not None:  # a collective persist: only if every rank has that step
            offers = self._group.gather(newest.step if due and newest is not None else None)
            due = due and all(o == offers[0] for o in offers)
        if due and newest is not None:
            self._persist_snapshot(newest)
            self._wait_worker()
        if self._emergency_deadline is not None:  # within the grace period, best effort
            left = self._emergency_deadline - time.monotonic()
            if left > 0:
                self._wait_mirror(left, strict=False)
        else:
            self._wait_mirror()

    def _remove_stale(self) -> None:
        if self.rank != 0:  # rank 0 owns the attempts of a coordinated save
            return
        for name in self._committer.stale():
            try:
                self.storage.delete(name)
            except CheckpointError as exc:
                log.warning("could not remove stale %s: %s", name, exc)
                continue
            log.info("removed stale %s (data of a commit that never finished)", name)
            self.audit.record("stale_removed", name=name)


def _storage_ptr(t: torch.Tensor) -> int:
    """Where ``t``'s bytes are: a DTensor's are its local shard's (the wrapper has none)."""
    if is_dtensor(t):
        with torch.no_grad():
            return int(t.to_local().data_ptr())  # type: ignore[attr-defined]
    return int(t.data_ptr())


def views_base(arena: ShmArena, index: int) -> Any:
    slot = arena.slots[index]
    assert slot is not None
    return slot.data_tensor()


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def _keep_json(keep: Keep | None) -> Any:
    from resumable.worker import keep_to_json

    return keep_to_json(keep)


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _register_atexit(ckpt: Checkpointer) -> Checkpointer:
    _live.add(ckpt)
    return ckpt


def _unregister_atexit(ckpt: Checkpointer) -> None:
    _live.discard(ckpt)


@atexit.register
def _close_all_at_exit() -> None:
    """At interpreter exit (normal, or after an uncaught exception), make every open
    Checkpointer's newest snapshot durable and release its resources."""
    for ckpt in list(_live):
        if ckpt._group is not None:
            ckpt._skip_flush = True  # a collective persist would wait for the other ranks
        try:
            ckpt.close()
        except Exception as exc:
            log.error("closing the checkpointer of %s at exit failed: %s", ckpt.url, exc)


def _options_for(
    url: str | os.PathLike[str] | Storage, options: dict[str, Any] | None
) -> dict[str, Any] | None:
    """``storage_options`` apply to the ``s3://`` roots only."""
    if options and isinstance(url, (str, os.PathLike)) and os.fspath(url).startswith("s3://"):
        return options
    return None


def _timed(policy: Every) -> bool:
    """Whether ``policy`` depends on the clock (then ranks must agree on each decision)."""
    return policy.auto or policy.seconds is not None or policy.minutes is not None
