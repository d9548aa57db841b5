"""Which roots ``storage_options`` apply to, and the refusal when none does.

``storage_options`` configure an object-store client (endpoint, credentials, part
size). A local path, a ``memory://`` store or an already-built `Storage` has no client to
take them. Dropping them there would hide a root missing its ``s3://``: the run would
checkpoint to a local directory instead. So options that no root can use are refused,
naming them and saying what to do. With a mirror they apply to whichever of the two
roots is an object store; one of them must be.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from resumable.errors import CheckpointError
from resumable.storage.base import Storage

__all__ = [
    "FSSPEC_SCHEMES",
    "OBJECT_SCHEMES",
    "check_storage_options",
    "is_object_root",
    "options_for",
]

Root = str | os.PathLike[str] | Storage

FSSPEC_SCHEMES = ("gs", "gcs", "az", "abfs", "abfss")
OBJECT_SCHEMES = ("s3", *FSSPEC_SCHEMES)


def is_object_root(root: Root | None) -> bool:
    """Whether ``root`` is an object-store URL (``s3://``, ``gs://``, ``az://``,
    ``abfs://``...), the only kind of root whose backend ``storage_options`` build."""
    if root is None or isinstance(root, Storage):
        return False
    return urlparse(os.fspath(root)).scheme in OBJECT_SCHEMES


def check_storage_options(
    root: Root, storage_options: Mapping[str, Any] | None, *, mirror: Root | None = None
) -> None:
    """Refuse ``storage_options`` that neither ``root`` nor ``mirror`` can use.

    Called before anything is opened, by `resumable.storage.open_storage` (one root)
    and by the `Checkpointer` (its root and mirror). Empty or None options pass.

    Raises:
        CheckpointError: options were given and no root is an object-store URL; the
            message names the options and the root(s).
    """
    if not storage_options or is_object_root(root) or is_object_root(mirror):
        return
    roots = [_describe(root)] + ([_describe(mirror)] if mirror is not None else [])
    raise CheckpointError(
        f"storage_options {sorted(storage_options)} apply to object storage URLs only "
        f"(s3://, gs://, az://, abfs://), not {' or '.join(roots)}; give an object-store "
        "root (or mirror), or drop storage_options"
    )


def options_for(root: Root, storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The options ``root``'s backend is built with: ``storage_options`` for an
    object-store URL, None for any other root (after `check_storage_options` passed,
    the options belong to the other root)."""
    if storage_options and is_object_root(root):
        return dict(storage_options)
    return None


def _describe(root: Root) -> str:
    if isinstance(root, Storage):
        return f"an already-built {type(root).__name__} (pass them to its constructor)"
    return repr(os.fspath(root))
