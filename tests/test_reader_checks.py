"""A restore checks a checkpoint's tensors on several threads (`resumable.reader._digests`)
where their bytes are all in memory, and still behaves as one check after another: the
first damaged tensor in the file's order is the one named, a tensor in pieces is copied
into the live one only once every tensor passed, and the threads really share the work
(one thread where bytes must come from the disk, `_resident`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable.reader as reader_mod
from resumable import Checkpointer, CorruptCheckpointError, Incremental
from resumable.capture import capture, iter_tensor_refs
from resumable.commit import committer_for
from resumable.pipeline.write import WriteRequest, write_distributed
from resumable.reader import CheckpointReader, _digests
from resumable.snapshot import Arena, copy_threads
from resumable.storage import open_storage
from state_checks import ThreadRanks

pytestmark = pytest.mark.usefixtures("sync_persist")
MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    """Tensors of 4, 3, 2 and 1 MiB and a small one: 10 MiB, over the bound from which
    the check is shared among threads."""
    g = torch.Generator().manual_seed(0)
    return {
        name: torch.rand(mib * MiB // 4, generator=g) if mib else torch.rand(100, generator=g)
        for name, mib in (("one", 1), ("big", 4), ("three", 3), ("two", 2), ("tiny", 0))
    }


def _flip(root: Path, step: int, name: str, at: int = 10) -> None:
    """Flip one byte of tensor ``name``'s bytes in step ``step``'s data file."""
    reader = CheckpointReader(open_storage(str(root)), step)
    info = reader.manifest["tensors"][name]
    if "extents" in info:  # an incremental checkpoint's entry: its first extent, own
        source, begin = info["sources"][info["extents"][0]], info["extents"][1]
        assert "step" not in source
        fname = source["file"]
    else:
        fname, begin = info["file"], info["offsets"][0]
    path = root / f"step-{step:012d}" / fname
    data = bytearray(path.read_bytes())
    data[begin + at] ^= 0x10
    path.write_bytes(bytes(data))


def _offset(root: Path, step: int, name: str) -> int:
    reader = CheckpointReader(open_storage(str(root)), step)
    return int(reader.manifest["tensors"][name]["offsets"][0])


def test_the_first_damaged_tensor_in_file_order_is_named(tmp_path: Path) -> None:
    state = _state()
    with Checkpointer(tmp_path, state, keep=None, incremental=False) as ck:
        ck.save(1)
    # two damaged tensors: the one earlier in the file is the smaller one, which
    # a check that takes the largest first reaches last
    names = sorted(["big", "one"], key=lambda n: _offset(tmp_path, 1, n))
    assert names == ["one", "big"]
    for name in names:
        _flip(tmp_path, 1, name)
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    reader.check_files()
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in tensor '{names[0]}'"):
        reader.tensors()
    # and one alone is found wherever it is
    for name in state:
        with Checkpointer(tmp_path / name, state, keep=None, incremental=False) as ck:
            ck.save(1)
        _flip(tmp_path / name, 1, name, at=0)
        with pytest.raises(CorruptCheckpointError, match=f"tensor '{name}'"):
            CheckpointReader(open_storage(str(tmp_path / name)), 1).tensors()


def test_the_check_runs_on_several_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader asks `_digests` for every core where the bytes are in memory, for one
    thread where they must come from the disk or are few. (Which thread runs which job
    is up to the scheduler: on a loaded machine the calling thread may take them all
    before another starts, so that is tested apart, below, with jobs that wait for
    each other.)"""
    if copy_threads() < 2:
        pytest.skip("one core for this process: the check stays on one thread")
    state = _state()
    with Checkpointer(tmp_path, state, keep=None, incremental=False) as ck:
        ck.save(1)
    for f in tmp_path.glob("step-*/*.safetensors"):
        f.read_bytes()  # in the page cache: written with O_DIRECT, it was not
    asked: list[tuple[int, int]] = []  # (jobs, threads) of each call
    real = reader_mod._digests

    def spy(jobs: list[Any], threads: int) -> list[str]:
        asked.append((len(jobs), threads))
        return real(jobs, threads)

    monkeypatch.setattr(reader_mod, "_digests", spy)
    got = CheckpointReader(open_storage(str(tmp_path)), 1).tensors()
    assert asked == [(len(got), copy_threads())]
    assert all(torch.equal(got[n].view(-1), t) for n, t in state.items())
    # bytes not all in memory (to be read from the disk): one thread, in the file's order
    asked.clear()
    monkeypatch.setattr(reader_mod, "_resident", lambda address, n: False)
    CheckpointReader(open_storage(str(tmp_path)), 1).tensors()
    assert asked == [(len(got), 1)]


def test_digests_spread_jobs_over_threads_and_stay_on_one_below_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two jobs that each wait for the other: only two threads at once can finish them
    # (one thread alone would wait out the barrier and raise BrokenBarrierError).
    meet = threading.Barrier(2, timeout=60)
    seen: set[int] = set()

    def job(i: int) -> Any:
        def fn() -> str:
            seen.add(threading.get_ident())
            meet.wait()
            return f"sum{i}"

        return fn

    big = reader_mod._DIGESTS_SPLIT_MIN
    assert _digests([(big, job(0)), (big, job(1))], 2) == ["sum0", "sum1"]
    assert len(seen) == 2 and threading.get_ident() in seen
    # below the bound, the calling thread runs every job
    seen.clear()
    calls: list[int] = []

    def small(i: int) -> Any:
        return lambda: (calls.append(threading.get_ident()), f"sum{i}")[1]

    assert _digests([(1, small(0)), (1, small(1))], 8) == ["sum0", "sum1"]
    assert calls == [threading.get_ident()] * 2
    monkeypatch.setattr(reader_mod, "_DIGESTS_SPLIT_MIN", 1 << 40)
    calls.clear()
    assert _digests([(big, small(0)), (big, small(1))], 8) == ["sum0", "sum1"]
    assert calls == [threading.get_ident()] * 2


