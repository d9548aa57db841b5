"""The persist worker: format, write, commit and retention, off the training thread.

The trainer (`PersistWorker`, owned by the `Checkpointer`) hands the worker *jobs* that
name a shared-memory slot and the snapshot ``seq`` it must find there; the worker
writes that snapshot to storage, commits it, applies retention, records the audit
events and replies. One job runs at a time; the trainer keeps the slot of every
outstanding job locked, so the worker never reads a slot being rewritten.

Two ways to run it, same job code (`JobRunner`):

- ``process`` (default): a separate interpreter (``python -I -c <boot>``), so
  serialisation and checksums never hold the trainer's GIL. It is launched with
  ``subprocess`` rather than ``multiprocessing`` so a user script without a
  ``__main__`` guard is never re-imported. Messages are length-prefixed JSON over a
  socketpair (no pickle). If the trainer dies, the worker notices and abandons an
  uncommitted job: the next launch adopts the shared-memory snapshot and persists it
  itself, so there is never a second writer.

  The worker does not rely on the socket's EOF alone to learn that the trainer died:
  a process forked from the trainer (a DataLoader worker) would hold the trainer's end
  open, so the EOF would wait for that process. So the trainer's end is closed in every
  child forked from the trainer (`os.register_at_fork`), the worker's end is not
  inherited past its ``exec``, and the worker watches the trainer itself: a pidfd of
  its parent (Linux 5.3+) that becomes readable when the trainer exits, or else a
  once-a-second look at ``getppid()``. The worker's stdout is ``/dev/null`` (it never
  prints), so a wrapper reading the trainer's stdout sees EOF when the trainer exits;
  stderr stays shared, so the worker's warnings reach the job's log.

  Shared stderr means an orphaned worker would hold ``python train.py 2>&1 | tee log``
  open for as long as it lives, so a worker whose trainer died ends at once, whatever
  it is doing (booting, importing torch, in the middle of a persist), before its first
  heavy import: on Linux the kernel kills it (``PR_SET_PDEATHSIG``, SIGKILL), and on
  every platform a thread of its own ends it (`ORPHAN_EXIT`) on the EOF of a *lifeline*,
  a second socket whose trainer end nothing ever writes or closes before the trainer
  exits (closed in forked children as the job socket is). The death signal follows the
  *thread* that started the worker, so it is asked for only when that is the trainer's
  main thread, which lives as long as the process; a worker started from another
  thread (a callback, a thread-pool training loop) relies on the lifeline. Nothing is
  torn by the abrupt end: a commit is one atomic rename or marker, a staging or trash
  directory of a dead writer is removed by a later launch, the shared-memory snapshot
  stays for the next launch to adopt, and an interrupted mirror upload is caught up.
  Once started, the worker process runs at a lower CPU priority than the trainer:
  ``nice`` +10 by default (`WORKER_NICE_ENV`; ``0`` keeps the trainer's; its start-up,
  which the first save may wait for, runs at the trainer's). It is background work by
  design, and where the training step uses every core, an equal-priority worker takes
  CPU time from the step that follows a save (on 2 cores, most of the Transformers
  Trainer's stall per checkpoint in `examples/integrations/measure_stall.py`); at a
  lower priority it runs on what the trainer leaves, which includes every moment the
  trainer waits for it (``on_busy="wait"``, ``wait()``, ``close()``, a preemption).
- ``thread``: a thread in the trainer, for backends that only live in this process
  (``memory://``).

Lease fencing: on an object store the trainer holds the root by a lease
(`resumable.lock`), which a job frozen for longer than the lease loses. A persist under
way when the job froze must not commit or apply retention after it wakes, so the worker
checks the trainer's `LeaseFence` (shared memory: the descriptor is passed to a worker
process, the object itself to a thread) right before each commit and retention delete;
a refused commit fails its job with `RootInUseError`.

Error propagation: a failed job comes back as a ``failed`` reply; the `Checkpointer`
raises it as `PersistError` at the next ``save``/``maybe_save``/``wait``/``close``. A
worker process that dies is detected the same way.

What the worker process imports: the trainer's import path, less what depends on where
the trainer was started (the current directory, ``''``, relative entries, the main
script's directory), and the ``resumable`` package the trainer runs, loaded from its
own directory. The interpreter runs isolated (``-I``: no current directory on the
path, ``PYTHON*`` variables and the user site ignored), so a ``signal.py`` or
``json.py`` in the directory a job was launched from is never imported, while torch or
boto3 found through ``PYTHONPATH`` or the user site still are (their entries are on the
trainer's path, and passed on). With ``PYTHONHOME`` set, which ``-I`` would ignore and
the interpreter may need to start, the worker runs with ``-s`` instead, and the boot
code replaces the import path before its first import.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumable import settings
from resumable.audit import AuditLog
from resumable.commit import Quarantined, committer_for, list_committed
from resumable.errors import CheckpointError, PersistError, RootInUseError, StorageError
from resumable.incremental import DeltaBase, Incremental
from resumable.lock import LeaseFence
from resumable.pieces import owned_tensors, pieces_from_json
from resumable.pipeline.messages import (
    Committed,
    Failed,
    Job,
    Message,
    Mirrored,
    MirrorFailed,
    MirrorFlushed,
    MirrorFlushJob,
    PersistJob,
    Ready,
    Reply,
    Report,
    StopJob,
    WorkerConfig,
    decode,
    encode,
    with_id,
)
from resumable.policy import Keep
from resumable.retention import apply_retention, retention_entry
from resumable.retrying import retrying
from resumable.shm import ShmSlot, SlotContent
from resumable.snapshot import Arena, Snapshot, tensor_view
from resumable.storage import Storage, open_storage

if TYPE_CHECKING:
    from resumable.persist import Coordination
    from resumable.tiering import Mirror

log = logging.getLogger(__name__)

WORKER_NICE_ENV = settings.WORKER_NICE.name
"""How much lower than the trainer's the persist worker process's CPU priority is
(added to its ``nice`` value; 0 to 19, default 10)."""
DEFAULT_WORKER_NICE = 10


def worker_nice() -> int:
    """The niceness increment of the persist worker process (`WORKER_NICE_ENV`)."""
    text = (settings.WORKER_NICE.read() or "").strip()
    if not text:
        return DEFAULT_WORKER_NICE
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(
            f"{WORKER_NICE_ENV} must be an integer from 0 (the trainer's priority) to 19 "
            f"(the lowest), got {text!r}; unset it for the default, {DEFAULT_WORKER_NICE}"
        )
    return value


_LEN = struct.Struct(">I")

ORPHAN_EXIT = 75
"""The exit status of a persist worker that ended itself because its trainer died (a
worker the kernel killed for it ends by SIGKILL instead)."""

# argv: the socket's fd, the lifeline's fd, the lease fence's fd (-1: none), the trainer's
# pid, the death signal (0: none), the resumable package's directory, then the import
# path. First of all, before any import
# that takes time, the worker ties its life to the trainer's: the death signal (Linux), a
# check that the trainer did not die before it was set, and a thread that ends the worker
# on the lifeline's EOF. The path is set before the next import (`sys`, `os` are loaded
# already). Signals sent to every process of a group or Slurm job step (Ctrl-C,
# --signal=USR1@90, torchrun stopping its workers) are the trainer's: ignored here, before
# the slow imports, so an in-flight persist survives them. The trainer ends the worker
# (stop, socket EOF, SIGKILL). `resumable` is loaded from the trainer's copy, whatever else
# the path holds.
_WORKER_BOOT = (
    "import os, sys\n"
    "fd, lifeline, fence, trainer, deathsig, package_dir, *path = sys.argv[1:]\n"
    "if deathsig != '0':\n"
    "    try:\n"
    "        import ctypes\n"
    "        ctypes.CDLL(None, use_errno=True).prctl(1, int(deathsig), 0, 0, 0)\n"
    "    except (ImportError, OSError, AttributeError):\n"
    "        pass\n"
    "if os.getppid() != int(trainer):\n"
    f"    os._exit({ORPHAN_EXIT})\n"
    "import threading\n"
    "def watch_lifeline(fd=int(lifeline)):\n"
    "    try:\n"
    "        while os.read(fd, 64):\n"
    "            pass\n"
    "    except OSError:\n"
    "        pass\n"
    f"    os._exit({ORPHAN_EXIT})\n"
    "os.set_inheritable(int(lifeline), False)\n"
    "threading.Thread(target=watch_lifeline, name='resumable-lifeline', daemon=True).start()\n"
    "sys.path[:] = path\n"
    "import signal\n"
    "for name in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGUSR1', 'SIGUSR2'):\n"
    "    signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
    "import importlib.machinery, importlib.util\n"
    "spec = importlib.machinery.PathFinder.find_spec('resumable', [package_dir])\n"
    "sys.modules['resumable'] = package = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(package)\n"
    "from resumable.worker import worker_main\n"
    "sys.exit(worker_main(['--fd', fd, '--fence', fence]))"
)
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
            from resumable.tiering import Mirror

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
        content = slot.read()
        if content is None or content.seq != job.seq or content.step != job.step:
            raise CheckpointError(
                f"snapshot of step {job.step} was overwritten before it was persisted"
            )
        if job.group:
            return self._persist_coordinated(slot, content, job.group)
        reply, sums = self.persist_snapshot(
            Snapshot(content.slots, slot.data_tensor()),
            step=content.step,
            tree=content.meta["tree"],
            metrics=content.meta.get("metrics"),
            pieces=pieces_from_json(content.meta.get("pieces")),
        )
        if not slot.still(content.seq):
            raise CheckpointError("snapshot slot was rewritten while being persisted")
        slot.write_checksums(content.seq, sums)
        return reply

    def persist_snapshot(
        self, snap: Snapshot, *, step: int, tree: Any, metrics: Any, pieces: Any = None
    ) -> tuple[Committed, list[str]]:
        """Write, commit (retrying transient storage errors), audit and apply retention.
        Returns the reply and the per-tensor checksums in layout order."""
        from resumable.persist import write_checkpoint

        t0 = time.perf_counter()

        def on_retry(exc: StorageError, n: int) -> None:
            log.warning("persist of step %d failed (%s), retry %d", step, exc, n)
            self.audit.record("retry", step=step, error=repr(exc)[:300])

        result = retrying(
            lambda: write_checkpoint(
                self.storage,
                self.committer,
                step=step,
                snapshot=snap,
                tree=tree,
                metrics=metrics,
                before_commit=self._check_parent,
                pieces=pieces,
                base=self.delta,
            ),
            retries=self.retries,
            backoff_s=0.4,
            permanent=_NOT_TRANSIENT,
            on_retry=on_retry,
        )
        seconds = time.perf_counter() - t0
        self.audit.record(
            "commit",
            step=step,
            bytes=result.nbytes,
            duration_s=round(seconds, 6),
            replaced=result.replaced,
            metrics=result.manifest["metrics"],
        )
        self.metrics_cache[step] = retention_entry(result.manifest)
        deleted = self._retain(step)
        if self.mirror is not None:
            self.mirror.submit(step)
        sums = [result.manifest["tensors"][s.name]["xxh3_64"] for s in snap.slots]
        reply = Committed(
            step=step,
            seconds=seconds,
            bytes=result.nbytes,
            replaced=result.replaced,
            deleted=deleted,
        )
        return reply, sums

    def _persist_coordinated(
        self, slot: ShmSlot, content: SlotContent, where: dict[str, Any]
    ) -> Committed:
        """This rank's share of a coordinated persist, from its shared-memory snapshot:
        its tensors copied out (the slot may be rewritten once the job ends), then the
        exchanges of `write_distributed` through the coordination store."""
        from resumable.coordination import StoreCoordinator

        coordinator = StoreCoordinator.connect(where, self._stores)
        meta = content.meta
        data = slot.data_tensor()
        views = {s.name: tensor_view(data, s) for s in content.slots}
        own = owned_tensors(
            views, meta.get("replicated", []), coordinator.rank, coordinator.world_size
        )
        snap = self._arena.snapshot(own)
        if not slot.still(content.seq):
            raise CheckpointError("snapshot slot was rewritten while being persisted")
        return self.persist_group(
            coordinator,
            snap,
            step=content.step,
            tree=meta["tree"],
            pieces=pieces_from_json(meta.get("pieces")),
            metrics=meta.get("metrics"),
        )

    def persist_group(
        self,
        group: Coordination,
        snap: Snapshot,
        *,
        step: int,
        tree: Any,
        pieces: Any,
        metrics: Any,
    ) -> Committed:
        """The coordinated commit of several ranks (`write_distributed`), then, on rank
        0, the audit entry and retention. Not retried: a retry would need every rank."""
        from resumable.persist import write_distributed

        result = write_distributed(
            group,
            self.storage,
            self.committer,
            step=step,
            snapshot=snap,
            tree=tree,
            pieces=pieces,
            metrics=metrics,
            check=self._check_parent,
            base=self.delta,
        )
        deleted: list[int] = []
        if group.coordinator:
            self.audit.record(
                "commit",
                step=step,
                bytes=result.nbytes,
                duration_s=round(result.seconds, 6),
                replaced=result.replaced,
                ranks=group.world_size,
                metrics=result.manifest["metrics"],
            )
            self.metrics_cache[step] = retention_entry(result.manifest)
            deleted = self._retain(step)
            if self.mirror is not None:  # rank 0's worker uploads the whole checkpoint
                self.mirror.submit(step)
        return Committed(
            step=step,
            seconds=result.seconds,
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


def _send(sock: socket.socket, msg: Message) -> None:
    data = json.dumps(encode(msg)).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Message | None:
    """The next message; None at end of file; `CheckpointError` if it is not one."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    if body is None:
        return None
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise CheckpointError(f"malformed message from the other end: {exc}") from exc
    return decode(obj)


