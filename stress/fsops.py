"""An interposer on the ``os`` calls of `resumable.storage.local.LocalStorage`.

`FileOps` replaces ``os.open``, ``os.write``, ``os.pwrite``, ``os.fsync``, ``os.close``,
``os.mkdir``, ``os.rename``, ``os.unlink``, ``os.rmdir``, ``os.link``, ``os.listdir`` and
``os.stat`` for the duration of a ``with`` block. Calls on paths inside one checkpoint root are

- recorded as `Op` tuples, in the order they returned (what `resumable.stress`'s
  power-loss replay replays), and/or
- counted and failed on demand (`Fault`: an errno raised at call number ``at``, once or
  from then on), which is how the I/O-error campaign reaches every call of a save;
- listed in an order of the campaign's choosing (``listdir_order``: a directory's
  order is the file system's; ext4 hashes names), so that code which deletes "in
  listing order" is tried in more than one;
- or skipped (``skip``: e.g. every directory ``fsync`` returns without syncing), or a
  failed ``fsync`` swallowed or retried (``broken``), which is how the campaigns build
  deliberately broken save paths.

Calls on other paths (logging to a terminal, shared memory, the interpreter's own
files) pass straight through. LocalStorage names everything relative to directory
descriptors (``dir_fd``); a descriptor's path is read from ``/proc/self/fd`` once, when
it is opened, and forgotten when it is closed. Linux only.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

Op = tuple[Any, ...]
"""One recorded operation, ``(kind, *args)`` with paths relative to the root:

