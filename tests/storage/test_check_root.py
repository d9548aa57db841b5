"""`Storage.check_root`: a root that cannot hold checkpoints is refused at once, with a
`StorageError` saying what is wrong, instead of at the first persist (a regular file as
root used to restore 0, then fail 30 minutes later with ``[Errno 17] File exists``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from resumable.errors import StorageError
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import ForwardingStorage
from resumable.storage.s3 import S3Storage

as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any directory")


def test_a_fresh_root_passes_on_every_backend(storage: Storage) -> None:
    storage.check_root()
    storage.check_root()


def test_a_missing_root_is_created_and_no_probe_is_left(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "root"
    ForwardingStorage(LocalStorage(root)).check_root()
    assert root.is_dir() and list(root.iterdir()) == []


def test_a_regular_file_as_root(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match="is a regular file, not a directory") as err:
        LocalStorage(tmp_path / "f").check_root()
    assert err.value.errno == errno.ENOTDIR
    assert (tmp_path / "f").read_text() == "x"


def test_a_link_to_a_file_as_root(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with pytest.raises(StorageError, match="not a directory"):
        LocalStorage(tmp_path / "link").check_root()


def test_a_root_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match=r"cannot create .*f is a regular file"):
        LocalStorage(tmp_path / "f" / "sub" / "root").check_root()


@as_root
def test_a_read_only_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(StorageError, match=r"cannot write in the checkpoint root.*owner"):
            LocalStorage(root).check_root()
    finally:
        root.chmod(0o755)


@as_root
def test_an_unwritable_parent(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="cannot create the checkpoint root"):
            LocalStorage(parent / "root").check_root()
    finally:
        parent.chmod(0o755)


def _sysfs_dir() -> Path | None:
    d = Path("/sys/kernel")
    return d if (d.is_dir() and not os.access(d, os.W_OK)) or d.is_dir() else None


@pytest.mark.skipif(_sysfs_dir() is None, reason="no /sys/kernel")
def test_a_root_on_a_file_system_nobody_may_write() -> None:
    """sysfs refuses new files even to root: a read-only root and parent without chmod."""
    with pytest.raises(StorageError, match="cannot write in the checkpoint root /sys/kernel"):
        LocalStorage("/sys/kernel").check_root()
    with pytest.raises(StorageError, match="cannot create the checkpoint root"):
        LocalStorage("/sys/kernel/resumable-root").check_root()


def test_a_missing_bucket(seaweedfs: Any) -> None:
    storage = S3Storage(
        "s3://no-such-bucket-resumable/run",
        endpoint_url=seaweedfs.endpoint,
        aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key,
        region_name=seaweedfs.region,
        max_attempts=1,
    )
    with pytest.raises(StorageError, match="does not exist"):
        storage.check_root()
