"""`Emergency` alone (issue 46 item 5): noticing a preemption (a signal, a watcher's
notice) and taking the emergency checkpoint with a real persister within the grace:
this step's snapshot if there is one, else a fresh save if its measured cost fits the
grace, else the newest older snapshot. Its outcome goes to the audit log."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable.audit import AuditLog, read_audit
from resumable.commit import list_committed
from resumable.coordination import Agreement
from resumable.errors import StorageError
from resumable.group import Group
from resumable.monitor import Monitor
from resumable.pipeline.emergency import Emergency
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import BackgroundPersister, SyncPersister
from resumable.preemption import Preemption
from resumable.snapshot import MemorySnapshot
from resumable.storage import LocalStorage
from resumable.storage.base import Buffer, ForwardingStorage


class FullDisk(ForwardingStorage):
    """Refuses every data file's write (ENOSPC: final, not retried) while ``full``."""

    full = True

    def __init__(self, inner: LocalStorage) -> None:
        super().__init__(inner)
        self.refused = threading.Event()

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if self.full and path.endswith(".safetensors"):
            self.refused.set()
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
    return {"w": torch.full((32,), float(step))}


def emergency(grace: float = 60.0) -> Emergency:
    group = Group(0, 1)
    config = Preemption(signals=("SIGUSR1",), grace_seconds=grace, exit=False)
    return Emergency(config, group, Agreement(group, None))


class Rig:
    """A root, its memory tier and a `SyncPersister`, wired as `Checkpointer` wires them;
    records which of the callbacks `Emergency.checkpoint` used."""

    def __init__(self, root: Path, shm_dir: Path) -> None:
        self.storage = LocalStorage(root)
        self.audit = AuditLog(self.storage)
        self.memory = MemoryTier(
            self.storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=self.audit
        )
        self.persister = SyncPersister(
            self.storage,
            keep=None,
            mirror_keep=None,
            coordination=Group(0, 1),
            memory=self.memory,
            audit=self.audit,
            monitor=Monitor(url=self.storage.url),
            mirror=None,
        )
        self.calls: list[tuple[str, int]] = []

    def snapshot(self, step: int) -> None:
        self.memory.take(weights(step), step, None, rng=False)

    def persist(self, snap: MemorySnapshot) -> None:
        self.calls.append(("persist", snap.step))
        self.persister.persist(snap, None)

    def save(self, step: int, metrics: Mapping[str, Any] | None) -> object:
        self.calls.append(("save", step))
        return self.persister.persist_state(weights(step), step, metrics, rng=False)

    def checkpoint(
        self, e: Emergency, step: int, *, snapshot_s: float | None, persist_s: float | None
    ) -> None:
        e.checkpoint(
            step,
            None,
            persister=self.persister,
            newest=lambda: self.memory.newest,
            persist=self.persist,
            save=self.save,
            audit=self.audit,
            snapshot_s=snapshot_s,
            persist_s=persist_s,
        )

    def emergency_entry(self) -> dict[str, Any]:
        (entry,) = [e for e in read_audit(self.storage) if e["event"] == "emergency_commit"]
        return entry

    def close(self) -> None:
        self.persister.close()
        self.memory.close(unlink=True)


@pytest.fixture
def rig(tmp_path: Path, shm_dir: Path) -> Iterator[Rig]:
    r = Rig(tmp_path / "root", shm_dir)
    yield r
    r.close()


def test_a_signal_is_noticed_at_the_next_step_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    e = emergency()
    try:
        assert not e.requested(1)
        assert e.left_s() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert e.requested(2)
        assert e.monitor.reason == "signal SIGUSR1"
    finally:
        e.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_watchers_notice_is_a_preemption() -> None:
    e = emergency()
    try:
        e.monitor.notice("spot termination notice")
        assert e.requested(5)
    finally:
        e.close()


def test_the_snapshot_of_this_step_is_persisted(rig: Rig) -> None:
    e = emergency()
    try:
        rig.snapshot(10)
        e.monitor.notice("test")
        rig.checkpoint(e, 10, snapshot_s=None, persist_s=None)
        left = e.left_s()
    finally:
        e.close()
    assert rig.calls == [("persist", 10)]
    assert list_committed(rig.storage) == [10]
    assert left is not None and 0 < left <= 60.0
    entry = rig.emergency_entry()
    assert entry["step"] == 10
    assert entry["how"] == "persisted the snapshot of this step"
    assert entry["within_grace"] is True
    preempt = [x for x in read_audit(rig.storage) if x["event"] == "preempt"]
    assert preempt and preempt[0]["reason"] == "test"


def test_without_a_snapshot_the_state_is_saved_fresh(rig: Rig) -> None:
    e = emergency()
    try:
        e.monitor.notice("test")
        rig.checkpoint(e, 4, snapshot_s=None, persist_s=None)
    finally:
        e.close()
    assert rig.calls == [("save", 4)]
    assert list_committed(rig.storage) == [4]
    assert rig.emergency_entry()["how"] == "snapshot and persist"


def test_a_fresh_save_that_fits_the_grace_is_taken_over_an_older_snapshot(rig: Rig) -> None:
    e = emergency(grace=60.0)
    try:
        rig.snapshot(8)
        e.monitor.notice("test")
        rig.checkpoint(e, 9, snapshot_s=1.0, persist_s=2.0)  # 3 s of 60
    finally:
        e.close()
    assert rig.calls == [("save", 9)]
    assert list_committed(rig.storage) == [9]
    entry = rig.emergency_entry()
    assert entry["estimate_s"] == 3.0 and entry["within_grace"] is True


def test_the_older_snapshot_is_persisted_when_a_fresh_save_does_not_fit(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    e = emergency(grace=60.0)
    try:
        rig.snapshot(8)
        e.monitor.notice("test")
        with caplog.at_level(logging.WARNING):
            rig.checkpoint(e, 9, snapshot_s=20.0, persist_s=100.0)  # 120 s of 60
    finally:
        e.close()
    assert rig.calls == [("persist", 8)]
    assert list_committed(rig.storage) == [8]
    assert rig.emergency_entry()["how"] == "persisted the older snapshot of step 8"
    assert "does not fit" in caplog.text


def test_an_earlier_failed_persist_is_logged_and_the_emergency_checkpoint_still_taken(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = FullDisk(LocalStorage(tmp_path / "root"))
    audit = AuditLog(storage)
    memory = MemoryTier(storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=audit)
    persister = BackgroundPersister(
        storage,
        mode="thread",
        keep=None,
        mirror_keep=None,
        storage_options=None,
        mirror_options=None,
        store=None,
        coordination=Group(0, 1),
        memory=memory,
        audit=audit,
        monitor=Monitor(url=storage.url),
        mirror=None,
    )
    e = emergency()
    try:
        memory.take(weights(3), 3, None, rng=False)
        snap3 = memory.current(3)
        assert snap3 is not None
        persister.persist(snap3, None)  # fails in the background: the disk is full
        memory.take(weights(6), 6, None, rng=False)
        assert storage.refused.wait(60)
        storage.full = False
        e.monitor.notice("test")
        with caplog.at_level(logging.ERROR):
            e.checkpoint(
                6,
                None,
                persister=persister,
                newest=lambda: memory.newest,
                persist=lambda snap: persister.persist(snap, None),
                save=lambda step, metrics: pytest.fail("the snapshot of step 6 exists"),
                audit=audit,
                snapshot_s=None,
                persist_s=None,
            )
    finally:
        e.close()
        persister.close()
        memory.close(unlink=True)
    assert "an earlier persist failed" in caplog.text
    assert persister.committed == 6
    assert list_committed(storage) == [6]