class TrainerWatch:
    """The worker's own check that its trainer (its parent process) is alive.

    With a pidfd of the parent, `wait` sleeps until the socket is readable or the
    trainer exited; without one (an old kernel, not Linux) it wakes once a second to
    compare ``getppid()`` with the trainer's pid: a dead parent's children are given
    to another process. Called from the worker's main thread only."""

    POLL_S = 1.0

    def __init__(self, trainer_pid: int) -> None:
        self.trainer_pid = trainer_pid
        self._pidfd: int | None = None
        if trainer_pid and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(trainer_pid)
            except OSError:
                self._pidfd = None
        # Opened after the trainer died, the pidfd could name another process that got its
        # pid; while the trainer is still our parent, it names the trainer.
        if self._pidfd is not None and self.gone():
            self.close()

    @property
    def uses_pidfd(self) -> bool:
        """Whether it sleeps on a pidfd (else it polls ``getppid``)."""
        return self._pidfd is not None

    def gone(self) -> bool:
        return bool(self.trainer_pid) and os.getppid() != self.trainer_pid

    def wait(self, sock: socket.socket) -> bool:
        """Block until ``sock`` is readable (True) or the trainer is gone (False)."""
        while True:
            if self.gone():
                return False
            watched: list[Any] = [sock] if self._pidfd is None else [sock, self._pidfd]
            timeout = self.POLL_S if self._pidfd is None and self.trainer_pid else None
            ready, _, _ = select.select(watched, [], [], timeout)
            if sock in ready:
                return True
            if self._pidfd is not None and self._pidfd in ready:
                return False

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process (``--fd N``: its end of the socketpair)."""
    p = argparse.ArgumentParser(prog="resumable-worker")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--fence", type=int, default=-1)  # the trainer's `LeaseFence`
    args = p.parse_args(argv)
    os.set_inheritable(args.fd, False)  # made inheritable for our exec only
    fence = LeaseFence.attach(args.fence) if args.fence >= 0 else None
    sock = socket.socket(fileno=args.fd)
    try:
        config = _recv(sock)
        if config is None:
            return 0
        if not isinstance(config, WorkerConfig):
            raise CheckpointError(f"expected the worker's configuration, found {config!r}")
        watch = TrainerWatch(config.parent_pid)
        send_lock = threading.Lock()

        def send(msg: Message) -> None:
            with send_lock:
                _send(sock, msg)

        def notify(msg: Report) -> None:
            try:
                send(msg)
            except OSError:
                pass  # the trainer is gone

        runner = JobRunner(
            open_storage(config.url, config.storage_options or None),
            config,
            notify=notify,
            background=True,
            fence=fence,
        )
        send(Ready(pid=os.getpid()))
    except OSError:
        return 0  # the trainer is already gone
    if config.nice:  # after the start-up, which the trainer's first save may wait for
        _lower_priority(config.nice)
    try:
        while True:
            if not watch.wait(sock):
                log.debug("the training process is gone; the persist worker exits")
                break
            try:
                job = _recv(sock)
            except ConnectionResetError:  # the trainer died (SIGKILL): same as its EOF
                break
            if job is None or isinstance(job, StopJob):
                break
            if not isinstance(job, (PersistJob, MirrorFlushJob)):
                raise CheckpointError(f"expected a job from the trainer, found {job!r}")
            reply = runner.handle(job)
            try:
                send(reply)
            except OSError:
                break
    finally:
        watch.close()
        runner.close()
    return 0


# --------------------------------------------------------------------------- trainer side


def _worker_command(fd: int, lifeline: int, fence: int = -1) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a worker process that talks over ``fd``, ends
    at the EOF of ``lifeline`` and maps the `LeaseFence` ``fence`` (see `_WORKER_BOOT`).
    Called by the thread that starts the worker: the death signal is asked for only if
    that is the main thread."""
    env = dict(os.environ)
    flags = ["-I"]
    if env.get("PYTHONHOME"):
        flags = ["-s"]
        env.pop("PYTHONPATH", None)
    if sys.flags.dont_write_bytecode:
        flags.append("-B")
    package_dir = str(Path(__file__).resolve().parents[1])
    return [
        sys.executable,
        *flags,
        "-c",
        _WORKER_BOOT,
        str(fd),
        str(lifeline),
        str(fence),
        str(os.getpid()),
        str(_death_signal()),
        package_dir,
        *_worker_import_path(),
    ], env


