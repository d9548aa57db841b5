"""The audit log: one JSON line per save start, commit, skip, failure, delete, restore
and cleanup, in ``audit.jsonl`` at the checkpoint root.

Lines are appended with a single ``write`` each (``O_APPEND``), so concurrent writers
never interleave within a line. A failure to write the audit log is logged and never
fails training: the log describes the checkpoints, it is not one of them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from resumable.storage.base import Storage

AUDIT_LOG = "audit.jsonl"
log = logging.getLogger("resumable")


class AuditLog:
    """Appends to ``audit.jsonl``. With several ranks only rank 0 writes (``enabled``):
    it records the job's commits; other ranks' failures reach it as reports."""

    def __init__(self, storage: Storage, *, rank: int = 0, enabled: bool = True) -> None:
        self.storage = storage
        self.rank = rank
        self.enabled = enabled
        self._warned = False
        self._checked_tail = False

    def record(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        entry = {
            "time": round(time.time(), 6),
            "event": event,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "rank": self.rank,
            **fields,
        }
        line = json.dumps(entry, default=str, allow_nan=False) + "\n"
        try:
            if not self._checked_tail:
                line = self._repair_prefix() + line
            self.storage.append(AUDIT_LOG, line.encode())
        except Exception as exc:  # the log must never break training
            if not self._warned:
                log.warning("could not append to the audit log of %s: %s", self.storage.url, exc)
                self._warned = True

    def _repair_prefix(self) -> str:
        """A newline if a crash left the log's last line torn, so the next entry is not
        glued to it (checked once per writer)."""
        self._checked_tail = True
        try:
            size = self.storage.size(AUDIT_LOG)
            if size and self.storage.read_range(AUDIT_LOG, size - 1, 1) != b"\n":
                return "\n"
        except (FileNotFoundError, OSError, ValueError):
            pass
        return ""


def read_audit(storage: Storage) -> list[dict[str, Any]]:
    """Parsed audit entries; unparseable lines (a torn last line after a crash) are skipped."""
    try:
        data = storage.read(AUDIT_LOG)
    except FileNotFoundError:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out
