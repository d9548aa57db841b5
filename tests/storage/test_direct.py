"""`resumable.storage.direct`: large files written with ``O_DIRECT`` from where their
bytes lie, through a bounce buffer where they are not aligned, the last partial block
through the page cache, and buffered where the flag is refused; and `LocalStorage` and
the persist around it (headers padded to a page, the arena page-aligned)."""

from __future__ import annotations

import errno
import fcntl
import glob
import mmap
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable import Checkpointer, Every
from resumable.errors import StorageError
from resumable.format import parse_safetensors_header
from resumable.storage import LocalStorage, direct

pytestmark = pytest.mark.skipif(not direct.available(), reason="no O_DIRECT here")


class Spy:
    """Every ``os.pwrite`` of `direct`: (direct?, file offset, bytes, address % ALIGN),
    and the errors the kernel gave."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int, int, int]] = []
        self.errors: list[int] = []
        self.real = os.pwrite

    def __call__(self, fd: int, data: Any, offset: int) -> int:
        view = memoryview(data).cast("B")
        on = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        self.calls.append((on, offset, len(view), direct.address(view) % direct.ALIGN))
        try:
            return self.real(fd, data, offset)
        except OSError as exc:
            self.errors.append(exc.errno or 0)
            raise

    def bytes(self, *, direct_: bool) -> int:
        return sum(n for on, _, n, _ in self.calls if on == direct_)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    s = Spy()
    monkeypatch.setattr(direct.os, "pwrite", s)
    return s


def cached_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages), by ``mincore`` on a mapping of it:
    whichever process wrote the file, its direct writes left nothing there."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        addr = ctypes.c_void_p(direct.address(memoryview(mm)))
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(addr, ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec), pages
    finally:
        mm.close()


def aligned(nbytes: int, seed: int = 0) -> memoryview:
    """Page-aligned memory filled with a pattern that differs at every offset."""
    buf = mmap.mmap(-1, nbytes)
    g = torch.Generator().manual_seed(seed)
    buf[:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()
    return memoryview(buf)


def write(path: Path, chunks: list[Any]) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = direct.write_direct(fd, chunks)
        os.fsync(fd)
    finally:
        os.close(fd)
    return n


def test_an_aligned_buffer_goes_to_the_disk_from_where_it_lies(tmp_path: Path, spy: Spy) -> None:
    data = aligned(3 * direct.PIECE_BYTES + 5 * direct.ALIGN + 123)
    header = b"h" * direct.ALIGN  # a header padded to a page, as a persist writes it

    n = write(tmp_path / "f", [header, data])

    assert n == direct.ALIGN + len(data)
    assert (tmp_path / "f").read_bytes() == header + bytes(data)
    assert not spy.errors
    # all but the last partial block went around the page cache, in pieces of at most
    # PIECE_BYTES, every one aligned in memory, in the file and in length
    assert spy.bytes(direct_=False) == 123
    for on, offset, length, addr in spy.calls:
        if on:
            assert offset % direct.ALIGN == length % direct.ALIGN == addr == 0
            assert length <= direct.PIECE_BYTES
    # the data itself was not copied: its pieces were written from its own pages
    assert sum(n for on, _, n, a in spy.calls if on and n > direct.BOUNCE_BYTES) >= 3 * (
        direct.PIECE_BYTES
    )


def test_the_descriptor_is_left_without_o_direct(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        direct.write_direct(fd, [aligned(4 * direct.ALIGN)])
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        os.write(fd, b"x")  # an unaligned write after it still works
    finally:
        os.close(fd)
    assert (tmp_path / "f").stat().st_size == 4 * direct.ALIGN + 1


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pieces=st.lists(
        st.tuples(
            st.sampled_from(["arena", "bytes"]),
            st.integers(0, 3 * direct.ALIGN),  # where in the arena a piece starts
            st.sampled_from([0, 1, 7, 4095, 4096, 4097, 8192, 12_345, 65_536, 70_000]),
        ),
        max_size=12,
    ),
    bounce=st.sampled_from([direct.ALIGN, 2 * direct.ALIGN, 16 * direct.ALIGN]),
)
def test_any_mix_of_buffers_is_written_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pieces: list[Any], bounce: int
) -> None:
    """Buffers at any address and of any length, with the bounce buffer as small as a
    block: the file holds exactly their bytes, and no direct write was ever refused (a
    misaligned one would be, by the kernel, and silently fall back)."""
    monkeypatch.setattr(direct, "BOUNCE_BYTES", bounce)
    monkeypatch.setattr(direct, "PIECE_BYTES", 3 * direct.ALIGN)
    spy = Spy()
    monkeypatch.setattr(direct.os, "pwrite", spy)
    arena = aligned(3 * direct.ALIGN + 70_000, seed=len(pieces))
    chunks: list[Any] = []
    for kind, start, length in pieces:
        if kind == "arena":
            chunks.append(arena[start : start + length])
        else:
            chunks.append(bytes(arena[start : start + length]))
    path = tmp_path / "mix"

    n = write(path, chunks)

    want = b"".join(bytes(c) for c in chunks)
    assert n == len(want)
    assert path.read_bytes() == want
    assert not spy.errors
    assert spy.bytes(direct_=False) < direct.ALIGN  # only the last partial block


def test_a_refused_direct_write_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that takes the flag but refuses the I/O (``EINVAL``): the rest of
    the file, from where the direct writes stopped, is written buffered."""
    real = os.pwrite
    refused: list[int] = []

    def refuse_the_second_direct_write(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset > 0:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(direct, "PIECE_BYTES", 4 * direct.ALIGN)
    monkeypatch.setattr(direct.os, "pwrite", refuse_the_second_direct_write)
    data = aligned(20 * direct.ALIGN + 99)

    assert write(tmp_path / "f", [data]) == len(data)

    assert (tmp_path / "f").read_bytes() == bytes(data)
    assert refused == [4 * direct.ALIGN]  # once: the writer did not ask again


def test_a_descriptor_that_refuses_the_flag_is_written_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spy: Spy
) -> None:
    def refuse(fd: int, fd_op: int, arg: int = 0) -> int:
        if fd_op == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, fd_op, arg)

    real = fcntl.fcntl
    monkeypatch.setattr(direct.fcntl, "fcntl", refuse)
    data = aligned(5 * direct.ALIGN + 1)

    assert write(tmp_path / "f", [b"head", data]) == 4 + len(data)

    assert (tmp_path / "f").read_bytes() == b"head" + bytes(data)
    assert spy.bytes(direct_=True) == 0


