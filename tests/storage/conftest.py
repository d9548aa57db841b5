"""Backends for the shared storage suite.

Every test that takes the ``storage`` fixture runs once per backend in `BACKENDS`. A
new backend joins the suite by adding one factory here: it receives the pytest
``request`` (to pull in server fixtures, e.g. a SeaweedFS S3 endpoint) and a fresh
``tmp_path``, and returns an empty `Storage`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.storage import LocalStorage, MemoryStorage, Storage
from resumable.storage.fsspec_store import FsspecStorage
from resumable.storage.s3 import S3Storage

BackendFactory = Callable[[pytest.FixtureRequest, Path], Storage]


def _s3(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh prefix in the suite's bucket on the session's SeaweedFS server (a bucket
    per test would cost a volume allocation each); other tests' keys live beside it and
    must stay invisible."""
    bucket = request.getfixturevalue("s3_suite_bucket")
    server = request.getfixturevalue("seaweedfs")
    return S3Storage(
        f"s3://{bucket}/runs/{uuid.uuid4().hex[:12]}",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        part_size=5 << 20,
        max_attempts=2,
        connect_timeout=5,
        read_timeout=20,
    )


def _gcs(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh prefix in the suite's bucket on the session's fake-gcs-server."""
    server = request.getfixturevalue("fake_gcs")
    bucket = request.getfixturevalue("gcs_suite_bucket")
    url = f"gs://{bucket}/runs/{uuid.uuid4().hex[:12]}"
    return FsspecStorage(url, **server.options(part_size=5 << 20))


def _azure(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh prefix in the suite's container on the session's Azurite."""
    server = request.getfixturevalue("azurite")
    bucket = request.getfixturevalue("azure_suite_bucket")
    url = f"az://{bucket}/runs/{uuid.uuid4().hex[:12]}"
    return FsspecStorage(url, **server.options(part_size=5 << 20, max_attempts=2))


BACKENDS: dict[str, BackendFactory] = {
    "local": lambda request, tmp_path: LocalStorage(tmp_path / "root"),
    "memory": lambda request, tmp_path: MemoryStorage(),
    "s3": _s3,
    "gcs": _gcs,
    "azure": _azure,
}


@pytest.fixture(scope="session")
def s3_suite_bucket(seaweedfs: Any) -> str:
    return str(seaweedfs.new_bucket("suite"))


@pytest.fixture(scope="session")
def gcs_suite_bucket(fake_gcs: Any) -> str:
    return str(fake_gcs.new_bucket("suite"))


@pytest.fixture(scope="session")
def azure_suite_bucket(azurite: Any) -> str:
    return str(azurite.new_bucket("suite"))


@pytest.fixture(params=sorted(BACKENDS))
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    """An empty checkpoint root on each backend in turn."""
    backend = BACKENDS[request.param](request, tmp_path)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def local_storage(tmp_path: Path) -> Iterator[LocalStorage]:
    """The local backend alone, for filesystem-only behaviour (symlinks, fsync, ENOSPC)."""
    backend = LocalStorage(tmp_path / "root")
    try:
        yield backend
    finally:
        backend.close()
