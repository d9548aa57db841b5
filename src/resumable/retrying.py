"""One retry loop for storage work done in the background (persists, mirror uploads).

Requests to an object store are already retried by its client (botocore's standard
mode); this loop retries a whole unit of work (a checkpoint's write and commit, an
upload) when it failed with a `StorageError` that another try may not meet again,
with exponential backoff. Errors that no retry can fix (``permanent``) are raised at
once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection
from typing import TypeVar

from resumable.errors import StorageError

T = TypeVar("T")


def retrying(
    work: Callable[[], T],
    *,
    retries: int,
    backoff_s: float,
    permanent: Collection[int],
    on_retry: Callable[[StorageError, int], None],
) -> T:
    """``work()``, tried again up to ``retries`` times after a transient `StorageError`
    (``on_retry(error, n)`` before the n-th retry, then a sleep of
    ``backoff_s * 2**(n-1)``); the last error, or a permanent one, is raised."""
    for n in itertools.count(1):
        try:
            return work()
        except StorageError as exc:
            if exc.errno in permanent or n > retries:
                raise
            on_retry(exc, n)
            time.sleep(backoff_s * 2 ** (n - 1))
    raise AssertionError("unreachable")  # pragma: no cover
