"""The replicas a rank holds for its peers: one file per replica in a memory directory.

A replica is a copy of one rank's memory snapshot as its shared-memory slot holds it
(`resumable._shm`): the slot's metadata JSON, then its tensor data region. It travels and
rests as *pieces*, byte ranges each with its XXH3-64 digest. A file is
``<dir>/r<source rank>-s<step>.replica``, with a trailer naming the run, source rank,
step, lengths and every piece's digest.

Contract: a half-received replica is never listed, and a damaged one is never returned.
A replica is written as ``.partial-*``, each piece checked as it arrives, the trailer
last, and only then renamed. A newer replica of a source rank replaces the older only
once complete. A reader checks every digest again (`read`). The trade-off: no fsync (the
directory is memory), so a replica lasts only as long as the node does.
One process owns a store directory (`ReplicaStore`, ``owner=False`` only reads).

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from resumable.errors import ReplicaError

log = logging.getLogger(__name__)

MAGIC = b"RSMBLREP"
VERSION = 1
SUFFIX = ".replica"
PARTIAL = ".partial-"
LOCK = ".lock"
CHUNK = 4 << 20  # default piece size
_TAIL = struct.Struct("<QI8s")  # trailer xxh3, trailer length, magic
_MAX_TRAILER = 64 << 20
_NAME = re.compile(r"^r(\d+)-s(\d+)\.replica\Z")


def replica_memory(snapshot_bytes: int, replicas: int) -> int:
    """The memory a node gives to its peers' replicas, in steady state: ``replicas - 1``
    copies of a snapshot of ``snapshot_bytes`` (each node holds as many other nodes'
    snapshots as it sends out). While a newer replica is received the older one is
    kept, so the peak is up to twice that."""
    return max(0, replicas - 1) * snapshot_bytes


def check_room(directory: Path, needed: int) -> None:
    """Refuse, with what to do, when ``directory``'s filesystem has less than
    ``needed`` bytes free (`ReplicaError`, reason ``space``)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise ReplicaError(
            f"replicas need {needed} bytes in {directory}, {free} are free; enlarge the "
            "memory directory (docker --shm-size, a larger tmpfs) or lower replicas",
            reason="space",
        )


def digest(data: Any) -> str:
    """XXH3-64 of a buffer as 16 hex digits (the project's checksum, `format.checksum`)."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of a replica's ``meta || data``."""

    offset: int
    length: int
    digest: str


