"""Per-tensor checksums hashed on a thread of their own while the data file is written
(`resumable.pipeline.write.Checksums`): the manifest holds the same checksums as before, a
failure of the hashing fails the persist and commits nothing, and no hashing outlives
the persist that started it (the snapshot it reads is reused after)."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable.pipeline.write as write_mod
from resumable import Checkpointer, Incremental, Keep, StorageError
from resumable.commit import list_committed
from resumable.format import checksum
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage
from resumable.storage.base import ForwardingStorage


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(64, 1024, generator=g),  # 256 KiB
        "mid": torch.randn(4096, generator=g),
        "ints": torch.arange(100, dtype=torch.int64) * seed,
    }


@pytest.fixture
def hash_behind(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every state here is hashed behind its write (the threshold lowered), and the
    threads that hash are recorded."""
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    threads: list[str] = []
    real = write_mod.checksum

    def recording(data: Any) -> str:
        threads.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(write_mod, "checksum", recording)
    return threads


def slow_checksums(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Make each checksum take 50 ms more; returns the (start, end) of each one hashed."""
    spans: list[tuple[float, float]] = []
    real = write_mod.checksum

    def slow(data: Any) -> str:
        t0 = time.monotonic()
        time.sleep(0.05)
        out = real(data)
        spans.append((t0, time.monotonic()))
        return out

    monkeypatch.setattr(write_mod, "checksum", slow)
    return spans


@pytest.mark.parametrize("incremental", [False, True])
def test_checksums_hashed_behind_the_write_are_the_tensors_own(
    tmp_path: Path, hash_behind: list[str], incremental: bool
) -> None:
    state = make_state(1)
    ck = Checkpointer(tmp_path, state, persist="sync", capture_rng=False, incremental=incremental)
    ck.save(1)
    with torch.no_grad():
        state["big"][0].add_(1.0)  # a part of one tensor changes; the rest does not
    ck.save(2)
    ck.close()
    assert hash_behind and set(hash_behind) == {"resumable-checksums"}
    for step in (1, 2):
        reader = CheckpointReader(LocalStorage(tmp_path), step)
        entries = reader.manifest["tensors"]
        for name, tensor in state.items():
            if step == 2 or name != "big":
                want = checksum(tensor.contiguous().view(torch.uint8).numpy().data)
                assert entries[name]["xxh3_64"] == want, (step, name)
        assert all(len(e["xxh3_64"]) == 16 for e in entries.values())
        reader.tensors(list(entries), verify=True)  # every checksum checks out
    fresh = make_state(2)
    assert Checkpointer(tmp_path, fresh, persist="sync", capture_rng=False).restore() == 2
    assert all(torch.equal(fresh[k], state[k]) for k in state)


def test_a_failed_hash_fails_the_persist_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    state = make_state(1)
    ck = Checkpointer(tmp_path, state, persist="sync", capture_rng=False, keep=Keep(last=2))
    ck.save(1)
    real = write_mod.checksum

    def failing(data: Any) -> str:
        if threading.current_thread().name == "resumable-checksums":
            raise MemoryError("injected: the hashing thread failed")
        return real(data)

    monkeypatch.setattr(write_mod, "checksum", failing)
    with torch.no_grad():
        state["big"].add_(1.0)
    with pytest.raises(MemoryError, match="injected"):
        ck.save(2)
    monkeypatch.setattr(write_mod, "checksum", real)
    assert list_committed(LocalStorage(tmp_path)) == [1]
    ck.save(3)  # the next persist commits
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == [1, 3]


class FailingWrite(ForwardingStorage):
    """Fails every data file's write at once, while its checksums are being hashed (a
    full disk: final, not retried)."""

    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            raise StorageError(errno.ENOSPC, f"injected: could not write {path}")
        return super().write(path, chunks)


def test_no_hashing_outlives_a_persist_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    spans = slow_checksums(monkeypatch)  # still hashing when the write fails
    state = make_state(1)
    ck = Checkpointer(
        FailingWrite(LocalStorage(tmp_path)), state, persist="sync", capture_rng=False
    )
    with pytest.raises(StorageError, match="injected"):
        ck.save(1)
    failed_at = time.monotonic()
    assert spans and all(end <= failed_at for _, end in spans)
    count = len(spans)
    time.sleep(0.2)
    assert len(spans) == count  # nothing hashed after the persist returned
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == []


def test_no_hashing_outlives_a_persist_whose_reference_check_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An incremental persist checks that the checkpoints it refers to are still there
    after its checksums started; when that check fails, they are stopped there too."""
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    state = make_state(1)
    incremental = Incremental(chunk_bytes=4096, min_bytes=0)
    ck = Checkpointer(tmp_path, state, persist="sync", capture_rng=False, incremental=incremental)
    ck.save(1)
    spans = slow_checksums(monkeypatch)

    def unreachable(storage: Any, refs: list[int]) -> bool:
        raise StorageError(errno.EACCES, "injected: could not look for the referred steps")

    monkeypatch.setattr(write_mod, "check_refs", unreachable)
    with torch.no_grad():
        state["big"][0].add_(1.0)  # the rest is reused: an incremental persist
    with pytest.raises(StorageError, match="injected"):
        ck.save(2)
    failed_at = time.monotonic()
    assert spans and all(end <= failed_at for _, end in spans)
    count = len(spans)
    time.sleep(0.2)
    assert len(spans) == count
    monkeypatch.setattr(write_mod, "check_refs", lambda storage, refs: True)
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == [1]