def test_an_error_other_than_a_refusal_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(direct.os, "pwrite", full)
    with pytest.raises(OSError) as info:
        write(tmp_path / "f", [aligned(4 * direct.ALIGN)])
    assert info.value.errno == errno.ENOSPC


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    """A real file system of 12 MiB (tmpfs; root only)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_under_a_direct_write_is_a_storage_error_and_keeps_what_was_saved(
    small_disk: Path,
) -> None:
    storage = LocalStorage(small_disk / "root", direct_io=True)
    storage.write("earlier.bin", [b"earlier"])
    with pytest.raises(StorageError, match="disk is full") as info:
        storage.write("big.bin", [b"h" * direct.ALIGN, aligned(16 << 20)])
    assert info.value.errno == errno.ENOSPC
    assert storage.read("earlier.bin") == b"earlier"


def test_local_storage_writes_large_files_direct_and_small_ones_buffered(
    tmp_path: Path, spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = LocalStorage(tmp_path / "root")
    assert storage.direct_io
    big = aligned(direct.DIRECT_MIN_BYTES)
    storage.write("small.bin", [b"x" * 1000])
    assert spy.calls == []  # buffered: `write_all`, not this module
    storage.write("big.bin", [big])
    assert spy.bytes(direct_=True) == len(big)
    assert storage.read("big.bin") == bytes(big)

    spy.calls.clear()
    monkeypatch.setenv("RESUMABLE_DIRECT_IO", "0")
    off = LocalStorage(tmp_path / "root")
    assert not off.direct_io
    off.write("big2.bin", [big])
    assert spy.calls == []
    assert off.read("big2.bin") == bytes(big)


@pytest.mark.parametrize(
    "memory_every", [None, Every(steps=1)], ids=["no-memory-tier", "memory-tier"]
)
def test_a_large_checkpoint_has_its_data_on_a_page_and_restores_bit_identical(
    tmp_path: Path, memory_every: Every | None
) -> None:
    """From the arena (memory tier off) or the shared-memory slot: the header is
    padded to a page, the file was written around the page cache (none of its pages
    but the tail's is cached), it is a valid safetensors file, and a restore
    from it is bit-identical. A small checkpoint keeps the 8-byte padding."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(3 << 20, generator=g),
        "b": torch.randn(1001, generator=g),
        "small": {"x": torch.arange(5)},
    }
    want = {"w": state["w"].clone(), "b": state["b"].clone()}
    root = tmp_path / "ck"
    with Checkpointer(root, state=state, memory_every=memory_every, capture_rng=False) as ck:
        ck.save(1)
        ck.wait()
    (path,) = glob.glob(f"{root}/step-*/rank-*.safetensors")
    cached, pages = cached_pages(path)  # before anything reads it
    assert pages > 3000 and cached <= 2  # the persist worker wrote all but the tail direct
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    start, _ = parse_safetensors_header(head, os.path.getsize(path))
    assert start % direct.ALIGN == 0
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("w"), want["w"])

    for t in (state["w"], state["b"]):
        t.zero_()
    with Checkpointer(root, state=state, memory_every=None, capture_rng=False) as ck:
        assert ck.restore() == 1
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])

    tiny = {"x": torch.arange(10.0)}
    with Checkpointer(tmp_path / "tiny", state=tiny, capture_rng=False) as ck:
        ck.save(1)
        ck.wait()
    (path,) = glob.glob(f"{tmp_path}/tiny/step-*/rank-*.safetensors")
    with open(path, "rb") as f:
        head = f.read(4096)
    start, _ = parse_safetensors_header(head, os.path.getsize(path))
    assert start % 8 == 0 and start < direct.ALIGN
