"""Retention: apply a `Keep` policy to the committed checkpoints of a storage.

`policy.Keep` decides (pure); this module acts: it lists committed checkpoints, reads
their metrics, protects pinned ones and the one just written, checks that what it keeps
is valid, then un-commits and deletes the rest, recording each delete in the audit log.
It is called by the persist worker after every commit and by ``resumable prune``.

Both may run at once on one root (an operator prunes beside a running job), and each
may find a checkpoint it meant to read or delete already gone: the other one deleted
it. That is the outcome both wanted, not a failure. So a step that is no longer listed
as committed when its manifest read or its delete fails counts as deleted, with no
warning; a failure on a checkpoint that is still there is a real one and is raised or
logged as before.

Before deleting, it checks the checkpoint just written from one listing of its directory
(`CheckpointReader.check_sizes`): every data file there with its declared size. That
catches what the check is for, a file lost or cut short, with a listing per 1,000 files.
It reads no header: the writer built each header and the manifest's index from one
layout, in one process, from the bytes each rank checksummed. Damage at rest that keeps
a file's size was out of reach before too, but for the header bytes (the old check read
headers, never data); a restore checks headers and checksums before using any byte.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from resumable.audit import AuditLog
from resumable.commit import (
    Fence,
    RenameCommit,
    committer_for,
    list_committed,
    parse_step_dir,
    step_dir,
)
from resumable.errors import CheckpointError, RootInUseError
from resumable.policy import Entry, Keep
from resumable.reader import CheckpointReader
from resumable.storage import Storage

log = logging.getLogger(__name__)

PINS_DIR = "pins"


def pinned_steps(storage: Storage) -> set[int]:
    return {s for s in (parse_step_dir(n) for n in storage.list_dir(PINS_DIR)) if s is not None}


def retention_entry(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What retention needs of a checkpoint: its metrics and the steps it refers to."""
    return {"metrics": manifest["metrics"], "refs": list(manifest.get("refs", ()))}


