"""Reading a mapped file ahead of its reader, on a thread (Linux).

A restore maps each data file and reads it through the mapping: checksums, then copies.
Left to its page faults, the kernel reads such a file in the faulting thread's time,
and on the machines these checkpoints are measured on, pages that faults brought into
the page cache stay slow to map: a file read so once took ten times as long to map again
(0.035 to 0.040 s per GiB) as one brought in by a read (0.0035 s per GiB). A restore of
an incremental checkpoint, reading several files, paid that the most.

So a mapped file is read ahead of its reader on a thread of its own, in pieces of
`PIECE_BYTES`, in file order, with ``MADV_POPULATE_READ`` (Linux 5.14): each piece is
read into the page cache and mapped into the reader's address space in one call, while
the reader works on the pieces before it; its own touches then find the pages mapped.
The call is made through ``ctypes``, which lets go of the GIL for it (``mmap.madvise``
does not). At most `THREADS` files are read ahead at once.

Timing scripts (`docs/decisions.md`, "Mapped files read ahead on a thread"): the
fine-tuning shape of `benchmarks/incr_bench.py`, restores of the incremental checkpoint
from files not in the page cache 0.25 to 0.28 s before, 0.18 to 0.20 s now, and from
the cache those filled 0.068 to 0.080 s before, 0.063 to 0.065 s now (the whole
checkpoint 0.059 to 0.062 s either way); the 1 GiB state of `make bench`, cold, 0.682 s
before and 0.649 s now (its cold read floor 0.601 s).

Where the advice is unknown (an older kernel, another system) the first call fails and
the reader's faults read the file as before. A mapping closed while its turn comes is
skipped: the thread holds the mapping object, and a failed call ends that file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Any

from resumable.storage import direct

log = logging.getLogger(__name__)

MADV_POPULATE_READ = 22
"""The advice's number on Linux (``mmap`` in Python 3.11 does not name it)."""

PIECE_BYTES = 16 << 20
"""Bytes read and mapped per call: large enough for the disk, small enough that the
reader, following, rarely waits for a piece it needs."""

BLOCK_BYTES = 2 << 20
"""A span is read ahead from the start of the 2 MiB block it starts in, and in pieces
that end at multiples of `PIECE_BYTES` in the file. Timing script: started at a span's
first page instead (a data region starts 4 or 16 KiB into its file), restores were
about as slow as with faults (the fine-tuning shape's incremental restore from a cold
cache 0.25 to 0.26 s, against 0.18 to 0.19 s aligned): the kernel seems to cache a
file in large pieces only where the reads are aligned to them."""

THREADS = 2
"""Files read ahead at once, each on a thread of its own (started for it, so that it
runs before the reader goes on); more wait their turn."""

_state: dict[str, Any] = {"refused": False, "turns": threading.BoundedSemaphore(THREADS)}


def _fresh_turns() -> None:  # a forked child: the parent's threads are not here
    _state["turns"] = threading.BoundedSemaphore(THREADS)


os.register_at_fork(after_in_child=_fresh_turns)


def _madvise() -> Any:
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    # The C library this process has loaded already (``dlopen(NULL)``): looking it up
    # by name (``ctypes.util.find_library``) ran ``ldconfig -p`` in a subprocess at
    # every import, a persist worker's start included.
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


Span = tuple[int, int]


def read_ahead(mm: mmap.mmap, span: Span | list[Span] | None = None) -> bool:
    """Read ``span`` (``[begin, end)``, or a list of such ranges, read in file order;
    all of ``mm`` if None) of ``mm``, a read mapping of a file, into the page cache and
    map it, piece by piece in file order, on a thread; returns once that thread runs,
    False where nothing will be read ahead (no such advice here, or nothing to read)."""
    ranges = [(0, len(mm))] if span is None else [span] if isinstance(span, tuple) else span
    todo: list[Span] = []
    for b, e in sorted(ranges):
        begin, end = max(0, b - b % BLOCK_BYTES), min(e, len(mm))
        if end <= begin:
            continue
        if todo and begin <= todo[-1][1]:  # overlapping once aligned: one range
            todo[-1] = (todo[-1][0], max(end, todo[-1][1]))
        else:
            todo.append((begin, end))
    if _MADVISE is None or _state["refused"] or not todo:
        return False
    address = direct.address(memoryview(mm))
    threading.Thread(
        target=_run,
        args=(mm, address, todo, _state["turns"]),
        name="resumable-read-ahead",
        daemon=True,
    ).start()
    return True


def _run(mm: mmap.mmap, address: int, spans: list[Span], turns: threading.BoundedSemaphore) -> None:
    with turns:
        try:
            for begin, end in spans:
                if not _populate(mm, address, begin, end):
                    return
        except Exception as exc:
            log.debug("read-ahead of a mapped file stopped: %r", exc)


def _populate(mm: mmap.mmap, address: int, begin: int, end: int) -> bool:
    """Read ``[begin, end)`` ahead; False where reading ahead stopped (the mapping
    closed, or the advice failed)."""
    offset = begin
    while offset < end:
        if mm.closed:  # its reader is done; the address may now be another mapping's
            return False
        stop = min(end, offset - offset % PIECE_BYTES + PIECE_BYTES)
        if _MADVISE(address + offset, stop - offset, MADV_POPULATE_READ):
            if ctypes.get_errno() == errno.EINVAL and offset == begin and _advice_unknown():
                _state["refused"] = True
                log.debug("MADV_POPULATE_READ refused: mapped files are read by faults")
            return False
        offset = stop
    return True


def _advice_unknown() -> bool:
    """Whether the kernel refuses the advice itself, asked on a page of our own. It also
    refuses it (EINVAL) for a range of some mappings: one a closed reader's address now
    holds, say. Only the first means no file is ever to be read ahead."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    view = memoryview(probe)
    try:
        failed = _MADVISE(direct.address(view), len(probe), MADV_POPULATE_READ) != 0
        return failed and ctypes.get_errno() == errno.EINVAL
    finally:
        view.release()
        probe.close()
