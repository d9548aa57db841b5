"""What the object-store backends share: the commit by create-only write, probed once.

Object stores have no rename, so `resumable.commit.MarkerCommit` commits with
`put_if_absent`. That is safe only if the server refuses a second create-only write of
one key. `ObjectStorage` probes this once per storage and remembers the answer. A server
that ignores the precondition is refused on every call, unless the user accepted one
writer per root (``allow_unconditional_commit``): `put_if_absent` then checks and writes,
which a second writer could race.
"""

from __future__ import annotations

import errno
import logging
from abc import abstractmethod
from typing import Any

from resumable.errors import CheckpointError, NoCheckpointError, StorageError
from resumable.storage.base import Storage

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest multipart part, the floor for every object store


def not_installed(roots: str, package: str, install: str) -> CheckpointError:
    """The error for a backend whose client ``package`` is missing: ``roots`` (such as
    ``"s3://"``) need it, and ``install`` says how to get it."""
    return CheckpointError(f"{roots} checkpoints need {package}, which is not installed: {install}")


class ObjectStorage(Storage):
    """A `Storage` on an object store (S3, GCS, Azure): `put_if_absent` and its probe.

    A subclass sets ``url`` and ``allow_unconditional_commit`` in its constructor and
    provides `_object_key`, `_create` (one create-only request) and `_probe` (two on one
    key). Call order: `put_if_absent` calls `conditional_put_enforced`, which runs `_probe`
    on its first call only; then `_create`, or `exists` and `write` when the server ignores
    the precondition and the user allowed it. ``create_only``, ``overwrite`` and
    ``supported`` word the messages: the kind of write, how the overwrite got past it, and
    what a server must support.
    """

    url: str
    part_size: int
    max_concurrency: int
    allow_unconditional_commit: bool
    create_only: str
    overwrite: str
    supported: str
    _conditional_ok: bool | None = None

    def _take_transfer_options(self, options: dict[str, Any]) -> None:
        """Pop ``part_size`` (default 32 MiB, at least `MIN_PART`), ``max_concurrency``
        (default 8, at least 1) and ``allow_unconditional_commit`` (default False) from
        ``options`` into their attributes. Raises `CheckpointError` for a smaller part."""
        self.part_size = int(options.pop("part_size", 32 * MiB))
        if self.part_size < MIN_PART:
            raise CheckpointError(f"part_size must be at least 5 MiB, got {self.part_size}")
        self.max_concurrency = max(1, int(options.pop("max_concurrency", 8)))
        self.allow_unconditional_commit = bool(options.pop("allow_unconditional_commit", False))

    @abstractmethod
    def _object_key(self, path: str) -> str:
        """The key of the object ``path`` (checked by `check_relpath`)."""

    @abstractmethod
    def _create(self, path: str, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` in one create-only request; False when the
        server refuses it because the object exists. Other failures raise the project's
        errors."""

    @abstractmethod
    def _probe(self) -> bool:
        """Whether the server refuses a second create-only write of one new key (the key
        is deleted after). A failed request raises the project's errors."""

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; returns whether this call
        created it. A retried request whose first try landed reads as "exists": callers
        compare contents (see `MarkerCommit`)."""
        key = self._object_key(path)
        if not self.conditional_put_enforced():
            if self.exists(path):
                return False
            self.write(path, [data])
            return True
        return self._create(path, key, data)

    def conditional_put_enforced(self) -> bool:
        """Whether the server refuses a create-only write onto an existing object; probed
        once per storage (two writes and a delete under ``.resumable-probe/``).

        Raises `StorageError` (every time) if it does not, unless
        ``allow_unconditional_commit``."""
        if self._conditional_ok is None:
            self._conditional_ok = self._probe()
            if not self._conditional_ok and self.allow_unconditional_commit:
                log.warning(
                    "%s ignores %s; commits rely on a single writer "
                    "(allow_unconditional_commit=True)",
                    self.url,
                    self.create_only,
                )
        if not self._conditional_ok and not self.allow_unconditional_commit:
            raise StorageError(
                errno.ENOTSUP,
                f"the server behind {self.url} accepted an overwrite {self.overwrite}, so "
                f"two writers could both commit one step. Use a server that supports "
                f"{self.supported}, or, with a single writer per root only, pass "
                "storage_options={'allow_unconditional_commit': True}",
            )
        return self._conditional_ok

    def _is_object(self, path: str) -> bool:
        """Whether an object is stored at ``path`` itself (not only under ``path/``)."""
        try:
            self.size(path)
        except NoCheckpointError:
            return False
        return True
