"""One shared-memory slot: its control block, its sequence lock and its metadata.

A slot file holds one complete snapshot::

    [control block, 4 KiB][metadata JSON][per-tensor checksums][tensor data, packed]

The writer bumps ``seq`` to odd (WRITING), copies, then to even (COMPLETE). A reader
accepts a slot only if it is COMPLETE, ``seq`` is even and unchanged across the read,
and the metadata checksum holds, so a snapshot cut short by a kill is never used.
Per-tensor checksums are filled in later by the persist worker, tagged with their seq.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import xxhash

from resumable._lazy import torch_module
from resumable._shm_meta import SlotMeta, decode_meta
from resumable._shm_places import (
    TMP_MARK,
    map_file,
    open_private,
    own_fd,
    release_fd,
    replaced_size,
    same_file,
    shm_free_bytes,
)
from resumable.errors import CheckpointError, CorruptCheckpointError, StorageError
from resumable.format import TensorSlot

if TYPE_CHECKING:
    import torch
else:
    torch = torch_module()

log = logging.getLogger(__name__)

MAGIC = b"RSMBLSHM"
VERSION = 1
CONTROL = 4096
ALIGN = 4096

EMPTY, WRITING, COMPLETE = 0, 1, 2
# What to do when shared memory cannot hold the snapshots (also in
# `pipeline.memory.MemoryTier.preflight`'s message: one remedy wherever it is said).
SHM_REMEDY = (
    "enlarge /dev/shm (docker run --shm-size, or a larger tmpfs mount) or checkpoint "
    "without shared memory: persist='sync' with memory_every=None"
)

# magic, version, state, seq, step, meta_len, meta_cap, sums_cap, data_cap, data_len,
# meta_xxh, sums_seq, owner_pid, worker_pid, created, updated
_FMT = "<8sIIQQQQQQQQQIId d"
_FMT = _FMT.replace(" ", "")
_SIZE = struct.calcsize(_FMT)
# The fields a snapshot's write changes, written in place (`ShmSlot.begin_write`,
# `finish_write`): each one's offset in `_FMT`, and the run of fields from there.
_STATE_AT, _STEP_AT = struct.calcsize("<8sI"), struct.calcsize("<8sIIQ")
_DATA_LEN_AT, _UPDATED_AT = struct.calcsize("<8sIIQQQQQQ"), struct.calcsize("<8sIIQQQQQQQQQIId")
_STATE_SEQ, _STEP_LEN = struct.Struct("<IQ"), struct.Struct("<QQ")
_DATA_XXH_SUMS, _UPDATED = struct.Struct("<QQQ"), struct.Struct("<d")
_CAPS_AT, _CAPS = struct.calcsize("<8sIIQQQ"), struct.Struct("<QQQ")  # meta, sums, data


def unusable(path: Path, exc: Exception) -> str:
    """``path`` and why it is no slot, from the error `ShmSlot.attach` raised."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, OSError):
        return str(exc)  # names the path
    return f"{path} cannot be opened: {exc.strerror}"


def attach_unlocked(path: Path) -> ShmSlot | None:
    """``path``'s slot, attached without taking its lock, or None with a WARNING saying
    why it is no usable slot: a file in the way costs its slot, never the caller."""
    try:
        return ShmSlot.attach(path, lock=False)
    except (OSError, CheckpointError) as exc:
        log.warning("ignoring a shared-memory snapshot file: %s", unusable(path, exc))
        return None


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

    SIZE: ClassVar[int] = _SIZE

    @classmethod
    def unpack(cls, buf: Any) -> Control:
        """The control block at the start of ``buf`` (at least `SIZE` bytes)."""
        return cls(*struct.unpack_from(_FMT, buf, 0))

    def pack(self) -> bytes:
        return struct.pack(_FMT, *self.__dict__.values())


@dataclass(frozen=True)
class SlotContent:
    """A consistent view of a COMPLETE slot, valid while its ``seq`` is unchanged."""

    step: int
    seq: int
    meta: SlotMeta
    slots: list[TensorSlot]
    checksums: list[str] | None