def referenced(kept: Iterable[int], refs: Mapping[int, Iterable[int]]) -> set[int]:
    """Every checkpoint that one of ``kept`` refers to, directly or through others."""
    out: set[int] = set()
    todo = list(kept)
    while todo:
        for k in refs.get(todo.pop(), ()):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def apply_retention(
    storage: Storage,
    keep: Keep,
    audit: AuditLog,
    *,
    just_written: int | None = None,
    cache: dict[int, dict[str, Any]] | None = None,
    dry_run: bool = False,
    deletable: Callable[[int], bool] | None = None,
    each: Callable[[list[int]], Iterable[int]] = iter,
    protect: Iterable[int] = (),
    discard: Callable[[str], None] | None = None,
    fence: Fence | None = None,
) -> list[int]:
    """Delete committed checkpoints that ``keep`` does not retain; returns their steps.

    Only ``step-N`` directories whose manifest parses as a resumable manifest are
    candidates (anything else was not written by resumable, or is damaged and left for
    an operator). The checkpoint just written and pinned ones are never deleted, and
    nothing is deleted unless a retained checkpoint checks out: the one just written
    (its files, listed with their sizes: `_files_valid`), or else, as in ``resumable
    prune``, one that passes a full verification. So retention never leaves zero valid
    checkpoints. ``deletable`` can hold back more (the tiering keeps local checkpoints
    that are not mirrored yet). ``each`` wraps the loop over the deletions (``resumable
    prune`` shows a progress bar with it).
    ``discard`` removes a checkpoint's directory once it is un-committed (renamed
    aside), for a caller that removes them in the background; by default at once.
    ``protect`` names more steps never to delete (the base of the writer's next
    incremental checkpoint). A checkpoint that a retained one refers to is never
    deleted (`referenced`), and doomed checkpoints are deleted newest first, so a crash
    at any moment of a delete leaves no listed checkpoint that refers to a deleted one.
    ``fence`` runs before each delete (a writer whose lease on the root lapsed deletes
    nothing: it raises `RootInUseError`, and what it already deleted stays deleted).
    """
    cache = cache if cache is not None else {}
    entries = []
    for s in list_committed(storage):
        if s not in cache:
            try:
                cache[s] = retention_entry(CheckpointReader(storage, s).top)
            except CheckpointError as exc:
                if _gone(storage, s):
                    log.debug("retention: %s was deleted meanwhile", step_dir(s))
                else:
                    log.warning("retention ignores %s: %s", step_dir(s), exc)
                continue
        entries.append(Entry(s, cache[s]["metrics"]))
    pinned = pinned_steps(storage)
    pinned.update(protect)
    if just_written is not None:
        pinned.add(just_written)
    doomed = keep.to_delete(entries, pinned)
    if deletable is not None:
        doomed = [s for s in doomed if deletable(s)]
    # A checkpoint that a kept one refers to (incremental checkpoints) holds that one's
    # data: it stays, whole and committed, until nothing kept refers to it. (A step
    # whose manifest cannot be read is left alone, as always; being unreadable, it
    # cannot be restored, so what it may refer to need not stay for it.)
    refs = {s: cache[s]["refs"] for s in cache}
    needed = referenced([e.step for e in entries if e.step not in doomed], refs)
    doomed = [s for s in doomed if s not in needed]
    if dry_run or not doomed:
        return doomed
    survivors = sorted({e.step for e in entries} - set(doomed))
    if just_written is not None:
        # Written and checksummed from memory moments ago: its files' sizes are enough.
        trusted = _files_valid(storage, just_written)
    else:
        trusted = any(_fully_valid(storage, s) for s in reversed(survivors))
    if not trusted:
        log.warning(
            "retention deletes nothing in %s: none of the checkpoints it would keep %s verifies",
            storage.url,
            survivors,
        )
        audit.record("skip", reason="retention: no retained checkpoint verifies", steps=doomed)
        return []
    committer = committer_for(storage, fence=fence)
    if discard is not None and isinstance(committer, RenameCommit):
        committer.discard = discard
    # Newest first: a reference always points to a smaller step, so every doomed
    # checkpoint that refers to another doomed one is gone before it. Oldest first, a
    # crash after deleting step K would leave a doomed step K+1 that refers to it
    # listed, committed and unreadable.
    for s in each(sorted(doomed, reverse=True)):
        try:
            committer.delete(s)
        except RootInUseError:  # the fence: this writer may no longer delete
            raise
        except (CheckpointError, OSError):
            if not _gone(storage, s):
                raise
            # Another process (``resumable prune``, another writer's retention) deleted
            # it between our listing and this delete; it records its own delete.
            log.info("retention: %s was already deleted by another process", step_dir(s))
        else:
            audit.record("delete", step=s, reason="retention")
            log.info("retention deleted %s", step_dir(s))
        cache.pop(s, None)
    return doomed


def _gone(storage: Storage, step: int) -> bool:
    """Whether ``step`` is no longer a committed checkpoint (a listing that itself fails
    says nothing, so it counts as not gone)."""
    try:
        return step not in list_committed(storage)
    except (CheckpointError, OSError):
        return False


def _files_valid(storage: Storage, step: int) -> bool:
    """Whether the checkpoint ``step`` just written has its manifest and every data
    file it reads, each of its declared size: a listing per 1,000 files on an object
    store (it once read each file's header: three requests a file)."""
    try:
        CheckpointReader(storage, step).check_sizes()
    except CheckpointError as exc:
        if not _gone(storage, step):
            log.warning("checkpoint %s does not check out: %s", step_dir(step), exc)
        return False
    return True


def _fully_valid(storage: Storage, step: int) -> bool:
    try:
        CheckpointReader(storage, step).verify()
    except CheckpointError as exc:
        if not _gone(storage, step):
            log.warning("checkpoint %s does not verify: %s", step_dir(step), exc)
        return False
    return True
