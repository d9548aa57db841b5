"""Shared-memory snapshot slots: the memory tier, which survives the training process.

A slot is one file in ``/dev/shm``, mapped into the trainer and into the persist worker.
It holds one complete snapshot (`ShmSlot`, in `resumable._shm_slot`). Its data region has
a safetensors layout, so the worker writes it out without another copy. Its metadata
(`SlotMeta`, in `resumable._shm_meta`) holds all a restore needs, and ``root``, the URL
of the checkpoint root it belongs to.

Slots are private to their user by construction (`resumable._shm_places`). Liveness is
a lock, not a pid: each process mapping a slot holds a shared `flock` on it. A slot is
taken over or deleted only by a process that gets the exclusive lock. This module names
a run's slot files, lists them and removes dead ones. We map files ourselves, because
`multiprocessing.shared_memory` unlinks a segment when its creator dies: the very case
the memory tier exists for. The long rationale is in docs/decisions.md.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from resumable._shm_meta import (
    ROOT_KEY,
    RawJSON,
    SlotMeta,
    decode_meta,
    encode_meta,
    layout_meta,
    slot_layout,
)
from resumable._shm_places import (
    PREFIX,
    SHM_DIR,
    TMP_MARK,
    fallback_dir,
    open_private,
    own_dir,
    release_fd,
    replaced_size,
    same_file,
    shm_free_bytes,
    user_dirs,
)
from resumable._shm_slot import (
    ALIGN,
    COMPLETE,
    CONTROL,
    EMPTY,
    MAGIC,
    SHM_REMEDY,
    VERSION,
    WRITING,
    Control,
    ShmSlot,
    SlotContent,
    attach_unlocked,
    unusable,
)
from resumable.errors import CheckpointError

log = logging.getLogger(__name__)


def run_key(location: str) -> str:
    """A short stable key naming a run's segments: the same checkpoint location on the
    same host finds the same segments after a crash."""
    return xxhash.xxh3_64_hexdigest(location.encode())[:12]


def run_key_for(location: str) -> str:
    """The key of a checkpoint root's segments on this host, from its
    `Storage.location` (which tells apart equal URLs on different servers)."""
    return run_key(f"{os.uname().nodename}:{location}")


def run_key_of(path: Path) -> str | None:
    """The run key a slot file is named for (`slot_paths`; also a leftover of a slot
    creation cut short), or None for another name."""
    name = path.name
    if not name.startswith(PREFIX) or "-r" not in name[len(PREFIX) :]:
        return None
    return name[len(PREFIX) :].split("-r", 1)[0]


# Slot files per run and rank: two alternate (the newest complete snapshot and the one
# before it), and a third is made only while a persist holds one of them, so that a
# snapshot never overwrites the newest complete one (`snapshot.ShmArena`). With
# replicas, the two newest are kept while the next is copied: three in rotation, and a
# fourth while a persist holds one.
SLOTS = 4


def slot_paths(key: str, rank: int, directory: Path) -> list[Path]:
    """The slot files of run ``key`` and ``rank`` in a slot directory (`own_dir`): `SLOTS`
    names, of which only those a snapshot was written to exist."""
    return [directory / f"{PREFIX}{key}-r{rank}-s{i}" for i in range(SLOTS)]


@dataclass(frozen=True)
class SegmentInfo:
    """One slot file. ``owner_pid`` is the pid its owner recorded, for people to read:
    it may belong to another PID namespace. ``in_use`` is what counts: some process
    holds the file's lock."""

    path: Path
    size: int
    owner_pid: int
    in_use: bool
    step: int | None
    updated: float
    root: str | None = None  # the checkpoint root of its snapshot, if it records one


def list_segments(shm_dir: Path = SHM_DIR) -> Iterator[SegmentInfo]:
    """This user's slot files in ``shm_dir`` (see `user_dirs`), with owner and step.
    Files that are not private slots of this user are skipped with a WARNING."""
    for directory in user_dirs(shm_dir):
        for path in _entries(directory, tmp=False):
            slot = attach_unlocked(path)
            if slot is None:
                continue
            try:
                c = slot.control()
                content = slot.read()
                yield SegmentInfo(
                    path,
                    slot.size,
                    c.owner_pid,
                    slot.in_use(),
                    content.step if content else None,
                    c.updated,
                    _root_of(content),
                )
            finally:
                slot.close()


def _root_of(content: SlotContent | None) -> str | None:
    return content.meta.root if content is not None else None


def _entries(directory: Path, *, tmp: bool) -> list[Path]:
    """Slot files in ``directory``, and with ``tmp`` the leftovers of cut-short creations."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [directory / n for n in names if n.startswith(PREFIX) and (tmp or TMP_MARK not in n)]


def remove_dead_segments(
    shm_dir: Path = SHM_DIR,
    *,
    older_than_s: float = 0.0,
    spare: Collection[Path] = (),
    select: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """Unlink this user's slot files in ``shm_dir`` that no process holds (see the
    module doc) and that were last written more than ``older_than_s`` ago, together
    with leftovers of slot creations cut short and empty fallback directories, except
    the files in ``spare``. A run's own segments are adopted by its next launch, so the
    default age used at start-up is long (a day); ``resumable shm --clean`` uses 0 and
    spares the slots that hold progress their root has not committed; with ``--root``
    it passes ``select``, which names the files of that root (others are not touched).

    Whatever pid a slot records, a slot whose lock is held is kept: its owner is alive,
    possibly in a PID namespace this process cannot see. Files of other users are never
    touched."""
    removed = []
    cutoff = time.time() - older_than_s
    for directory in user_dirs(shm_dir):
        for path in _entries(directory, tmp=True):
            if path in spare or (select is not None and not select(path)):
                continue
            if _remove_if_dead(path, cutoff):
                removed.append(path)
        if directory.name != f"{PREFIX}{os.geteuid()}":
            _remove_if_unused(directory)
    return removed


def _remove_if_unused(directory: Path) -> None:
    """Remove a fallback directory that is empty and that nobody holds."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if same_file(directory, fd):
            directory.rmdir()  # fails if not empty
    except OSError:  # held (BlockingIOError), not empty, or gone
        pass
    finally:
        os.close(fd)


def _remove_if_dead(path: Path, cutoff: float) -> bool:
    try:
        fd = open_private(path, os.O_RDONLY)
    except (OSError, CheckpointError) as exc:
        log.warning("not removing a shared-memory snapshot file: %s", unusable(path, exc))
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not same_file(path, fd):
            return False
        head = os.pread(fd, Control.SIZE, 0)
        if len(head) == Control.SIZE and head[:8] == MAGIC:
            updated = Control.unpack(head).updated
        else:
            updated = os.fstat(fd).st_mtime
        if updated > cutoff:
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


__all__ = [
    "ALIGN",
    "COMPLETE",
    "CONTROL",
    "EMPTY",
    "MAGIC",
    "PREFIX",
    "ROOT_KEY",
    "SHM_DIR",
    "SHM_REMEDY",
    "SLOTS",
    "TMP_MARK",
    "VERSION",
    "WRITING",
    "Control",
    "RawJSON",
    "SegmentInfo",
    "ShmSlot",
    "SlotContent",
    "SlotMeta",
    "attach_unlocked",
    "decode_meta",
    "encode_meta",
    "fallback_dir",
    "layout_meta",
    "list_segments",
    "own_dir",
    "release_fd",
    "remove_dead_segments",
    "replaced_size",
    "run_key",
    "run_key_for",
    "run_key_of",
    "shm_free_bytes",
    "slot_layout",
    "slot_paths",
    "unusable",
    "user_dirs",
]