def plan_pieces(
    meta: Any, data: Any, *, chunk: int = CHUNK, ranges: Sequence[tuple[int, int]] | None = None
) -> list[Piece]:
    """Pieces covering ``meta || data`` with their digests: the metadata as one piece,
    then the data in ``chunk``-sized pieces, or in the given ``ranges`` (offset, length
    into ``data``; they must tile it in order)."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, found {chunk}")
    m, d = memoryview(meta).cast("B"), memoryview(data).cast("B")
    pieces = [Piece(0, len(m), digest(m))]
    if ranges is None:
        ranges = [(o, min(chunk, len(d) - o)) for o in range(0, len(d), chunk)]
    at = 0
    for offset, length in ranges:
        if offset != at or length < 0:
            raise ValueError(f"piece ranges must tile the data in order; at {at}, found {offset}")
        pieces.append(Piece(len(m) + offset, length, digest(d[offset : offset + length])))
        at = offset + length
    if at != len(d):
        raise ValueError(f"piece ranges cover {at} of {len(d)} data bytes")
    return pieces


def check_pieces(pieces: Sequence[Piece], total: int) -> None:
    """Refuse pieces that do not tile ``[0, total)`` in order (a hostile or broken header)."""
    at = 0
    for p in pieces:
        if p.offset != at or p.length < 0 or not re.fullmatch(r"[0-9a-f]{16}", p.digest):
            raise ReplicaError(
                f"replica pieces must tile its bytes in order with 16-hex-digit digests; "
                f"at byte {at} found {p}",
                reason="corrupt",
            )
        at += p.length
    if at != total:
        raise ReplicaError(f"replica pieces cover {at} of {total} bytes", reason="corrupt")


def pieces_digest(pieces: Sequence[Piece]) -> str:
    """The replica's digest: XXH3-64 over its pieces' digests in order."""
    return digest("".join(p.digest for p in pieces).encode())


@dataclass(frozen=True)
class ReplicaInfo:
    """A complete replica a store holds."""

    run_id: str
    source_rank: int
    step: int
    meta_len: int
    data_len: int
    pieces: tuple[Piece, ...]
    path: Path

    @property
    def nbytes(self) -> int:
        return self.meta_len + self.data_len

    @property
    def digest(self) -> str:
        return pieces_digest(self.pieces)

    def header(self) -> dict[str, Any]:
        """The JSON form the trailer and the transport carry."""
        return {
            "version": VERSION,
            "run_id": self.run_id,
            "source_rank": self.source_rank,
            "step": self.step,
            "meta_len": self.meta_len,
            "data_len": self.data_len,
            "pieces": [[p.offset, p.length, p.digest] for p in self.pieces],
        }


def info_from_header(raw: Any, path: Path) -> ReplicaInfo:
    """A `ReplicaInfo` from its JSON form; `ReplicaError` (corrupt) if it is not one."""
    try:
        if not isinstance(raw, dict) or raw.get("version") != VERSION:
            raise ValueError(f"expected version {VERSION}")
        pieces = tuple(Piece(int(o), int(n), str(h)) for o, n, h in raw["pieces"])
        info = ReplicaInfo(
            run_id=str(raw["run_id"]),
            source_rank=int(raw["source_rank"]),
            step=int(raw["step"]),
            meta_len=int(raw["meta_len"]),
            data_len=int(raw["data_len"]),
            pieces=pieces,
            path=path,
        )
        if min(info.source_rank, info.step, info.meta_len, info.data_len) < 0:
            raise ValueError("negative field")
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplicaError(
            f"replica header of {path} is malformed ({exc}); the replica is not used",
            reason="corrupt",
        ) from None
    check_pieces(info.pieces, info.nbytes)
    return info


@dataclass(frozen=True)
class Replica:
    """A replica's bytes, ``meta || data`` in one buffer: the source rank's snapshot
    metadata JSON and its data region (a view, not a copy)."""

    info: ReplicaInfo
    buffer: bytearray

    @property
    def meta(self) -> bytes:
        return bytes(self.buffer[: self.info.meta_len])

    @property
    def data(self) -> memoryview:
        return memoryview(self.buffer)[self.info.meta_len :]


class PartialReplica:
    """A replica being received: pieces are checked and written at their offsets; it
    becomes visible only through `commit`. One thread uses it. `abort` (or a failed
    `commit`) removes its file; a kill leaves a ``.partial-*`` the next owner removes."""

    def __init__(self, store: ReplicaStore, info: ReplicaInfo) -> None:
        self._store = store
        self.info = info
        name = f"{PARTIAL}r{info.source_rank}-s{info.step}-{secrets.token_hex(4)}"
        self.path = store.directory / name
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._done = [False] * len(info.pieces)
        self._closed = False
        try:
            os.ftruncate(self._fd, info.nbytes)
        except OSError:
            self.abort()
            raise

    def write_piece(self, index: int, payload: Any) -> None:
        """Check piece ``index``'s bytes against its digest, then write them; a mismatch
        raises `ReplicaError` (corrupt) and the replica can never be committed."""
        writer = self.piece_writer(index)
        writer.write(payload)
        writer.finish()

    def piece_writer(self, index: int) -> PieceWriter:
        """A writer taking piece ``index``'s bytes in order, in any number of chunks."""
        if not 0 <= index < len(self.info.pieces):
            raise ReplicaError(f"no piece {index} in this replica", reason="corrupt")
        self._done[index] = False
        return PieceWriter(self, index)

    def _mark(self, index: int) -> None:
        self._done[index] = True

    def commit(self) -> ReplicaInfo:
        """Write the trailer and publish the replica under its complete name, then drop
        the source rank's older replicas. Raises `ReplicaError` if a piece is missing or
        a newer replica of the source rank is already complete (nothing is published)."""
        try:
            missing = [i for i, done in enumerate(self._done) if not done]
            if missing:
                raise ReplicaError(
                    f"rank {self.info.source_rank}'s replica at step {self.info.step} lacks "
                    f"{len(missing)} of {len(self._done)} pieces; it is not published",
                    reason="truncated",
                )
            trailer = json.dumps(self.info.header(), separators=(",", ":")).encode()
            tail = _TAIL.pack(xxhash.xxh3_64_intdigest(trailer), len(trailer), MAGIC)
            os.pwrite(self._fd, trailer + tail, self.info.nbytes)
            os.close(self._fd)
            self._closed = True
            return self._store._publish(self)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class PieceWriter:
    """Receives one piece's bytes in order: each chunk is hashed and written at its
    place; `finish` compares the digest and marks the piece received."""

    def __init__(self, partial: PartialReplica, index: int) -> None:
        self._partial = partial
        self._index = index
        self._piece = partial.info.pieces[index]
        self._hash = xxhash.xxh3_64()
        self._at = 0

    def write(self, chunk: Any) -> None:
        view = memoryview(chunk).cast("B")
        if self._at + len(view) > self._piece.length:
            raise ReplicaError(
                f"piece {self._index} is {self._piece.length} bytes; more arrived",
                reason="corrupt",
            )
        self._hash.update(view)
        fd, offset = self._partial._fd, self._piece.offset + self._at
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
        self._at += len(view)

    def finish(self) -> None:
        info = self._partial.info
        if self._at != self._piece.length:
            raise ReplicaError(
                f"piece {self._index} of rank {info.source_rank}'s replica at step "
                f"{info.step}: expected {self._piece.length} bytes, received {self._at}",
                reason="truncated",
            )
        found = self._hash.hexdigest()
        if found != self._piece.digest:
            raise ReplicaError(
                f"piece {self._index} of rank {info.source_rank}'s replica at step "
                f"{info.step} has digest {found}, expected {self._piece.digest}: its bytes "
                "changed after they were digested or in transit; the replica is discarded",
                reason="corrupt",
            )
        self._partial._mark(self._index)


