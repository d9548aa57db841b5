"""Local (or network-mounted POSIX) filesystem backend.

Durability follows the usual POSIX recipe: data is written to the final file name
inside a not-yet-visible directory, ``fsync``-ed, and made visible by renaming the
directory (see `resumable.commit`).

Containment does not rely on checking a path and then using it (a directory swapped
for a symlink between the two would redirect the use). Every call opens the root
directory and walks the relative path one component at a time with ``openat``
(``dir_fd``) and ``O_NOFOLLOW``; creations, renames, links and removals are the
``*at`` variants on those directory descriptors. So a symbolic link anywhere inside
the root, planted or swapped in mid-call, is never followed: the call fails with
`CorruptCheckpointError` when reading and `StorageError` (``ELOOP``) when writing.
The root path itself is the user's: links in it are followed, each time it is opened,
so a root that is deleted and recreated is seen afresh.

Only regular files are read or written. Files are opened with ``O_NONBLOCK`` (a FIFO
then opens at once instead of waiting for a peer), checked with ``fstat``, and put
back to blocking mode before any I/O; a FIFO, socket, device or directory is refused.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from resumable import settings
from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from resumable.format import check_relpath
from resumable.storage import direct, readahead
from resumable.storage.base import Buffer, Storage
from resumable.storage.writeback import write_all

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_LOCK = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CHANGED = "changed"  # what `_refusal` is told when a name changed kind under the walk
_MAX_TREE_DEPTH = 64  # deeper than any checkpoint; a hostile tree must not exhaust fds


def _storage_error(action: str, path: Path, exc: OSError) -> StorageError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; the disk is full: free space or point the checkpointer at another volume"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "; check the directory's permissions"
    err = StorageError(exc.errno, f"could not {action} {path}: {exc.strerror or exc}{hint}")
    return err


def _why(exc: OSError) -> str:
    """The cause of a failure to create or write in a root, and what to do, in words."""
    text = exc.strerror or str(exc)
    if exc.errno == errno.EROFS:
        return f"{text} (the file system is mounted read-only): pass a writable directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{text}: this user (uid {os.geteuid()}) may not write there; check the "
            "directory's owner and mode, or pass a directory this user owns"
        )
    if exc.errno == errno.ENOSPC:
        return f"{text}: the disk is full; free space or pass a directory on another volume"
    return text


def _kind(mode: int) -> str:
    """What a file of mode ``mode`` is, in words."""
    for test, words in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return words
    return "a special file"


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _empty_dir(fd: int, depth: int = 0) -> None:
    """Remove everything in the directory open as ``fd``, never following a symbolic
    link: links are unlinked, and each subdirectory is opened with ``O_NOFOLLOW`` and
    emptied through its own descriptor, so one swapped for a link midway makes this
    fail (``ENOTDIR``) instead of reaching the link's target."""
    if depth > _MAX_TREE_DEPTH:
        raise OSError(errno.ELOOP, f"directories nested deeper than {_MAX_TREE_DEPTH} levels")
    for entry in os.listdir(fd):
        if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
            child = os.open(entry, _DIR, dir_fd=fd)
            try:
                _empty_dir(child, depth + 1)
            finally:
                os.close(child)
            os.rmdir(entry, dir_fd=fd)
        else:
            os.unlink(entry, dir_fd=fd)


