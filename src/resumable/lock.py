"""One writer per checkpoint root.

Contract: a job holds its root for as long as it writes it, since a check before
starting is a race. A second job is refused with `RootInUseError`, which names the
holder (host, pid, since when). `acquire_root` picks how to hold the root:

- filesystem roots (`Storage.open_lock` gives a descriptor): ``flock`` on
  ``.resumable-lock``. The kernel drops it however the holder exits, so nothing expires.
- object stores and memory: a *lease*, generation objects created with
  `Storage.put_if_absent` and renewed every third of ``ttl_s``. A holder past its
  ``ttl_s`` writes nothing until it holds the lease again. If another job took it,
  `RootLock.check` raises and the next save stops.

The trade-off of the lease: a job killed without releasing blocks the root for up to
``ttl_s + skew_s`` (60 + 10 s by default). A smaller ``ttl_s`` costs more requests and
less tolerance to a stalled holder. The persist worker checks a `LeaseFence` before each
commit and retention delete. Why and how, in full: docs/root-safety.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import math
import mmap
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from resumable.errors import CheckpointError, NoCheckpointError, RootInUseError
from resumable.storage.base import Storage

log = logging.getLogger(__name__)

LOCK_FILE = ".resumable-lock"
LEASE_DIR = ".resumable-lease"
DEFAULT_TTL_S = 60.0
DEFAULT_SKEW_S = 10.0
_LEASE_PREFIX = "lease-"
_LEASE_SUFFIX = ".json"
_KEEP_GENERATIONS = 3  # older lease objects are deleted by the holder
_MAX_RECORD = 64 << 10

_forked_away: set[int] = set()  # lock descriptors held by this process, closed in children


def _close_in_child() -> None:
    for fd in list(_forked_away):
        try:
            os.close(fd)
        except OSError:
            pass
    _forked_away.clear()


os.register_at_fork(after_in_child=_close_in_child)


@dataclass(frozen=True)
class Holder:
    """Who holds a root: enough for an operator to find the process."""

    host: str
    pid: int
    since: float  # when it took the root (seconds since the epoch)
    command: str = ""
    token: str = ""  # tells two holders apart even on one host and pid
    expires: float | None = None  # leases only: when it lapses unless renewed
    released: bool = False  # leases only: given back by its holder
    pidns: int = 0  # the holder's pid namespace (0: unknown): where ``pid`` means something

    @staticmethod
    def me(token: str) -> Holder:
        return Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            since=time.time(),
            command=" ".join(sys.argv)[:200],
            token=token,
            pidns=_pid_namespace(),
        )

    def gone(self) -> bool:
        """Whether this holder is known dead: on this host, in this pid namespace, and
        no process has its pid. A holder elsewhere is never known dead (its lease must
        lapse)."""
        if self.host != socket.gethostname() or not self.pidns or self.pidns != _pid_namespace():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # exists, another user's
            return False
        return False

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        text = f"pid {self.pid} on host {self.host} since {since} ({_ago(now - self.since)})"
        if self.command:
            text += f", running {self.command!r}"
        return text

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @staticmethod
    def from_json(data: bytes) -> Holder | None:
        """The holder recorded in ``data`` (its first JSON value), or None if it is not
        one (empty, being rewritten, foreign): never raises."""
        try:
            value, _ = json.JSONDecoder().raw_decode(data[:_MAX_RECORD].decode("utf-8"))
            expires = value.get("expires")
            return Holder(
                host=str(value["host"]),
                pid=int(value["pid"]),
                since=float(value["since"]),
                command=str(value.get("command", "")),
                token=str(value.get("token", "")),
                expires=None if expires is None else float(expires),
                released=bool(value.get("released", False)),
                pidns=int(value.get("pidns", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


class RootLock:
    """A held root. `check` before each write (cheap: no I/O); `release` once, at close."""

    url: str
    holder: Holder

    def check(self) -> None:
        """Raise `RootInUseError` if this process no longer holds the root."""

    def trusted_until(self) -> float:
        """The boot-clock time (``CLOCK_BOOTTIME``) until which this holder counts on the
        root: ``inf`` for a lock nobody can take over (``flock``), ``-inf`` once lost or
        released."""
        return math.inf

    def watch(self, listener: Callable[[float, str | None], None]) -> None:
        """Call ``listener(trusted_until(), why_lost)`` now and after each change (a
        confirmed renewal, the loss). Called from the renewal thread or the caller's."""
        listener(self.trusted_until(), None)

    def fence(self) -> LeaseFence | None:
        """A `LeaseFence` kept at `trusted_until`, for the processes that write under this
        lock; None where the lock cannot be lost while its holder lives (``flock``)."""
        return None

    def release(self) -> None:
        """Give the root back (idempotent). Never raises: a failure is logged."""

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FileLock(RootLock):
    """``flock`` on ``.resumable-lock`` in a filesystem root (see the module docstring)."""

    def __init__(self, storage: Storage, fd: int, holder: Holder) -> None:
        self.url = storage.url
        self.holder = holder
        self._fd: int | None = fd

    def __del__(self) -> None:  # a holder dropped without release() frees the root
        self.release()

    def release(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is None:
            return
        _forked_away.discard(fd)
        try:
            os.close(fd)  # drops the flock with the last reference to the description
        except OSError as exc:
            log.warning("could not release the lock on %s: %s", self.url, exc)


class LeaseLock(RootLock):
    """A renewed lease object on a storage without operating-system locks.

    Call order: `acquire_root` builds it; `renew` runs every ``ttl_s / 3`` (its thread,
    or the caller with ``renew=False``); `check` before each write; `release` once. A
    holder counts on its lease only for ``ttl_s`` after the start of its last confirmed
    renewal, by its own clocks. Past that it writes nothing until it has taken the lease
    again through the acquire path, which it may only where the newest generation is
    still its own (nobody took the root meanwhile). Once lost, it stays lost.
    """

    def __init__(
        self,
        storage: Storage,
        claim: _Claim,
        *,
        ttl_s: float,
        skew_s: float,
        clock: Callable[[], float],
        renew: bool,
    ) -> None:
        self.url = storage.url
        self._storage = storage
        self._ttl_s = ttl_s
        self._skew_s = skew_s
        self._clock = clock
        self._listeners: list[Callable[[float, str | None], None]] = []
        self._lost: str | None = None
        self._confirm(claim)
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(
                target=self._renew_loop, name="resumable-lease", daemon=True
            )
            self._thread.start()

    def check(self) -> None:
        """Raise `RootInUseError` unless this process still holds the root. Cheap (no
        I/O) while the lease runs. Once it has lapsed by this process's clocks (a freeze,
        a starved renewal thread, an unreachable storage), the lease is taken again
        through the acquire path, or the lock is lost for good."""
        if self._lost is None and self._lapsed() is not None:
            self.renew()
            if self._lost is None and self._lapsed() is not None:  # released meanwhile
                self._lose("it gave the root back (release)")
        if self._lost is not None:
            raise RootInUseError(self._lost, url=self.url)

    def renew(self) -> bool:
        """Write the next generation with a new expiry; return whether this process still
        holds the root. Called by the renewal thread; callable directly (tests). A lapsed
        lease is not renewed but taken again (`acquire_root`'s path, only if the newest
        generation is still this holder's); a renewal whose put won but that finds a
        newer generation (another holder, further along) has lost the root."""
        with self._mutex:
            if self._lost is not None or self._stop.is_set():
                return self._lost is None
            lapsed = self._lapsed()
            if lapsed is not None:
                return self._retake(lapsed)
            return self._extend()

    def trusted_until(self) -> float:
        """The boot-clock time at which the lease lapses by this holder's clocks (the
        boot clock's deadline, less what the caller's clock ran ahead of it since the last
        confirmed renewal); ``-inf`` once lost or released."""
        if self._lost is not None or self.holder.released:
            return -math.inf
        boot = _boot_clock()
        ahead = (self._clock() - self._confirmed_at) - (boot - self._confirmed_boot)
        return self._confirmed_boot + self._ttl_s - max(0.0, ahead)

    def watch(self, listener: Callable[[float, str | None], None]) -> None:
        self._listeners.append(listener)
        listener(self.trusted_until(), self._lost)

    def fence(self) -> LeaseFence:
        # A worker that finds the lease lapsed waits this long for the renewal thread
        # (which wakes with it after a freeze) to take the lease again or lose it.
        fence = LeaseFence.create(wait_s=self._ttl_s / 3 + 5.0)
        self.watch(fence.publish)
        return fence

    def _changed(self) -> None:
        until = self.trusted_until()
        for listener in self._listeners:
            listener(until, self._lost)

    def _lapsed(self) -> str | None:
        """Why the lease can no longer be counted on, or None while it can: more than
        ``ttl_s`` since the start of the last confirmed renewal, on the caller's clock or
        on the boot clock (which a wall-clock step does not move and that counts time
        the process was stopped or the host suspended)."""
        elapsed = max(self._clock() - self._confirmed_at, _boot_clock() - self._confirmed_boot)
        if elapsed <= self._ttl_s:
            return None
        return (
            f"its lease lapsed ({elapsed:.0f} s since its last confirmed renewal; it lasts "
            f"{self._ttl_s:g} s: the process was stopped or starved, or the storage "
            "unreachable)"
        )

    def _confirm(self, claim: _Claim) -> None:
        self._generation = claim.generation
        self.holder = claim.record
        self._confirmed_at = (claim.record.expires or 0.0) - self._ttl_s
        self._confirmed_boot = claim.boot
        self._changed()

    def _extend(self) -> bool:
        boot = _boot_clock()
        record = replace(self.holder, expires=self._clock() + self._ttl_s)
        try:
            held, outcome = _advance(self._storage, self._generation, record)
        except (CheckpointError, OSError) as exc:
            left = self._ttl_s - max(
                self._clock() - self._confirmed_at, _boot_clock() - self._confirmed_boot
            )
            log.warning(
                "could not renew the lease on %s (retrying; it lapses in %.0f s): %s",
                self.url,
                max(0.0, left),
                exc,
            )
            return True
        if held and outcome is not None:
            self._confirm(_Claim(self._generation + 1, outcome, boot))
            return True
        self._lose(_taken(outcome, self._clock()))
        return False

    def _retake(self, lapsed: str) -> bool:
        try:
            claim = _claim(
                self._storage,
                self.holder,
                ttl_s=self._ttl_s,
                skew_s=self._skew_s,
                clock=self._clock,
                own=True,
            )
        except RootInUseError as exc:
            taker = exc.holder if isinstance(exc.holder, Holder) else None
            self._lose(f"{lapsed}, and {_taken(taker, self._clock())}")
            return False
        except (CheckpointError, OSError) as exc:
            self._lose(f"{lapsed}, and it could not be taken again: {exc}")
            return False
        log.warning(
            "%s on %s; nobody took the root meanwhile, so this process took it again",
            lapsed,
            self.url,
        )
        self._confirm(claim)
        return True

    def _lose(self, why: str) -> None:
        self._lost = (
            f"this process no longer holds the checkpoint root {self.url}: {why}. Another "
            "job may now be writing it, so this one stops saving. Make sure only one job "
            "uses a root; if the storage was unreachable for a while, a larger ttl_s for "
            "the lease tolerates longer outages"
        )
        log.error("%s", self._lost)
        self._changed()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                if not self.renew():
                    return
            except Exception:  # a bug must not kill the thread silently
                log.exception("renewing the lease on %s failed", self.url)

    def release(self) -> None:
        """Write a released generation, so that the next job starts at once. A holder
        that lost or let its lease lapse writes nothing (its lease expires by itself)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            try:
                self._release()
            finally:
                for listener in self._listeners:  # nothing is written under it any more
                    listener(-math.inf, self._lost or "it gave the root back (release)")

    def _release(self) -> None:
        if self._lost is None and not self.holder.released and self._lapsed() is None:
            record = replace(self.holder, released=True, expires=self._clock())
            try:
                held, outcome = _advance(self._storage, self._generation, record)
            except (CheckpointError, OSError) as exc:
                log.warning(
                    "could not release the lease on %s (it expires by itself at %s): %s",
                    self.url,
                    _utc(self.holder.expires or 0.0),
                    exc,
                )
                return
            if held and outcome is not None:
                self._generation += 1
                self.holder = outcome


class LeaseFence:
    """The boot-clock time until which a root's holder counts on its lease, in 16 bytes of
    memory shared with the processes that write under it (the persist worker).

    Call order: the holder's `RootLock.fence` creates it and keeps it current (`publish`
    on each confirmed renewal, ``-inf`` once lost or released); `fd` goes to a worker
    process, which maps it with `attach`; whoever commits or deletes calls `check` right
    before. The boot clock counts the time a process was stopped or a host suspended, so
    a worker frozen with its trainer finds the deadline passed when it wakes. Each value
    is one aligned 8-byte word, so a reader never sees half a write.
    """

    def __init__(self, fd: int, *, keep_fd: bool) -> None:
        self._map = mmap.mmap(fd, _FENCE_BYTES)
        self._words = (ctypes.c_double * 2).from_buffer(self._map)  # deadline, wait_s
        self._fd: int | None = fd if keep_fd else None
        if not keep_fd:
            os.close(fd)
        self.reason: str | None = None  # why it was lost: known in the holder's process

    @staticmethod
    def create(wait_s: float) -> LeaseFence:
        """A fence that refuses until the first `publish`. ``wait_s``: how long `check`
        waits for a verdict on a lapsed lease."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("resumable-lease-fence")
        else:  # an unlinked temporary file
            import tempfile

            with tempfile.TemporaryFile() as f:
                fd = os.dup(f.fileno())
        os.ftruncate(fd, _FENCE_BYTES)
        fence = LeaseFence(fd, keep_fd=True)
        fence._words[0] = -math.inf
        fence._words[1] = wait_s
        return fence

    @staticmethod
    def attach(fd: int) -> LeaseFence:
        """The fence whose descriptor ``fd`` a worker process inherited (closed here)."""
        return LeaseFence(fd, keep_fd=False)

    @property
    def fd(self) -> int:
        """The descriptor to hand to a worker process (`attach`)."""
        if self._fd is None:
            raise ValueError("only the fence's creator can hand it on")
        return self._fd

    @property
    def deadline(self) -> float:
        return float(self._words[0])

    @property
    def lost(self) -> bool:
        """Whether the holder lost the root or gave it back (never to be held again)."""
        return self.deadline == -math.inf

    @property
    def lapsed(self) -> bool:
        """Whether the lease cannot be counted on now (lapsed, lost or given back)."""
        return _boot_clock() >= self.deadline

    def publish(self, deadline: float, why_lost: str | None = None) -> None:
        """Set the deadline (a `RootLock.watch` listener)."""
        if why_lost is not None:
            self.reason = why_lost
        self._words[0] = deadline

    def check(self, action: str) -> None:
        """Return if the lease runs now; else raise `RootInUseError` saying that
        ``action`` was refused. A lease that lapsed but is not lost (a freeze the holder
        and this process wake from together) gets up to ``wait_s`` for the holder's
        renewal thread to take it again (nobody took the root meanwhile: go on) or to
        lose it (refuse)."""
        deadline = self.deadline
        now = _boot_clock()
        if now < deadline:
            return
        end = now + float(self._words[1])
        while deadline != -math.inf and now < end:
            time.sleep(_FENCE_POLL_S)
            deadline, now = self.deadline, _boot_clock()
            if now < deadline:
                log.info("the lease lapsed and was taken again; %s goes ahead", action)
                return
        why = (
            "it lost its lease (another job may hold the root now) or gave the root back"
            if deadline == -math.inf
            else f"its lease lapsed {now - deadline:.0f} s ago and was not renewed"
        )
        raise RootInUseError(
            f"{action} was refused: this job no longer holds the checkpoint root ({why}), "
            "so it writes nothing more there. Nothing of it was made visible. Make sure "
            "only one job uses a root; a job that was stopped or starved for longer than "
            "the lease (ttl_s) must be started again to take the root afresh"
        )


