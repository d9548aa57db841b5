"""`Saver` alone, built as `wiring.build_parts` builds it, with real collaborators (a
local root and its claim, the memory tier's slots, a persister, the schedule, the audit
log): a save snapshots once and persists, reuses the memory snapshot of its step, defers
while a persist runs (``on_busy="skip"``), and the flush at close makes the final state
durable only when it is newer than the last commit."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from resumable.audit import AuditLog, ProgressNotes, read_audit
from resumable.commit import list_committed
from resumable.coordination import Agreement
from resumable.group import Group
from resumable.monitor import Monitor
from resumable.options import CheckpointOptions
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.persister import BackgroundPersister, Persister, SyncPersister
from resumable.pipeline.root_claim import RootClaim
from resumable.pipeline.saver import Saver
from resumable.pipeline.schedule import Schedule
from resumable.policy import Every
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import ForwardingStorage
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture


class Gate(ForwardingStorage):
    """Data-file writes wait until ``gate`` is set (at the latest after 60 s)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.timer = threading.Timer(60, self.gate.set)
        self.timer.start()

    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            self.gate.wait()
        return self.inner.write(path, chunks)

    def open(self) -> None:
        self.timer.cancel()
        self.gate.set()


class Built:
    """A `Saver` and the parts it was built with."""

    def __init__(self, storage: Storage, shm_dir: Path | None, **kw: Any) -> None:
        self.options = CheckpointOptions.from_kwargs(
            persist_every=Every(steps=10**9), shm_dir=shm_dir, keep=None, **kw
        )
        self.mode = self.options.persist.mode if shm_dir is not None else "sync"
        group = Group(0, 1)
        self.claim = RootClaim(storage, None, group)
        self.audit = AuditLog(storage)
        self.monitor = Monitor(url=storage.url)
        agreement = Agreement(group, None)
        self.schedule = Schedule(None, self.options.schedule.persist_every, agreement)
        self.memory = (
            MemoryTier(
                storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=self.audit
            )
            if shm_dir is not None
            else None
        )
        parts: dict[str, Any] = {
            "coordination": group,
            "memory": self.memory,
            "audit": self.audit,
            "monitor": self.monitor,
            "mirror": None,
            "keep": None,
            "mirror_keep": None,
        }
        self.persister: Persister = (
            SyncPersister(storage, **parts)
            if self.mode == "sync"
            else BackgroundPersister(
                storage,
                mode=self.mode,
                storage_options=None,
                mirror_options=None,
                store=None,
                **parts,
            )
        )
        self.saver = Saver(
            self.options,
            mode=self.mode,
            group=group,
            claim=self.claim,
            memory=self.memory,
            persister=self.persister,
            agreement=agreement,
            schedule=self.schedule,
            audit=self.audit,
            monitor=self.monitor,
            progress=ProgressNotes(self.audit),
        )
        self.copies: list[int] = []

    def snapshot(self, state: Mapping[str, Any]) -> Any:
        """The facade's snapshot call, counted."""

        def take(step: int, metrics: Mapping[str, Any] | None) -> None:
            self.copies.append(step)
            self.saver.snapshot(state, step, metrics)

        return take

    def close(self) -> None:
        self.persister.wait()
        self.persister.close()
        if self.memory is not None:
            self.memory.close(unlink=True)
        self.claim.release()


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((32,), float(step))}


def test_without_the_memory_tier_a_save_writes_on_the_calling_thread(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    b = Built(storage, None, persist="sync")
    try:
        s = state(4)
        assert b.saver.save(s, 4, {"loss": 0.5}, b.snapshot(s)) is True
        assert list_committed(storage) == [4], "durable when save returns"
        assert b.copies == [], "no memory snapshot without the memory tier"
        assert b.schedule.last_persist == 4
        assert b.saver.last_snapshot_s is not None
    finally:
        b.close()


def test_a_save_snapshots_once_and_reuses_the_snapshot_of_its_step(
    tmp_path: Path, shm_dir: Path
) -> None:
    storage = LocalStorage(tmp_path / "root")
    b = Built(storage, shm_dir, persist="thread")
    try:
        s = state(1)
        assert b.saver.save(s, 1, None, b.snapshot(s))
        assert b.copies == [1]
        b.persister.wait()  # else step 2's persist would be deferred (on_busy="skip")
        b.saver.snapshot(s, 2, None)  # a memory snapshot of step 2 (maybe_save's)
        assert b.saver.save(s, 2, None, b.snapshot(s))
        assert b.copies == [1], "step 2's snapshot was reused, not copied again"
        b.persister.wait()
        assert list_committed(storage) == [1, 2]
    finally:
        b.close()


def test_skip_defers_while_a_persist_runs_and_records_why(tmp_path: Path, shm_dir: Path) -> None:
    storage = Gate(LocalStorage(tmp_path / "root"))
    b = Built(storage, shm_dir, persist="thread", on_busy="skip")
    try:
        s = state(1)
        assert b.saver.save(s, 1, None, b.snapshot(s))
        assert b.saver.save(s, 2, None, b.snapshot(s)) is False, "deferred: step 1 persists"
        assert b.copies == [1, 2], "the snapshot of a deferred save is still taken"
        assert b.schedule.owed, "the deferred persist is owed to the next maybe_save"
        skips = [e for e in read_audit(storage) if e["event"] == "skip"]
        assert [e["step"] for e in skips] == [2] and "[1]" in skips[0]["reason"]
        storage.open()
        b.persister.wait()
        assert list_committed(storage) == [1]
    finally:
        storage.open()
        b.close()


def test_flush_makes_the_final_state_durable_only_if_newer(tmp_path: Path, shm_dir: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    b = Built(storage, shm_dir, persist="thread")
    saved: list[int] = []

    def save(step: int, metrics: Mapping[str, Any] | None) -> bool:
        saved.append(step)
        s = state(step)
        return b.saver.save(s, step, metrics, b.snapshot(s))

    try:
        save(5, None)
        b.persister.wait()
        b.saver.flush((5, None), save, url=storage.url, left_s=lambda: None)
        assert saved == [5], "step 5 is committed already: nothing to flush"
        b.saver.flush((3, None), save, url=storage.url, left_s=lambda: None)
        assert saved == [5], "an older final step is never saved over a newer commit"
        b.saver.flush((8, {"loss": 0.1}), save, url=storage.url, left_s=lambda: None)
        assert saved == [5, 8]
        assert list_committed(storage) == [5, 8]
    finally:
        b.close()
