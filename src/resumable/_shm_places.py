"""Private places for shared-memory slots: this user's directories and descriptors.

Slots live in ``<shm_dir>/resumable-<euid>/`` (`own_dir`), used only while it is a real
directory of this user that nobody else may write to; otherwise a fresh private
directory (`fallback_dir`). A slot file is opened without following links and used
only if it is a regular file of this user that nobody else may open (`open_private`).
A child forked from the trainer closes its copies of these descriptors at once, so an
orphaned child never holds a dead trainer's locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import tempfile
from pathlib import Path

from resumable.errors import CheckpointError, StorageError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "resumable-"
TMP_MARK = ".new"

# --------------------------------------------------------------------------- descriptors

# Descriptors of this process's slots and fallback-directory locks. fork copies every
# descriptor (close-on-exec or not), and a flock lives as long as any copy does; a forked
# child closes its copies at once and forgets them, so only their owner closes them again.
_OWN_FDS: set[int] = set()


def _close_in_child() -> None:
    for fd in list(_OWN_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _OWN_FDS.clear()


os.register_at_fork(after_in_child=_close_in_child)


def own_fd(fd: int) -> int:
    _OWN_FDS.add(fd)
    return fd


def map_file(fd: int, size: int, path: Path) -> mmap.mmap:
    """Map ``size`` bytes of the file open at ``fd`` (named ``path``) through a
    description of its own.

    `mmap.mmap` keeps a duplicate of the descriptor it is given for as long as the map
    lives, and a forked child keeps the map; a duplicate of ``fd`` would hold ``fd``'s
    flock in the child. A second open of the same file holds none. If ``path`` no
    longer names that file, the map is made from ``fd`` after all."""
    try:
        other = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return mmap.mmap(fd, size)
    try:
        a, b = os.fstat(fd), os.fstat(other)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # replaced meanwhile
            return mmap.mmap(fd, size)
        return mmap.mmap(other, size)
    finally:
        os.close(other)


def release_fd(fd: int) -> None:
    """Close a descriptor this module handed out, unless this process is a forked child
    of its owner (which closed its copy when it started)."""
    if fd in _OWN_FDS:
        _OWN_FDS.discard(fd)
        os.close(fd)


# --------------------------------------------------------------------------- private places


def own_dir(shm_dir: Path = SHM_DIR) -> Path | None:
    """This user's slot directory in ``shm_dir``, ``resumable-<euid>``, created (mode
    0700) if missing; None, with a WARNING, if that name cannot be trusted.

    An existing one is used only if it is a real directory (not a link) owned by this
    user and not writable by group or others. Otherwise another user created the name
    first, to read or plant snapshots: the caller then uses a `fallback_dir`, so the run
    works but does not find snapshots an earlier launch left. Raises `StorageError` if
    ``shm_dir`` takes no directory of this user at all."""
    path = shm_dir / f"{PREFIX}{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _dir_error(path, exc) from exc
    problem = _dir_problem(path)
    if problem is None:
        return path
    log.warning(
        "not using %s for shared-memory snapshots: it %s. Using a new private directory "
        "instead, so snapshots left by an earlier launch are not found; remove %s or pass "
        "shm_dir= another directory",
        path,
        problem,
        path,
    )
    return None


def fallback_dir(shm_dir: Path) -> tuple[Path, int]:
    """A fresh private directory in ``shm_dir`` (``resumable-<euid>-XXXXXXXX``, mode
    0700) and a descriptor holding its shared lock: `remove_dead_segments` removes an
    empty fallback directory only when nobody holds it. Close the descriptor when done."""
    for _ in range(3):
        try:
            path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.geteuid()}-", dir=shm_dir))
        except OSError as exc:
            raise _dir_error(shm_dir, exc) from exc
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:  # a cleaner saw it empty and unlocked
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        if same_file(path, fd):
            return path, own_fd(fd)
        os.close(fd)
    raise StorageError(errno.EAGAIN, f"private directories created in {shm_dir} keep disappearing")


def user_dirs(shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's slot directories in ``shm_dir`` (its own and fallbacks), creating none;
    entries with these names that are not private directories of this user are skipped
    with a WARNING."""
    euid = os.geteuid()
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    dirs = []
    for name in names:
        if name != f"{PREFIX}{euid}" and not name.startswith(f"{PREFIX}{euid}-"):
            continue
        problem = _dir_problem(shm_dir / name)
        if problem is None:
            dirs.append(shm_dir / name)
        else:
            log.warning("ignoring %s: it %s", shm_dir / name, problem)
    return dirs


def _dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a private directory of this user, or None if it is one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"is not a directory ({exc.strerror})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _dir_error(path: Path, exc: OSError) -> StorageError:
    return StorageError(
        exc.errno,
        f"cannot create a private directory for shared-memory snapshots in {path}: "
        f"{exc.strerror}; pass shm_dir= a writable directory on a tmpfs, or use "
        "persist='sync' without memory_every",
    )


def open_private(path: Path, flags: int) -> int:
    """A descriptor of ``path`` (never through a link) if it is a regular file of this
    user that no one else may open; `CheckpointError` saying what it is otherwise, and
    `OSError` if it cannot be opened."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problem = "it is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"it belongs to uid {st.st_uid}"
        elif st.st_mode & 0o077:
            problem = f"other users may open it (mode {stat.S_IMODE(st.st_mode):o})"
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise CheckpointError(
        f"{path} is not a private snapshot slot of this user (uid {os.geteuid()}): {problem}"
    )


def same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def shm_free_bytes(directory: Path = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def replaced_size(path: Path) -> int:
    """Bytes freed when a new slot replaces ``path`` (a regular file; never followed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
