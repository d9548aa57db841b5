"""One writer per root on every backend (`resumable.lock`): a filesystem gives a lock
descriptor, the others a lease built on `Storage.put_if_absent`. A wrapper keeps the
lock of its backend (`ForwardingStorage.open_lock`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resumable.errors import RootInUseError
from resumable.lock import FileLock, LeaseLock, acquire_root, read_holder
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import ForwardingStorage


def test_a_root_has_one_holder_at_a_time(storage: Storage) -> None:
    first = acquire_root(storage, renew=False)
    assert isinstance(first, FileLock if isinstance(storage, LocalStorage) else LeaseLock)
    with pytest.raises(RootInUseError, match=f"pid {os.getpid()}"):
        acquire_root(storage, renew=False)
    holder = read_holder(storage)
    assert holder is not None and holder.pid == os.getpid()
    first.release()
    second = acquire_root(storage, renew=False)
    second.check()
    second.release()


def test_a_wrapper_keeps_the_lock_of_its_backend(tmp_path: Path) -> None:
    with acquire_root(ForwardingStorage(LocalStorage(tmp_path))) as lock:
        assert isinstance(lock, FileLock)
        with pytest.raises(RootInUseError):
            acquire_root(LocalStorage(tmp_path))
