"""A mapped file is read ahead of its reader on a thread (`resumable.storage.readahead`):
its pages end up mapped without the reader touching them, a mapping closed early ends
its read-ahead quietly, a kernel that refuses the advice leaves the reader's faults to
read the file, and a forked child reads ahead on threads of its own."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable import Checkpointer
from resumable.storage import LocalStorage, direct, readahead

pytestmark = pytest.mark.skipif(
    readahead._MADVISE is None, reason="read-ahead needs Linux's madvise"
)

SIZE = 24 << 20  # two pieces and a half


def data_file(path: Path, size: int = SIZE) -> Path:
    g = torch.Generator().manual_seed(size)
    path.write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:  # out of the page cache, as a file written with O_DIRECT is
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def rss(mm: mmap.mmap) -> int:
    """Bytes of ``mm`` mapped into this process (``Rss`` in /proc/self/smaps)."""
    start = direct.address(memoryview(mm))
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not found:
                found = line.split("-", 1)[0] == f"{start:x}"
            elif line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def mapped_within(mm: mmap.mmap, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while rss(mm) < len(mm):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def untouched_map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def refuse_populate(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def refused(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        ctypes.set_errno(22)  # EINVAL: an older kernel
        return -1

    monkeypatch.setattr(readahead, "_MADVISE", refused)
    monkeypatch.setitem(readahead._state, "refused", False)
    return calls


def test_a_mapped_file_is_read_and_mapped_without_its_reader(tmp_path: Path) -> None:
    mm = untouched_map(data_file(tmp_path / "f"))
    assert rss(mm) == 0
    assert readahead.read_ahead(mm)
    assert mapped_within(mm), "the read-ahead thread did not map the file"
    assert bytes(mm[:16]) == (tmp_path / "f").read_bytes()[:16]
    mm.close()


def test_only_the_span_asked_for_is_read_ahead(tmp_path: Path) -> None:
    mm = untouched_map(data_file(tmp_path / "f"))
    assert readahead.read_ahead(mm, ((8 << 20) + 100, 12 << 20))
    deadline = time.monotonic() + 30
    while rss(mm) < 4 << 20:  # from the page the span starts in
        assert time.monotonic() < deadline, "the span was not read ahead"
        time.sleep(0.01)
    time.sleep(0.2)
    assert rss(mm) < 8 << 20, "read ahead beyond the span"
    assert not readahead.read_ahead(mm, (SIZE, SIZE + 10)), "nothing to read there"
    mm.close()


def test_only_the_spans_of_a_list_are_read_ahead_in_one_go(tmp_path: Path) -> None:
    """A reader of a few tensors of a file maps it once and names their ranges: each is
    read ahead (from the 2 MiB block it starts in), nothing between them."""
    mm = untouched_map(data_file(tmp_path / "f"))
    spans = [((20 << 20) + 5, 21 << 20), (2 << 20, (3 << 20) + 7)]  # out of order
    assert readahead.read_ahead(mm, spans)
    deadline = time.monotonic() + 30
    while rss(mm) < 2 << 20:  # [2, 3 MiB + 7) and [20, 21 MiB): 1 MiB each
        assert time.monotonic() < deadline, "the spans were not read ahead"
        time.sleep(0.01)
    time.sleep(0.2)
    assert rss(mm) < 8 << 20, "read ahead between or beyond the spans"
    assert not readahead.read_ahead(mm, [(SIZE, SIZE + 10)]), "nothing to read there"
    mm.close()


def test_local_storage_reads_ahead_what_it_maps(tmp_path: Path) -> None:
    data_file(tmp_path / "f")
    mm = LocalStorage(tmp_path).map_file("f")
    assert mapped_within(mm)
    assert bytes(mm) == (tmp_path / "f").read_bytes()
    mm.close()


def test_mappings_closed_before_their_turn_end_it_quietly(tmp_path: Path) -> None:
    path = data_file(tmp_path / "f")
    for _ in range(20):  # more than THREADS: some wait their turn, then find it closed
        mm = untouched_map(path)
        assert readahead.read_ahead(mm)
        mm.close()
    mm = untouched_map(path)
    assert readahead.read_ahead(mm)
    assert mapped_within(mm), "read-ahead stopped working after closed mappings"
    mm.close()


def test_a_file_of_one_page_is_read_ahead(tmp_path: Path) -> None:
    small = untouched_map(data_file(tmp_path / "f", size=mmap.PAGESIZE))
    assert readahead.read_ahead(small)
    assert mapped_within(small)
    small.close()


def test_a_refused_advice_is_not_asked_again_and_restores_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = refuse_populate(monkeypatch)
    mm = untouched_map(data_file(tmp_path / "f"))
    assert readahead.read_ahead(mm)  # queued; its thread finds out
    deadline = time.monotonic() + 30
    while not readahead._state["refused"]:
        assert time.monotonic() < deadline, "the refusal was not noticed"
        time.sleep(0.01)
    asked = len(calls)  # the file's piece, then a page of our own to tell the two apart
    assert calls == [readahead.MADV_POPULATE_READ] * 2
    assert not readahead.read_ahead(mm), "a refused advice is asked again"
    assert len(calls) == asked
    mm.close()

    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB: one data file past direct.DIRECT_MIN_BYTES
    ck = Checkpointer(tmp_path / "ck", {"model": model}, persist="sync")
    ck.save(1)
    ck.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    again = Checkpointer(tmp_path / "ck", {"model": model}, persist="sync")
    assert again.restore() == 1
    again.close()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert len(calls) == asked, "asked again after the refusal"


def test_a_forked_child_reads_ahead_on_threads_of_its_own(tmp_path: Path) -> None:
    path = data_file(tmp_path / "f")
    turns: Any = readahead._state["turns"]
    held = [turns.acquire(blocking=False) for _ in range(readahead.THREADS)]
    assert all(held)  # as if every read-ahead thread were busy when the process forked
    try:
        pid = os.fork()
        if pid == 0:  # the child: its turns are its own
            code = 1
            try:
                mm = untouched_map(path)
                code = 0 if readahead.read_ahead(mm) and mapped_within(mm, 20) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's read-ahead never ran"
    finally:
        for _ in held:
            turns.release()


def test_a_mapping_that_refuses_the_advice_does_not_turn_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL for one mapping's range (a closed reader's address now another mapping's)
    while a page of our own takes the advice: this file is skipped, later ones are not."""
    real = readahead._MADVISE
    first = tmp_path / "f"
    refused_at: list[int] = []

    def refuse_once(address: int, length: int, advice: int) -> int:
        if not refused_at:
            refused_at.append(address)
            ctypes.set_errno(22)
            return -1
        return real(address, length, advice)

    monkeypatch.setattr(readahead, "_MADVISE", refuse_once)
    monkeypatch.setitem(readahead._state, "refused", False)
    mm = untouched_map(data_file(first))
    assert readahead.read_ahead(mm)
    deadline = time.monotonic() + 30
    while not refused_at:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    mm.close()
    small = untouched_map(data_file(tmp_path / "g", size=mmap.PAGESIZE))
    assert readahead.read_ahead(small), "one mapping's refusal turned read-ahead off"
    assert mapped_within(small)
    small.close()
