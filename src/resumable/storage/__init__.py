"""Storage backends, chosen by URL scheme.

``open_storage("runs/exp1")`` and ``open_storage("file:///abs/dir")`` give the local
filesystem backend; ``s3://bucket/prefix`` S3-compatible object storage (boto3, with
``storage_options`` such as ``endpoint_url``, ``part_size``, ``max_concurrency``);
``gs://bucket/prefix`` Google Cloud Storage and ``az://container/prefix`` (or
``abfs://``) Azure Blob Storage, both through fsspec (gcsfs, adlfs; see
`resumable.storage.fsspec_store`); ``memory://name`` an in-process store (tests).
``storage_options`` given for any other root are refused (`resumable.storage.options`).
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
from resumable.storage.options import (
    FSSPEC_SCHEMES,
    OBJECT_SCHEMES,
    check_storage_options,
    options_for,
)

__all__ = [
    "OBJECT_SCHEMES",
    "LocalStorage",
    "MemoryStorage",
    "Storage",
    "check_storage_options",
    "open_storage",
    "options_for",
]

_memory_stores: dict[str, MemoryStorage] = {}
_memory_lock = threading.Lock()


def open_storage(
    url: str | os.PathLike[str] | Storage, storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """The backend for ``url``: a path or ``file://`` URL, ``s3://BUCKET/PREFIX``,
    ``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` (``abfs://``), ``memory://NAME``,
    or an already-built `Storage` (returned as is). ``storage_options`` go to the
    backend of an object-store URL.

    Raises:
        CheckpointError: ``storage_options`` for another root (`check_storage_options`),
            a local root that would mean another directory, or an unsupported scheme.
    """
    check_storage_options(url, storage_options)
    if isinstance(url, Storage):
        return url
    text = os.fspath(url)
    parsed = urlparse(text)
    if parsed.scheme == "s3":
        from resumable.storage.s3 import S3Storage

        return S3Storage(text, **dict(storage_options or {}))
    if parsed.scheme in FSSPEC_SCHEMES:
        from resumable.storage.fsspec_store import FsspecStorage

        return FsspecStorage(text, **dict(storage_options or {}))
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        _refuse_misleading_root(text, parsed.scheme, parsed.netloc, parsed.path)
        return LocalStorage(parsed.path if parsed.scheme == "file" else text)
    if parsed.scheme == "memory":
        with _memory_lock:
            return _memory_stores.setdefault(text, MemoryStorage(text))
    raise CheckpointError(
        f"unsupported checkpoint URL scheme {parsed.scheme!r} in {text!r}; "
        "use a local path, file://, s3://, gs://, az://, abfs://, or memory://. "
        "HDFS is not supported (docs/cloud-storage.md says why)"
    )


def _refuse_misleading_root(text: str, scheme: str, host: str, path: str) -> None:
    """Refuse local roots that would silently mean another directory: an empty one (the
    current directory) and ``file://`` URLs whose host part is neither empty nor
    ``localhost`` (``file://runs/x`` names host ``runs`` and path ``/x``)."""
    if not text.strip():
        raise CheckpointError(
            "the checkpoint root is empty (or blank), which would mean the current "
            "directory; pass a directory such as 'runs/exp1' or file:///abs/path"
        )
    if scheme == "file" and host not in ("", "localhost"):
        raise CheckpointError(
            f"{text!r} names the host {host!r} and the directory {path or '/'!r}: a "
            "file:// URL takes an absolute path after three slashes. Use "
            f"file:///abs/path or a plain path such as {host + path!r}"
        )
    if scheme == "file" and not path:
        raise CheckpointError(f"{text!r} names no directory; use file:///abs/path or a plain path")