def _death_signal() -> int:
    """The signal the kernel sends the worker when its parent dies, 0 for none: SIGKILL
    on Linux when called from the main thread. ``PR_SET_PDEATHSIG`` fires when the
    *thread* that started the worker ends, and only the main thread lives as long as the
    process (Python's ends last); from another thread the lifeline alone is used."""
    if not sys.platform.startswith("linux"):
        return 0
    if threading.current_thread() is not threading.main_thread():
        return 0
    return int(signal.SIGKILL)


def _lower_priority(nice: int) -> None:
    """Add ``nice`` to this process's niceness (a failure only costs speed)."""
    try:
        os.nice(nice)
    except OSError as exc:
        log.debug("could not lower the persist worker's CPU priority: %s", exc)


def _worker_import_path() -> list[str]:
    """The trainer's ``sys.path`` without the entries that depend on where it was
    started: ``''`` and other relative entries, the current directory and the main
    script's directory (compared after resolving links)."""
    untrusted: set[str] = set()
    try:
        untrusted.add(os.path.realpath(os.getcwd()))
    except OSError:
        pass  # the current directory was removed; relative entries are left out anyway
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main_file, str):  # its directory, through a link to the script or not
        untrusted.add(os.path.realpath(os.path.dirname(os.path.abspath(main_file))))
        untrusted.add(os.path.dirname(os.path.realpath(main_file)))
    path: list[str] = []
    for entry in sys.path:
        if (
            isinstance(entry, str)
            and os.path.isabs(entry)
            and entry not in path
            and os.path.realpath(entry) not in untrusted
        ):
            path.append(entry)
    return path


