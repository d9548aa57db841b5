"""The fault-injecting proxy, driven by boto3 against a real SeaweedFS server."""

from __future__ import annotations

import base64
import io
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import botocore.exceptions
import pytest

from faultproxy import FaultProxy, ProxiedRequest, copy_chunked, read_head, response_framing

if TYPE_CHECKING:
    from s3server import S3Server


# What botocore raises when the connection drops before a response arrives.
CONNECTION_ERRORS = (botocore.exceptions.ConnectionClosedError,)


@pytest.fixture
def proxy(seaweedfs: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(seaweedfs.endpoint, seed=0) as proxy:
        yield proxy
    assert proxy.errors == []


def proxied_client(seaweedfs: S3Server, proxy: FaultProxy, retries: int = 0) -> Any:
    return seaweedfs.client(proxy.endpoint, max_attempts=retries, read_timeout=5)


def raw_request(endpoint: str, request: bytes) -> bytes:
    """Send raw bytes to ``endpoint``, half-close, and return all it answers."""
    host, port = endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: sock.recv(65536), b""))


def aws_chunked_put(bucket: str, key: str, data: bytes, crc32: bytes) -> bytes:
    """A PUT whose body is aws-chunked with a trailing checksum, framed by Content-Length."""
    body = b"".join(
        b"%x\r\n%s\r\n" % (len(data[i : i + 4096]), data[i : i + 4096])
        for i in range(0, len(data), 4096)
    )
    body += b"0\r\nx-amz-checksum-crc32:" + base64.b64encode(crc32) + b"\r\n\r\n"
    head = (
        f"PUT /{bucket}/{key} HTTP/1.1\r\nHost: s3\r\nContent-Length: {len(body)}\r\n"
        "Content-Encoding: aws-chunked\r\n"
        "x-amz-content-sha256: STREAMING-UNSIGNED-PAYLOAD-TRAILER\r\n"
        f"x-amz-decoded-content-length: {len(data)}\r\nx-amz-trailer: x-amz-checksum-crc32\r\n"
        "x-amz-sdk-checksum-algorithm: CRC32\r\n\r\n"
    )
    return head.encode() + body


def error_code(exc: pytest.ExceptionInfo[botocore.exceptions.ClientError]) -> tuple[int, str]:
    response = exc.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def test_clean_pass_through(seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    s3 = proxied_client(seaweedfs, proxy)
    s3.put_object(Bucket=s3_bucket, Key="a/small", Body=b"hello")
    assert s3.get_object(Bucket=s3_bucket, Key="a/small")["Body"].read() == b"hello"
    assert s3.head_object(Bucket=s3_bucket, Key="a/small")["ContentLength"] == 5

    part1, part2 = b"1" * (5 * 1024 * 1024), b"2" * 1000
    upload = s3.create_multipart_upload(Bucket=s3_bucket, Key="a/big")["UploadId"]
    parts = [
        {
            "PartNumber": n,
            "ETag": s3.upload_part(
                Bucket=s3_bucket, Key="a/big", UploadId=upload, PartNumber=n, Body=body
            )["ETag"],
        }
        for n, body in ((1, part1), (2, part2))
    ]
    s3.complete_multipart_upload(
        Bucket=s3_bucket, Key="a/big", UploadId=upload, MultipartUpload={"Parts": parts}
    )
    assert s3.get_object(Bucket=s3_bucket, Key="a/big")["Body"].read() == part1 + part2

    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="a/")["Contents"]
    assert sorted(o["Key"] for o in listed) == ["a/big", "a/small"]
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.put_object(Bucket=s3_bucket, Key="a/small", Body=b"again", IfNoneMatch="*")
    assert error_code(exc)[0] == 412
    s3.delete_object(Bucket=s3_bucket, Key="a/small")

    records = proxy.requests
    assert [r.index for r in records] == list(range(len(records)))
    assert {r.action for r in records} == {"pass"}
    assert [r.status for r in records if r.status != 200] == [412, 204]


