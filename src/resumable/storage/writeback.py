"""Writing a file with the disk already at work: the kernel's writeback started piece by
piece (Linux), so that the ``fsync`` at the end waits for little.

A data file written in one go, then ``fsync``-ed, sits as dirty page cache until the
``fsync``: the disk idles while the bytes are copied into the cache, then the copy
waits for the disk, and the two take their sum. `write_all` writes in pieces of
`PIECE_BYTES` and, after each, asks the kernel to start writing that piece to the disk
(``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``, which starts the I/O and
returns). The disk then writes one piece while the next is copied into the cache, and
the ``fsync`` waits only for the tail (measured in ``docs/decisions.md``, "Persists at
the disk's speed").

Durability is not changed by it: ``fsync`` is still what makes a file durable, and
callers still call it. The request is a hint. Where it is not there (not Linux, a libc
without it) or refused (a file system or file it does not apply to: ``EINVAL``,
``ESPIPE``, ``ENOSYS``, ...), writing goes on without it, and errors of the writeback
itself surface where they always did, at the ``fsync``.

Python's `os` has no ``sync_file_range``; it is called through `ctypes` (which releases
the GIL for the call, as `os.write` does).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterable

from resumable.storage.base import Buffer

PIECE_BYTES = 32 << 20
"""Bytes written between two writeback requests: large enough that the requests cost
nothing beside the copy (a system call per 32 MiB), small enough that the tail left to
the final ``fsync`` is short."""

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range


def _find_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()


def available() -> bool:
    """Whether this platform lets writes start their writeback early."""
    return _sync_file_range is not None


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to the disk,
    without waiting; whether it took the request (False: go on without)."""
    if _sync_file_range is None or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def write_all(fd: int, chunks: Iterable[Buffer], *, piece_bytes: int | None = None) -> int:
    """Write every byte of ``chunks`` to ``fd`` (from its current offset, assumed 0: a
    file just opened for writing), in writes of at most ``piece_bytes`` (`PIECE_BYTES`),
    starting the writeback of each ``piece_bytes`` of the file once they are written;
    the bytes written. Buffers smaller than a thirty-second of a piece are gathered
    into one write (an incremental checkpoint hands over one buffer per run of changed
    chunks: thousands of 4 KiB ones at the smallest chunk size). `OSError` from a
    write propagates; the caller fsyncs. A refused writeback request is not asked
    again."""
    out = _Writer(fd, piece_bytes or PIECE_BYTES)
    for chunk in chunks:
        out.add(memoryview(chunk).cast("B"))
    return out.close()


class _Writer:
    def __init__(self, fd: int, piece: int) -> None:
        self.fd, self.piece = fd, piece
        self.gathered = bytearray()
        self.written = 0  # bytes written
        self.requested = 0  # bytes whose writeback was asked for
        self.behind = available()

    def add(self, view: memoryview) -> None:
        if len(view) < self.piece // 32:
            self.gathered += view
            if len(self.gathered) >= self.piece:
                self._flush()
            return
        self._flush()
        self._write(view)

    def close(self) -> int:
        self._flush()
        if self.behind and self.written > self.requested:
            start_writeback(self.fd, self.requested, self.written - self.requested)
        return self.written

    def _flush(self) -> None:
        if self.gathered:
            gathered, self.gathered = self.gathered, bytearray()
            self._write(memoryview(gathered))

    def _write(self, view: memoryview) -> None:
        while view:
            n = os.write(self.fd, view[: self.piece])
            view = view[n:]
            self.written += n
            while self.behind and self.written - self.requested >= self.piece:
                self.behind = start_writeback(self.fd, self.requested, self.piece)
                self.requested += self.piece
