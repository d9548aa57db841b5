"""The audit log: one JSON line per save start, commit, skip, failure, delete, restore
and cleanup, at the checkpoint root.

Contract: a failure to write the log is logged and never fails training. The log
describes the checkpoints; it is not one of them. No writer loses or overwrites another
writer's line, and an event costs a bounded write, however long the log.

Where it lives depends on `Storage.supports_append`. A store that appends atomically
(local filesystem, memory) gets ``audit.jsonl``, one ``O_APPEND`` write per line. An
object store gets ``audit/``: each `AuditLog` writes segment objects of its own, rolled
over at `SEGMENT_BYTES`. The trade-off: many small objects, against one shared object
that would cost the whole log per event and lose a racing writer's lines. `read_audit`
reads both layouts and merges the writers' lines by time, each writer's kept in order.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from resumable.storage.base import Storage

AUDIT_LOG = "audit.jsonl"
AUDIT_DIR = "audit"
SEGMENT_BYTES = 64 * 1024  # a segment rolls over once it holds this much
MAX_UNSENT_BYTES = 1 << 20  # lines kept for a retry while the store refuses writes
READ_CONCURRENCY = 16
PROGRESS_EVERY_S = 5.0  # at most one ``progress`` entry per this many seconds

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"^([0-9]{13})-(.+)-([0-9]{6,})\.jsonl\Z")
_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class _Sink(Protocol):
    def write(self, line: bytes) -> None:
        """Store ``line`` (one JSON line with its newline) or raise."""


class _AppendedFile:
    """``audit.jsonl``, one atomic append per line."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._checked_tail = False

    def write(self, line: bytes) -> None:
        if not self._checked_tail:
            line = self._repair_prefix() + line
        self.storage.append(AUDIT_LOG, line)

    def _repair_prefix(self) -> bytes:
        """A newline if a crash left the log's last line torn, so the next entry is not
        glued to it (checked once per writer)."""
        self._checked_tail = True
        try:
            size = self.storage.size(AUDIT_LOG)
            if size and self.storage.read_range(AUDIT_LOG, size - 1, 1) != b"\n":
                return b"\n"
        except (OSError, ValueError):
            pass
        return b""


class _Segments:
    """This writer's segments under ``audit/``: the current one is kept in memory and
    put whole at each line (never read back); past ``cap`` bytes the next line starts a
    new object. A line whose put failed stays in memory and goes out with the next one
    (up to `MAX_UNSENT_BYTES`, then the unsent lines are given up)."""

    def __init__(self, storage: Storage, cap: int = SEGMENT_BYTES) -> None:
        self.storage = storage
        self.cap = cap
        host = _HOST_UNSAFE.sub("_", socket.gethostname())[:64] or "host"
        self.writer = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = -1
        self._name: str | None = None
        self._buf = bytearray()
        self._sent = 0  # bytes of _buf known to be stored
        self._lock = threading.Lock()  # one instance may serve several threads

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._name is None:
                self._seq += 1
                ms = int(time.time() * 1000)
                self._name = f"{AUDIT_DIR}/{ms:013d}-{self.writer}-{self._seq:06d}.jsonl"
                self._buf.clear()
                self._sent = 0
            self._buf += line
            try:
                self.storage.write(self._name, [self._buf])
            except BaseException:
                if len(self._buf) - self._sent > MAX_UNSENT_BYTES:
                    del self._buf[self._sent :]
                raise
            self._sent = len(self._buf)
            if self._sent >= self.cap:
                self._name = None