def test_injected_errors_surface_without_retries(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    s3 = proxied_client(seaweedfs, proxy)
    proxy.set_faults(error_rate=1.0, error_codes=(500,))
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    assert error_code(exc) == (500, "InternalError")
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.head_object(Bucket=s3_bucket, Key="k")  # a HEAD error has no body to frame
    assert error_code(exc)[0] == 500
    proxy.set_faults(error_rate=1.0, error_codes=(503,))
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.get_object(Bucket=s3_bucket, Key="k")
    assert error_code(exc) == (503, "SlowDown")

    proxy.clear_faults()
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    assert [(r.action, r.status) for r in proxy.requests] == [
        ("error", 500),
        ("error", 500),
        ("error", 503),
        ("pass", 200),
    ]


def test_scheduled_errors_are_retried(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    s3 = proxied_client(seaweedfs, proxy, retries=3)
    proxy.schedule({0: 500, 1: "503", 3: "reset"})
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"retried")
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"retried"
    assert [r.action for r in proxy.requests] == ["error", "error", "pass", "reset", "pass"]


def test_reset_is_a_connection_error_and_not_forwarded(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    s3 = proxied_client(seaweedfs, proxy)
    proxy.set_faults(reset_rate=1.0)
    with pytest.raises(CONNECTION_ERRORS):
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x" * 100_000)
    direct = seaweedfs.client()
    assert direct.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    assert [(r.action, r.status) for r in proxy.requests] == [("reset", None)]


def test_lost_response_put_takes_effect(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    s3 = proxied_client(seaweedfs, proxy)
    proxy.set_faults(lost_response_rate=1.0, match=lambda method, path: method == "PUT")
    with pytest.raises(CONNECTION_ERRORS):
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"landed")
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"landed"
    assert [(r.method, r.action) for r in proxy.requests] == [
        ("PUT", "lost_response"),
        ("GET", "pass"),
    ]


def test_delay_slows_requests(seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy) -> None:
    s3 = proxied_client(seaweedfs, proxy)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    proxy.set_faults(delay_rate=1.0, delay_s=0.4)
    start = time.monotonic()
    s3.head_object(Bucket=s3_bucket, Key="k")
    assert time.monotonic() - start >= 0.4
    assert proxy.requests[-1].action == "delay"


def test_on_request_sees_every_index(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    seen: list[tuple[int, str, str]] = []
    proxy.on_request(lambda index, method, path: seen.append((index, method, path)))
    s3 = proxied_client(seaweedfs, proxy)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read()
    s3.list_objects_v2(Bucket=s3_bucket)
    assert [(i, m) for i, m, _ in seen] == [(0, "PUT"), (1, "GET"), (2, "GET")]
    assert seen[0][2] == f"/{s3_bucket}/k"
    assert [(r.index, r.method, r.path) for r in proxy.requests] == seen
    assert proxy.count == 3


def test_random_faults_follow_the_seed(seaweedfs: S3Server, s3_bucket: str) -> None:
    def actions(seed: int) -> list[str]:
        with FaultProxy(seaweedfs.endpoint, seed=seed) as proxy:
            proxy.set_faults(error_rate=0.3, reset_rate=0.2, delay_rate=0.2, delay_s=0.0)
            s3 = proxied_client(seaweedfs, proxy)
            for _ in range(12):
                try:
                    s3.head_bucket(Bucket=s3_bucket)
                except (botocore.exceptions.ClientError, *CONNECTION_ERRORS):
                    pass
            records: list[ProxiedRequest] = proxy.requests
            assert proxy.errors == []
        return [r.action for r in records]

    first = actions(seed=7)
    assert first == actions(seed=7)
    assert {"pass", "error", "reset", "delay"} <= set(first)


def test_chunked_framing_is_relayed_verbatim() -> None:
    wire = b"4;ext=1\r\nabcd\r\n2\r\nef\r\n0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\nNEXT"
    reader = io.BufferedReader(io.BytesIO(wire))
    out: list[bytes] = []
    copy_chunked(reader, out.append)
    assert b"".join(out) == wire.removesuffix(b"NEXT")
    assert reader.read() == b"NEXT"

    head = read_head(io.BufferedReader(io.BytesIO(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n")))
    assert head is not None
    assert response_framing("GET", 200, head) == ("length", 7)
    assert response_framing("HEAD", 200, head) == ("none", 0)
    assert response_framing("GET", 204, head) == ("none", 0)


def test_chunked_and_aws_chunked_requests_pass_through(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    chunked = (
        f"PUT /{s3_bucket}/chunked HTTP/1.1\r\nHost: s3\r\nTransfer-Encoding: chunked\r\n"
        "Expect: 100-continue\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    ).encode()
    reply = raw_request(proxy.endpoint, chunked)
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")

    data = b"checkpoint bytes " * 1000
    crc = struct.pack(">I", zlib.crc32(data))
    good = raw_request(proxy.endpoint, aws_chunked_put(s3_bucket, "aws", data, crc))
    bad = raw_request(proxy.endpoint, aws_chunked_put(s3_bucket, "bad", data, b"\0\0\0\0"))
    assert good.startswith(b"HTTP/1.1 200 ")
    assert bad.startswith(b"HTTP/1.1 400 ")  # the trailer reached the server intact

    s3 = seaweedfs.client()
    assert s3.get_object(Bucket=s3_bucket, Key="chunked")["Body"].read() == b"abcdefg"
    assert s3.get_object(Bucket=s3_bucket, Key="aws")["Body"].read() == data
    assert [r.status for r in proxy.requests] == [200, 200, 400]


def test_client_killed_mid_request_is_not_a_proxy_error(s3_bucket: str, proxy: FaultProxy) -> None:
    head = f"PUT /{s3_bucket}/k HTTP/1.1\r\nHost: s3\r\nContent-Length: 100\r\n\r\n"
    reply = raw_request(proxy.endpoint, head.encode() + b"partial")  # then the socket closes
    assert reply == b""
    deadline = time.monotonic() + 5
    while proxy.count < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(r.method, r.status) for r in proxy.requests] == [("PUT", None)]