_FENCE_BYTES = 16
_FENCE_POLL_S = 0.05


@dataclass(frozen=True)
class _Claim:
    """A generation this process created and found no newer one beside."""

    generation: int
    record: Holder
    boot: float  # `_boot_clock` just before the put


def _boot_clock() -> float:
    """Seconds since boot, counting time suspended (Linux); else a monotonic clock."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.monotonic() if boottime is None else time.clock_gettime(boottime)


def _taken(taker: Holder | None, now: float) -> str:
    return "another process took it over" + (f": {taker.describe(now)}" if taker else "")


def _advance(storage: Storage, generation: int, record: Holder) -> tuple[bool, Holder | None]:
    """Create generation ``generation + 1`` holding ``record`` and check that it is the
    newest. Returns (True, the record that stands there: ``record``, or this process's
    own from a put whose answer was lost), or (False, the holder that has the root, None
    if unreadable) where the put lost or a newer generation exists. A won put into a
    generation another holder had pruned is deleted again. Storage failures raise."""
    path = _lease_path(generation + 1)
    if not storage.put_if_absent(path, record.to_json()):
        mine = _read_generation(storage, generation + 1)
        if mine is None or mine.token != record.token:
            return False, mine
        record = mine  # a put whose answer was lost, retried, finds its own record
    later = [g for g in _generations(storage) if g > generation + 1]
    if later:  # wrote into a generation already pruned: someone is further along
        _delete_quietly(storage, path)
        return False, _read_generation(storage, later[-1])
    _prune(storage, generation + 1)
    return True, record


def _delete_quietly(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except (CheckpointError, OSError) as exc:
        log.debug("could not delete the stray lease object %s/%s: %s", storage.url, path, exc)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _lease_path(generation: int) -> str:
    return f"{LEASE_DIR}/{_LEASE_PREFIX}{generation:020d}{_LEASE_SUFFIX}"


def _generations(storage: Storage) -> list[int]:
    out = []
    for name in storage.list_dir(LEASE_DIR):
        digits = name[len(_LEASE_PREFIX) : -len(_LEASE_SUFFIX)]
        if name.startswith(_LEASE_PREFIX) and name.endswith(_LEASE_SUFFIX) and digits.isdigit():
            out.append(int(digits))
    return sorted(out)


def _read_generation(storage: Storage, generation: int) -> Holder | None:
    try:
        return Holder.from_json(bytes(storage.read(_lease_path(generation))))
    except NoCheckpointError:
        return None


def _prune(storage: Storage, current: int) -> None:
    """Delete lease objects older than the last few (best effort)."""
    try:
        for g in _generations(storage):
            if g <= current - _KEEP_GENERATIONS:
                storage.delete(_lease_path(g))
    except (CheckpointError, OSError) as exc:
        log.debug("could not prune old lease objects of %s: %s", storage.url, exc)


def _in_use(url: str, holder: Holder | None, extra: str) -> RootInUseError:
    who = holder.describe() if holder is not None else "a process that did not say who it is"
    return RootInUseError(
        f"the checkpoint root {url} is in use by another job: {who}. Two jobs writing one "
        "root would replace each other's checkpoints. Wait for that job to finish or stop "
        f"it, or give this job another directory{extra}",
        url=url,
        holder=holder,
    )


def read_holder(storage: Storage) -> Holder | None:
    """Who holds (or last held) ``storage``'s root, from what the holder wrote: for
    operators and error messages. Says nothing about whether it still holds it."""
    fd = storage.open_lock(LOCK_FILE)
    if fd is not None:
        try:
            return Holder.from_json(os.pread(fd, _MAX_RECORD, 0))
        finally:
            os.close(fd)
    gens = _generations(storage)
    return _read_generation(storage, gens[-1]) if gens else None


def acquire_root(
    storage: Storage,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    skew_s: float = DEFAULT_SKEW_S,
    clock: Callable[[], float] = time.time,
    renew: bool = True,
) -> RootLock:
    """Take ``storage``'s root for this process, or raise `RootInUseError` naming the
    holder. Never waits: a held root is an error at once.

    Called once per job, by the process that writes the root (rank 0 of a distributed
    job), before anything is written. The caller calls `RootLock.check` before each
    save and `RootLock.release` at close. ``ttl_s``, ``skew_s``, ``clock`` and ``renew``
    apply to leases only (object stores); ``renew=False`` starts no renewal thread (the
    caller then calls `LeaseLock.renew` itself). Storage failures raise `StorageError`.
    """
    token = secrets.token_hex(8)
    fd = storage.open_lock(LOCK_FILE)
    if fd is not None:
        return _take_file(storage, fd, Holder.me(token))
    return _take_lease(storage, token, ttl_s=ttl_s, skew_s=skew_s, clock=clock, renew=renew)


def _take_file(storage: Storage, fd: int, me: Holder) -> FileLock:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = Holder.from_json(os.pread(fd, _MAX_RECORD, 0))
        finally:
            os.close(fd)
        raise _in_use(
            storage.url,
            holder,
            ". The lock is released by the operating system when that process exits "
            "(it cannot be left behind by a crash)",
        ) from None
    except OSError:
        os.close(fd)
        raise
    try:
        data = me.to_json()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError as exc:  # the lock holds anyway; only the description is missing
        log.warning("could not record the holder in %s/%s: %s", storage.url, LOCK_FILE, exc)
    _forked_away.add(fd)
    return FileLock(storage, fd, me)


def _take_lease(
    storage: Storage,
    token: str,
    *,
    ttl_s: float,
    skew_s: float,
    clock: Callable[[], float],
    renew: bool,
) -> LeaseLock:
    if ttl_s <= 0 or skew_s < 0:
        raise ValueError(f"ttl_s must be > 0 and skew_s >= 0, got {ttl_s} and {skew_s}")
    claim = _claim(storage, Holder.me(token), ttl_s=ttl_s, skew_s=skew_s, clock=clock, own=False)
    return LeaseLock(storage, claim, ttl_s=ttl_s, skew_s=skew_s, clock=clock, renew=renew)


def _claim(
    storage: Storage,
    me: Holder,
    *,
    ttl_s: float,
    skew_s: float,
    clock: Callable[[], float],
    own: bool,
) -> _Claim:
    """Create the generation after the newest, holding ``me``, or raise `RootInUseError`.
    A new holder (``own=False``) takes a lease that is released, expired by more than
    ``skew_s``, or held by a dead process on this host; a holder whose lease lapsed
    (``own=True``) takes it again only while the newest generation is its own."""
    for _ in range(8):  # each retry follows a generation someone else just wrote
        gens = _generations(storage)
        newest = gens[-1] if gens else 0
        current = _read_generation(storage, newest) if gens else None
        if gens and current is None and storage.exists(_lease_path(newest)):
            current = Holder("?", 0, 0.0, expires=0.0)  # unreadable record: treat as lapsed
        now, boot = clock(), _boot_clock()
        if own and (current is None or current.token != me.token):
            raise _in_use(storage.url, current, "")
        if not own and current is not None and not current.released:
            expires = current.expires if current.expires is not None else 0.0
            if now <= expires + skew_s and not current.gone():
                raise _in_use(
                    storage.url,
                    current,
                    f". Its lease runs until {_utc(expires)} and is renewed while that job "
                    f"runs; if the job is gone, a start after {_utc(expires + skew_s)} "
                    "takes the root over",
                )
        held, outcome = _advance(storage, newest, replace(me, expires=now + ttl_s))
        if not held or outcome is None:
            continue  # another wrote this generation or a newer one: look again
        if not own and current is not None and not current.released:
            log.warning(
                "took over the checkpoint root %s from %s (%s)",
                storage.url,
                "a dead process on this host" if current.gone() else "an expired lease",
                current.describe(now),
            )
        return _Claim(newest + 1, outcome, boot)
    raise _in_use(storage.url, read_holder(storage), " (the lease changed hands repeatedly)")


__all__ = [
    "DEFAULT_SKEW_S",
    "DEFAULT_TTL_S",
    "LEASE_DIR",
    "LOCK_FILE",
    "FileLock",
    "Holder",
    "LeaseFence",
    "LeaseLock",
    "RootLock",
    "acquire_root",
    "read_holder",
]
