"""Atomic commit: a checkpoint becomes visible all at once, or not at all.

Contract: a checkpoint is committed iff ``step-N/manifest.json`` exists. A crash leaves
no new checkpoint or a complete one, and the newest earlier checkpoint stays loadable at
every instant. A ``step-N`` directory without a manifest is never deleted: it is moved
into ``quarantine/``, with a warning, and the caller is told (``on_quarantine``).

`RenameCommit` (filesystems) writes into a hidden staging directory, manifest last, and
renames it into place. Object stores have no rename. `MarkerCommit` writes under keys
unique to the attempt, then the manifest with a conditional put. Of two writers of one
step, exactly one commits. `committer_for` picks the one a storage supports. A
``fence`` is checked right before the first visible change, so a writer whose lease
lapsed changes nothing. The trade-off: a crash leaves staged data behind, which no
listing reports and the next start removes.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from resumable.format import MANIFEST, MAX_MANIFEST_BYTES, checksum, decode_manifest
from resumable.storage.base import Storage

_STEP_DIR = re.compile(r"^step-([0-9]{12,20})\Z")
_STAGING = re.compile(r"^\.(tmp|trash)-step-([0-9]{12,20})\.([0-9]+)\.([0-9a-f]+)\Z")
_ATTEMPT = re.compile(r"^att-([0-9]{13})-([0-9]+)-([0-9a-f]{8})\Z")

log = logging.getLogger(__name__)

Fence = Callable[[str], None]
"""Raises (`RootInUseError`) if the writer may no longer change the root; its argument
says what it was about to do."""


def step_dir(step: int) -> str:
    """Directory name of a checkpoint: sorts numerically by step as plain text."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def list_committed(storage: Storage) -> list[int]:
    """Steps of committed checkpoints (a ``step-N`` directory holding a manifest), ascending.
    Says nothing about validity: the reader verifies before use."""
    steps = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            committed = storage.exists(f"{name}/{MANIFEST}")
        except CorruptCheckpointError:
            committed = True  # e.g. a symlink out of the root: listed, so the reader refuses it
        if committed:
            steps.append(step)
    return sorted(steps)


def list_uncommitted(storage: Storage) -> list[str]:
    """Names of ``step-N`` directories without a manifest (not written by a completed
    commit: foreign or damaged). Listed for operators; never loaded or deleted."""
    names = []
    for n in storage.list_dir(""):
        if parse_step_dir(n) is None:
            continue
        try:
            if not storage.exists(f"{n}/{MANIFEST}"):
                names.append(n)
        except CheckpointError:  # a link, say: refused (and reported) where it is read
            continue
    return names


def checkpoint_as_root(storage: Storage) -> tuple[str, int | None] | None:
    """If ``storage``'s root is itself one checkpoint (it holds a manifest directly, as
    ``step-N/`` does: what users of Transformers and Lightning point at), the URL of
    the directory that holds it and its step (None if the name is not ``step-N``);
    otherwise None. Our roots never hold a manifest at their top. One `exists` call."""
    try:
        if not storage.exists(MANIFEST):
            return None
    except CheckpointError:  # e.g. a link named manifest.json: not ours either way
        return None
    url = storage.url.rstrip("/")
    parent, _, name = url.rpartition("/")
    return (parent or url), parse_step_dir(name)


def refuse_checkpoint_as_root(storage: Storage) -> None:
    """Raise `CheckpointError` if ``storage``'s root is one checkpoint (`checkpoint_as_root`):
    used as a root, a new run would start at step 0 nested inside it, and ``ls`` would
    find no checkpoints. The message names the parent to pass instead."""
    found = checkpoint_as_root(storage)
    if found is None:
        return
    parent, step = found
    which = f"step {step}" if step is not None else "it"
    raise CheckpointError(
        f"{storage.url} is a checkpoint, not a checkpoint directory: pass its parent "
        f"directory {parent} (restore() there resumes from the newest valid checkpoint; "
        f"restore(step=...) or `resumable show --step ...` picks {which})"
    )


QUARANTINE_DIR = "quarantine"
_QUARANTINE_README = (
    b"Step directories that had no manifest (not a completed commit: a deleted manifest,\n"
    b"a copy cut short, or another tool's files) and stood where resumable had to save\n"
    b"that step. They were moved here instead of being deleted; nothing reads them.\n"
    b"Each name is the step directory's, then the time it was moved (UTC). Inspect them,\n"
    b"then delete them. See docs/root-safety.md.\n"
)


