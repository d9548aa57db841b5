"""S3-compatible object storage backend (AWS S3, MinIO, Ceph RGW, SeaweedFS, ...).

Built on boto3, the reference S3 client (why boto3 and not s3fs: ``docs/decisions.md``).
A root is ``s3://bucket/prefix``; every path is a key under that prefix, validated by
`check_relpath` first, so nothing read from a checkpoint can name a key outside it.

- **Throughput.** Objects above ``part_size`` go up as multipart uploads whose parts
  are sent ``max_concurrency`` at a time, straight from the caller's buffers (no copy of
  the snapshot); large reads are split into ranged GETs run in parallel into one
  buffer.
- **Bounded, retried requests.** Every request has a connect and a read timeout.
  Transient failures (5xx, throttling, connection resets, timeouts) are retried by
  botocore's "standard" retry mode (exponential backoff with full jitter) up to
  ``max_attempts``; then they surface as `StorageError`.
- **End-to-end integrity.** Every PUT and part carries a CRC32 of its bytes that the
  server checks before accepting it (a corrupted upload fails with ``BadDigest``).
  Reads are checked by the manifest's own per-tensor checksums.
- **Commit.** There is no rename: `put_if_absent` (``If-None-Match: *``) is the
  primitive `resumable.commit.MarkerCommit` builds on, and `conditional_put_enforced`
  probes once that the server really refuses an overwrite.
- **No append.** An object cannot grow, and a read-modify-write would lose the bytes of
  a concurrent writer, so ``supports_append`` is false (the audit log writes segments
  of its own instead, see `resumable.audit`).
"""

from __future__ import annotations

import errno
import io
import logging
import re
import secrets
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
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

# S3's limits: parts of 5 MiB (`object_store.MIN_PART`) to 5 GiB, the last may be
# smaller; at most 10,000 per upload.
MAX_PARTS = 10_000
_SESSIONS: dict[str | None, Any] = {}
_DELETE_BATCH_MIN = 200  # keys per DeleteObjects before a second batch is sent in parallel
_SESSION_LOCK = threading.Lock()
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")

# Options accepted in ``storage_options`` besides the boto3 session/client arguments.
_OWN_OPTIONS = {
    "part_size",
    "max_concurrency",
    "connect_timeout",
    "read_timeout",
    "max_attempts",
    "allow_unconditional_commit",
    "addressing_style",
}
_CLIENT_OPTIONS = {
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "profile_name",
    "verify",
}


class _PartReader(io.RawIOBase):
    """A seekable file object over a list of buffers, read without copying them first:
    botocore seeks back to re-read a body for its checksum, signature and retries."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._len = sum(len(v) for v in views)
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = min(max(0, base + offset), self._len)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        pos = self._pos
        for v in self._views:
            if pos >= len(v):
                pos -= len(v)
                continue
            take = min(len(v) - pos, len(out) - n)
            out[n : n + take] = v[pos : pos + take]
            n += take
            pos = 0
            if n == len(out):
                break
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._len - self._pos
        buf = bytearray(min(size, self._len - self._pos))
        n = self.readinto(buf)
        return bytes(buf[:n])


def _split(views: list[memoryview], part_size: int) -> Iterator[list[memoryview]]:
    """Consecutive slices of ``views`` (concatenated) of ``part_size`` bytes each."""
    part: list[memoryview] = []
    room = part_size
    for v in views:
        while len(v):
            take = min(room, len(v))
            part.append(v[:take])
            v = v[take:]
            room -= take
            if room == 0:
                yield part
                part, room = [], part_size
    if part:
        yield part


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (prefix may be "")."""
    parsed = urlparse(url)
    bucket = parsed.netloc
    if parsed.scheme != "s3" or not _BUCKET.match(bucket):
        raise CheckpointError(
            f"invalid S3 URL {url!r}: expected s3://BUCKET/PREFIX with a valid bucket name"
        )
    prefix = parsed.path.strip("/")
    if prefix:
        check_relpath(prefix)
    return bucket, prefix


