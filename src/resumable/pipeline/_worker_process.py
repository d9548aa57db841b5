"""The persist worker's process: its launch, its messages and its tie to the trainer.

A worker process is started with ``subprocess`` (`worker_command`), talks to the trainer
in length-prefixed JSON over a socketpair (`send_message`, `receive_message`) and ends
when the trainer does: by the kernel's death signal, by the EOF of its lifeline, or by
its own `TrainerWatch`. The trainer's ends of these sockets are closed in every child
forked from the trainer, so only the trainer's exit ends its worker.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from resumable import settings
from resumable.errors import CheckpointError
from resumable.pipeline.messages import (
    Message,
    decode,
    encode,
)

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
# the path holds, and its ``__init__`` (the public API, which imports torch) is not run:
# the worker imports only the modules it uses, none of which loads torch until a tensor
# is needed (`resumable._lazy`).
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
    "sys.modules['resumable'] = importlib.util.module_from_spec(spec)\n"
    "from resumable.pipeline._worker import worker_main\n"
    "code = worker_main(['--fd', fd, '--fence', fence])\n"
    # Every job is done, its files closed and fsynced, its reply sent: the interpreter's
    # teardown (a second or more of freeing torch's modules) would only delay the
    # trainer's close, which waits for this process to end.
    "import logging\n"
    "logging.shutdown()\n"
    "for stream in (sys.stdout, sys.stderr):\n"
    "    try:\n"
    "        stream.flush()\n"
    "    except (AttributeError, OSError, ValueError):\n"
    "        pass\n"
    "os._exit(code)"
)


def send_message(sock: socket.socket, msg: Message) -> None:
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


def receive_message(sock: socket.socket) -> Message | None:
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


def worker_command(fd: int, lifeline: int, fence: int = -1) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a worker process that talks over ``fd``, ends
    at the EOF of ``lifeline`` and maps the `LeaseFence` ``fence`` (see `_WORKER_BOOT`).
    Called by the thread that starts the worker: the death signal is asked for only if
    that is the main thread."""
    env = dict(os.environ)
    # The worker does no linear algebra: a NumPy it loads (to check a long extents list,
    # to write with O_DIRECT) starts no BLAS threads, whose start costs CPU on the cores
    # the trainer uses.
    env["OPENBLAS_NUM_THREADS"] = "1"
    flags = ["-I"]
    if env.get("PYTHONHOME"):
        flags = ["-s"]
        env.pop("PYTHONPATH", None)
    if sys.flags.dont_write_bytecode:
        flags.append("-B")
    package_dir = str(Path(__file__).resolve().parents[2])  # holds resumable/pipeline/
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


def lower_priority(nice: int) -> None:
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


def hold_trainer_ends(*socks: socket.socket) -> None:
    """Close ``socks`` in every child forked from this process from now on."""
    _TRAINER_ENDS.update(socks)


def hold_lifeline(proc: subprocess.Popen[bytes], life: socket.socket) -> None:
    """Keep the trainer's end ``life`` of ``proc``'s lifeline open until it exits."""
    _LIFELINES[proc.pid] = (proc, life)


def release_lifeline(pid: int) -> None:
    entry = _LIFELINES.pop(pid, None)
    if entry is not None:
        entry[1].close()


def release_ended_lifelines() -> None:
    for pid, (proc, _) in list(_LIFELINES.items()):
        if proc.poll() is not None:
            release_lifeline(pid)


os.register_at_fork(after_in_child=_close_inherited_ends)