def warn_uncommitted(storage: Storage) -> list[str]:
    """`list_uncommitted`, and a WARNING naming them if there are any: restore calls it
    so that data directories it will not use are never passed over in silence."""
    names = list_uncommitted(storage)
    if names:
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        log.warning(
            "%s holds step directories without a commit: %s. They are not restored (no "
            "manifest: deleted, a copy cut short, or not written by resumable). If the run "
            "saves one of these steps again, the old directory is moved into %s/ first. "
            "Check them, then delete them or put their manifest back",
            storage.url,
            shown,
            QUARANTINE_DIR,
        )
    return names


@dataclass(frozen=True)
class Quarantined:
    """A step directory without a manifest that stood in the way of a save, and where it
    was moved (both relative to the root)."""

    step: int
    name: str
    moved_to: str


def quarantine(storage: Storage, name: str) -> str:
    """Move directory ``name`` of the root into ``quarantine/`` (created with a README on
    first use) under a name that is new; return that path. Never deletes, never leaves
    the root. Needs a storage that renames (`Storage.rename_dir`)."""
    readme = f"{QUARANTINE_DIR}/README.txt"
    if not storage.exists(readme):
        storage.write(readme, [_QUARANTINE_README])
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst = f"{QUARANTINE_DIR}/{name}.{stamp}.{secrets.token_hex(4)}"
    storage.rename_dir(name, dst)
    storage.sync_dir("")
    return dst


@dataclass(frozen=True)
class Attempt:
    """One try at committing a step: data files go under ``staging``; the manifest names
    them relative to the step directory, under ``subdir`` (empty for a rename commit)."""

    step: int
    staging: str
    final: str
    subdir: str = ""
    replaces: str | None = None  # checksum of the committed manifest seen at begin

    def path(self, fname: str) -> str:
        """Where to write data file ``fname`` in storage."""
        return f"{self.staging}/{fname}"

    def key(self, fname: str) -> str:
        """The name of data file ``fname`` in the manifest."""
        return f"{self.subdir}/{fname}" if self.subdir else fname


def abort_quietly(committer: Committer, attempt: Attempt) -> None:
    """Remove a failed attempt's files. A failure to remove them is logged, not raised:
    the error that made the attempt fail is the one to report, and `stale()` removes
    what is left at the next start."""
    try:
        committer.abort(attempt)
    except Exception as exc:
        log.warning(
            "could not remove the failed attempt %s (it is removed at the next start): %s",
            attempt.staging,
            exc,
        )


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs; a zombie (killed, not yet reaped) does not."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; or a pid no process has
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):  # no procfs: kill's answer stands
        return True


# The staging and trash names this process made (in order): one with this process's pid
# that is not among them was made by another process that had the pid before (pids are
# reused: 32,768 of them on many systems), and is stale.
_MINE: dict[str, None] = {}
_MINE_MAX = 4096


def _own_name(storage: Storage, kind: str, final: str) -> str:
    name = f".{kind}-{final}.{os.getpid()}.{secrets.token_hex(4)}"
    if len(_MINE) >= _MINE_MAX:
        # Keep the names still on disk and the newest (an attempt not yet written).
        listed = set(storage.list_dir(""))
        recent = list(_MINE)[-16:]
        kept = [n for n in _MINE if n in listed] + recent
        _MINE.clear()
        _MINE.update(dict.fromkeys(kept))
    _MINE[name] = None
    return name


def _writer_alive(name: str, pid: int) -> bool:
    """Whether the process that made staging or trash directory ``name`` still runs."""
    if pid == os.getpid():
        return name in _MINE
    return _pid_alive(pid)