def remove_dead_stores(parent: Path, prefix: str, older_than_s: float) -> list[Path]:
    """Remove the store directories named ``prefix*`` in ``parent`` that no process
    holds (their ``.lock`` is free) and that nothing changed for ``older_than_s``
    seconds: those of runs that ended without closing (a crash no relaunch followed).
    Directories of other users, and anything not a directory, are left alone."""
    removed: list[Path] = []
    cutoff = time.time() - older_than_s
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return removed
    for path in entries:
        if not path.name.startswith(prefix):
            continue
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            newest = max([st.st_mtime] + [e.lstat().st_mtime for e in path.iterdir()])
            if newest > cutoff:
                continue
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            for entry in path.iterdir():
                with contextlib.suppress(OSError):
                    entry.unlink()
            with contextlib.suppress(OSError):
                path.rmdir()
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class ReplicaStore:
    """The complete replicas in ``directory`` that belong to run ``run_id``.

    The owner (one process: the rank's replica server) creates the directory (mode
    0700), holds its lock, removes partial files left by a killed owner, and receives
    (`begin`). Anyone may list and read. Methods are thread-safe."""

    def __init__(self, directory: Path | str, run_id: str, *, owner: bool = True) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
        if owner:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.directory.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ReplicaError(
                f"replica directory {self.directory} must be a directory of this user "
                "that nobody else may write to; remove it or choose another",
                reason="io",
            )
        if owner:
            fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ReplicaError(
                    f"another process holds replica directory {self.directory}; each rank's "
                    "replica server needs its own directory",
                    reason="io",
                ) from None
            self._lock_fd = fd
            self._remove_partials()

    def close(self, *, remove: bool = False) -> None:
        """Release the directory; with ``remove`` (the owner, at the end of a run that
        finished cleanly) delete its replicas and the directory first."""
        if remove and self._lock_fd is not None:
            for entry in self.directory.iterdir():
                if entry.name == LOCK:
                    continue
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    entry.unlink()
            with contextlib.suppress(FileNotFoundError):
                (self.directory / LOCK).unlink()
            with contextlib.suppress(OSError):
                self.directory.rmdir()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> ReplicaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _remove_partials(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(PARTIAL):
                log.info("removing the partial replica %s a killed receiver left", entry)
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    # ------------------------------------------------------------------ reading

    def _trailer(self, path: Path) -> ReplicaInfo:
        """The trailer of a complete replica file; `ReplicaError` (corrupt) if damaged."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _TAIL.size:
                raise ReplicaError(f"replica {path} is truncated", reason="corrupt")
            f.seek(size - _TAIL.size)
            h, n, magic = _TAIL.unpack(f.read(_TAIL.size))
            if magic != MAGIC or n > min(_MAX_TRAILER, size - _TAIL.size):
                raise ReplicaError(f"replica {path} has no valid trailer", reason="corrupt")
            f.seek(size - _TAIL.size - n)
            trailer = f.read(n)
        if xxhash.xxh3_64_intdigest(trailer) != h:
            raise ReplicaError(f"replica {path}'s trailer fails its digest", reason="corrupt")
        try:
            raw = json.loads(trailer)
        except (ValueError, RecursionError):
            raise ReplicaError(f"replica {path}'s trailer is not JSON", reason="corrupt") from None
        info = info_from_header(raw, path)
        if info.nbytes + n + _TAIL.size != size:
            raise ReplicaError(f"replica {path} is truncated or padded", reason="corrupt")
        return info

    def held(self) -> list[ReplicaInfo]:
        """This run's complete replicas, by source rank then step. A file whose trailer
        is damaged is skipped with a warning (`read` of it raises)."""
        found = []
        for entry in sorted(self.directory.iterdir()):
            if not _NAME.match(entry.name):
                continue
            try:
                info = self._trailer(entry)
            except FileNotFoundError:
                continue  # replaced meanwhile
            except ReplicaError as exc:
                log.warning("ignoring replica %s: %s", entry, exc)
                continue
            if info.run_id == self.run_id:
                found.append(info)
        found.sort(key=lambda i: (i.source_rank, i.step))
        return found

    def drop_other_runs(self) -> list[Path]:
        """Delete the complete replicas of other runs (an earlier run of the same
        directory) and those whose trailer is damaged (owner only); returns them."""
        dropped = []
        for entry in sorted(self.directory.iterdir()):
            if not _NAME.match(entry.name):
                continue
            try:
                keep = self._trailer(entry).run_id == self.run_id
            except FileNotFoundError:
                continue
            except ReplicaError:
                keep = False
            if not keep:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                dropped.append(entry)
        return dropped

    def newest(self, source_rank: int) -> ReplicaInfo | None:
        held = [i for i in self.held() if i.source_rank == source_rank]
        return held[-1] if held else None

    def find(self, source_rank: int, step: int | None = None) -> ReplicaInfo:
        """The complete replica of ``source_rank`` at ``step`` (its newest if None)."""
        if step is None:
            info = self.newest(source_rank)
        else:
            info = next(
                (i for i in self.held() if i.source_rank == source_rank and i.step == step), None
            )
        if info is None:
            at = "" if step is None else f" at step {step}"
            raise ReplicaError(
                f"no complete replica of rank {source_rank}{at} in {self.directory} for run "
                f"{self.run_id}",
                reason="absent",
            )
        return info

    def read(self, source_rank: int, step: int | None = None) -> Replica:
        """The bytes of a complete replica, every piece checked against its digest; a
        replica damaged at rest raises `ReplicaError` (corrupt)."""
        info = self.find(source_rank, step)
        with open(info.path, "rb") as f:
            buf = bytearray(info.nbytes)
            view = memoryview(buf)
            got = f.readinto(view)
        if got != info.nbytes:
            raise ReplicaError(f"replica {info.path} is truncated", reason="corrupt")
        for index, p in enumerate(info.pieces):
            found = digest(view[p.offset : p.offset + p.length])
            if found != p.digest:
                raise ReplicaError(
                    f"replica {info.path}: piece {index} has digest {found}, expected "
                    f"{p.digest}; the replica was damaged at rest and is not used",
                    reason="corrupt",
                )
        return Replica(info, buf)

    @contextlib.contextmanager
    def mapped(
        self, source_rank: int, step: int | None = None
    ) -> Iterator[tuple[ReplicaInfo, memoryview]]:
        """A complete replica's ``meta || data`` mapped read-only, unchecked (the caller
        checks each piece's digest as it uses it); still valid if a newer replica
        replaces the file meanwhile."""
        info = self.find(source_rank, step)
        with open(info.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < info.nbytes:
                raise ReplicaError(f"replica {info.path} is truncated", reason="corrupt")
            if info.nbytes == 0:
                yield info, memoryview(b"")
                return
            mm = mmap.mmap(f.fileno(), info.nbytes, prot=mmap.PROT_READ)
        view = memoryview(mm)
        try:
            yield info, view
        finally:
            with contextlib.suppress(BufferError):  # a slice still held: closed when freed
                view.release()
                mm.close()

    # ------------------------------------------------------------------ writing

    def begin(
        self, source_rank: int, step: int, meta_len: int, data_len: int, pieces: Sequence[Piece]
    ) -> PartialReplica:
        """Start receiving a replica (owner only). Refused if a newer replica of the
        source rank is complete, or if the directory lacks the room."""
        if self._lock_fd is None:
            raise ReplicaError("only the store's owner receives replicas", reason="io")
        info = ReplicaInfo(
            self.run_id, source_rank, step, meta_len, data_len, tuple(pieces), self.directory
        )
        check_pieces(info.pieces, info.nbytes)
        held = self.newest(source_rank)
        if held is not None and held.step > step:
            raise ReplicaError(
                f"rank {source_rank}'s replica at step {held.step} is already held; step "
                f"{step} is older and is not stored",
                reason="stale",
            )
        check_room(self.directory, info.nbytes)
        return PartialReplica(self, info)

    def _publish(self, partial: PartialReplica) -> ReplicaInfo:
        info = partial.info
        final = self.directory / f"r{info.source_rank}-s{info.step}{SUFFIX}"
        with self._lock:
            held = self.newest(info.source_rank)
            if held is not None and held.step > info.step:
                raise ReplicaError(
                    f"rank {info.source_rank}'s replica at step {held.step} completed first; "
                    f"step {info.step} is discarded",
                    reason="stale",
                )
            os.replace(partial.path, final)
            self.drop_older(info.source_rank, keep_step=info.step)
        return dataclasses.replace(info, path=final)

    def drop_older(self, source_rank: int, *, keep_step: int | None = None) -> list[int]:
        """Delete ``source_rank``'s complete replicas older than ``keep_step`` (its
        newest if None); returns the steps deleted."""
        held = [i for i in self.held() if i.source_rank == source_rank]
        if not held:
            return []
        keep = held[-1].step if keep_step is None else keep_step
        dropped = []
        for info in held:
            if info.step < keep:
                with contextlib.suppress(FileNotFoundError):
                    info.path.unlink()
                dropped.append(info.step)
        return dropped
