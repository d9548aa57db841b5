"""Physical floors, measured in the same run as everything they are compared with.

- copy: ``dst.copy_(src)`` of every state tensor into preallocated, already touched
  tensors — the least a consistent in-memory snapshot can block.
- write: sequential write of the same number of bytes into the bench directory, then
  ``fsync`` — from Python with random bytes (so no layer can compress it), through the
  page cache and around it (``O_DIRECT``, as resumable writes large files), and with
  ``dd if=/dev/zero ... conv=fsync`` as PEERS.md prescribes.
- read: read those bytes back sequentially into one preallocated buffer; "cold" after
  dropping the page cache when this process may (root on Linux), "warm" otherwise.

A "cold" read on these machines is not cold below the guest: the virtual disk has a
cache of its own, which a page-cache drop does not reach. A timing script (interleaved
restores of the 1 GiB state, the page cache dropped before each) found a restore right
after another of the same files at 0.70 s, and right after a restore of other files, a
read of other files or 2 s of sleep at 1.3 to 1.9 s, for resumable and `dcp.load`
alike; so a method's "cold" time depended on which method ran before it. `cold_start`
gives every timed cold read the same past: a read of an unrelated file as large as the
state, then the drop (the same script: each restore 0.80 to 0.89 s, both methods).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import state as state_mod
import torch

CHUNK = 16 * 2**20


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def copy_floor(tree: Any, reps: int) -> list[float]:
    src = list(state_mod.iter_tensors(tree))
    dst = [torch.empty_like(t).fill_(0) for _, t in src]
    samples = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for d, (_, s) in zip(dst, src):
                d.copy_(s)
            samples.append(time.perf_counter() - t0)
    return samples[1:]  # the first pass also faults in the destination pages' TLB entries


def _random_block(nbytes: int) -> bytes:
    return os.urandom(nbytes)


def write_file_fsync(path: Path, nbytes: int, block: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n] if n < len(block) else block)
            left -= n
        os.fsync(f.fileno())


def write_floor_python(directory: Path, nbytes: int, reps: int) -> list[float]:
    """Sequential 16 MiB writes of random bytes, then fsync, into a fresh file."""
    block = _random_block(CHUNK)
    samples = []
    for i in range(reps):
        path = directory / f"write-floor-{i}.bin"
        os.sync()
        samples.append(timed(lambda p=path: write_file_fsync(p, nbytes, block)))
        if i < reps - 1:
            path.unlink()
    return samples


def write_file_direct(path: Path, nbytes: int, block: mmap.mmap) -> None:
    """``nbytes`` written with ``O_DIRECT`` from the page-aligned ``block`` (whole blocks
    of it, then the tail through the page cache, as `resumable.storage.direct` does),
    then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        view, at = memoryview(block), 0
        whole = nbytes - nbytes % 4096
        while at < whole:
            at += os.pwrite(fd, view[: min(len(view), whole - at)], at)
        if at < nbytes:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            os.pwrite(fd, view[: nbytes - at], at)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_floor_direct(directory: Path, nbytes: int, reps: int) -> list[float]:
    """Sequential 16 MiB writes of random bytes with ``O_DIRECT`` (around the page
    cache), then fsync, into a fresh file: the floor of a file written as resumable's
    local storage writes large ones. Empty where the platform has no ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        return []
    block = mmap.mmap(-1, CHUNK)
    block[:] = _random_block(CHUNK)
    samples = []
    for i in range(reps):
        path = directory / f"write-direct-{i}.bin"
        os.sync()
        samples.append(timed(lambda p=path: write_file_direct(p, nbytes, block)))
        path.unlink()
    return samples


def write_floor_dd(directory: Path, nbytes: int, reps: int) -> dict[str, Any]:
    """``dd if=/dev/zero of=DIR/x bs=16M count=N conv=fsync``, timed from outside."""
    dd = shutil.which("dd")
    if dd is None:
        return {"error": "dd not found"}
    count = max(1, round(nbytes / CHUNK))
    samples, reported = [], []
    for i in range(reps):
        path = directory / f"dd-{i}.bin"
        os.sync()
        t0 = time.perf_counter()
        proc = subprocess.run(
            [dd, "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"],
            capture_output=True,
            text=True,
            check=False,
        )
        samples.append(time.perf_counter() - t0)
        path.unlink(missing_ok=True)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip()[-300:]}
        m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
        if m:
            reported.append(float(m.group(1)))
    return {
        "bytes": count * CHUNK,
        "samples": samples,
        "dd_reported_s": reported,
        "command": f"dd if=/dev/zero of=DIR/x bs=16M count={count} conv=fsync",
    }


def read_file_into(path: Path, buf: bytearray) -> int:
    view = memoryview(buf)
    got = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view[got : got + CHUNK])
            if not n:
                break
            got += n
    return got


def make_flush_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` random bytes (written once) for `cold_start` to read."""
    if not path.exists() or path.stat().st_size != nbytes:
        write_file_fsync(path, nbytes, _random_block(CHUNK))
    return path


def cold_start(flush: Path | None) -> bool:
    """Read ``flush`` (an unrelated file) through, untimed, then drop the page cache:
    the same past for every timed cold read (see the module's docstring); False if the
    cache may not be dropped."""
    if flush is not None:
        with open(flush, "rb", buffering=0) as f:
            buf = bytearray(CHUNK)
            while f.readinto(buf):
                pass
    return drop_page_cache()


def read_floor(path: Path, reps: int, *, cold: bool, flush: Path | None = None) -> dict[str, Any]:
    """Read ``path`` back ``reps`` times; ``cold`` drops the page cache before each read
    (after reading ``flush`` through, where given: `cold_start`)."""
    size = path.stat().st_size
    buf = bytearray(size)
    samples = []
    cache = "warm"
    if not cold:
        read_file_into(path, buf)  # make sure it is cached
    for _ in range(reps):
        if cold:
            cache = "cold" if cold_start(flush) else "warm (drop_caches not permitted)"
        samples.append(timed(lambda: read_file_into(path, buf)))
    return {"bytes": size, "samples": samples, "page_cache": cache}
