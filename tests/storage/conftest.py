"""Backends for the shared storage suite.

Every test that takes the ``storage`` fixture runs once per backend in `BACKENDS`. A
new backend joins the suite by adding one factory here: it receives the pytest
``request`` (to pull in server fixtures, e.g. a SeaweedFS S3 endpoint) and a fresh
``tmp_path``, and returns an empty `Storage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from resumable.storage import LocalStorage, MemoryStorage, Storage

BackendFactory = Callable[[pytest.FixtureRequest, Path], Storage]

BACKENDS: dict[str, BackendFactory] = {
    "local": lambda request, tmp_path: LocalStorage(tmp_path / "root"),
    "memory": lambda request, tmp_path: MemoryStorage(),
}


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
