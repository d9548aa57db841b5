"""Google Cloud Storage (``gs://``) and Azure Blob Storage (``az://``, ``abfs://``) through fsspec.

The data path is fsspec's (`gcsfs`, `adlfs`): ranged reads run concurrently with
``cat_ranges``, writes stream through the filesystem's own multi-part upload (a
resumable upload on GCS, staged blocks on Azure), listings and deletes are the
library's. What differs between the two stores sits in one small table, `FLAVORS`:

- **The commit primitive.** ``pipe_file(path, data, mode="create")`` is a true
  create-only write on both: one request carrying ``ifGenerationMatch=0`` on GCS (a
  single multipart upload, the only form fake-gcs-server checks the precondition on)
  and ``If-None-Match: *`` on Azure. gcsfs's ``open(path, "xb")`` is *not* create-only
  (its resumable upload drops the precondition on the emulator), so it is never used.
  A refusal arrives as `FileExistsError` from the current gcsfs and adlfs, and as an
  HTTP 412 (GCS) or 409 (Azure) from older ones: the table names both.
- **Credentials and endpoints**, the way each ecosystem expects: GCS reads
  ``GOOGLE_APPLICATION_CREDENTIALS`` (or the metadata server) and
  ``STORAGE_EMULATOR_HOST``; Azure reads ``AZURE_STORAGE_CONNECTION_STRING``, or
  ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` /
  ``AZURE_STORAGE_SAS_TOKEN``, or an account name alone with ``DefaultAzureCredential``
  (``azure-identity``).

Everything else matches `resumable.storage.s3.S3Storage`: keys are ``check_relpath``-ed
paths under the URL's prefix, no rename and no append, the marker commit
(`resumable.commit.MarkerCommit`) on top of `put_if_absent`, probed once per storage
by `conditional_put_enforced`. Listing caches are off: every call asks the server.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from resumable.format import check_relpath
from resumable.storage.base import Buffer
from resumable.storage.object_store import ObjectStorage, not_installed

log = logging.getLogger(__name__)

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,221}[a-z0-9]\Z")
_OWN_OPTIONS = {
    "part_size",
    "max_concurrency",
    "allow_unconditional_commit",
    "max_attempts",
    "connect_timeout",
    "read_timeout",
}


def _status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec backend's error carries, if any."""
    for attr in ("code", "status_code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class Limits:
    """How long and how often a filesystem's requests may try (from `FsspecStorage`'s
    ``max_attempts``, ``connect_timeout`` and ``read_timeout``)."""

    attempts: int  # tries per request, the first included; at least 1
    connect: float  # seconds to connect
    read: float  # seconds to wait for the next bytes of an answer


@dataclass(frozen=True)
class Flavor:
    """What one object store needs beyond fsspec's common verbs."""

    name: str  # for messages
    schemes: tuple[str, ...]
    bucket_word: str  # "bucket" / "container"
    refusal_status: int  # the HTTP status of a refused create-only write
    client_options: frozenset[str]  # constructor arguments passed through to fsspec
    credentials_hint: str
    make_fs: Callable[[dict[str, Any], Limits], Any]  # (client options, limits) -> filesystem

    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the server refusing a create-only write onto an existing object."""
        return isinstance(exc, FileExistsError) or _status(exc) == self.refusal_status


def _make_gcs(options: dict[str, Any], limits: Limits) -> Any:
    # gcsfs's own `GCSFileSystem`, never the "experimental" subclass that
    # `import gcsfs` substitutes unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false *at the
    # time gcsfs is first imported* (by whichever library imports it first: Lightning
    # does). That subclass first asks for the bucket's type over gRPC, which stalls each
    # call 60 s on an emulator; the plain class answers a real bucket the same for the
    # calls used here (no renames on object stores).
    try:
        import aiohttp
        import gcsfs  # noqa: F401 (the package first: a missing one raises here)
        from gcsfs.core import GCSFileSystem
        from gcsfs.retry import retry_request
    except ImportError as exc:
        raise not_installed(
            "gs://",
            "gcsfs",
            "pip install gcsfs (in a source checkout of resumable: pip install -e '.[gcs]')",
        ) from exc
    if "endpoint_url" not in options and os.environ.get("STORAGE_EMULATOR_HOST"):
        options.setdefault("token", "anon")  # an emulator takes no credentials
    # gcsfs sends each request with no timeout at all, and retries it six times over
    # about 35 s: a server that is not there took a minute to report. Both bounded here,
    # as the S3 backend bounds boto3's.
    options.setdefault(
        "requests_timeout",
        aiohttp.ClientTimeout(total=None, sock_connect=limits.connect, sock_read=limits.read),
    )
    fs = GCSFileSystem(**options)
    raw = getattr(GCSFileSystem._request, "__wrapped__", None)
    if raw is not None:
        fs._request = types.MethodType(retry_request(retries=limits.attempts)(raw), fs)
    return fs


def _make_azure(options: dict[str, Any], limits: Limits) -> Any:
    try:
        import adlfs
    except ImportError as exc:
        raise not_installed(
            "az:// and abfs://",
            "adlfs",
            "pip install adlfs azure-identity (in a source checkout of resumable: "
            "pip install -e '.[azure]')",
        ) from exc
    options.setdefault("connection_timeout", limits.connect)
    options.setdefault("read_timeout", limits.read)
    try:
        fs = adlfs.AzureBlobFileSystem(**options)
    except ValueError as exc:
        raise StorageError(
            errno.EACCES,
            f"no Azure credentials: {exc}. Set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
            "AZURE_STORAGE_SAS_TOKEN, or AZURE_STORAGE_ACCOUNT_NAME alone with "
            "azure-identity installed (DefaultAzureCredential), or pass them in "
            "storage_options",
        ) from exc
    # The SDK's default (3 retries from 15 s, x3 each) takes 80 s to give up on a
    # server that is not there; bound it like the S3 backend's max_attempts.
    policy = getattr(getattr(fs.service_client, "_config", None), "retry_policy", None)
    if policy is not None and hasattr(policy, "total_retries"):
        policy.total_retries = policy.connect_retries = limits.attempts - 1
        if hasattr(policy, "initial_backoff"):
            policy.initial_backoff, policy.increment_base = 0.5, 2
    return fs


GCS = Flavor(
    name="Google Cloud Storage",
    schemes=("gs", "gcs"),
    bucket_word="bucket",
    refusal_status=412,
    client_options=frozenset(
        {"project", "token", "endpoint_url", "requester_pays", "consistency", "access"}
    ),
    credentials_hint="GOOGLE_APPLICATION_CREDENTIALS, or storage_options={'token': ...}",
    make_fs=_make_gcs,
)
AZURE = Flavor(
    name="Azure Blob Storage",
    schemes=("az", "abfs", "abfss"),
    bucket_word="container",
    refusal_status=409,
    client_options=frozenset(
        {
            "account_name",
            "account_key",
            "connection_string",
            "credential",
            "sas_token",
            "tenant_id",
            "client_id",
            "client_secret",
            "account_host",
            "anon",
        }
    ),
    credentials_hint=(
        "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME with "
        "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or DefaultAzureCredential"
    ),
    make_fs=_make_azure,
)
FLAVORS: dict[str, Flavor] = {s: f for f in (GCS, AZURE) for s in f.schemes}


def parse_url(url: str) -> tuple[Flavor, str, str, str | None]:
    """``gs://bucket/prefix`` -> (flavor, bucket, prefix, account); the account comes
    from an ``abfs://container@account.dfs.core.windows.net/prefix`` form only."""
    parsed = urlparse(url)
    flavor = FLAVORS.get(parsed.scheme)
    netloc = parsed.netloc
    account = None
    if "@" in netloc and flavor is AZURE:
        netloc, host = netloc.split("@", 1)
        account = host.split(".", 1)[0]
    if flavor is None or not _BUCKET.match(netloc):
        kind = flavor.bucket_word if flavor else "bucket"
        raise CheckpointError(
            f"invalid object storage URL {url!r}: expected gs://BUCKET/PREFIX, "
            f"az://CONTAINER/PREFIX or abfs://CONTAINER/PREFIX with a valid {kind} name"
        )
    prefix = parsed.path.strip("/")
    if prefix:
        check_relpath(prefix)
    return flavor, netloc, prefix, account


class FsspecStorage(ObjectStorage):
    """Objects under ``gs://bucket/prefix`` or ``az://container/prefix`` (``abfs://``).

    Args:
        url: the root.
        filesystem: a ready fsspec filesystem (then the client options are ignored).
        part_size: size of each ranged read run in parallel, and of each upload block
            (default 32 MiB, at least 5 MiB).
        max_concurrency: ranges in flight per read (default 8).
        max_attempts: tries per request, the first included (default 4): a server
            that is not there is reported after 7 to 10 s.
        connect_timeout, read_timeout: seconds to connect, and to wait for the next
            bytes of an answer (default 10 and 60).
        allow_unconditional_commit: accept a server that ignores create-only writes
            (one writer per root only), as for ``s3://``.
        anything else: passed to the filesystem (`gcsfs.GCSFileSystem`:
            ``project``, ``token``, ``endpoint_url``, ...; `adlfs.AzureBlobFileSystem`:
            ``account_name``, ``account_key``, ``connection_string``, ``credential``,
            ``sas_token``, ...); unset ones come from the environment.
    """

    supports_rename = False
    supports_append = False
    create_only = "create-only writes"
    overwrite = "of a create-only write"
    supported = "preconditions"

    def __init__(self, url: str, *, filesystem: Any = None, **options: Any) -> None:
        self.flavor, self.bucket, self.prefix, account = parse_url(url)
        unknown = set(options) - _OWN_OPTIONS - self.flavor.client_options
        if unknown:
            raise CheckpointError(
                f"unknown {self.flavor.name} storage option(s) {sorted(unknown)}; expected "
                f"some of {sorted(_OWN_OPTIONS | self.flavor.client_options)}"
            )
        scheme = urlparse(url).scheme
        self.url = f"{scheme}://{self.bucket}/{self.prefix}".rstrip("/")
        self._take_transfer_options(options)
        attempts = max(1, int(options.pop("max_attempts", 4)))
        if filesystem is None:
            if account is not None:
                options.setdefault("account_name", account)
            options.update(skip_instance_cache=True, use_listings_cache=False)
            limits = Limits(
                attempts,
                float(options.pop("connect_timeout", 10)),
                float(options.pop("read_timeout", 60)),
            )
            filesystem = self.flavor.make_fs(options, limits)
        self.fs = filesystem
        self._bucket_checked = False

    @property
    def location(self) -> str:
        endpoint = getattr(self.fs, "_endpoint", None) or getattr(self.fs, "account_url", None)
        return f"{self.url} at {endpoint}" if endpoint else self.url

    # ----------------------------------------------------------------- helpers

    def _key(self, path: str) -> str:
        """``bucket/prefix/path`` ("" is the root prefix itself)."""
        rel = check_relpath(path) if path else ""
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    def _object_key(self, path: str) -> str:
        return self._key(check_relpath(path))

    def _bucket_exists(self) -> bool:
        try:
            return bool(self.fs.exists(self.bucket))
        except Exception:
            return True  # cannot tell: report the original error

    def _error(self, action: str, path: str, exc: BaseException) -> OSError:
        """The project's error for a failed request (after the client's retries)."""
        where = f"{self.url}/{path}" if path else self.url
        status = _status(exc)
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        missing_bucket = "ContainerNotFound" in str(exc) or "BucketNotFound" in str(exc)
        if isinstance(exc, FileNotFoundError) or status == 404 or missing_bucket:
            if missing_bucket or not self._bucket_exists():
                return StorageError(
                    errno.ENOENT,
                    f"could not {action} {where}: {self.flavor.bucket_word} "
                    f"{self.bucket!r} does not exist; create it first or fix the URL",
                )
            return NoCheckpointError(errno.ENOENT, f"no such object: {where}")
        if status in (401, 403) or "AuthenticationFailed" in str(exc) or "credential" in text:
            return StorageError(
                errno.EACCES,
                f"could not {action} {where}: {text}; check the credentials "
                f"({self.flavor.credentials_hint}) and the access rights",
            )
        return StorageError(
            errno.EIO,
            f"could not {action} {where}: {text} (after retries; check the endpoint and "
            "the network)",
        )

    # ----------------------------------------------------------------- writes

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Stream ``chunks`` through the filesystem's upload (no copy of the whole
        object); a failure midway cancels the upload, so no object is left."""
        key = self._object_key(path)
        total = 0
        try:
            f = self.fs.open(key, "wb", block_size=self.part_size)
        except Exception as exc:
            raise self._error("write", path, exc) from exc
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                if len(view):
                    f.write(view)
                    total += len(view)
            f.close()
        except BaseException as exc:
            try:
                f.discard()  # cancel the upload (its blocks expire on the server)
            except Exception as cleanup:
                log.warning("could not cancel the upload of %s/%s: %s", self.url, path, cleanup)
            f.closed = True  # or the file's finaliser would commit the partial object
            if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
                raise self._error("write", path, exc) from exc
            raise
        return total

    def _create(self, path: str, key: str, data: bytes) -> bool:
        """``pipe_file(mode="create")``: one create-only request."""
        try:
            self.fs.pipe_file(key, bytes(data), mode="create")
        except Exception as exc:
            if self.flavor.refused(exc):
                return False
            raise self._error("write", path, exc) from exc
        return True

    def _probe(self) -> bool:
        key = self._key(f".resumable-probe/{secrets.token_hex(8)}")
        try:
            try:
                self.fs.pipe_file(key, b"1", mode="create")
                self.fs.pipe_file(key, b"2", mode="create")
                ok = False
            except Exception as exc:
                if not self.flavor.refused(exc):
                    raise
                ok = True
            self.fs.rm_file(key)
        except Exception as exc:
            raise self._error("probe create-only writes in", "", exc) from exc
        return ok

    # ----------------------------------------------------------------- reads

    def size(self, path: str) -> int:
        key = self._object_key(path)
        try:
            info = self.fs.info(key)
        except Exception as exc:
            raise self._error("stat", path, exc) from exc
        if info.get("type") != "file":
            raise NoCheckpointError(errno.ENOENT, f"no such object: {self.url}/{path}")
        return int(info["size"])

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if 0 < length <= self.part_size:  # one request, its bytes returned as they come
            parts = self._ranges(path, [offset], [offset + length])
            if len(parts) == 1 and len(parts[0]) == length:
                return bytes(parts[0])
            raise self._truncated(path, offset, length)
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    def _ranges(self, path: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """The byte ranges ``[starts[i], ends[i])`` of ``path``, fetched concurrently; a
        range starting past the end gives ``[]`` (the caller reports the truncation)."""
        key = self._object_key(path)  # a hostile name is refused before any request
        try:
            parts: list[bytes] = self.fs.cat_ranges(
                [key] * len(starts),
                starts,
                ends,
                on_error="raise",
                batch_size=self.max_concurrency,
            )
        except Exception as exc:
            if _status(exc) != 416 and "InvalidRange" not in str(exc):
                raise self._error("read", path, exc) from exc
            return []
        return parts

    def _truncated(self, path: str, offset: int, length: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.url}/{path} is truncated: wanted bytes [{offset}, "
            f"{offset + length}), the object ends before"
        )

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``path``: ranges of
        ``part_size`` fetched concurrently (``cat_ranges``), each checked for length."""
        out = out.cast("B") if out.format != "B" else out
        length = len(out)
        if length == 0:
            self.size(path)  # still an error if missing
            return
        starts = list(range(offset, offset + length, self.part_size))
        ends = [min(st + self.part_size, offset + length) for st in starts]
        parts = self._ranges(path, starts, ends)
        got = 0
        for st, e, part in zip(starts, ends, parts):
            if len(part) != e - st:
                break
            out[st - offset : e - offset] = part
            got += 1
        if got != len(starts):
            raise self._truncated(path, offset, length)

    def list_dir(self, path: str = "") -> list[str]:
        base = self._key(path)
        try:
            entries = self.fs.ls(base, detail=False, refresh=True)
        except FileNotFoundError:
            if not path:
                self._check_bucket()
            return []
        except Exception as exc:
            raise self._error("list", path, exc) from exc
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        names.discard("")
        if base in {str(e).rstrip("/") for e in entries}:  # ls of a file lists the file
            return []
        return sorted(names)

    def _check_bucket(self) -> None:
        """An empty listing of the root of a missing bucket is an error, not "no
        checkpoints yet" (a typo would otherwise show only at the first save)."""
        if not self._bucket_checked:
            if not self._bucket_exists():
                raise StorageError(
                    errno.ENOENT,
                    f"{self.flavor.bucket_word} {self.bucket!r} of {self.url} does not "
                    "exist; create it first or fix the URL",
                )
            self._bucket_checked = True

    def list_files(self, path: str = "") -> dict[str, int]:
        """Every object under ``path`` and its size (``find`` with details: the
        client pages the listing)."""
        base = self._key(path)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._error("list", path, exc) from exc
        if not isinstance(found, dict):  # adlfs answers a list when ``base`` is a file
            found = {str(n): {"type": "other"} for n in found}
        out: dict[str, int] = {}
        for name, info in sorted(found.items()):
            name = str(name)
            if info.get("type") != "file" or not name.startswith(base + "/"):
                continue
            out[check_relpath(name[len(base) + 1 :])] = int(info["size"])
        return out

    def exists(self, path: str) -> bool:
        """An object at ``path``, or any object under ``path/`` (a "directory")."""
        if path and self._is_object(path):
            return True
        return bool(self.list_dir(path))

    def delete(self, path: str) -> None:
        """Delete the object ``path`` and every object under ``path/``."""
        names = list(self.list_files(path))
        keys = [self._key(f"{path}/{name}" if path else name) for name in names]
        if path and self._is_object(path):
            keys.append(self._object_key(path))
        if not keys:
            return
        try:
            self.fs.rm(keys)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error("delete", path, exc) from exc

    def close(self) -> None:
        """fsspec keeps one session per filesystem for the life of the process."""