class RenameCommit:
    """Commit by renaming a fully written, fsync-ed staging directory."""

    def __init__(
        self,
        storage: Storage,
        *,
        on_quarantine: Callable[[Quarantined], None] | None = None,
        fence: Fence | None = None,
    ) -> None:
        if not storage.supports_rename:
            raise TypeError(f"{type(storage).__name__} cannot rename; use a marker commit")
        self.storage = storage
        self.on_quarantine = on_quarantine
        self.fence = fence
        # Removes an un-committed checkpoint's directory; a persist worker passes one
        # that does it on a thread of its own (unlinking a GiB file takes ~0.3 s here).
        self.discard: Callable[[str], None] = storage.delete

    def begin(self, step: int) -> Attempt:
        final = step_dir(step)
        self._clear_uncommitted(step, final)
        staging = _own_name(self.storage, "tmp", final)
        return Attempt(step, staging, final)

    def commit(self, attempt: Attempt, manifest: bytes) -> bool:
        """Write the manifest last and publish; returns whether an older checkpoint of
        the same step was replaced. On failure nothing new is visible."""
        s = self.storage
        s.write(f"{attempt.staging}/{MANIFEST}", [manifest])
        s.sync_dir(attempt.staging)
        if self.fence is not None:
            self.fence(f"the commit of {s.url}/{attempt.final}")
        replaced = False
        trash = None
        self._clear_uncommitted(attempt.step, attempt.final)
        if s.exists(attempt.final):
            trash = _own_name(s, "trash", attempt.final)
            s.rename_dir(attempt.final, trash)
            replaced = True
        s.rename_dir(attempt.staging, attempt.final)
        s.sync_dir("")
        if trash is not None:
            s.delete(trash)
        return replaced

    def _clear_uncommitted(self, step: int, final: str) -> None:
        """A ``step-N`` directory without a manifest was not made by a commit (ours never
        leave one). It is never replaced or deleted, and never stops the run: it is
        moved into ``quarantine/``, logged, and reported to ``on_quarantine``."""
        s = self.storage
        if not s.exists(final) or s.exists(f"{final}/{MANIFEST}"):
            return
        try:
            moved_to = quarantine(s, final)
        except CheckpointError as exc:  # e.g. a file or a link by that name
            raise StorageError(
                exc.errno if isinstance(exc, OSError) and exc.errno else errno.EEXIST,
                f"{s.url}/{final} exists but is not a committed checkpoint (no manifest), "
                f"and it could not be moved into {QUARANTINE_DIR}/: {exc}. Move it away "
                "to save this step",
            ) from exc
        log.warning(
            "%s/%s had no manifest (not a completed commit) and stood where step %d is "
            "saved: moved it to %s/%s, not deleted",
            s.url,
            final,
            step,
            s.url,
            moved_to,
        )
        if self.on_quarantine is not None:
            self.on_quarantine(Quarantined(step, final, moved_to))

    def delete(self, step: int) -> None:
        """Remove a committed checkpoint: first renamed aside (atomically un-committed),
        the root synced so that the rename is durable, then deleted, so a crash midway
        never leaves a listed but damaged checkpoint. (Without the sync, a power loss
        may keep the unlinks inside the renamed directory and lose the rename itself:
        ``step-N`` back, with its data gone and its manifest still there.)"""
        if self.fence is not None:
            self.fence(f"the delete of {self.storage.url}/{step_dir(step)}")
        trash = _own_name(self.storage, "trash", step_dir(step))
        self.storage.rename_dir(step_dir(step), trash)
        self.storage.sync_dir("")
        self.discard(trash)

    def abort(self, attempt: Attempt) -> None:
        self.storage.delete(attempt.staging)

    def stale(self) -> list[str]:
        """Staging and trash directories left by processes that no longer run."""
        out = []
        for name in self.storage.list_dir(""):
            m = _STAGING.match(name)
            if m and not _writer_alive(name, int(m.group(3))):
                out.append(name)
        return out


