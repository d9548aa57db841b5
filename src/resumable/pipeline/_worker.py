"""The persist worker: format, write, commit and retention, off the training thread.

The trainer (`PersistWorker`, owned by the `Checkpointer`) hands the worker *jobs* that
name a shared-memory slot and the snapshot ``seq`` it must find there. The worker
writes that snapshot to storage, commits it, applies retention, records the audit
events and replies. One job runs at a time; the trainer keeps the slot of every
outstanding job locked, so the worker never reads a slot being rewritten.

Two modes run the same job code (`JobRunner`). ``process`` (the default) is a separate
interpreter, launched and tied to the trainer by `resumable.pipeline._worker_process`, so
serialisation never holds the trainer's GIL. ``thread`` serves backends that live only
in this process (``memory://``). A failed job or a dead worker is raised as
`PersistError` at the next ``save``, ``wait`` or ``close``. Why the process is launched
and watched as it is: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import queue
import select
import socket
import subprocess
import threading
import time
from collections import deque
from typing import Any

from resumable.errors import CheckpointError, PersistError
from resumable.format import loaded_versions, tell_versions
from resumable.incremental import Incremental
from resumable.lock import LeaseFence
from resumable.pipeline._worker_jobs import JobRunner, TrainerGone, keep_from_json, keep_to_json
from resumable.pipeline._worker_process import (
    DEFAULT_WORKER_NICE,
    ORPHAN_EXIT,
    WORKER_NICE_ENV,
    TrainerWatch,
    hold_lifeline,
    hold_trainer_ends,
    lower_priority,
    receive_message,
    release_ended_lifelines,
    release_lifeline,
    send_message,
    worker_command,
    worker_nice,
)
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
    with_id,
)
from resumable.policy import Keep
from resumable.storage import Storage, open_storage

log = logging.getLogger(__name__)


def _load_torch_early(config: WorkerConfig) -> None:
    """Start importing torch on a thread of its own, after the start-up, where a job
    of this worker will need it: a coordinated persist (its store client, its share's
    copy) or a mirror's upload (a full verification). A single process's persist never
    does (`resumable._lazy`); this only moves the import off the first such job. The
    thread keeps the trainer's CPU priority (started before `lower_priority`, which
    Linux applies to the calling thread): niced, two trainers starved it for seconds."""
    if config.world_size <= 1 and not config.mirror:
        return
    name = "torch.distributed" if config.world_size > 1 else "torch"
    threading.Thread(
        target=importlib.import_module, args=(name,), name="resumable-load-torch", daemon=True
    ).start()


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
        config = receive_message(sock)
        if config is None:
            return 0
        if not isinstance(config, WorkerConfig):
            raise CheckpointError(f"expected the worker's configuration, found {config!r}")
        if isinstance(config.versions, dict):
            tell_versions(config.versions)
        watch = TrainerWatch(config.parent_pid)
        send_lock = threading.Lock()

        def send(msg: Message) -> None:
            with send_lock:
                send_message(sock, msg)

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
    _load_torch_early(config)  # before the niceness, which Linux sets per thread
    if config.nice:  # after the start-up, which the trainer's first save may wait for
        lower_priority(config.nice)
    try:
        while True:
            if not watch.wait(sock):
                log.debug("the training process is gone; the persist worker exits")
                break
            try:
                job = receive_message(sock)
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


_WAITID = getattr(os, "waitid", None)
_RUNNING = getattr(os, "WEXITED", 0) | getattr(os, "WNOHANG", 0) | getattr(os, "WNOWAIT", 0)


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
        world_size: int = 1,
    ) -> None:
        """``fence``: the trainer's lease (`RootLock.fence`), None where it cannot lapse;
        ``world_size``: the job's ranks."""
        if mode not in ("process", "thread"):
            raise ValueError(f"persist mode must be 'process' or 'thread', got {mode!r}")
        self.mode = mode
        self.outstanding: deque[Job] = deque()
        self._next_id = 0
        self._stopped = False
        # Without a mirror the worker only ever answers a job (and says Ready once):
        # with nothing outstanding, `poll` has nothing to look for.
        self._answers_only = mirror is None and mirror_storage is None
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
            world_size=world_size,
            versions=loaded_versions(),
        )
        self.pid = os.getpid()
        if mode == "process":
            release_ended_lifelines()
            parent, child = socket.socketpair()
            life, line = socket.socketpair()  # `life` is never written nor closed early
            hold_trainer_ends(parent, child, life, line)
            fence_fd = fence.fd if fence is not None else -1
            command, env = worker_command(child.fileno(), line.fileno(), fence_fd)
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
            hold_lifeline(self._proc, life)
            self._sock: socket.socket | None = parent
            send_message(parent, config)
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
                send_message(self._sock, job)
            except OSError as exc:
                raise PersistError(f"the persist process is gone ({exc})") from exc
        else:
            self._jobs.put(job)
        return job

    def poll(self, timeout: float = 0.0) -> list[Reply | Report]:
        """Replies and reports that arrived (waiting up to ``timeout`` seconds for the
        first one)."""
        if not self.outstanding and self._ready and self._answers_only and not timeout:
            self._check_alive()  # nothing can have arrived, but it may have died
            return []
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
            return receive_message(self._sock)
        except (OSError, CheckpointError):
            return None

    def wait_all(self, timeout: float | None = None, *, leave: int = 0) -> list[Reply | Report]:
        """Block until every outstanding job but the ``leave`` newest replied; returns
        the replies."""
        replies: list[Reply | Report] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.outstanding) > leave:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise PersistError(f"persist did not finish within {timeout} s")
            replies.extend(self.poll(timeout=left))
        return replies

    def _exited(self) -> bool:
        """Whether the worker process exited: asked without reaping it (``WNOWAIT``, one
        syscall), and through `subprocess.Popen.poll` (which reaps it) once it has."""
        proc = self._proc
        assert proc is not None
        if proc.returncode is None and _WAITID is not None:
            try:
                if _WAITID(os.P_PID, proc.pid, _RUNNING) is None:
                    return False
            except ChildProcessError:  # reaped already (by `Popen.poll`, or SIG_IGN)
                pass
        return proc.poll() is not None

    def _check_alive(self) -> None:
        if self._proc is not None and not self._stopped and self._exited():
            code = self._proc.returncode
            release_lifeline(self._proc.pid)
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
            return not self._exited()
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to finish and exit; kills a process that does not."""
        if self._stopped:
            return
        self._stopped = True
        if self._sock is not None and self._proc is not None:
            try:
                send_message(self._sock, StopJob())
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            release_lifeline(self._proc.pid)
            self._sock.close()
        else:
            self._jobs.put(None)
            self._thread.join(timeout)


__all__ = [
    "DEFAULT_WORKER_NICE",
    "ORPHAN_EXIT",
    "WORKER_NICE_ENV",
    "JobRunner",
    "PersistWorker",
    "TrainerGone",
    "TrainerWatch",
    "keep_from_json",
    "keep_to_json",
    "worker_main",
    "worker_nice",
]
