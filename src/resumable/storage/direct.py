"""Writing a large file around the page cache (``O_DIRECT``, Linux): the disk reads the
bytes straight from the caller's memory, which for a persist is the page-aligned
snapshot arena.

Why: a buffered write first copies every byte into page cache pages the kernel must
find and fault in. On the virtual machines these checkpoints are measured on, freshly
allocated pages are slow (the guest's freed pages go back to the host and fault in
again), and so is the writeback of a large dirty range: 256 MiB written and fsynced took
0.21 to 1.03 s buffered and 0.13 to 0.15 s with ``O_DIRECT`` (median 0.59 s against
0.14 s; `docs/decisions.md`, "Data files written with O_DIRECT"). The cost: what is
written is not left in the page cache, so a restore in the same boot reads it from the
disk (the shared-memory tier serves those restores).

How (`write_direct`): ``O_DIRECT`` wants the memory address, the file offset and the
length of each write aligned to the device's logical block. `ALIGN` (4 KiB, a page)
covers every common device. A buffer that starts on a page where the file is at a page
goes to the disk as it is, in writes of `PIECE_BYTES`; anything else (the header, the
runs of an incremental file, the tail) is copied into a reused page-aligned bounce
buffer, written from there once full. The last partial block is written through the
page cache (``O_DIRECT`` cleared on the descriptor). Where the flag is refused (by
``fcntl``, or ``EINVAL`` from a write: a file system without it, or a device with a
larger block), the rest of the file is written buffered, from where the direct writes
stopped. Durability is unchanged: the caller still ``fsync``-s (the device's cache and
the file's size and blocks are only durable then).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Iterable

from resumable.storage.base import Buffer

ALIGN = 4096
"""Alignment of addresses, offsets and lengths of direct writes: a page, a multiple of
every common device's logical block (512 B or 4 KiB)."""

DIRECT_MIN_BYTES = 8 << 20
"""Files from this size up are written with ``O_DIRECT``; smaller ones buffered (a
manifest, a small model's file: the page cache costs them little, and a restore soon
after finds them there)."""

PIECE_BYTES = 32 << 20
"""Bytes per direct write: the kernel splits each into many device requests at once."""

BOUNCE_BYTES = 8 << 20
"""The page-aligned buffer unaligned bytes are gathered in (one per writing thread)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_local = threading.local()


def available() -> bool:
    """Whether this platform has ``O_DIRECT`` at all."""
    return _O_DIRECT != 0


def address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte (read-only buffers too)."""
    import numpy as np  # loaded at the first use, not by every importer (a persist worker)

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _bounce() -> mmap.mmap:
    buf: mmap.mmap | None = getattr(_local, "bounce", None)
    if buf is None or len(buf) != BOUNCE_BYTES:
        buf = _local.bounce = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous: page-aligned
    return buf


def _set_direct(fd: int, on: bool) -> bool:
    """Set or clear ``O_DIRECT`` on ``fd``; whether it took."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError:
        return False
    return True


def write_direct(fd: int, chunks: Iterable[Buffer]) -> int:
    """Write every byte of ``chunks`` to ``fd`` (a regular file just opened for writing,
    empty) from offset 0 with ``O_DIRECT`` where it takes, buffered where not; the bytes
    written, the descriptor's offset left after them. `OSError` other than a refusal of
    the flag propagates; the caller fsyncs."""
    out = _DirectWriter(fd, available() and _set_direct(fd, True))
    try:
        for chunk in chunks:
            out.add(memoryview(chunk).cast("B"))
        out.close()
    finally:
        if out.direct:
            _set_direct(fd, False)
    os.lseek(fd, out.at, os.SEEK_SET)  # where sequential writes would have left it
    return out.at


class _DirectWriter:
    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct
        self.bounce = memoryview(_bounce()) if direct else None
        self.at = 0  # file offset of the bounce buffer's first byte (all before: written)
        self.fill = 0  # bytes in the bounce buffer

    def add(self, view: memoryview) -> None:
        while view:
            if not self.direct or self.bounce is None:
                self._flush(final=True)
                self._pwrite(view)
                return
            if self.fill == 0 and len(view) >= ALIGN and address(view) % ALIGN == 0:
                n = len(view) - len(view) % ALIGN  # self.at is aligned: nothing pending
                self._pwrite(view[:n])
                view = view[n:]
                continue
            if self.fill and len(view) >= ALIGN + (-self.fill % ALIGN):
                # A few bytes complete the bounce buffer's last block; if the rest of the
                # view then starts on a page, it goes to the disk from where it lies.
                k = -self.fill % ALIGN
                if (address(view) + k) % ALIGN == 0 and self.fill + k <= BOUNCE_BYTES:
                    self._take(view[:k])
                    self._flush(final=False)
                    view = view[k:]
                    continue
            view = view[self._take(view) :]
            if self.fill == BOUNCE_BYTES:
                self._flush(final=False)

    def _take(self, view: memoryview) -> int:
        assert self.bounce is not None
        n = min(len(view), BOUNCE_BYTES - self.fill)
        self.bounce[self.fill : self.fill + n] = view[:n]
        self.fill += n
        return n

    def close(self) -> None:
        self._flush(final=True)

    def _flush(self, *, final: bool) -> None:
        """Write the bounce buffer's whole blocks; with ``final``, its tail too (through
        the page cache: a direct write's length must be a whole block)."""
        if not self.fill:
            return
        assert self.bounce is not None
        whole = self.fill - self.fill % ALIGN
        if whole:
            self._pwrite(self.bounce[:whole])
        tail = self.fill - whole
        if tail:
            assert final, "only the last flush leaves a partial block"
            if self.direct:
                self.direct = not _set_direct(self.fd, False)
            self._pwrite(self.bounce[whole : self.fill])
        self.fill = 0

    def _pwrite(self, view: memoryview) -> None:
        """Write ``view`` at ``self.at``, advancing it; direct writes refused fall back
        to buffered ones for the rest of the file."""
        while view:
            try:
                n = os.pwrite(self.fd, view[:PIECE_BYTES] if self.direct else view, self.at)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                _set_direct(self.fd, False)
                self.direct = False
                continue
            if n == 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            view = view[n:]
            self.at += n
