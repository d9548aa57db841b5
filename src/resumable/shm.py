"""Shared-memory snapshot slots: the memory tier, which survives the training process.

A slot is one file in ``/dev/shm`` (POSIX shared memory is exactly that on Linux),
mapped into the trainer and into the persist worker. It holds one complete snapshot:

    [control block, 4 KiB][metadata JSON][per-tensor checksums][tensor data, packed]

The data region has the layout of a safetensors data region (`format.plan_layout`), so
the persist worker writes it out without another copy. The metadata carries the step,
the state tree, the tensor layout and metrics: everything needed to restore without
storage.

Consistency is a sequence lock. The trainer sets the state to WRITING and bumps
``seq`` (odd) before touching a slot, copies, writes the metadata and its checksum,
then sets COMPLETE and bumps ``seq`` again (even). A reader accepts a slot only if it
is COMPLETE, ``seq`` is even and unchanged across the read, and the metadata checksum
holds, so a snapshot cut short by a kill is never used. Per-tensor checksums are
filled in later by the worker (they would double the blocking time on the training
thread) and are tagged with the ``seq`` they belong to; a restore verifies them when
present.

We map files ourselves instead of using `multiprocessing.shared_memory`: its resource
tracker unlinks a segment when the creating process dies, which is precisely the case
the memory tier exists for.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from resumable.errors import CheckpointError, StorageError
from resumable.format import TensorSlot, dtype_from_name, dtype_name

SHM_DIR = Path("/dev/shm")
PREFIX = "resumable-"
MAGIC = b"RSMBLSHM"
VERSION = 1
CONTROL = 4096
ALIGN = 4096

EMPTY, WRITING, COMPLETE = 0, 1, 2

# magic, version, state, seq, step, meta_len, meta_cap, sums_cap, data_cap, data_len,
# meta_xxh, sums_seq, owner_pid, worker_pid, created, updated
_FMT = "<8sIIQQQQQQQQQIId d"
_FMT = _FMT.replace(" ", "")
_SIZE = struct.calcsize(_FMT)


def run_key(url: str) -> str:
    """A short stable key naming a run's segments: the same checkpoint URL on the same
    host finds the same segments after a crash."""
    return xxhash.xxh3_64_hexdigest(url.encode())[:12]


def run_key_for(url: str) -> str:
    """The key of a checkpoint URL's segments on this host."""
    return run_key(f"{os.uname().nodename}:{url}")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Control:
    magic: bytes
    version: int
    state: int
    seq: int
    step: int
    meta_len: int
    meta_cap: int
    sums_cap: int
    data_cap: int
    data_len: int
    meta_xxh: int
    sums_seq: int
    owner_pid: int
    worker_pid: int
    created: float
    updated: float


@dataclass(frozen=True)
class SlotContent:
    """A consistent view of a COMPLETE slot, valid while its ``seq`` is unchanged."""

    step: int
    seq: int
    meta: dict[str, Any]
    slots: list[TensorSlot]
    checksums: list[str] | None


