"""Local (or network-mounted POSIX) filesystem backend.

Durability follows the usual POSIX recipe: data is written to the final file name
inside a not-yet-visible directory, ``fsync``-ed, and made visible by renaming the
directory (see `resumable.commit`). Every path is resolved and checked to stay under
the root after following symlinks, so a planted symlink cannot redirect a read or a
write outside it.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from resumable.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from resumable.format import check_relpath
from resumable.storage.base import Buffer, Storage


def _storage_error(action: str, path: Path, exc: OSError) -> StorageError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; the disk is full: free space or point the checkpointer at another volume"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "; check the directory's permissions"
    err = StorageError(exc.errno, f"could not {action} {path}: {exc.strerror or exc}{hint}")
    return err


class LocalStorage(Storage):
    """Files under ``root``; created on first write."""

    supports_rename = True
    supports_append = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, rel: str, *, must_exist: bool = False) -> Path:
        full = self.root / check_relpath(rel) if rel else self.root
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(full)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise CorruptCheckpointError(
                f"refusing {rel!r}: it resolves to {real}, outside the checkpoint root {real_root}"
            )
        if must_exist and not full.exists():
            raise NoCheckpointError(errno.ENOENT, f"no such file in checkpoint root: {full}")
        return full

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        full = self._path(check_relpath(path))
        written = 0
        try:
            full.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                        written += n
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error("write", full, exc) from exc
        return written

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf) if length < (1 << 20) else buf  # type: ignore[return-value]

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Read ``len(out)`` bytes at ``offset`` straight into ``out`` (no extra copy)."""
        full, fd = self._open_ro(path)
        try:
            got, length = 0, len(out)
            while got < length:
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{full} is truncated: wanted bytes [{offset}, {offset + length}), "
                        f"file ends at {offset + got}"
                    )
                got += n
        except OSError as exc:
            raise _storage_error("read", full, exc) from exc
        finally:
            os.close(fd)

    def _open_ro(self, path: str) -> tuple[Path, int]:
        """Open a file inside the root for reading, never through a symlink."""
        full = self._path(check_relpath(path), must_exist=True)
        try:
            return full, os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCheckpointError(f"refusing {full}: it is a symbolic link") from exc
            raise _storage_error("open", full, exc) from exc

    def map_file(self, path: str) -> mmap.mmap:
        """The whole file mapped copy-on-write (``MAP_PRIVATE``): reads come straight
        from the page cache, and writes through the mapping never reach the file.
        Committed files are never modified, so the mapping stays valid."""
        full, fd = self._open_ro(path)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            for advice in ("MADV_SEQUENTIAL", "MADV_WILLNEED"):
                if hasattr(mmap, advice):
                    mm.madvise(getattr(mmap, advice))
            return mm
        except OSError as exc:
            raise _storage_error("map", full, exc) from exc
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        full = self._path(check_relpath(path), must_exist=True)
        try:
            return full.stat().st_size
        except OSError as exc:
            raise _storage_error("stat", full, exc) from exc

    def list_dir(self, path: str = "") -> list[str]:
        full = self._path(path)
        try:
            return sorted(os.listdir(full))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise _storage_error("list", full, exc) from exc

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def delete(self, path: str) -> None:
        full = self._path(path)
        try:
            if full.is_dir() and not full.is_symlink():
                shutil.rmtree(full)
            else:
                full.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _storage_error("delete", full, exc) from exc

    def append(self, path: str, data: bytes) -> None:
        full = self._path(check_relpath(path))
        try:
            full.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error("append to", full, exc) from exc

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Write a hidden sibling, fsync it, then hard-link it to ``path``: ``link``
        fails if ``path`` exists, atomically, so the file appears whole or not at all."""
        full = self._path(check_relpath(path))
        tmp = full.with_name(f".{full.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self.write(str(tmp.relative_to(self.root)), [data])
        try:
            os.link(tmp, full, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as exc:
            raise _storage_error("create", full, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)
        self.sync_dir(str(full.parent.relative_to(self.root)) if full.parent != self.root else "")
        return True

    def rename_dir(self, src: str, dst: str) -> None:
        s, d = self._path(src), self._path(dst)
        try:
            os.rename(s, d)
        except OSError as exc:
            raise _storage_error(f"rename {s.name} to", d, exc) from exc

    def sync_dir(self, path: str = "") -> None:
        full = self._path(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _storage_error("sync directory", full, exc) from exc