class ShmSlot:
    """One mapped slot file. Created by the trainer (`create`), attached by the worker
    or by the next launch (`attach`). Not thread-safe; one writer (the trainer).

    A slot created, or attached with ``lock=True``, holds a shared lock on its file
    until `close`: that is what tells other processes it is in use."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self._fd = own_fd(fd)
        self._mm: mmap.mmap | None = mm
        self._data: torch.Tensor | None = None
        self._caps: tuple[int, int, int] | None = None  # see `capacities`
        # The metadata head this object last wrote (see `finish_write`), and its hash state.
        self._head: bytes | None = None
        self._head_hash: Any = None
        # What `read` last parsed: the metadata bytes, the data capacity, their parse.
        self._parsed: tuple[bytes, int, SlotMeta, list[TensorSlot]] | None = None

    # ---------------------------------------------------------------- lifecycle

    @staticmethod
    def check_room(path: Path, *, meta_cap: int, sums_cap: int, data_cap: int) -> int:
        """The bytes of a slot file at ``path`` with these capacities, once shared memory
        is found to have room for it (a file it replaces counted as free). Raises
        `StorageError` if it has not, `CheckpointError` if ``path``'s directory cannot be
        looked at: as `create` does, before it makes anything."""
        total = (
            CONTROL
            + _round_up(meta_cap, ALIGN)
            + _round_up(sums_cap, ALIGN)
            + _round_up(max(data_cap, 1), ALIGN)
        )
        try:
            free = shm_free_bytes(path.parent)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create a snapshot slot in {path.parent}: {exc.strerror}"
            ) from exc
        if total > free + replaced_size(path):
            raise StorageError(
                errno.ENOSPC,
                f"shared memory {path.parent} has {free / 2**20:.0f} MiB free, the snapshot "
                f"arena needs {total / 2**20:.0f} MiB per slot (two slots); {SHM_REMEDY}",
            )
        return total

    @classmethod
    def create(cls, path: Path, *, meta_cap: int, sums_cap: int, data_cap: int) -> ShmSlot:
        """Create (or replace) a slot file sized for the given capacities; pages are
        touched now so the first snapshot does not pay the page faults. The new file
        is private (mode 0600) and locked before it appears under ``path``.

        Raises `StorageError` if shared memory is too small, and `CheckpointError` if
        no file can be made at ``path`` (its directory is gone, or a directory sits at
        the name): the caller may try another directory."""
        meta_cap = _round_up(meta_cap, ALIGN)
        sums_cap = _round_up(sums_cap, ALIGN)
        total = cls.check_room(path, meta_cap=meta_cap, sums_cap=sums_cap, data_cap=data_cap)
        tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create a snapshot slot in {path.parent}: {exc.strerror}"
            ) from exc
        mm: mmap.mmap | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                raise StorageError(
                    exc.errno,
                    f"cannot reserve {total / 2**20:.0f} MiB in {path.parent}: {exc.strerror}; "
                    + SHM_REMEDY,
                ) from exc
            mm = map_file(fd, total, tmp)
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot put a snapshot slot at {path}: {exc.strerror}"
                ) from exc
        except BaseException:
            if mm is not None:
                mm.close()
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
    def attach(cls, path: Path, *, lock: bool = True) -> ShmSlot:
        """Map an existing slot of this user.

        With ``lock`` (a persist worker) a shared lock is taken, waiting while a cleaner
        holds the exclusive one; without it the caller only reads the slot, or locks it
        itself (`lock_exclusive`). Raises `CheckpointError` if ``path`` is not a private
        file of this user or not a resumable slot, `OSError` if it cannot be opened."""
        fd = open_private(path, os.O_RDWR)
        try:
            if lock:
                fcntl.flock(fd, fcntl.LOCK_SH)
            size = os.fstat(fd).st_size
            if size < CONTROL:
                raise CheckpointError(f"{path} is not a resumable snapshot slot (too small)")
            mm = map_file(fd, size, path)
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

    def lock_exclusive(self) -> bool:
        """Take the exclusive lock unless another process (or another `attach` in this
        one) holds a lock on the file; returns at once."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def lock_shared(self) -> None:
        """Hold a shared lock (turning an exclusive one into it) until `close`."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def in_use(self) -> bool:
        """Whether some process holds a lock on the file: it maps the slot. Only for a
        slot attached with ``lock=False`` (this one's own lock would be dropped)."""
        if not self.lock_exclusive():
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def linked(self) -> bool:
        """Whether ``path`` still names this file (not removed or replaced since)."""
        return same_file(self.path, self._fd)

    @property
    def size(self) -> int:
        return len(self.mm)

    def close(self) -> None:
        self._data = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            release_fd(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Close, and remove the file if ``path`` still names it."""
        ours = self._fd >= 0 and self.linked()
        self.close()
        if ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # ---------------------------------------------------------------- control block

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise CheckpointError(f"snapshot slot {self.path} is closed")
        return self._mm

    def control(self) -> Control:
        return Control.unpack(self.mm)

    def _write_control(self, c: Control) -> None:
        self.mm[: Control.SIZE] = c.pack()

    def _update(self, **fields: Any) -> Control:
        c = self.control()
        for k, v in fields.items():
            setattr(c, k, v)
        c.updated = time.time()
        self._write_control(c)
        return c

    def set_worker(self, pid: int) -> None:
        self._update(worker_pid=pid)

    def claim(self) -> None:
        """Record this process as the owner, with no worker (when a launch adopts it)."""
        self._update(owner_pid=os.getpid(), worker_pid=0)

    def capacities(self) -> tuple[int, int, int]:
        """The metadata, checksum and data capacities: set when the slot is created
        (`attach` checks them against the file's size) and never changed, so read once."""
        caps = self._caps
        if caps is None:
            caps = self._caps = _CAPS.unpack_from(self.mm, _CAPS_AT)
        return caps

    def fits(self, meta_len: int, n_tensors: int, data_len: int) -> bool:
        meta_cap, sums_cap, data_cap = self.capacities()
        return meta_len <= meta_cap and 16 * n_tensors <= sums_cap and data_len <= data_cap

    # ---------------------------------------------------------------- data

    def data_tensor(self) -> torch.Tensor:
        """The data region as a uint8 tensor sharing the mapping."""
        if self._data is None:
            meta_cap, sums_cap, data_cap = self.capacities()
            self._data = torch.frombuffer(
                self.mm,
                dtype=torch.uint8,
                offset=CONTROL + meta_cap + sums_cap,
                count=max(data_cap, 1),
            )
        return self._data

    def data_view(self, length: int) -> memoryview:
        c = self.control()
        start = CONTROL + c.meta_cap + c.sums_cap
        return memoryview(self.mm)[start : start + length]

    # ---------------------------------------------------------------- writer side

    def begin_write(self) -> int:
        """Mark the slot WRITING (odd seq); returns the seq the completed write will have."""
        mm = self.mm
        seq = _STATE_SEQ.unpack_from(mm, _STATE_AT)[1]
        seq = seq + 1 if seq % 2 == 0 else seq + 2
        _STATE_SEQ.pack_into(mm, _STATE_AT, WRITING, seq)
        _UPDATED.pack_into(mm, _UPDATED_AT, time.time())
        return seq + 1

    def finish_write(self, *, step: int, blob: bytes, data_len: int, head: bytes = b"") -> int:
        """Write the metadata (``head`` then ``blob``: its JSON, from `SlotMeta.encode`) and
        publish the slot as COMPLETE; returns its seq.

        ``head``, the same bytes object at every snapshot of one layout (its JSON), is
        written and hashed only when this slot does not already hold it from its last
        write: a snapshot of 10,000 tensors rewrites a few hundred bytes of metadata,
        not the 700 KB of its layout."""
        total = len(head) + len(blob)
        if total > self.capacities()[0]:
            raise CheckpointError("snapshot metadata outgrew its slot; the arena is re-created")
        mm = self.mm
        if head is not self._head:
            self._head = None
            mm[CONTROL : CONTROL + len(head)] = head
            self._head, self._head_hash = head, xxhash.xxh3_64(head)
        mm[CONTROL + len(head) : CONTROL + total] = blob
        digest = self._head_hash.copy()
        digest.update(blob)
        seq = _STATE_SEQ.unpack_from(mm, _STATE_AT)[1] + 1  # odd: `begin_write` marked it
        # The fields it changes, in place, state and seq last: a reader that finds the
        # slot COMPLETE at ``seq`` finds the rest written (it checks seq again after).
        _STEP_LEN.pack_into(mm, _STEP_AT, step, total)
        _DATA_XXH_SUMS.pack_into(mm, _DATA_LEN_AT, data_len, digest.intdigest(), 0)
        _STATE_SEQ.pack_into(mm, _STATE_AT, COMPLETE, seq)
        _UPDATED.pack_into(mm, _UPDATED_AT, time.time())
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
        parsed = self._parsed
        if parsed is not None and parsed[0] == blob and parsed[1] == c.data_cap:
            meta, slots = parsed[2], parsed[3]  # the same bytes as at the last read
        else:
            try:
                meta, slots = decode_meta(blob, c.data_cap)
            except CorruptCheckpointError:  # not written by this library: as if cut short
                return None
            self._parsed = (blob, c.data_cap, meta, slots)
        sums = None
        if c.sums_seq == c.seq:
            start = CONTROL + c.meta_cap
            raw = bytes(self.mm[start : start + 8 * len(slots)])
            sums = [raw[i : i + 8].hex() for i in range(0, len(raw), 8)]
        if self.control().seq != c.seq:
            return None
        return SlotContent(c.step, c.seq, meta, slots, sums)

    def replica_bytes(self, seq: int) -> tuple[bytes, memoryview] | None:
        """Snapshot ``seq``'s metadata JSON (checked against its recorded hash) and a
        view of its data region, as a replica carries them (`resumable.replicas`); None
        if the slot no longer holds that snapshot complete. The view is valid until the
        slot is rewritten: the caller checks `still` after using it."""
        c = self.control()
        if c.seq != seq or c.state != COMPLETE or c.meta_len > c.meta_cap:
            return None
        meta = bytes(self.mm[CONTROL : CONTROL + c.meta_len])
        if xxhash.xxh3_64_intdigest(meta) != c.meta_xxh:
            return None
        return meta, self.data_view(c.data_len)

    def still(self, seq: int) -> bool:
        """True while the slot still holds snapshot ``seq``."""
        c = self.control()
        return c.seq == seq and c.state == COMPLETE


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