def shm_free_bytes(directory: Path = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class ShmSlot:
    """One mapped slot file. Created by the trainer (`create`), attached by the worker
    or by the next launch (`attach`). Not thread-safe; one writer (the trainer)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self._data: torch.Tensor | None = None

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, path: Path, *, meta_cap: int, sums_cap: int, data_cap: int) -> ShmSlot:
        """Create (or replace) a slot file sized for the given capacities; pages are
        touched now so the first snapshot does not pay the page faults."""
        meta_cap = _round_up(meta_cap, ALIGN)
        sums_cap = _round_up(sums_cap, ALIGN)
        total = CONTROL + meta_cap + sums_cap + _round_up(max(data_cap, 1), ALIGN)
        free = shm_free_bytes(path.parent)
        existing = path.stat().st_size if path.exists() else 0
        if total > free + existing:
            raise StorageError(
                errno.ENOSPC,
                f"shared memory {path.parent} has {free / 2**20:.0f} MiB free, the snapshot "
                f"arena needs {total / 2**20:.0f} MiB per slot (two slots); enlarge /dev/shm "
                "(e.g. docker --shm-size, or a tmpfs mount) or pass memory_every=None",
            )
        tmp = path.with_name(path.name + f".new{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                raise StorageError(
                    exc.errno,
                    f"cannot reserve {total / 2**20:.0f} MiB in {path.parent}: {exc.strerror}; "
                    "enlarge /dev/shm or pass memory_every=None",
                ) from exc
            mm = mmap.mmap(fd, total)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        slot = cls(path, fd, mm)
        now = time.time()
        slot._write_control(
            Control(
                MAGIC,
                VERSION,
                EMPTY,
                0,
                0,
                0,
                meta_cap,
                sums_cap,
                data_cap,
                0,
                0,
                0,
                os.getpid(),
                0,
                now,
                now,
            )
        )
        slot.data_tensor().fill_(0)
        return slot

    @classmethod
    def attach(cls, path: Path) -> ShmSlot:
        """Map an existing slot; `CheckpointError` if it is not a resumable slot."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < CONTROL:
                raise CheckpointError(f"{path} is not a resumable snapshot slot (too small)")
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        slot = cls(path, fd, mm)
        c = slot.control()
        if c.magic != MAGIC or c.version != VERSION:
            slot.close()
            raise CheckpointError(f"{path} is not a resumable snapshot slot (version {c.version})")
        if CONTROL + c.meta_cap + c.sums_cap + c.data_cap > size:
            slot.close()
            raise CheckpointError(f"{path}: slot capacities exceed the file size")
        return slot

    def close(self) -> None:
        self._data = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ---------------------------------------------------------------- control block

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise CheckpointError(f"snapshot slot {self.path} is closed")
        return self._mm

    def control(self) -> Control:
        return Control(*struct.unpack_from(_FMT, self.mm, 0))

    def _write_control(self, c: Control) -> None:
        struct.pack_into(_FMT, self.mm, 0, *c.__dict__.values())

    def _update(self, **fields: Any) -> Control:
        c = self.control()
        for k, v in fields.items():
            setattr(c, k, v)
        c.updated = time.time()
        self._write_control(c)
        return c

    def set_worker(self, pid: int) -> None:
        self._update(worker_pid=pid)

    def fits(self, meta_len: int, n_tensors: int, data_len: int) -> bool:
        c = self.control()
        return meta_len <= c.meta_cap and 16 * n_tensors <= c.sums_cap and data_len <= c.data_cap

    # ---------------------------------------------------------------- data

    def data_tensor(self) -> torch.Tensor:
        """The data region as a uint8 tensor sharing the mapping."""
        if self._data is None:
            c = self.control()
            start = CONTROL + c.meta_cap + c.sums_cap
            self._data = torch.frombuffer(
                self.mm, dtype=torch.uint8, offset=start, count=max(c.data_cap, 1)
            )
        return self._data

    def data_view(self, length: int) -> memoryview:
        c = self.control()
        start = CONTROL + c.meta_cap + c.sums_cap
        return memoryview(self.mm)[start : start + length]

    # ---------------------------------------------------------------- writer side

    def begin_write(self) -> int:
        """Mark the slot WRITING (odd seq); returns the seq the completed write will have."""
        c = self.control()
        seq = c.seq + 1 if c.seq % 2 == 0 else c.seq + 2
        self._update(state=WRITING, seq=seq)
        return seq + 1

    def finish_write(self, *, step: int, meta: dict[str, Any], data_len: int) -> int:
        """Write the metadata and publish the slot as COMPLETE; returns its seq."""
        blob = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
        c = self.control()
        if len(blob) > c.meta_cap:
            raise CheckpointError("snapshot metadata outgrew its slot; the arena is re-created")
        self.mm[CONTROL : CONTROL + len(blob)] = blob
        seq = c.seq + 1
        self._update(
            state=COMPLETE,
            seq=seq,
            step=step,
            meta_len=len(blob),
            meta_xxh=xxhash.xxh3_64_intdigest(blob),
            data_len=data_len,
            sums_seq=0,
        )
        return seq

    def write_checksums(self, seq: int, sums: list[str]) -> bool:
        """Store per-tensor checksums for snapshot ``seq``; False if the slot moved on."""
        c = self.control()
        if c.seq != seq or c.state != COMPLETE or 8 * len(sums) > c.sums_cap:
            return False
        start = CONTROL + c.meta_cap
        packed = b"".join(bytes.fromhex(s) for s in sums)
        self.mm[start : start + len(packed)] = packed
        return self._commit_sums(seq)

    def _commit_sums(self, seq: int) -> bool:
        c = self.control()
        if c.seq != seq:
            return False
        self._update(sums_seq=seq)
        return True

    # ---------------------------------------------------------------- reader side

    def read(self) -> SlotContent | None:
        """The slot's snapshot if it is COMPLETE and consistent, else None."""
        c = self.control()
        if c.state != COMPLETE or c.seq % 2 or c.meta_len > c.meta_cap:
            return None
        blob = bytes(self.mm[CONTROL : CONTROL + c.meta_len])
        if xxhash.xxh3_64_intdigest(blob) != c.meta_xxh:
            return None
        try:
            meta = json.loads(blob)
            slots = [
                TensorSlot(
                    t["name"],
                    dtype_from_name(t["dtype"]),
                    tuple(t["shape"]),
                    int(t["begin"]),
                    int(t["end"]),
                )
                for t in meta["layout"]
            ]
        except (ValueError, KeyError, TypeError, CheckpointError):
            return None
        if slots and slots[-1].end > c.data_cap:
            return None
        sums = None
        if c.sums_seq == c.seq:
            start = CONTROL + c.meta_cap
            raw = bytes(self.mm[start : start + 8 * len(slots)])
            sums = [raw[i : i + 8].hex() for i in range(0, len(raw), 8)]
        if self.control().seq != c.seq:
            return None
        return SlotContent(c.step, c.seq, meta, slots, sums)

    def still(self, seq: int) -> bool:
        """True while the slot still holds snapshot ``seq``."""
        c = self.control()
        return c.seq == seq and c.state == COMPLETE


def layout_meta(slots: list[TensorSlot]) -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "dtype": dtype_name(s.dtype),
            "shape": list(s.shape),
            "begin": s.begin,
            "end": s.end,
        }
        for s in slots
    ]


