"""Storage backends, chosen by URL scheme.

``open_storage("runs/exp1")`` and ``open_storage("file:///abs/dir")`` give the local
filesystem backend; ``memory://name`` an in-process store (tests). Further schemes
(``s3://``) plug in here.
"""

from __future__ import annotations

import os
import threading
from urllib.parse import urlparse

from resumable.errors import CheckpointError
from resumable.storage.base import Storage
from resumable.storage.local import LocalStorage
from resumable.storage.memory import MemoryStorage

__all__ = ["LocalStorage", "MemoryStorage", "Storage", "open_storage"]

_memory_stores: dict[str, MemoryStorage] = {}
_memory_lock = threading.Lock()


def open_storage(url: str | os.PathLike[str] | Storage) -> Storage:
    """The backend for ``url``: a path or ``file://`` URL, ``memory://NAME``, or an
    already-built `Storage` (returned as is)."""
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        return LocalStorage(parsed.path if parsed.scheme == "file" else text)
    if parsed.scheme == "memory":
        with _memory_lock:
            return _memory_stores.setdefault(text, MemoryStorage(text))
    raise CheckpointError(
        f"unsupported checkpoint URL scheme {parsed.scheme!r} in {text!r}; "
        "use a local path, file://, or memory://"
    )