# The trainer's ends of its workers' sockets. A child forked from the trainer (a DataLoader
# worker; fork copies every descriptor, close-on-exec or not) closes its copies at once, so
# the worker's EOF comes when the trainer exits, not when its last forked child does.
_TRAINER_ENDS: weakref.WeakSet[socket.socket] = weakref.WeakSet()
# The trainer's ends of its workers' lifelines, by worker pid, with the worker's process.
# Held here, not only by the `PersistWorker`, so that a worker whose handle was dropped
# without `stop` (a Checkpointer collected unclosed) still finishes its job and ends on
# the job socket's EOF, instead of dying mid-persist when the lifeline is collected. A
# lifeline is closed once its worker exited (`stop`, or the next start here).
_LIFELINES: dict[int, tuple[subprocess.Popen[bytes], socket.socket]] = {}


def _close_inherited_ends() -> None:
    for sock in list(_TRAINER_ENDS):
        try:
            sock.close()
        except OSError:
            pass
    _TRAINER_ENDS.clear()
    _LIFELINES.clear()  # the parent's workers, not this child's


def _release_lifeline(pid: int) -> None:
    entry = _LIFELINES.pop(pid, None)
    if entry is not None:
        entry[1].close()


def _release_ended_lifelines() -> None:
    for pid, (proc, _) in list(_LIFELINES.items()):
        if proc.poll() is not None:
            _release_lifeline(pid)