def slot_paths(key: str, rank: int, directory: Path = SHM_DIR) -> list[Path]:
    return [directory / f"{PREFIX}{key}-r{rank}-s{i}" for i in range(2)]


@dataclass(frozen=True)
class SegmentInfo:
    path: Path
    size: int
    owner_pid: int
    owner_alive: bool
    step: int | None
    updated: float


def list_segments(directory: Path = SHM_DIR) -> Iterator[SegmentInfo]:
    """Every resumable slot file in ``directory``, with its owner and step."""
    if not directory.is_dir():
        return
    for p in sorted(directory.glob(f"{PREFIX}*")):
        try:
            slot = ShmSlot.attach(p)
        except (OSError, CheckpointError, ValueError):
            continue
        try:
            c = slot.control()
            content = slot.read()
            yield SegmentInfo(
                p,
                p.stat().st_size,
                c.owner_pid,
                _pid_alive(c.owner_pid),
                content.step if content else None,
                c.updated,
            )
        finally:
            slot.close()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def remove_dead_segments(directory: Path = SHM_DIR, *, older_than_s: float = 0.0) -> list[Path]:
    """Unlink slot files whose owner process is gone and that were last written more
    than ``older_than_s`` ago. A run's own segments are adopted by its next launch, so
    the default age used at start-up is long (a day); ``resumable shm --clean`` uses 0."""
    removed = []
    now = time.time()
    for seg in list_segments(directory):
        if not seg.owner_alive and now - seg.updated >= older_than_s:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)
            removed.append(seg.path)
    return removed
