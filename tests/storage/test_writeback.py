"""`resumable.storage.writeback`: files written in pieces whose writeback the kernel
starts at once (``sync_file_range``), on this machine's real file system; and what
happens where the request is refused or not there."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.storage import LocalStorage, writeback
from resumable.storage.writeback import write_all

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="sync_file_range is Linux's"
)


class Recorder:
    """Wraps the real ``sync_file_range`` (or stands in for it) and records each call."""

    def __init__(self, real: Any, result: int | None = None) -> None:
        self.real, self.result = real, result
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.calls.append((offset, nbytes, flags))
        if self.result is not None:
            ctypes.set_errno(errno.EINVAL)
            return self.result
        return int(self.real(fd, offset, nbytes, flags))


def payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


def chunked(data: bytes, *cuts: int) -> Iterator[Any]:
    """``data`` as mixed buffers cut at ``cuts``, as a persist hands them over."""
    last = 0
    for i, cut in enumerate([*cuts, len(data)]):
        part = data[last:cut]
        yield memoryview(part) if i % 2 else bytearray(part)
        last = cut


@linux_only
def test_every_piece_is_written_and_its_writeback_started(tmp_path: Path) -> None:
    """The kernel takes each request on this file system: the ranges asked for cover the
    file once, in order, in pieces no larger than asked; the bytes are all there."""
    assert writeback.available()
    data = payload(10_000)
    recorder = Recorder(writeback._sync_file_range)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        real, writeback._sync_file_range = writeback._sync_file_range, recorder  # type: ignore[assignment]
        try:
            n = write_all(fd, chunked(data, 1, 3000, 3001, 9999), piece_bytes=1024)
        finally:
            writeback._sync_file_range = real
        os.fsync(fd)
    finally:
        os.close(fd)
    assert n == len(data)
    assert path.read_bytes() == data
    offsets = [(o, k) for o, k, _ in recorder.calls]
    assert all(0 < k <= 1024 for _, k in offsets)
    assert [o for o, _ in offsets] == [sum(k for _, k in offsets[:i]) for i in range(len(offsets))]
    assert sum(k for _, k in offsets) == len(data)
    assert {f for _, _, f in recorder.calls} == {2}  # SYNC_FILE_RANGE_WRITE alone: no waits


def test_a_refused_request_is_not_asked_again_and_the_write_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(None, result=-1)
    monkeypatch.setattr(writeback, "_sync_file_range", recorder)
    data = payload(5000)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        assert write_all(fd, chunked(data, 100, 2500), piece_bytes=512) == len(data)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert recorder.calls == [(0, 512, 2)]  # the first piece, then never again


@linux_only
def test_a_pipe_refuses_writeback_and_is_written_all_the_same(tmp_path: Path) -> None:
    """A file the request does not apply to (a pipe: ESPIPE from the real call)."""
    recorder = Recorder(writeback._sync_file_range)
    read_end, write_end = os.pipe()
    real, writeback._sync_file_range = writeback._sync_file_range, recorder  # type: ignore[assignment]
    try:
        assert write_all(write_end, [b"abc", memoryview(b"defgh")], piece_bytes=4) == 8
    finally:
        writeback._sync_file_range = real
        os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        assert r.read() == b"abcdefgh"
    assert recorder.calls == [(0, 4, 2)]  # refused at once, never asked again


def test_without_the_call_files_are_written_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not Linux, or a libc without it."""
    monkeypatch.setattr(writeback, "_sync_file_range", None)
    assert not writeback.available()
    assert not writeback.start_writeback(0, 0, 10)
    storage = LocalStorage(tmp_path / "root")
    data = payload(3000)
    assert storage.write("d/f.bin", chunked(data, 1000)) == len(data)
    assert storage.read("d/f.bin") == data


@linux_only
def test_local_storage_writes_a_large_file_with_the_disk_already_at_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LocalStorage.write` (what a persist's data file goes through) asks for the
    writeback of every piece, and the fsync still comes after the last one."""
    monkeypatch.setattr(writeback, "PIECE_BYTES", 1 << 16)
    events: list[str] = []
    real_sfr = writeback._sync_file_range

    def sfr(fd: int, offset: int, nbytes: int, flags: int) -> int:
        events.append("writeback")
        return int(real_sfr(fd, offset, nbytes, flags))  # type: ignore[misc]

    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr(writeback, "_sync_file_range", sfr)
    monkeypatch.setattr(os, "fsync", fsync)
    data = os.urandom(5 * (1 << 16) + 123)
    storage = LocalStorage(tmp_path / "root")
    storage.write("d/data.bin", [data[:1000], memoryview(data)[1000:]])
    pieces = 1 + -(-(len(data) - 1000) // (1 << 16))  # the first chunk, then the rest's
    assert events == ["writeback"] * pieces + ["fsync"]
    assert storage.read("d/data.bin") == data