``("mkdir", path)``, ``("create", path)``, ``("truncate", path)``,
``("write", path, offset, data)``, ``("fsync", path, is_dir)``,
``("rename", src, dst)``, ``("unlink", path)``, ``("rmdir", path)``,
``("link", src, dst)`` and ``("mark", label, value)`` (written by the harness, e.g.
``("mark", "committed", 3)`` when ``save(3)`` returned)."""

_REAL = {
    name: getattr(os, name)
    for name in (
        "open",
        "write",
        "pwrite",
        "fsync",
        "close",
        "mkdir",
        "rename",
        "unlink",
        "rmdir",
        "link",
        "listdir",
        "stat",
    )
}


@dataclass
class Fault:
    """Fail call number ``at`` (0-based, counting every interposed call inside the
    root) with ``errno``; with ``sticky``, every later call fails too."""

    errno: int
    at: int
    sticky: bool = False
    injected: list[tuple[int, str, str]] = field(default_factory=list)  # (index, kind, path)


class FileOps:
    """Record, fail or skip the file-system calls made inside ``root`` (see module doc).

    ``calls`` lists ``(kind, path)`` of every interposed call inside the root, in order
    (failed ones included); ``ops`` the recorded operations of those that succeeded.
    Thread-safe; one `FileOps` may be active at a time per process."""

    _active_lock = threading.Lock()

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fault: Fault | None = None,
        skip: Callable[[str, str, bool], bool] | None = None,
        record: bool = True,
        listdir_order: str = "os",
        broken: str | None = None,
    ) -> None:
        self.root = os.path.realpath(root)
        self.fault = fault
        self.skip = skip
        self.record = record
        self.listdir_order = listdir_order  # "os", "sorted" or "reversed"
        if broken not in (None, "ignore-fsync-error", "retry-fsync"):
            raise ValueError(f"unknown broken fsync {broken!r}")
        self.broken = broken
        self.ops: list[Op] = []
        self.calls: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.fsync_failed: set[int] = set()  # descriptors whose fsync failed (injected)
        self.fsync_after_failure: list[str] = []  # a later fsync of such a descriptor
        # Files (device, inode) whose fsync failed and that were not rewritten from
        # scratch (created or truncated) since: their data may be gone whatever a later
        # fsync says.
        self.poisoned: set[tuple[int, int]] = set()
        # Names created, or renamed into place, whose directory was not synced since.
        self.unsynced: set[str] = set()
        self._fds: dict[int, tuple[str, int]] = {}  # fd -> (relative path, open flags)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ paths

    def _rel(self, path: Any, dir_fd: int | None) -> str | None:
        """``path`` relative to the root, or None when it lies outside."""
        if isinstance(path, int):
            return None
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            base = self._fd_path(dir_fd)
            if base is None:
                return None
            p = os.path.join(base, p)
        p = os.path.normpath(p)
        if p == self.root:
            return ""
        if p.startswith(self.root + os.sep):
            return p[len(self.root) + 1 :]
        return None

    def _fd_path(self, fd: int) -> str | None:
        with self._lock:
            known = self._fds.get(fd)
        if known is not None:
            return os.path.join(self.root, known[0]) if known[0] else self.root
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None

    def _rel_fd(self, fd: int) -> str | None:
        with self._lock:
            known = self._fds.get(fd)
        return known[0] if known is not None else None

    # ------------------------------------------------------------------ bookkeeping

    def _call(self, kind: str, rel: str) -> None:
        """Count a call inside the root; raise the planned fault if it is this one."""
        with self._lock:
            index = len(self.calls)
            self.calls.append((kind, rel))
            f = self.fault
            if f is not None and (index == f.at or (f.sticky and index > f.at)):
                f.injected.append((index, kind, rel))
                raise OSError(f.errno, f"{os.strerror(f.errno)} (injected)")

    def mark(self, label: str, value: Any = None) -> None:
        """Add a harness event to the op log (e.g. a commit that returned)."""
        with self._lock:
            self.ops.append(("mark", label, value))

    def _op(self, *op: Any) -> None:
        if self.record:
            with self._lock:
                self.ops.append(op)

    # ------------------------------------------------------------------ the wrappers

    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        rel = self._rel(path, dir_fd)
        if rel is None:
            return int(_REAL["open"](path, flags, mode, dir_fd=dir_fd))
        existed = True
        if flags & os.O_CREAT:
            try:
                _REAL["stat"](path, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                existed = False
        self._call("open", rel)
        fd = int(_REAL["open"](path, flags, mode, dir_fd=dir_fd))
        with self._lock:
            self._fds[fd] = (rel, flags)
            if not existed or flags & os.O_TRUNC:
                st = os.fstat(fd)
                self.poisoned.discard((st.st_dev, st.st_ino))
            if not existed:
                self._op("create", rel)
                self.unsynced.add(rel)
            if flags & os.O_TRUNC and existed and stat.S_ISREG(os.fstat(fd).st_mode):
                self._op("truncate", rel)
        return fd

    def _write(self, fd: int, data: Any) -> int:
        rel = self._rel_fd(fd)
        if rel is None:
            return int(_REAL["write"](fd, data))
        self._call("write", rel)
        flags = self._fds[fd][1]
        offset = os.fstat(fd).st_size if flags & os.O_APPEND else os.lseek(fd, 0, os.SEEK_CUR)
        n = int(_REAL["write"](fd, data))
        self._op("write", rel, offset, bytes(memoryview(data).cast("B")[:n]))
        return n

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        """A positioned write (`resumable.storage.direct` writes large files so): one
        "write" op at its offset, like a write."""
        rel = self._rel_fd(fd)
        if rel is None:
            return int(_REAL["pwrite"](fd, data, offset))
        self._call("write", rel)
        n = int(_REAL["pwrite"](fd, data, offset))
        self._op("write", rel, offset, bytes(memoryview(data).cast("B")[:n]))
        return n

    def _fsync(self, fd: int) -> None:
        rel = self._rel_fd(fd)
        if rel is None:
            _REAL["fsync"](fd)
            return
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        if fd in self.fsync_failed:
            self.fsync_after_failure.append(rel)
        try:
            self._call("fsync", rel)
        except OSError:
            self.fsync_failed.add(fd)
            if not is_dir:
                st = os.fstat(fd)
                self.poisoned.add((st.st_dev, st.st_ino))
            if self.broken == "ignore-fsync-error":
                return
            if self.broken == "retry-fsync":
                self._fsync(fd)
                return
            raise
        if self.skip is not None and self.skip("fsync", rel, is_dir):
            self.skipped.append(("fsync", rel))
            return
        _REAL["fsync"](fd)
        if is_dir:
            with self._lock:
                self.unsynced = {p for p in self.unsynced if os.path.dirname(p) != rel}
        self._op("fsync", rel, is_dir)

    def _close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            self.fsync_failed.discard(fd)
        _REAL["close"](fd)

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        if rel is not None:
            self._call("mkdir", rel)
        _REAL["mkdir"](path, mode, dir_fd=dir_fd)
        if rel is not None:
            self._op("mkdir", rel)
            with self._lock:
                self.unsynced.add(rel)

    def _rename(
        self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
    ) -> None:
        s, d = self._rel(src, src_dir_fd), self._rel(dst, dst_dir_fd)
        if s is not None:
            self._call("rename", s)
        _REAL["rename"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if s is not None and d is not None:
            self._op("rename", s, d)
            with self._lock:
                moved = {p for p in self.unsynced if p == s or p.startswith(s + "/")}
                self.unsynced -= moved
                self.unsynced |= {d + p[len(s) :] for p in moved if p != s} | {d}

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        if rel is not None:
            self._call("unlink", rel)
        _REAL["unlink"](path, dir_fd=dir_fd)
        if rel is not None:
            self._op("unlink", rel)
            with self._lock:
                self.unsynced.discard(rel)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        if rel is not None:
            self._call("rmdir", rel)
        _REAL["rmdir"](path, dir_fd=dir_fd)
        if rel is not None:
            self._op("rmdir", rel)
            with self._lock:
                self.unsynced = {
                    p for p in self.unsynced if p != rel and not p.startswith(rel + "/")
                }

    def _link(
        self,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        s, d = self._rel(src, src_dir_fd), self._rel(dst, dst_dir_fd)
        if d is not None:
            self._call("link", d)
        _REAL["link"](
            src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks
        )
        if s is not None and d is not None:
            self._op("link", s, d)

    def _listdir(self, path: Any = ".") -> list[str]:
        rel = self._fd_rel_or_path(path)
        if rel is not None:
            self._call("listdir", rel)
        names = list(_REAL["listdir"](path))
        if rel is not None and self.listdir_order != "os":
            names.sort(reverse=self.listdir_order == "reversed")
        return names

    def _stat(
        self, path: Any, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> os.stat_result:
        rel = self._fd_rel_or_path(path) if isinstance(path, int) else self._rel(path, dir_fd)
        if rel is not None:
            self._call("stat", rel)
        return _REAL["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    def _fd_rel_or_path(self, path: Any) -> str | None:
        if isinstance(path, int):
            return self._rel_fd(path)
        return self._rel(path, None)

    # ------------------------------------------------------------------ activation

    @contextmanager
    def active(self) -> Iterator[FileOps]:
        """Interpose for the duration of the block (one `FileOps` at a time)."""
        if not FileOps._active_lock.acquire(blocking=False):
            raise RuntimeError("another FileOps is active in this process")
        wrappers = {
            "open": self._open,
            "write": self._write,
            "pwrite": self._pwrite,
            "fsync": self._fsync,
            "close": self._close,
            "mkdir": self._mkdir,
            "rename": self._rename,
            "unlink": self._unlink,
            "rmdir": self._rmdir,
            "link": self._link,
            "listdir": self._listdir,
            "stat": self._stat,
        }
        try:
            for name, fn in wrappers.items():
                setattr(os, name, fn)
            yield self
        finally:
            for name, fn in _REAL.items():
                setattr(os, name, fn)
            FileOps._active_lock.release()


def no_directory_fsync(kind: str, path: str, is_dir: bool) -> bool:
    """A ``skip`` rule: the broken save path that never syncs a directory."""
    return kind == "fsync" and is_dir


def no_file_fsync(kind: str, path: str, is_dir: bool) -> bool:
    """A ``skip`` rule: the broken save path that never syncs a file's data."""
    return kind == "fsync" and not is_dir


ERRNOS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC}
