"""Storage backends, chosen by URL scheme.

``open_storage("runs/exp1")`` and ``open_storage("file:///abs/dir")`` give the local
filesystem backend; ``s3://bucket/prefix`` S3-compatible object storage (boto3, with
``storage_options`` such as ``endpoint_url``, ``part_size``, ``max_concurrency``);
``memory://name`` an in-process store (tests).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from resumable.errors import CheckpointError
from resumable.storage.base import Storage
from resumable.storage.local import LocalStorage
from resumable.storage.memory import MemoryStorage

__all__ = ["LocalStorage", "MemoryStorage", "Storage", "open_storage"]

_memory_stores: dict[str, MemoryStorage] = {}
_memory_lock = threading.Lock()


def open_storage(
    url: str | os.PathLike[str] | Storage, storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """The backend for ``url``: a path or ``file://`` URL, ``s3://BUCKET/PREFIX``,
    ``memory://NAME``, or an already-built `Storage` (returned as is).
    ``storage_options`` go to the backend (only S3 takes any)."""
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme == "s3":
        from resumable.storage.s3 import S3Storage

        return S3Storage(text, **dict(storage_options or {}))
    if storage_options:
        raise CheckpointError(
            f"storage_options {sorted(storage_options)} apply to s3:// URLs only, not {text!r}"
        )
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        return LocalStorage(parsed.path if parsed.scheme == "file" else text)
    if parsed.scheme == "memory":
        with _memory_lock:
            return _memory_stores.setdefault(text, MemoryStorage(text))
    raise CheckpointError(
        f"unsupported checkpoint URL scheme {parsed.scheme!r} in {text!r}; "
        "use a local path, file://, s3://, or memory://"
    )
