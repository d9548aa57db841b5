"""In-process memory backend, for tests and for measuring everything but the disk."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable

from resumable.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from resumable.format import check_relpath
from resumable.storage.base import Buffer, Storage


class MemoryStorage(Storage):
    """A dict of path -> bytes; directories are implied by path prefixes."""

    supports_rename = True
    supports_append = True

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self.files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _get(self, path: str) -> bytes:
        check_relpath(path)
        try:
            return self.files[path]
        except KeyError:
            raise NoCheckpointError(errno.ENOENT, f"no such object: {self.url}{path}") from None

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        with self._lock:
            self.files[check_relpath(path)] = data
        return len(data)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        data = self._get(path)
        if offset + length > len(data):
            raise CorruptCheckpointError(
                f"{path} is truncated: wanted bytes [{offset}, {offset + length}), "
                f"object has {len(data)}"
            )
        return data[offset : offset + length]

    def size(self, path: str) -> int:
        return len(self._get(path))

    def _prefix(self, path: str) -> str:
        return check_relpath(path) + "/" if path else ""

    def list_dir(self, path: str = "") -> list[str]:
        prefix = self._prefix(path)
        with self._lock:
            names = {p[len(prefix) :].split("/", 1)[0] for p in self.files if p.startswith(prefix)}
        return sorted(names)

    def list_files(self, path: str = "") -> dict[str, int]:
        prefix = self._prefix(path)
        with self._lock:
            files = list(self.files.items())
        found = sorted((p[len(prefix) :], len(d)) for p, d in files if p.startswith(prefix))
        return {check_relpath(name): size for name, size in found}

    def exists(self, path: str) -> bool:
        prefix = self._prefix(path)
        with self._lock:
            return path in self.files or any(p.startswith(prefix) for p in self.files)

    def delete(self, path: str) -> None:
        prefix = self._prefix(path)
        with self._lock:
            for p in [p for p in self.files if p == path or p.startswith(prefix)]:
                del self.files[p]

    def append(self, path: str, data: bytes) -> None:
        with self._lock:
            self.files[check_relpath(path)] = self.files.get(path, b"") + data

    def put_if_absent(self, path: str, data: bytes) -> bool:
        with self._lock:
            if check_relpath(path) in self.files:
                return False
            self.files[path] = bytes(data)
            return True

    def rename_dir(self, src: str, dst: str) -> None:
        sp, dp = self._prefix(src), self._prefix(dst)
        with self._lock:
            if any(p.startswith(dp) for p in self.files):
                raise StorageError(errno.EEXIST, f"cannot rename onto {dst}: it exists")
            if not any(p.startswith(sp) for p in self.files):
                raise StorageError(errno.ENOENT, f"cannot rename {src}: it does not exist")
            for p in [p for p in self.files if p.startswith(sp)]:
                self.files[dp + p[len(sp) :]] = self.files.pop(p)