os.register_at_fork(after_in_child=_close_inherited_ends)


class PersistWorker:
    """The trainer's handle on its worker. Called from the training thread only.

    ``submit`` never blocks on the job; ``poll`` collects replies without blocking;
    ``wait_all`` blocks until nothing is outstanding. Dead workers raise `PersistError`.
    """

    def __init__(
        self,
        *,
        url: str,
        mode: str,
        keep: Keep | None,
        rank: int = 0,
        storage: Storage | None = None,
        storage_options: dict[str, Any] | None = None,
        mirror: str | None = None,
        mirror_keep: Keep | None = None,
        mirror_options: dict[str, Any] | None = None,
        mirror_storage: Storage | None = None,
        incremental: Incremental | None = None,
        fence: LeaseFence | None = None,
    ) -> None:
        """``fence``: the trainer's lease (`RootLock.fence`), None where it cannot lapse."""
        if mode not in ("process", "thread"):
            raise ValueError(f"persist mode must be 'process' or 'thread', got {mode!r}")
        self.mode = mode
        self.outstanding: deque[Job] = deque()
        self._next_id = 0
        self._stopped = False
        config = WorkerConfig(
            url=url,
            keep=keep_to_json(keep),
            rank=rank,
            parent_pid=os.getpid(),
            storage_options=storage_options,
            mirror=mirror,
            mirror_keep=keep_to_json(mirror_keep),
            mirror_options=mirror_options,
            incremental=incremental.to_json() if incremental is not None else None,
            nice=worker_nice() if mode == "process" else 0,  # a bad value: refused here
        )
        self.pid = os.getpid()
        if mode == "process":
            _release_ended_lifelines()
            parent, child = socket.socketpair()
            life, line = socket.socketpair()  # `life` is never written nor closed early
            _TRAINER_ENDS.update((parent, child, life, line))
            fence_fd = fence.fd if fence is not None else -1
            command, env = _worker_command(child.fileno(), line.fileno(), fence_fd)
            try:
                self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                    command,
                    pass_fds=[child.fileno(), line.fileno()] + ([fence_fd] if fence else []),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env=env,
                    close_fds=True,
                )
            except BaseException:
                life.close()
                raise
            finally:
                child.close()
                line.close()
            _LIFELINES[self._proc.pid] = (self._proc, life)
            self._sock: socket.socket | None = parent
            _send(parent, config)
            self._ready = False
            self.pid = self._proc.pid
        else:
            self._proc = None
            self._sock = None
            self._jobs: queue.Queue[Job | None] = queue.Queue()
            self._replies: queue.Queue[Message] = queue.Queue()
            runner = JobRunner(
                storage or open_storage(url, storage_options),
                dataclasses.replace(config, parent_pid=0),
                notify=self._replies.put,
                mirror_storage=mirror_storage,
                background=True,
                fence=fence,
            )
            self._thread = threading.Thread(
                target=self._thread_main, args=(runner,), name="resumable-persist", daemon=True
            )
            self._thread.start()
            self._ready = True

    def _thread_main(self, runner: JobRunner) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                self._replies.put(runner.handle(job))
        finally:
            runner.close()

    @property
    def busy(self) -> bool:
        return bool(self.outstanding)

    def submit(self, job: Job) -> Job:
        """Send ``job``; returns it with the id its reply will carry."""
        self._check_alive()
        self._next_id += 1
        job = with_id(job, self._next_id)
        self.outstanding.append(job)
        if self._sock is not None:
            try:
                _send(self._sock, job)
            except OSError as exc:
                raise PersistError(f"the persist process is gone ({exc})") from exc
        else:
            self._jobs.put(job)
        return job

    def poll(self, timeout: float = 0.0) -> list[Reply | Report]:
        """Replies and reports that arrived (waiting up to ``timeout`` seconds for the
        first one)."""
        replies: list[Reply | Report] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self._receive(max(0.0, deadline - time.monotonic()) if not replies else 0.0)
            if msg is None:
                break
            if isinstance(msg, Ready):
                self._ready = True
                continue
            if not isinstance(msg, (Committed, Failed, MirrorFlushed, Mirrored, MirrorFailed)):
                raise PersistError(f"unexpected message from the persist worker: {msg!r}")
            if (
                self.outstanding
                and isinstance(msg, (Committed, Failed, MirrorFlushed))
                and self.outstanding[0].id == msg.id
            ):
                self.outstanding.popleft()
            replies.append(msg)
        if not replies:
            self._check_alive()
        return replies

    def _receive(self, timeout: float) -> Message | None:
        if self._sock is None:
            try:
                return (
                    self._replies.get(timeout=timeout)
                    if timeout > 0
                    else self._replies.get_nowait()
                )
            except queue.Empty:
                return None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        try:
            return _recv(self._sock)
        except (OSError, CheckpointError):
            return None

    def wait_all(self, timeout: float | None = None) -> list[Reply | Report]:
        """Block until every outstanding job replied; returns the replies."""
        replies: list[Reply | Report] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.outstanding:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise PersistError(f"persist did not finish within {timeout} s")
            replies.extend(self.poll(timeout=left))
        return replies

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None and not self._stopped:
            code = self._proc.returncode
            _release_lifeline(self._proc.pid)
            lost = [j.step for j in self.outstanding if isinstance(j, PersistJob)]
            self.outstanding.clear()
            self._stopped = True
            raise PersistError(
                f"the persist process (pid {self._proc.pid}) exited with code {code}"
                + (f"; step(s) {lost} were not committed" if lost else "")
                + ". Committed checkpoints are intact; the next save starts a new worker"
            )
        if self._proc is None and not self._stopped and not self._thread.is_alive():
            self._stopped = True
            raise PersistError("the persist thread died")

    @property
    def alive(self) -> bool:
        if self._stopped:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to finish and exit; kills a process that does not."""
        if self._stopped:
            return
        self._stopped = True
        if self._sock is not None and self._proc is not None:
            try:
                _send(self._sock, StopJob())
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            _release_lifeline(self._proc.pid)
            self._sock.close()
        else:
            self._jobs.put(None)
            self._thread.join(timeout)
