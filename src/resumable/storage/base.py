"""The storage protocol: a few byte-level verbs plus the primitives commits build on.

Every backend (local filesystem, memory, object storage) implements `Storage`, and the
shared test suite in ``tests/storage/`` runs against each of them. Paths are relative,
``/``-separated and validated by `check_relpath` before any backend sees them, so no
name found in a checkpoint can reach outside the root.

Contract for every backend:
- `write` returns only once the bytes are durable (fsync on a filesystem, a completed
  PUT on object storage); a failed write raises `StorageError` and leaves no object or
  a partial one that no manifest references.
- `read_range` never returns fewer bytes than asked: a short object is a
  `CorruptCheckpointError` (the checkpoint is damaged, not the storage).
- Missing paths: `read*`/`size` raise `FileNotFoundError`-derived `NoCheckpointError`;
  `list_dir` returns ``[]``, `list_files` ``{}``; `delete` is a no-op.
- `list_files` gives every file under a directory with its size in one listing (paged
  on object stores: 1,000 names a request on S3), each name checked by `check_relpath`
  like any other: retention checks a checkpoint's files from it, one request per
  thousand files instead of one or more per file.
- `append` is offered only where it is atomic (``supports_append``): each call adds its
  bytes whole, and concurrent appenders never lose or interleave each other's data.
  Object stores cannot grow an object, so they do not offer it (the audit log writes
  per-writer segments there instead; see `resumable.audit`).
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from resumable.errors import CorruptCheckpointError
from resumable.format import check_relpath

Buffer = Any  # bytes, bytearray, memoryview, or anything exporting the buffer protocol


class Storage(ABC):
    """A checkpoint root. Methods may be called from the training thread or a persist
    worker, but a given path is only ever written by one caller at a time."""

    url: str
    supports_rename: bool = False
    supports_append: bool = False

    @property
    def location(self) -> str:
        """What tells this root apart from every other on this host: its ``url``, plus
        anything else that decides where the bytes go (an object store's endpoint).
        Names the root's shared-memory snapshots."""
        return self.url

    @abstractmethod
    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write ``chunks`` in order to ``path`` (replacing it), durably; return bytes written."""

    @abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``path`` starting at ``offset``."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path``."""

    @abstractmethod
    def list_dir(self, path: str = "") -> list[str]:
        """Names (not paths) directly under ``path``, sorted; ``[]`` if it does not exist."""

    @abstractmethod
    def list_files(self, path: str = "") -> dict[str, int]:
        """Every file under directory ``path``, at any depth: its path relative to
        ``path`` and its size in bytes; ``{}`` if ``path`` is no directory. Names are
        checked by `check_relpath` (one that fails raises `CorruptCheckpointError`: no
        backend of this library writes it). A filesystem lists regular files only and
        never follows a link: a link, FIFO or device under ``path`` raises
        `CorruptCheckpointError`, as reading it would."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file or a whole directory tree; no error if missing."""

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data``, durably and all at once, unless it already
        exists; return whether this call created it. Two concurrent callers never both
        get ``True``: the commit marker of object stores is built on this."""

    def conditional_put_enforced(self) -> bool:
        """Whether `put_if_absent` really is exclusive (filesystems and memory: by
        construction; object stores probe their server and raise if not)."""
        return True

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``path``. Backends
        that can read straight into memory override it; this fallback reads a copy."""
        data = self.read_range(path, offset, len(out))
        if len(data) != len(out):
            raise CorruptCheckpointError(
                f"{self.join(self.url, path)} is truncated: wanted {len(out)} bytes at "
                f"{offset}, found {len(data)}"
            )
        (out.cast("B") if out.format != "B" else out)[:] = data

    def map_file(
        self, path: str, span: tuple[int, int] | list[tuple[int, int]] | None = None
    ) -> mmap.mmap | None:
        """The whole file mapped copy-on-write, or None where the backend cannot map
        (the default; readers then use `read_into`). ``span``: the bytes ``[begin,
        end)`` the caller will read, or a list of such ranges (all of them if None),
        which a backend may read ahead."""
        return None

    def read(self, path: str) -> bytes:
        return self.read_range(path, 0, self.size(path))

    def append(self, path: str, data: bytes) -> None:
        """Append ``data`` to ``path`` (creating it) in one atomic step; only where
        ``supports_append`` (the audit log's ``audit.jsonl``)."""
        raise NotImplementedError(f"{type(self).__name__} has no atomic append")

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically make directory ``src`` visible as ``dst`` (which must not exist)."""
        raise NotImplementedError(f"{type(self).__name__} has no atomic rename")

    def sync_dir(self, path: str = "") -> None:
        """Make prior renames/creations inside ``path`` durable (no-op where meaningless)."""

    def check_root(self) -> None:
        """Fail now, with `StorageError` saying what is wrong and what to do, if this
        root cannot hold checkpoints; the `Checkpointer` calls it at construction, so a
        bad root is not found at the first persist, maybe hours later. This default
        (object stores, memory) lists the root (the bucket exists, the credentials may
        read) and probes the create-only put commits need (they may write, and the server
        honours it). A filesystem checks much more (`LocalStorage.check_root`)."""
        self.list_dir("")
        self.conditional_put_enforced()

    def open_lock(self, path: str) -> int | None:
        """A file descriptor of ``path`` (created if missing), opened read-write and
        close-on-exec, that the caller may ``flock`` and must close; or None where the
        backend has no operating-system locks (object stores, memory: `resumable.lock`
        then uses a lease object). Only a filesystem backend returns a descriptor."""
        return None

    def close(self) -> None:
        """Release connections or handles."""

    @staticmethod
    def join(*parts: str) -> str:
        path = "/".join(p for p in parts if p)
        return check_relpath(path) if path else path


class ForwardingStorage(Storage):
    """A storage that forwards every call to ``inner``: the base for wrappers that add
    behaviour to some verbs only (fault injection in tests, accounting, caching)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_rename = inner.supports_rename
        self.supports_append = inner.supports_append

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        return self.inner.write(path, chunks)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        return self.inner.read_range(path, offset, length)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(path)

    def list_files(self, path: str = "") -> dict[str, int]:
        return self.inner.list_files(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def append(self, path: str, data: bytes) -> None:
        self.inner.append(path, data)

    # Optional capabilities are forwarded too: a wrapper never loses them.
    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)

    def map_file(
        self, path: str, span: tuple[int, int] | list[tuple[int, int]] | None = None
    ) -> mmap.mmap | None:
        return self.inner.map_file(path, span)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        return self.inner.put_if_absent(path, data)

    @property
    def location(self) -> str:
        return self.inner.location

    def conditional_put_enforced(self) -> bool:
        return self.inner.conditional_put_enforced()

    def rename_dir(self, src: str, dst: str) -> None:
        self.inner.rename_dir(src, dst)

    def sync_dir(self, path: str = "") -> None:
        self.inner.sync_dir(path)

    def check_root(self) -> None:
        self.inner.check_root()

    def open_lock(self, path: str) -> int | None:
        return self.inner.open_lock(path)

    def close(self) -> None:
        self.inner.close()
