"""The identity of a checkpoint root: a run id written once, when the root is first used.

A path or URL does not identify a run: a directory deleted and created again has the
same name and none of the old run's checkpoints. Shared-memory snapshots outlive their
job (that is their point) and are found by the root's location, so without an identity
a relaunch into a recreated directory would resume the old run's weights from memory.
With one, a snapshot records the run id of the root it was taken for, and one restored
into a root whose run id differs is discarded (`snapshot_belongs`).

``.resumable-run`` holds ``{"run_id": "<32 hex>", "created": <epoch>}``. It is created
with `Storage.put_if_absent` (a hard link on filesystems, ``If-None-Match: *`` on object
stores), so of several processes creating it at once (the ranks of a job) exactly one
writes it and all read the same id. It is never rewritten; reading it is one small read.
An unreadable file does not stop a run: its id is derived from its bytes (stable, so
snapshots taken against it still match) and a warning says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time

from resumable.errors import NoCheckpointError
from resumable.storage.base import Storage

log = logging.getLogger(__name__)

RUN_ID_FILE = ".resumable-run"
_MAX_BYTES = 4096
_RUN_ID = re.compile(r"^[0-9a-f]{32}\Z")


def read_run_id(storage: Storage) -> str | None:
    """The run id of ``storage``'s root, or None if none was written yet (a new root, or
    one last written by a `resumable` older than run ids). One small read."""
    try:
        size = storage.size(RUN_ID_FILE)
        data = bytes(storage.read_range(RUN_ID_FILE, 0, min(size, _MAX_BYTES)))
    except NoCheckpointError:
        return None
    try:
        value = json.loads(data.decode("utf-8"))
        run_id = value["run_id"]
        if isinstance(run_id, str) and _RUN_ID.match(run_id) and size <= _MAX_BYTES:
            return run_id
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        pass
    derived = hashlib.sha256(data).hexdigest()[:32]
    log.warning(
        "%s/%s does not hold a run id as resumable writes it; using %s, derived from its "
        "bytes. Remove the file to give the root a new identity (shared-memory snapshots "
        "taken for it are then discarded)",
        storage.url,
        RUN_ID_FILE,
        derived,
    )
    return derived


def ensure_run_id(storage: Storage) -> str:
    """The run id of ``storage``'s root, written now if it has none. Safe to call from
    several processes at once: all get the same id. Storage failures raise
    `StorageError`."""
    existing = read_run_id(storage)
    if existing is not None:
        return existing
    run_id = secrets.token_hex(16)
    record = json.dumps({"run_id": run_id, "created": time.time()}).encode() + b"\n"
    if storage.put_if_absent(RUN_ID_FILE, record):
        return run_id
    winner = read_run_id(storage)  # created by another process meanwhile
    if winner is None:  # deleted again at once: whoever writes next defines the root
        return ensure_run_id(storage)
    return winner


def snapshot_belongs(snapshot_run_id: str | None, root_run_id: str | None) -> bool:
    """Whether a memory snapshot recorded for ``snapshot_run_id`` may be restored into a
    root whose run id is ``root_run_id``: only when both are known and equal (a snapshot
    without a run id predates them and cannot be placed; discarding it costs at most the
    steps since the newest commit)."""
    return snapshot_run_id is not None and snapshot_run_id == root_run_id