class LocalStorage(Storage):
    """Files under ``root``; created on first write. Holds no descriptor between calls,
    so it may be used from several threads and passed to other processes."""

    supports_rename = True
    supports_append = True

    def __init__(self, root: str | os.PathLike[str], *, direct_io: bool | None = None) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        if direct_io is None:
            text = settings.DIRECT_IO.read() or settings.DIRECT_IO.default
            direct_io = text.strip() not in ("0", "false", "no")
        # Files of `DIRECT_MIN_BYTES` or more are written with O_DIRECT (`direct`).
        self.direct_io = direct_io and direct.available()

    # ----------------------------------------------------------------------- walking

    def _refusal(
        self,
        rel: str,
        component: str,
        what: str,
        *,
        write: bool,
        code: int,
        want: str = "a regular file",
    ) -> CheckpointError:
        """The error for finding ``what`` (e.g. "a symbolic link") where ``want`` was
        expected, at ``component`` of ``rel``: `CorruptCheckpointError` for a read,
        `StorageError` (errno ``code``) for a write."""
        full = self.root / rel
        at = "it" if component == rel else f"{component!r} in its path"
        if what == _CHANGED:
            found = (
                f"{at} was replaced while it was being opened (it was not a directory a "
                "moment before: a symbolic link swapped in and out?)"
            )
            fix = "Another process is changing the checkpoint root; find it and stop it"
        elif what == "a symbolic link":
            found = (
                f"{at} is a symbolic link inside the checkpoint root {self.root}; links "
                "inside a checkpoint root are never followed"
            )
            fix = (
                "Remove the link, and check what else writes to the checkpoint root "
                "(a directory may have been replaced by a link while it was in use)"
                if write
                else "Remove the link (or put the real directory or file in its place)"
            )
        else:
            found = f"{at} is {what}, not {want}"
            fix = "A checkpoint holds only regular files and directories: remove or rename it"
        if write:
            return StorageError(code, f"could not write {full}: {found}. {fix}")
        return CorruptCheckpointError(f"refusing {full}: {found}. {fix}")

    def _open_root(self, rel: str, *, create: bool, write: bool) -> int:
        """A descriptor of the root directory (following links in the user's path);
        created first when ``create``. Missing root: `NoCheckpointError`."""
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except FileNotFoundError as exc:
            if not create:
                raise NoCheckpointError(
                    errno.ENOENT, f"no checkpoint root at {self.root} (looking for {rel!r})"
                ) from exc
        except NotADirectoryError as exc:
            if not write:
                raise NoCheckpointError(
                    errno.ENOTDIR, f"checkpoint root {self.root} is not a directory"
                ) from exc
            raise _storage_error("open the checkpoint root", self.root, exc) from exc
        except OSError as exc:
            raise _storage_error("open the checkpoint root", self.root, exc) from exc
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise _storage_error("create the checkpoint root", self.root, exc) from exc

    def _open_dir(self, rel: str, parts: list[str], *, create: bool, write: bool) -> int:
        """A descriptor of directory ``root/parts...``, walked one component at a time
        without following links (made where missing when ``create``). The caller closes
        it. A link on the way: `_refusal`; a missing directory (or a file where a
        directory should be) when reading: `NoCheckpointError`."""
        fd = self._open_root(rel, create=create, write=write)
        for i, name in enumerate(parts):
            try:
                child = self._open_child_dir(fd, name, create=create)
            except OSError as exc:
                err = self._walk_error(fd, rel, "/".join(parts[: i + 1]), name, exc, write)
                os.close(fd)
                raise err from exc
            os.close(fd)
            fd = child
        return fd

    @staticmethod
    def _open_child_dir(fd: int, name: str, *, create: bool) -> int:
        try:
            return os.open(name, _DIR, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        try:
            os.mkdir(name, 0o777, dir_fd=fd)
        except FileExistsError:
            pass  # made by a concurrent writer; opened below like any directory
        return os.open(name, _DIR, dir_fd=fd)

    def _walk_error(
        self, fd: int, rel: str, component: str, name: str, exc: OSError, write: bool
    ) -> CheckpointError:
        """The error for failing to open directory ``name`` (``component`` of ``rel``)."""
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # not a directory when opened
            st = _lstat_at(fd, name)
            if st is None or stat.S_ISDIR(st.st_mode):  # but now: swapped out and back
                return self._refusal(rel, component, _CHANGED, write=write, code=errno.ELOOP)
            what = _kind(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                return self._refusal(rel, component, what, write=write, code=errno.ELOOP)
            if write:
                return self._refusal(
                    rel, component, what, write=True, code=errno.ENOTDIR, want="a directory"
                )
        if not write and isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            return NoCheckpointError(
                exc.errno, f"no such file in checkpoint root: {self.root / rel}"
            )
        return _storage_error("write" if write else "read", self.root / rel, exc)

    def _split(self, path: str) -> tuple[list[str], str]:
        """Directory components and final name of a checked, non-empty ``path``."""
        parts = check_relpath(path).split("/")
        return parts[:-1], parts[-1]

    def _final_error(
        self, dfd: int, rel: str, name: str, exc: OSError, *, write: bool
    ) -> CheckpointError:
        """The error for failing to open the final component ``name`` of ``rel``."""
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link, whatever is there now
            return self._refusal(rel, rel, "a symbolic link", write=write, code=errno.ELOOP)
        st = _lstat_at(dfd, name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            return self._refusal(rel, rel, _kind(st.st_mode), write=write, code=errno.EINVAL)
        if not write and isinstance(exc, FileNotFoundError):
            return NoCheckpointError(
                errno.ENOENT, f"no such file in checkpoint root: {self.root / rel}"
            )
        return _storage_error("write" if write else "open", self.root / rel, exc)

    def _open_file(self, dfd: int, rel: str, name: str, flags: int, *, write: bool) -> int:
        """Open regular file ``name`` of directory ``dfd`` (``O_NOFOLLOW|O_NONBLOCK``),
        refuse anything else, and return it in blocking mode."""
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
        except OSError as exc:
            raise self._final_error(dfd, rel, name, exc, write=write) from exc
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise self._refusal(rel, rel, _kind(mode), write=write, code=errno.EINVAL)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_ro(self, path: str) -> tuple[Path, int]:
        """Open a regular file inside the root for reading, never through a link."""
        parts, name = self._split(path)
        dfd = self._open_dir(path, parts, create=False, write=False)
        try:
            return self.root / path, self._open_file(dfd, path, name, _READ, write=False)
        finally:
            os.close(dfd)

    # ----------------------------------------------------------------------- reading

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

    def map_file(
        self, path: str, span: tuple[int, int] | list[tuple[int, int]] | None = None
    ) -> mmap.mmap:
        """The whole file mapped copy-on-write (``MAP_PRIVATE``): reads come straight
        from the page cache, and writes through the mapping never reach the file.
        Committed files are never modified, so the mapping stays valid. ``span`` (a
        range or a list of ranges; the whole file if None) is read ahead of the caller,
        in order, on a thread (`readahead`)."""
        full, fd = self._open_ro(path)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            if not readahead.read_ahead(mm, span) and hasattr(mmap, "MADV_WILLNEED"):
                mm.madvise(mmap.MADV_WILLNEED)
            return mm
        except OSError as exc:
            raise _storage_error("map", full, exc) from exc
        finally:
            os.close(fd)

    def _lstat(self, path: str) -> os.stat_result | None:
        """``lstat`` of ``path`` inside the root (None if missing); a link on the way
        to it is refused, a link at it is returned as such."""
        parts, name = self._split(path)
        try:
            dfd = self._open_dir(path, parts, create=False, write=False)
        except NoCheckpointError:
            return None
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _storage_error("stat", self.root / path, exc) from exc
        finally:
            os.close(dfd)

    def size(self, path: str) -> int:
        st = self._lstat(path)
        if st is None:
            raise NoCheckpointError(
                errno.ENOENT, f"no such file in checkpoint root: {self.root / path}"
            )
        if not stat.S_ISREG(st.st_mode):
            raise self._refusal(path, path, _kind(st.st_mode), write=False, code=errno.EINVAL)
        return st.st_size

    def exists(self, path: str) -> bool:
        if not path:
            return self.root.is_dir()
        st = self._lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise self._refusal(path, path, "a symbolic link", write=False, code=errno.ELOOP)
        return st is not None

    def list_dir(self, path: str = "") -> list[str]:
        parts = check_relpath(path).split("/") if path else []
        try:
            fd = self._open_dir(path, parts, create=False, write=False)
        except NoCheckpointError:
            return []
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            raise _storage_error("list", self.root / path, exc) from exc
        finally:
            os.close(fd)

    def list_files(self, path: str = "") -> dict[str, int]:
        """Every regular file under ``path`` and its size, walked through directory
        descriptors opened with ``O_NOFOLLOW``: a link, FIFO, socket or device on the
        way is refused with `CorruptCheckpointError`, as reading it would be."""
        parts = check_relpath(path).split("/") if path else []
        try:
            fd = self._open_dir(path, parts, create=False, write=False)
        except NoCheckpointError:
            return {}
        out: dict[str, int] = {}
        try:
            self._walk_files(fd, path, "", out, 0)
        except CheckpointError:
            raise
        except OSError as exc:
            raise _storage_error("list", self.root / path, exc) from exc
        finally:
            os.close(fd)
        return dict(sorted(out.items()))

    def _walk_files(self, fd: int, base: str, rel: str, out: dict[str, int], depth: int) -> None:
        """Add the regular files under directory ``fd`` (``base/rel``) to ``out``."""
        if depth > _MAX_TREE_DEPTH:
            raise CorruptCheckpointError(
                f"refusing {self.root / base}: directories nested deeper than "
                f"{_MAX_TREE_DEPTH} levels"
            )
        with os.scandir(fd) as entries:
            for entry in entries:
                name = check_relpath(f"{rel}/{entry.name}" if rel else entry.name)
                full = f"{base}/{name}" if base else name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    out[name] = st.st_size
                elif not stat.S_ISDIR(st.st_mode):
                    raise self._refusal(
                        full, full, _kind(st.st_mode), write=False, code=errno.EINVAL
                    )
                else:
                    try:
                        child = os.open(entry.name, _DIR, dir_fd=fd)
                    except OSError as exc:
                        raise self._walk_error(fd, full, full, entry.name, exc, False) from exc
                    try:
                        self._walk_files(child, base, name, out, depth + 1)
                    finally:
                        os.close(child)

    # ----------------------------------------------------------------------- writing

    def _write_at(self, dfd: int, rel: str, name: str, chunks: Iterable[Buffer]) -> int:
        fd = self._open_file(dfd, rel, name, _WRITE | os.O_TRUNC, write=True)
        try:
            chunks = list(chunks)
            if self.direct_io and sum(memoryview(c).nbytes for c in chunks) >= (
                direct.DIRECT_MIN_BYTES
            ):
                written = direct.write_direct(fd, chunks)  # from the arena to the disk
            else:
                written = write_all(fd, chunks)  # the disk starts on each piece at once
            os.fsync(fd)
        except OSError as exc:
            raise _storage_error("write", self.root / rel, exc) from exc
        finally:
            os.close(fd)
        return written

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        parts, name = self._split(path)
        dfd = self._open_dir(path, parts, create=True, write=True)
        try:
            return self._write_at(dfd, path, name, chunks)
        finally:
            os.close(dfd)

    def append(self, path: str, data: bytes) -> None:
        parts, name = self._split(path)
        dfd = self._open_dir(path, parts, create=True, write=True)
        try:
            fd = self._open_file(dfd, path, name, _WRITE | os.O_APPEND, write=True)
        finally:
            os.close(dfd)
        try:
            os.write(fd, data)
        except OSError as exc:
            raise _storage_error("append to", self.root / path, exc) from exc
        finally:
            os.close(fd)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Write a hidden sibling, fsync it, then hard-link it to ``path``: ``link``
        fails if ``path`` exists, atomically, so the file appears whole or not at all."""
        parts, name = self._split(path)
        full = self.root / path
        dfd = self._open_dir(path, parts, create=True, write=True)
        try:
            tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            self._write_at(dfd, path, tmp, [data])
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                st = _lstat_at(dfd, name)
                if st is not None and stat.S_ISLNK(st.st_mode):
                    raise self._refusal(
                        path, path, "a symbolic link", write=True, code=errno.ELOOP
                    ) from None
                return False
            except OSError as exc:
                raise _storage_error("create", full, exc) from exc
            finally:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
            try:
                os.fsync(dfd)
            except OSError as exc:
                raise _storage_error("sync directory of", full, exc) from exc
            return True
        finally:
            os.close(dfd)

    def delete(self, path: str) -> None:
        """Remove a file, a link (never its target) or a directory tree (never
        following a link inside it); ``""`` empties and removes the root."""
        if not path:
            self._delete_root()
            return
        parts, name = self._split(path)
        try:
            dfd = self._open_dir(path, parts, create=False, write=True)
        except NoCheckpointError:
            return
        except StorageError as exc:
            if exc.errno == errno.ENOENT:
                return
            raise
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                fd = os.open(name, _DIR, dir_fd=dfd)
                try:
                    _empty_dir(fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _storage_error("delete", self.root / path, exc) from exc
        finally:
            os.close(dfd)

    def _delete_root(self) -> None:
        try:
            fd = self._open_root("", create=False, write=False)
        except NoCheckpointError:
            return
        try:
            _empty_dir(fd)
            os.rmdir(self.root)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _storage_error("delete", self.root, exc) from exc
        finally:
            os.close(fd)

    def rename_dir(self, src: str, dst: str) -> None:
        s_parts, s_name = self._split(src)
        d_parts, d_name = self._split(dst)
        sfd = self._open_dir(src, s_parts, create=False, write=True)
        try:
            dfd = self._open_dir(dst, d_parts, create=False, write=True)
            try:
                st = _lstat_at(sfd, s_name)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    code = errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.ENOTDIR
                    raise self._refusal(
                        src, src, _kind(st.st_mode), write=True, code=code, want="a directory"
                    )
                # renameat never follows a final link: one swapped in after the check
                # is moved itself, inside the root, and its target is not touched.
                os.rename(s_name, d_name, src_dir_fd=sfd, dst_dir_fd=dfd)
            except OSError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise _storage_error(f"rename {src} to", self.root / dst, exc) from exc
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def check_root(self) -> None:
        """Create the root (and missing parents) and a probe file in it, then remove the
        probe. Fails with `StorageError` naming the cause: the root (or a parent) is a
        file, a parent or the root is not writable or on a read-only file system, the
        disk is full."""
        root = self.root
        try:
            st: os.stat_result | None = os.stat(root)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError as exc:
            raise _storage_error("reach the checkpoint root", root, exc) from exc
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise StorageError(
                errno.ENOTDIR,
                f"the checkpoint root {root} is {_kind(st.st_mode)}, not a directory. Pass "
                "a directory (it is created if missing), or remove the file",
            )
        if st is None:
            for parent in root.parents:
                try:
                    pst = os.stat(parent)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as exc:
                    raise _storage_error("reach", parent, exc) from exc
                if not stat.S_ISDIR(pst.st_mode):
                    raise StorageError(
                        errno.ENOTDIR,
                        f"cannot create the checkpoint root {root}: {parent} is "
                        f"{_kind(pst.st_mode)}, not a directory. Pass another path",
                    )
                break
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(
                    exc.errno, f"cannot create the checkpoint root {root}: {_why(exc)}"
                ) from exc
        probe = f".resumable-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
            try:
                os.close(os.open(probe, _WRITE | os.O_EXCL, 0o600, dir_fd=dfd))
                os.unlink(probe, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise StorageError(
                exc.errno, f"cannot write in the checkpoint root {root}: {_why(exc)}"
            ) from exc

    def open_lock(self, path: str) -> int:
        """``path`` opened read-write (created, mode 0644), never through a link, and
        close-on-exec: a descriptor to ``flock`` (see `resumable.lock`)."""
        parts, name = self._split(path)
        dfd = self._open_dir(path, parts, create=True, write=True)
        try:
            return self._open_file(dfd, path, name, _LOCK, write=True)
        finally:
            os.close(dfd)

    def sync_dir(self, path: str = "") -> None:
        parts = check_relpath(path).split("/") if path else []
        fd = self._open_dir(path, parts, create=False, write=True)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _storage_error("sync directory", self.root / path, exc) from exc
        finally:
            os.close(fd)