class MarkerCommit:
    """Commit without rename, for object stores: data under attempt-unique keys, then
    the manifest (the commit marker) with a conditional put, last.

    - Two writers of one step: both write their own data; exactly one manifest put
      succeeds. The other gets `StorageError` (``EEXIST``) and its data is removed.
    - A put whose response was lost and was retried finds its own manifest there: the
      bytes are compared, so it still counts as committed. If the retries fail instead,
      the commit raises, but `abort` keeps the data of an attempt whose manifest landed.
    - Re-saving a committed step (after resuming from an older one) first deletes the
      old marker, which un-commits it, then puts the new one and removes the old data.
    - Objects of abandoned attempts (a killed writer, a lost race) are not referenced by
      any manifest; `stale` lists those older than ``gc_grace_s`` (default one hour, so
      that an attempt still being written on another node is never taken) for deletion.

    The server must honour ``If-None-Match: *``: the first `begin` probes it
    (`Storage.conditional_put_enforced`) and raises if it does not.
    """

    def __init__(
        self, storage: Storage, *, gc_grace_s: float = 3600.0, fence: Fence | None = None
    ) -> None:
        self.storage = storage
        self.gc_grace_s = gc_grace_s
        self.fence = fence
        self._marker_sent: set[str] = set()  # attempts whose manifest put was sent

    def begin(self, step: int) -> Attempt:
        self.storage.conditional_put_enforced()
        final = step_dir(step)
        sub = f"att-{int(time.time() * 1000):013d}-{os.getpid()}-{secrets.token_hex(4)}"
        return Attempt(step, f"{final}/{sub}", final, sub, self._marker_sum(final))

    def _marker_sum(self, final: str) -> str | None:
        try:
            return checksum(self.storage.read(f"{final}/{MANIFEST}"))
        except NoCheckpointError:
            return None

    def commit(self, attempt: Attempt, manifest: bytes) -> bool:
        s = self.storage
        marker = f"{attempt.final}/{MANIFEST}"
        replaced = False
        now = self._marker_sum(attempt.final)
        if now is not None and now != attempt.replaces:  # another writer committed it
            raise self._lost(attempt)
        if self.fence is not None:
            self.fence(f"the commit of {s.url}/{attempt.final}")
        if now is not None:
            s.delete(marker)  # un-commit the older checkpoint of this step, seen at begin()
            replaced = True
        self._marker_sent.add(attempt.staging)
        if not s.put_if_absent(marker, manifest):
            try:
                existing: bytes | None = bytes(s.read(marker))
            except NoCheckpointError:
                existing = None
            if existing != manifest:
                raise self._lost(attempt)
        if replaced:
            for name in s.list_dir(attempt.final):
                if _ATTEMPT.match(name) and name != attempt.subdir:
                    s.delete(f"{attempt.final}/{name}")
        self._marker_sent.discard(attempt.staging)
        return replaced

    def _lost(self, attempt: Attempt) -> StorageError:
        return StorageError(
            errno.EEXIST,
            f"step {attempt.step} in {self.storage.url} was committed by another writer "
            "while this one was writing it; this attempt is discarded. Two jobs may be "
            "writing to one checkpoint root",
        )

    def delete(self, step: int) -> None:
        """Un-commit (delete the marker) first, then delete the data."""
        final = step_dir(step)
        if self.fence is not None:
            self.fence(f"the delete of {self.storage.url}/{final}")
        self.storage.delete(f"{final}/{MANIFEST}")
        self.storage.delete(final)

    def abort(self, attempt: Attempt) -> None:
        """Delete the attempt's data, unless its manifest may be committed: a put whose
        answer was lost and whose retries failed raises, yet the manifest is there and
        names this data. Then (or if the marker cannot be read) the data stays, and
        `stale` collects it once no manifest references it."""
        if attempt.staging in self._marker_sent:
            self._marker_sent.discard(attempt.staging)
            try:
                files = self._manifest_files(attempt.final)
            except NoCheckpointError:
                files = []
            except (CheckpointError, OSError) as exc:
                log.warning(
                    "kept the data of the failed attempt %s: its manifest may have been "
                    "committed and could not be read (%s)",
                    attempt.staging,
                    exc,
                )
                return
            if any(f.split("/", 1)[0] == attempt.subdir for f in files):
                log.warning(
                    "the commit of step %d failed, but its manifest did land: %s/%s is "
                    "committed, and its data is kept",
                    attempt.step,
                    self.storage.url,
                    attempt.final,
                )
                return
        self.storage.delete(attempt.staging)

    def stale(self) -> list[str]:
        """Attempt prefixes no manifest references, older than ``gc_grace_s``."""
        out = []
        now = time.time()
        for name in self.storage.list_dir(""):
            if parse_step_dir(name) is None:
                continue
            entries = self.storage.list_dir(name)
            referenced: set[str] = set()
            if MANIFEST in entries:
                try:
                    files = self._manifest_files(name)
                except (CheckpointError, OSError) as exc:
                    # Damaged, hostile or newer: verify reports it; keep its data.
                    log.debug("not collecting attempts of %s: %s", name, exc)
                    continue
                referenced = {f.split("/", 1)[0] for f in files}
            for entry in entries:
                m = _ATTEMPT.match(entry)
                if m and entry not in referenced and now - int(m.group(1)) / 1000 > self.gc_grace_s:
                    out.append(f"{name}/{entry}")
        return out

    def _manifest_files(self, name: str) -> list[str]:
        """The data files the manifest of step directory ``name`` lists, read only after
        the whole manifest validates (a hostile one raises `CheckpointError`, never
        more; its size is checked before it is read)."""
        path = f"{name}/{MANIFEST}"
        size = self.storage.size(path)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{path} has {size} bytes, more than a manifest")
        return list(decode_manifest(self.storage.read(path), where=path)["files"])


Committer = RenameCommit | MarkerCommit


def committer_for(
    storage: Storage,
    *,
    on_quarantine: Callable[[Quarantined], None] | None = None,
    fence: Fence | None = None,
) -> Committer:
    """The commit strategy ``storage`` supports: rename where it can, else the marker.
    ``on_quarantine`` hears of each uncommitted step directory a rename commit moved out
    of its way (object stores need none: each attempt writes keys of its own, and the
    manifest-less leftovers are collected by `MarkerCommit.stale`). ``fence`` is called
    before each commit and delete changes anything visible (see the module docstring)."""
    if storage.supports_rename:
        return RenameCommit(storage, on_quarantine=on_quarantine, fence=fence)
    return MarkerCommit(storage, fence=fence)