class S3Storage(ObjectStorage):
    """Objects under ``s3://bucket/prefix``.

    Args:
        url: ``s3://bucket/prefix``.
        client: a ready boto3 S3 client (then the client options below are ignored).
        endpoint_url, region_name, aws_access_key_id, aws_secret_access_key,
            aws_session_token, profile_name, verify: passed to boto3; unset ones come
            from the standard AWS configuration (environment, ``~/.aws``,
            ``AWS_ENDPOINT_URL``).
        part_size: multipart part size in bytes (default 32 MiB, at least 5 MiB); also
            the size of each parallel ranged GET.
        max_concurrency: parts or ranges in flight at once per call (default 8).
        connect_timeout, read_timeout: seconds, per request (default 10 and 60).
        max_attempts: tries per request, first included, for transient failures
            (default 6).
        allow_unconditional_commit: accept a server that ignores ``If-None-Match: *``
            (two concurrent writers of one step could then both "commit"); only for a
            single writer per root.
    """

    supports_rename = False
    create_only = "conditional writes"
    overwrite = "despite 'If-None-Match: *'"
    supported = "conditional writes (AWS S3, MinIO, SeaweedFS, ...)"

    def __init__(self, url: str, *, client: Any = None, **options: Any) -> None:
        unknown = set(options) - _OWN_OPTIONS - _CLIENT_OPTIONS
        if unknown:
            raise CheckpointError(
                f"unknown S3 storage option(s) {sorted(unknown)}; expected some of "
                f"{sorted(_OWN_OPTIONS | _CLIENT_OPTIONS)}"
            )
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self._take_transfer_options(dict(options))
        self.client = client if client is not None else self._make_client(options)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _make_client(self, options: Mapping[str, Any]) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is a test dependency
            raise not_installed(
                "s3://", "boto3", "pip install 'boto3>=1.36' (the s3 extra of resumable-training)"
            ) from exc
        with _SESSION_LOCK:  # a session loads its data files once (~0.25 s); clients are cheap
            profile = options.get("profile_name")
            session = _SESSIONS.get(profile)
            if session is None:
                session = _SESSIONS[profile] = boto3.session.Session(profile_name=profile)
        config = Config(
            connect_timeout=float(options.get("connect_timeout", 10)),
            read_timeout=float(options.get("read_timeout", 60)),
            retries={"mode": "standard", "total_max_attempts": int(options.get("max_attempts", 6))},
            max_pool_connections=self.max_concurrency * 2 + 4,
            s3={"addressing_style": options.get("addressing_style", "path")},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs = {
            k: options[k]
            for k in ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key")
            if options.get(k) is not None
        }
        for k in ("aws_session_token", "verify"):
            if options.get(k) is not None:
                kwargs[k] = options[k]
        with _SESSION_LOCK:  # creating clients from one session is not thread-safe
            return session.client("s3", config=config, **kwargs)

    @property
    def location(self) -> str:
        """The url at its endpoint: one bucket name may exist on several servers."""
        return f"{self.url} at {self.client.meta.endpoint_url}"

    # ----------------------------------------------------------------- helpers

    def _key(self, path: str) -> str:
        """The key of ``path`` ("" is the root prefix itself)."""
        rel = check_relpath(path) if path else ""
        return "/".join(p for p in (self.prefix, rel) if p)

    def _object_key(self, path: str) -> str:
        """The key of the object ``path``: never the root (an empty name is not a file)."""
        return self._key(check_relpath(path))

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix="resumable-s3"
                )
            return self._pool

    def _error(self, action: str, path: str, exc: BaseException) -> OSError:
        """The project's error for a failed request (after botocore's retries)."""
        where = f"{self.url}/{path}" if path else self.url
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = response.get("Error", {}).get("Message", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return NoCheckpointError(errno.ENOENT, f"no such object: {where}")
            if code == "NoSuchBucket":
                return StorageError(
                    errno.ENOENT,
                    f"could not {action} {where}: bucket {self.bucket!r} does not exist; "
                    "create it first or fix the URL",
                )
            if (
                code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
                or status == 403
            ):
                return StorageError(
                    errno.EACCES,
                    f"could not {action} {where}: {code or status} ({message}); check the "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profile) and the "
                    "bucket policy",
                )
            return StorageError(
                errno.EIO, f"could not {action} {where}: {code or status} {message}".rstrip()
            )
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StorageError(
                errno.EACCES,
                f"could not {action} {where}: {exc}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or pass them in storage_options",
            )
        return StorageError(
            errno.EIO,
            f"could not {action} {where}: {type(exc).__name__}: {exc} (after retries; "
            "check the endpoint and the network)",
        )

    def _call(self, action: str, path: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(action, path, exc) from exc

    # ----------------------------------------------------------------- writes

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        key = self._object_key(path)
        views = [memoryview(c).cast("B") for c in chunks]
        total = sum(len(v) for v in views)
        if total <= self.part_size:
            self._call(
                "write",
                path,
                self.client.put_object,
                Key=key,
                Body=_PartReader(views),
                ChecksumAlgorithm="CRC32",
            )
            return total
        part_size = max(self.part_size, -(-total // MAX_PARTS))
        upload = self._call(
            "start upload of",
            path,
            self.client.create_multipart_upload,
            Key=key,
            ChecksumAlgorithm="CRC32",
        )
        upload_id = upload["UploadId"]
        try:
            parts = self._upload_parts(path, key, upload_id, _split(views, part_size))
            self._call(
                "complete upload of",
                path,
                self.client.complete_multipart_upload,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception as exc:  # the lifecycle rule for incomplete uploads cleans up
                log.warning("could not abort multipart upload of %s/%s: %s", self.url, path, exc)
            raise
        return total

    def _upload_parts(
        self, path: str, key: str, upload_id: str, parts: Iterator[list[memoryview]]
    ) -> list[dict[str, Any]]:
        """Upload parts with at most ``max_concurrency`` in flight (so at most that many
        parts' worth of memory is pinned by requests), in order of part number."""
        pool = self._executor()
        pending: list[tuple[int, Future[Any]]] = []
        done: list[dict[str, Any]] = []

        def send(number: int, views: list[memoryview]) -> dict[str, Any]:
            r = self._call(
                f"upload part {number} of",
                path,
                self.client.upload_part,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=_PartReader(views),
                ChecksumAlgorithm="CRC32",
            )
            return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32": r["ChecksumCRC32"]}

        try:
            for number, views in enumerate(parts, start=1):
                if len(pending) >= self.max_concurrency:
                    done.append(pending.pop(0)[1].result())
                pending.append((number, pool.submit(send, number, views)))
            for _, fut in pending:
                done.append(fut.result())
        finally:
            for _, fut in pending:
                fut.cancel()
        return done

    def _create(self, path: str, key: str, data: bytes) -> bool:
        """One PUT with ``If-None-Match: *``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*", ChecksumAlgorithm="CRC32"
            )
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise self._error("write", path, exc) from exc
        except BotoCoreError as exc:
            raise self._error("write", path, exc) from exc
        return True

    def _probe(self) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._key(f".resumable-probe/{secrets.token_hex(8)}")

        def refused(exc: ClientError) -> bool:
            return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412

        try:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
                self.client.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
                ok = False
            except ClientError as exc:
                # 412 on the second PUT; or on the first, when its answer was lost and
                # botocore's retry found the key its first try had created: enforced both.
                if not refused(exc):
                    raise
                ok = True
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise self._error("probe conditional writes in", "", exc) from exc
        return ok

    # ----------------------------------------------------------------- reads

    def size(self, path: str) -> int:
        r = self._call("stat", path, self.client.head_object, Key=self._object_key(path))
        return int(r["ContentLength"])

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``path``, with
        ranged GETs of ``part_size`` run in parallel."""
        out = out.cast("B") if out.format != "B" else out
        length = len(out)
        if length == 0:
            self.size(path)  # still an error if missing
            return
        key = self._object_key(path)
        spans = [(b, min(b + self.part_size, length)) for b in range(0, length, self.part_size)]

        def fetch(span: tuple[int, int]) -> None:
            b, e = span
            r = self._get(path, key, offset + b, offset + e)
            if len(r) != e - b:
                raise CorruptCheckpointError(
                    f"{self.url}/{path} is truncated: wanted bytes [{offset}, "
                    f"{offset + length}), the object ends before"
                )
            out[b:e] = r

        if len(spans) == 1:
            fetch(spans[0])
            return
        futures = [self._executor().submit(fetch, s) for s in spans]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()

    def _get(self, path: str, key: str, begin: int, end: int) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            r = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={begin}-{end - 1}"
            )
            return bytes(r["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                raise CorruptCheckpointError(
                    f"{self.url}/{path} is truncated: it has no bytes at offset {begin}"
                ) from exc
            raise self._error("read", path, exc) from exc
        except BotoCoreError as exc:
            raise self._error("read", path, exc) from exc

    def _pages(self, path: str, delimiter: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        """(prefix, response) for each page of the listing under ``path``."""
        base = self._key(path)
        prefix = base + "/" if base else ""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = "/"
            if token:
                kwargs["ContinuationToken"] = token
            r = self._call("list", path, self.client.list_objects_v2, **kwargs)
            yield prefix, r
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")

    def list_dir(self, path: str = "") -> list[str]:
        names: set[str] = set()
        for prefix, r in self._pages(path, True):
            names.update(
                p["Prefix"][len(prefix) :].rstrip("/") for p in r.get("CommonPrefixes", [])
            )
            names.update(
                o["Key"][len(prefix) :]
                for o in r.get("Contents", [])
                if not o["Key"].endswith("/")  # a directory marker, not an object
            )
        return sorted(n for n in names if n)

    def list_files(self, path: str = "") -> dict[str, int]:
        """Every object under ``path`` and its size: ListObjectsV2, 1,000 keys a page.
        Directory markers (keys ending in ``/``) are not objects."""
        return {
            check_relpath(o["Key"][len(prefix) :]): int(o["Size"])
            for prefix, r in self._pages(path, False)
            for o in r.get("Contents", [])
            if not o["Key"].endswith("/")
        }

    def exists(self, path: str) -> bool:
        """An object at ``path``, or any object under ``path/`` (a "directory")."""
        if path and self._is_object(path):
            return True
        base = self._key(path)
        r = self._call(
            "list",
            path,
            self.client.list_objects_v2,
            Prefix=base + "/" if base else "",
            MaxKeys=50,
        )
        return any(not o["Key"].endswith("/") for o in r.get("Contents", []))

    def delete(self, path: str) -> None:
        """Delete the object ``path`` and every object under ``path/``.

        Each page of the listing (1,000 keys) is sent for deletion as it arrives, while
        the next page is listed: a checkpoint of thousands of ranks spends the listing's
        time deleting rather than waiting for it. A listed name that is not a plain
        relative path stops it (`check_relpath`), after the batches already sent.
        Then the "directory" keys (``path/``, ``path/sub/``, deepest first): stores built
        on a filesystem (SeaweedFS, some MinIO modes) keep listing emptied directories
        otherwise; on AWS S3 there is no such key and deleting it is a no-op."""
        dirs = {path} if path else set()
        keys = [self._key(path)] if path else []
        futures: list[Future[None]] = []
        # A pool of its own: the storage's pool may be busy with (or be) the caller.
        with ThreadPoolExecutor(self.max_concurrency) as pool:
            for prefix, r in self._pages(path, False):
                for o in r.get("Contents", []):
                    if o["Key"].endswith("/"):  # a directory marker, not an object
                        continue
                    parts = check_relpath(o["Key"][len(prefix) :]).split("/")[:-1]
                    keys.append(o["Key"])
                    for i in range(1, len(parts) + 1):
                        dirs.add("/".join(x for x in (path, *parts[:i]) if x))
                futures += [pool.submit(self._delete_batch, path, b) for b in self._batches(keys)]
                keys = []
        for f in futures:
            f.result()
        deepest_first = sorted(dirs, key=lambda d: -d.count("/"))
        self._delete_keys(path, [self._key(d) + "/" for d in deepest_first])

    def _batches(self, keys: list[str]) -> list[list[str]]:
        """``keys`` in DeleteObjects batches: at most 1,000 keys (the S3 limit), at least
        `_DELETE_BATCH_MIN`, up to ``max_concurrency`` of them."""
        if not keys:
            return []
        workers = min(self.max_concurrency, -(-len(keys) // _DELETE_BATCH_MIN))
        size = min(1000, -(-len(keys) // workers))
        return [keys[i : i + size] for i in range(0, len(keys), size)]

    def _delete_keys(self, path: str, keys: list[str]) -> None:
        """DeleteObjects in batches (`_batches`), all in flight at once: a server spends
        its time per key, so a checkpoint of thousands of ranks (two objects each) is
        deleted about as fast as the server allows rather than one batch at a time.
        Every batch is sent even if one fails; then the first failure is raised."""
        batches = self._batches(keys)
        if len(batches) <= 1:
            for b in batches:
                self._delete_batch(path, b)
            return
        # A pool of its own: the storage's pool may be busy with (or be) the caller.
        with ThreadPoolExecutor(len(batches)) as pool:
            futures = [pool.submit(self._delete_batch, path, b) for b in batches]
        for f in futures:
            f.result()

    def _delete_batch(self, path: str, batch: list[str]) -> None:
        r = self._call(
            "delete",
            path,
            self.client.delete_objects,
            Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
        )
        errors = [e for e in r.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            raise StorageError(
                errno.EIO,
                f"could not delete {len(errors)} object(s) under {self.url}/{path}: "
                f"{errors[0].get('Code')} {errors[0].get('Message', '')}",
            )

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