class AuditLog:
    """Records events at a checkpoint root (see the module doc for where). With several
    ranks only rank 0 writes (``enabled``): it records the job's commits; other ranks'
    failures reach it as reports. `record` may be called from several threads."""

    def __init__(self, storage: Storage, *, rank: int = 0, enabled: bool = True) -> None:
        self.storage = storage
        self.rank = rank
        self.enabled = enabled
        self._sink: _Sink = (
            _AppendedFile(storage) if storage.supports_append else _Segments(storage)
        )
        self._warned = False

    def record(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        entry = {
            "time": round(time.time(), 6),
            "event": event,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "rank": self.rank,
            **fields,
        }
        line = json.dumps(entry, default=str, allow_nan=False) + "\n"
        try:
            self._sink.write(line.encode())
        except Exception as exc:  # the log must never break training
            if not self._warned:
                log.warning("could not write to the audit log of %s: %s", self.storage.url, exc)
                self._warned = True


class ProgressNotes:
    """Rate-limited ``progress`` entries: how far training got and what its memory
    snapshots cost, so that a report can tell how many steps a killed launch lost and
    what checkpointing stalled (a memory snapshot per step is too frequent for one
    entry each).

    Called on the training thread only: `saw` at every step the loop reports (one clock
    read; an entry at the first call and then at most every ``every_s`` seconds),
    `snapshot` after each memory snapshot, `flush` at close. An entry says ``step``
    (the newest step seen), ``snapshots`` and ``snapshot_s`` (count and summed blocking
    seconds of the memory snapshots since the previous entry)."""

    def __init__(self, audit: AuditLog, every_s: float = PROGRESS_EVERY_S) -> None:
        self.audit = audit
        self.every_s = every_s
        self.step: int | None = None
        self._recorded: int | None = None
        self._last: float | None = None
        self._snapshots = 0
        self._snapshot_s = 0.0
        # On object storage an entry is a PUT (retried when the store is slow or failing):
        # it goes out on a thread of its own, one at a time, never on the training thread.
        self._pool: ThreadPoolExecutor | None = None
        if audit.enabled and not audit.storage.supports_append:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="resumable-audit")
        self._pending: Future[None] | None = None

    def saw(self, step: int) -> None:
        self.step = step
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            self.flush()

    def snapshot(self, seconds: float) -> None:
        self._snapshots += 1
        self._snapshot_s += seconds

    def flush(self, *, final: bool = False) -> None:
        """Record an entry if anything happened since the last one. In the background
        (object storage) an entry still in flight makes this one wait for the next call,
        its counts kept; ``final`` (at close) waits for both and ends the thread."""
        pending = self._pending
        if pending is not None and not pending.done() and not final:
            return
        if self.step is not None and (self.step != self._recorded or self._snapshots):
            fields = {
                "step": self.step,
                "snapshots": self._snapshots,
                "snapshot_s": round(self._snapshot_s, 6),
            }
            self._recorded = self.step
            self._snapshots = 0
            self._snapshot_s = 0.0
            if self._pool is None:
                self.audit.record("progress", **fields)
            else:
                if pending is not None:
                    pending.result()  # in order (AuditLog.record never raises)
                self._pending = self._pool.submit(self.audit.record, "progress", **fields)
        if final and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def read_audit(storage: Storage, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every audit entry of ``storage``: ``audit.jsonl`` and the segments under
    ``audit/``, merged by ``time``; each writer's entries keep the order it wrote them.
    Unparseable lines (a torn last line after a crash, a foreign file) are skipped; with
    ``skipped`` given, each is described there (file, line number, start of the line)."""
    streams: list[list[dict[str, Any]]] = [
        _entries(_read_or_empty(storage, AUDIT_LOG), AUDIT_LOG, skipped)
    ]
    by_writer: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in storage.list_dir(AUDIT_DIR):
        m = _SEGMENT.match(name)
        if m:
            by_writer[m.group(2)].append((int(m.group(3)), f"{AUDIT_DIR}/{name}"))
    paths = [[p for _, p in sorted(segs)] for segs in by_writer.values()]
    flat = [p for ps in paths for p in ps]
    if len(flat) > 1:
        with ThreadPoolExecutor(min(READ_CONCURRENCY, len(flat))) as pool:
            data = dict(zip(flat, pool.map(lambda p: _read_or_empty(storage, p), flat)))
    else:
        data = {p: _read_or_empty(storage, p) for p in flat}
    streams += [[e for p in ps for e in _entries(data[p], p, skipped)] for ps in paths]
    return list(heapq.merge(*streams, key=_time))


def _read_or_empty(storage: Storage, path: str) -> bytes:
    try:
        return bytes(storage.read(path))
    except FileNotFoundError:  # not there (or gone since the listing)
        return b""


def _entries(
    data: bytes, source: str = "", skipped: list[str] | None = None
) -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            entry = None
        if isinstance(entry, dict):
            out.append(entry)
        elif skipped is not None and line.strip():
            shown = line if len(line) <= 80 else line[:80] + "..."
            skipped.append(f"{source} line {number}: not a JSON object: {shown!r}")
    return out


def _time(entry: dict[str, Any]) -> float:
    """The merge key: the entry's ``time``, or 0 (then it keeps its writer's order)."""
    t = entry.get("time")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        try:
            return float(t) if math.isfinite(t) else 0.0
        except OverflowError:  # an integer beyond the range of floats
            return 0.0
    return 0.0