def test_resident_tells_pages_in_memory_from_pages_not() -> None:
    import mmap

    import numpy as np

    fresh = mmap.mmap(-1, 8 * MiB)  # anonymous: no page in memory until touched
    at = int(np.frombuffer(fresh, dtype=np.uint8).ctypes.data)
    assert not reader_mod._resident(at, 8 * MiB)
    assert reader_mod._resident(at, 0)
    fresh[: 4 * MiB] = b"x" * (4 * MiB)  # the first half touched
    assert reader_mod._resident(at + 1, 4 * MiB - 1)
    assert not reader_mod._resident(at, 4 * MiB + 1)


def test_a_tensor_in_pieces_is_filled_only_once_every_tensor_passed(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"table": torch.rand(4 * MiB, generator=g), "dense": torch.rand(MiB, generator=g)}
    inc = Incremental(chunk_bytes=64 << 10, min_bytes=0, whole_every=0, min_saving=0.0)
    with Checkpointer(tmp_path, state, keep=None, incremental=inc) as ck:
        ck.save(1)
        with torch.no_grad():
            state["table"][: 64 << 10].add_(1.0)  # the first 256 KiB: 4 chunks
            state["dense"].add_(1.0)
        ck.save(2)
    storage = open_storage(str(tmp_path))
    reader = CheckpointReader(storage, 2)
    reader.check_files()
    lo, hi = reader._locations().where["table"]
    assert hi - lo > 1  # in pieces: the changed chunks here, the rest in step 1's file
    live = torch.zeros_like(state["table"])
    got = reader.tensors(into={"table": live})
    assert got["table"] is live and not live.any()  # not copied yet
    reader.fill()
    assert torch.equal(live, state["table"])

    _flip(tmp_path, 2, "dense")
    reader = CheckpointReader(storage, 2)
    reader.check_files()
    live = torch.zeros_like(state["table"])
    with pytest.raises(CorruptCheckpointError, match="tensor 'dense'"):
        reader.tensors(into={"table": live})
    reader.fill()  # nothing to fill: the table's pieces were never queued
    assert not live.any()


def test_digests_keep_order_and_raise_a_jobs_error() -> None:
    sizes = [5, 50 << 20, 1, 20 << 20, 3]
    jobs = [(n, (lambda i=i: f"sum{i}")) for i, n in enumerate(sizes)]
    for threads in (1, 2, 3, 8):
        assert _digests(jobs, threads) == [f"sum{i}" for i in range(len(sizes))]
    assert _digests([], 2) == []

    def boom() -> str:
        raise OSError("read failed")

    with pytest.raises(OSError, match="read failed"):
        _digests([*jobs, (30 << 20, boom)], 2)


def _two_ranks(storage: Any) -> list[Any]:
    """Step 1 of two ranks, each with its own data file; each rank's result."""
    shared: dict[Any, Any] = {}
    meet = threading.Barrier(2, timeout=60)
    committer = committer_for(storage)
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        state = {"extra": {"w": torch.full((1000,), float(r))}}
        cap = capture(state, include_rng=False, rank=r, world_size=2)
        results[r] = write_distributed(
            ThreadRanks(r, 2, shared, meet),
            storage,
            committer,
            WriteRequest(1, Arena().snapshot(cap.tensors), cap.tree, pieces={}),
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class _Counted:
    """A storage whose calls are counted, by name and first argument (the path)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.paths: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.paths.append(str(args[0]) if args else "")
            return attr(*args, **kwargs)

        return counted


def test_only_the_files_read_are_checked_and_each_once(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    results = _two_ranks(storage)
    # the manifest stays on rank 0; every rank has its digest
    assert results[0].manifest is not None and results[1].manifest is None
    assert results[0].digest == results[1].digest == results[0].manifest["digest"]
    trees = CheckpointReader(storage, 1).manifest["ranks"]
    names = [[n for _, n in iter_tensor_refs(trees[r]["tree"])] for r in range(2)]
    assert all(names)
    # rank 1's file damaged (cut short): a reader of rank 0's tensors never asks for
    # it, and reads them; it checks its one file once, however many reads
    cut = tmp_path / "step-000000000001" / "rank-00001.safetensors"
    cut.write_bytes(cut.read_bytes()[:-4])
    counted = _Counted(storage)
    reader = CheckpointReader(counted, 1)  # type: ignore[arg-type]
    reader.only_rank(0)
    got = reader.tensors(names[0])
    assert all(float(t.float().mean()) == 0.0 for t in got.values())
    # the top manifest (size, read), rank 0's part (size, read; no other part); its
    # file checked (size, header length, header), read
    own = "step-000000000001/rank-00000.safetensors"
    part = "step-000000000001/part-00000.json.gz"
    assert counted.paths == ["step-000000000001/manifest.json"] * 2 + [part] * 2 + [own] * 4
    assert reader.partial
    checks = len(counted.paths)
    reader.check_files(names[0])
    reader.tensors(names[0], verify=False)
    assert len(counted.paths) - checks == 1  # the data read alone, no check again
    # rank 1's tensors: refused before a byte of them is returned, and so is a check
    # of every file
    reader = CheckpointReader(storage, 1)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00001\.safetensors has"):
        reader.tensors(names[1])
    with pytest.raises(CorruptCheckpointError, match=r"rank-00001\.safetensors has"):
        CheckpointReader(storage, 1).check_files()
