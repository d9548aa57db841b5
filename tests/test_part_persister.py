"""The persisters alone (issue 46 item 5), built as `Checkpointer` builds them, with real
collaborators: a storage root, the memory tier's shared-memory slots, the audit log and
the monitor. Each turns a snapshot into a committed checkpoint; a failing storage's
error reaches the caller (at `persist` for `SyncPersister`, at `wait` or `collect` for
`BackgroundPersister`) and nothing is committed."""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable.audit import AuditLog, read_audit
from resumable.commit import list_committed
from resumable.errors import PersistError, StorageError
from resumable.group import Group
from resumable.monitor import Monitor
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import BackgroundPersister, SyncPersister
from resumable.policy import Keep
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import Buffer, ForwardingStorage
from resumable.storage.memory import MemoryStorage


class FullDisk(ForwardingStorage):
    """Refuses every data file's write (ENOSPC: final, not retried)."""

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if path.endswith(".safetensors"):
            raise StorageError(errno.ENOSPC, f"injected: no space for {path}")
        return self.inner.write(path, chunks)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A private directory standing in for /dev/shm."""
    d = Path("/dev/shm") / f"resumable-part-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def weights(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32) * step, "step": step}


def stored(storage: Storage, step: int) -> torch.Tensor:
    """The one tensor of the checkpoint of ``step``, verified against its checksums."""
    reader = CheckpointReader(storage, step)
    reader.check_files()
    (tensor,) = reader.tensors(verify=True).values()
    return tensor


def parts(storage: Storage, memory: MemoryTier | None = None) -> dict[str, Any]:
    return {
        "coordination": Group(0, 1),
        "memory": memory,
        "audit": AuditLog(storage),
        "monitor": Monitor(url=storage.url),
        "mirror": None,
    }


def tier(storage: Storage, shm_dir: Path) -> MemoryTier:
    return MemoryTier(
        storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=AuditLog(storage)
    )


def snapshot(memory: MemoryTier, step: int) -> Any:
    memory.take(weights(step), step, {"loss": 1.0 / step}, rng=False)
    snap = memory.current(step)
    assert snap is not None
    return snap


def background(storage: Storage, memory: MemoryTier, mode: str, **kw: Any) -> BackgroundPersister:
    return BackgroundPersister(
        storage,
        mode=mode,
        keep=kw.pop("keep", None),
        mirror_keep=None,
        storage_options=None,
        mirror_options=None,
        store=None,
        **parts(storage, memory),
        **kw,
    )


# ------------------------------------------------------------------ SyncPersister


def test_sync_persists_a_state_and_commits_it(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    p = SyncPersister(storage, keep=None, mirror_keep=None, **parts(storage))
    p.start()
    assert not p.busy and p.running() == []
    p.persist_state(weights(3), 3, {"loss": 0.5}, rng=False)
    assert p.committed == 3  # durable when persist returns
    p.wait()
    p.close()
    assert list_committed(storage) == [3]
    assert torch.equal(stored(storage, 3), weights(3)["w"])
    assert p.monitor.stats["commits"] == 1
    assert [e["step"] for e in read_audit(storage) if e["event"] == "save_start"] == [3]


def test_sync_persists_a_memory_snapshot_and_applies_retention(
    tmp_path: Path, shm_dir: Path
) -> None:
    storage = LocalStorage(tmp_path / "root")
    memory = tier(storage, shm_dir)
    p = SyncPersister(storage, keep=Keep(last=2), mirror_keep=None, **parts(storage, memory))
    for step in (1, 2, 3):
        p.persist(snapshot(memory, step), None)
    p.wait()
    p.close()
    memory.close(unlink=True)
    assert p.committed == 3
    assert list_committed(storage) == [2, 3]
    assert torch.equal(stored(storage, 2), weights(2)["w"])


def test_sync_raises_a_storage_failure_at_persist_and_commits_nothing(tmp_path: Path) -> None:
    storage = FullDisk(LocalStorage(tmp_path))
    p = SyncPersister(storage, keep=None, mirror_keep=None, **parts(storage))
    with pytest.raises(StorageError, match="injected: no space"):
        p.persist_state(weights(1), 1, None, rng=False)
    p.close()
    assert list_committed(storage) == []
    assert p.committed is None
    assert p.monitor.stats["failures"] == 1
    assert any(e["event"] == "failure" and e["step"] == 1 for e in read_audit(storage))


# ------------------------------------------------------------------ BackgroundPersister


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_persists_snapshots_and_commits_them(
    tmp_path: Path, shm_dir: Path, mode: str
) -> None:
    storage = LocalStorage(tmp_path / "root")
    memory = tier(storage, shm_dir)
    p = background(storage, memory, mode, keep=Keep(last=2))
    p.start()
    try:
        for step in (1, 2, 3):
            p.wait()  # one at a time: the slots of a running persist stay locked
            p.persist(snapshot(memory, step), 0.01)
        p.wait()
        assert not p.busy and p.running() == []
        assert p.committed == 3
        assert p.monitor.stats["commits"] == 3
    finally:
        p.close()
        memory.close(unlink=True)
    assert list_committed(storage) == [2, 3]
    assert torch.equal(stored(storage, 3), weights(3)["w"])


def test_background_thread_writes_to_an_in_process_store(shm_dir: Path) -> None:
    storage = MemoryStorage("memory://part-persister")
    memory = tier(storage, shm_dir)
    p = background(storage, memory, "thread")
    try:
        p.persist(snapshot(memory, 7), None)
        p.wait()
    finally:
        p.close()
        memory.close(unlink=True)
    assert list_committed(storage) == [7]
    assert torch.equal(stored(storage, 7), weights(7)["w"])


def test_background_raises_a_storage_failure_at_wait(tmp_path: Path, shm_dir: Path) -> None:
    storage = FullDisk(LocalStorage(tmp_path / "root"))
    memory = tier(storage, shm_dir)
    p = background(storage, memory, "thread")
    try:
        p.persist(snapshot(memory, 4), None)  # returns: the failure comes later
        with pytest.raises(PersistError, match=r"persisting step 4 .* failed: .*no space"):
            p.wait()
        p.wait()  # raised once, not again
        assert p.committed is None
        assert p.monitor.stats["failures"] == 1
        # The failed job's slot was released: the next snapshot and persist go on.
        snap = snapshot(memory, 5)
        storage.write = storage.inner.write  # type: ignore[method-assign]  # disk freed
        p.persist(snap, None)
        p.wait()
        assert p.committed == 5
    finally:
        p.close()
        memory.close(unlink=True)
    assert list_committed(storage) == [5]


def test_background_raises_a_storage_failure_at_collect(tmp_path: Path, shm_dir: Path) -> None:
    storage = FullDisk(LocalStorage(tmp_path / "root"))
    memory = tier(storage, shm_dir)
    p = background(storage, memory, "thread")
    try:
        p.persist(snapshot(memory, 2), None)
        with pytest.raises(PersistError, match="persisting step 2"):
            for _ in range(2000):  # collect() does not block: poll until the reply came
                p.collect()
                if not p.busy and not p.running():
                    p.collect()
                    break
                time.sleep(0.005)
    finally:
        p.close()
        memory.close(unlink=True)
    assert list_committed(storage) == []
