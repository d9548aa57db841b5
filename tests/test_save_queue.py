"""``on_busy="wait"``: a due persist queues behind the running one instead of blocking the
save (the first saves of a launch find the worker process still starting), every due
persist still commits, and a save waits only when one is queued already or shared
memory has no slot left for the snapshots taken meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable._shm_meta import SlotMeta
from resumable._shm_slot import ShmSlot
from resumable.errors import CheckpointError, StorageError
from resumable.snapshot import ShmArena
from resumable.storage.memory import MemoryStorage
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture

GATE_S = 60.0  # the gate opens by itself after this: a wrong wait fails, never hangs


class Gated(MemoryStorage):
    """Memory storage whose data-file writes wait until `open` is called."""

    def __init__(self) -> None:
        super().__init__("memory://gated")
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.timer = threading.Timer(GATE_S, self.gate.set)
        self.timer.start()

    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            self.writing.set()
            self.gate.wait()
        return super().write(path, chunks)

    def open(self) -> None:
        self.timer.cancel()
        self.gate.set()


def _checkpointer(storage: Gated, shm_dir: Path, **options: Any) -> resumable.Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    return resumable.Checkpointer(
        storage,
        {"model": model, "optim": torch.optim.AdamW(model.parameters())},
        persist="thread",
        on_busy="wait",
        shm_dir=shm_dir,
        **options,
    )


def _save_returns_before_the_gate(ck: resumable.Checkpointer, storage: Gated, step: int) -> bool:
    """Save ``step`` on another thread, open the gate a moment later, and say whether
    the save had returned before it opened (it queued) or only after (it waited)."""
    before: list[bool] = []
    saver = threading.Thread(
        target=lambda: (ck.save(step), before.append(not storage.gate.is_set()))
    )
    saver.start()
    saver.join(timeout=0.5)
    storage.open()
    saver.join(timeout=GATE_S)
    assert before, f"save({step}) did not return"
    return before[0]


def test_a_second_save_queues_behind_the_running_persist(shm_dir: Path) -> None:
    storage = Gated()
    ck = _checkpointer(storage, shm_dir)
    try:
        ck.save(1)
        assert storage.writing.wait(GATE_S), "the persist of step 1 never started writing"
        assert _save_returns_before_the_gate(ck, storage, 2), "save(2) waited for step 1"
        ck.wait()
        assert ck.steps() == [1, 2], "every due persist commits, in order"
    finally:
        storage.open()
        ck.close()


def test_a_third_save_waits_while_one_is_queued(shm_dir: Path) -> None:
    storage = Gated()
    ck = _checkpointer(storage, shm_dir)
    try:
        ck.save(1)
        assert storage.writing.wait(GATE_S)
        ck.save(2)  # queued: returns at once (the test above)
        assert not storage.gate.is_set()
        assert not _save_returns_before_the_gate(ck, storage, 3), "save(3) did not wait"
        ck.wait()
        assert ck.steps() == [1, 2, 3]
    finally:
        storage.open()
        ck.close()


class GatedEach(MemoryStorage):
    """Memory storage whose n-th data-file write waits until ``gates[n]`` is set."""

    def __init__(self, n: int) -> None:
        super().__init__("memory://gated-each")
        self.gates = [threading.Event() for _ in range(n)]
        self.writes = 0
        self.timers = [threading.Timer(GATE_S, g.set) for g in self.gates]
        for t in self.timers:
            t.start()

    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            self.writes += 1
            if self.writes <= len(self.gates):
                self.gates[self.writes - 1].wait()
        return super().write(path, chunks)

    def open_all(self) -> None:
        for t, g in zip(self.timers, self.gates):
            t.cancel()
            g.set()


def test_a_third_save_waits_for_the_oldest_persist_only(shm_dir: Path) -> None:
    storage = GatedEach(2)
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    ck = resumable.Checkpointer(
        storage, {"model": model}, persist="thread", on_busy="wait", shm_dir=shm_dir
    )
    try:
        ck.save(1)
        ck.save(2)  # queued behind step 1
        seen: list[tuple[bool, bool]] = []
        saver = threading.Thread(
            target=lambda: (
                ck.save(3),
                seen.append((storage.gates[0].is_set(), storage.gates[1].is_set())),
            )
        )
        saver.start()
        saver.join(timeout=0.5)
        storage.gates[0].set()  # step 1's write may end; step 2's still waits
        saver.join(timeout=GATE_S)
        assert seen == [(True, False)], "save(3) waits for step 1's persist, not step 2's"
        storage.open_all()
        ck.wait()
        assert ck.steps() == [1, 2, 3]
    finally:
        storage.open_all()
        ck.close()


def _beyond_two(path: Path) -> bool:
    """Whether ``path`` names a slot beyond the first two (`slot_paths`: ``...-s<i>``)."""
    return int(path.name.rsplit("-s", 1)[1]) >= 2


def test_without_room_for_a_spare_slot_the_save_waits(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = ShmSlot.check_room

    def no_third(path: Path, **caps: int) -> int:
        if _beyond_two(path):
            raise StorageError(28, "No space left on device (injected)")
        return room(path, **caps)

    monkeypatch.setattr(ShmSlot, "check_room", staticmethod(no_third))
    storage = Gated()
    ck = _checkpointer(storage, shm_dir)
    try:
        ck.save(1)
        assert storage.writing.wait(GATE_S)
        assert not _save_returns_before_the_gate(ck, storage, 2), "save(2) queued anyway"
        ck.wait()
        assert ck.steps() == [1, 2]
    finally:
        storage.open()
        ck.close()


def _memory_checkpointer(storage: Gated, shm_dir: Path) -> resumable.Checkpointer:
    """`_checkpointer` with a memory snapshot at every `maybe_save` and persists only
    when `save` is called."""
    return _checkpointer(
        storage,
        shm_dir,
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=10**9),
    )


def _before_a_spare_is_made(monkeypatch: pytest.MonkeyPatch, hook: Callable[[], None]) -> None:
    """Call ``hook`` (which may wait or raise) before a slot beyond the first two is made,
    on the thread making it."""
    create = ShmSlot.create.__func__  # type: ignore[attr-defined]

    def made(cls: type[ShmSlot], path: Path, **caps: int) -> ShmSlot:
        if _beyond_two(path):
            hook()
        return create(cls, path, **caps)  # type: ignore[no-any-return]

    monkeypatch.setattr(ShmSlot, "create", classmethod(made))


def test_the_spare_slot_is_made_while_the_save_that_queued_returns(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reserving and touching a spare slot's pages takes as long as a copy of the state:
    the save whose persist queues does not wait for it; the next snapshot takes it."""
    release = threading.Event()
    makers: list[str] = []

    def slow() -> None:
        makers.append(threading.current_thread().name)
        assert release.wait(GATE_S), "never released"

    _before_a_spare_is_made(monkeypatch, slow)
    storage = Gated()
    ck = _memory_checkpointer(storage, shm_dir)
    try:
        ck.save(1)
        assert storage.writing.wait(GATE_S)
        returned = threading.Event()
        saver = threading.Thread(target=lambda: (ck.save(2), returned.set()))
        saver.start()
        assert returned.wait(GATE_S), "save(2) waited for the spare slot to be made"
        assert makers and all(m.startswith("resumable-slot") for m in makers), makers
        release.set()
        saver.join(GATE_S)
        ck.maybe_save(3)  # goes to the spare: steps 1 and 2 are held by their persists
        arena = ck._parts.memory.arena  # type: ignore[union-attr]
        assert arena.newest is not None and arena.newest.index >= 2 and arena.newest.step == 3
        storage.open()
        ck.wait()
        assert ck.steps() == [1, 2]
    finally:
        release.set()
        storage.open()
        ck.close()


def test_a_spare_slot_made_in_vain_makes_the_next_snapshot_wait_for_a_persist(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared memory fills up between the room check and the spare slot's reservation:
    the queued persist keeps its slot, and the next snapshot waits for the running
    persist to end instead of failing or overwriting a slot being persisted."""

    def filled() -> None:
        raise StorageError(28, "No space left on device (injected)")

    _before_a_spare_is_made(monkeypatch, filled)
    storage = Gated()
    ck = _memory_checkpointer(storage, shm_dir)
    try:
        ck.save(1)
        assert storage.writing.wait(GATE_S)
        queued, returned = threading.Event(), threading.Event()
        saver = threading.Thread(
            target=lambda: (ck.save(2), queued.set(), ck.maybe_save(3), returned.set())
        )
        saver.start()
        assert queued.wait(GATE_S), "save(2) did not queue: shared memory had room"
        assert not returned.wait(1.0), "snapshot 3 did not wait for a persist to end"
        storage.open()
        assert returned.wait(GATE_S), "snapshot 3 never came"
        saver.join(GATE_S)
        ck.wait()
        assert ck.steps() == [1, 2]
        arena = ck._parts.memory.arena  # type: ignore[union-attr]
        assert arena.newest is not None and arena.newest.step == 3
        assert all(s is None for s in arena.slots[2:]), "a slot beyond two was made"
    finally:
        storage.open()
        ck.close()


def test_reserve_spare_makes_a_slot_as_large_as_the_taken_one(shm_dir: Path) -> None:
    arena = ShmArena("q", shm_dir=shm_dir)
    t = {"w": torch.zeros(4096)}
    try:
        first = arena.snapshot(1, t, SlotMeta(tree={}))
        assert not isinstance(first, type(None))
        arena.locked.add(first.index)  # step 1 persisting
        second = arena.snapshot(2, t, SlotMeta(tree={}))
        assert arena.reserve_spare(second.index)
        arena.settle_spare()  # made on the slot maker's thread
        spare = [i for i, s in enumerate(arena.slots) if s is not None][-1]
        assert spare not in (first.index, second.index)
        assert arena.slots[spare].fits(1, 1, 4 * 4096)  # type: ignore[union-attr]
        arena.locked.add(second.index)  # step 2 queued
        third = arena.snapshot(3, t, SlotMeta(tree={}))
        assert third.index == spare, "the snapshot taken meanwhile goes to the spare"
        arena.locked |= {third.index}
        assert not arena.reserve_spare(3), "every other slot locked: no spare is left"
        arena.keep = 2  # replicas keep the two newest snapshots: never queue
        arena.locked = {first.index}
        assert not arena.reserve_spare(second.index)
    finally:
        arena.close(unlink=True)


def test_a_queued_persist_survives_the_trainer_closing(shm_dir: Path) -> None:
    storage = Gated()
    ck = _checkpointer(storage, shm_dir)
    ck.save(1)
    assert storage.writing.wait(GATE_S)
    ck.save(2)
    threading.Timer(0.2, storage.open).start()
    ck.close()  # waits for both
    assert ck.steps() == [1, 2]


def test_a_spare_slot_with_no_place_at_all_is_given_up_without_an_error(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spare slot's file cannot be made where it should (its directory went away),
    and the fallback directory has no room: the spare is given up, no error reaches the
    snapshot, and with both slots held by persists the arena says it is full."""
    calls: list[str] = []

    def nowhere() -> None:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise CheckpointError("cannot create a snapshot slot here (injected)")
        raise StorageError(28, "No space left on device (injected)")

    _before_a_spare_is_made(monkeypatch, nowhere)
    arena = ShmArena("nowhere", shm_dir=shm_dir)
    t = {"w": torch.zeros(4096)}
    try:
        first = arena.snapshot(1, t, SlotMeta(tree={}))
        arena.locked.add(first.index)  # type: ignore[union-attr]
        second = arena.snapshot(2, t, SlotMeta(tree={}))
        assert arena.reserve_spare(second.index)  # type: ignore[union-attr]
        arena.locked.add(second.index)  # type: ignore[union-attr]
        assert arena.full(), "no slot is left and none may be made"
        assert len(calls) == 2 and calls[0].startswith("resumable-slot"), calls
        assert all(s is None for s in arena.slots[2:])
        arena.locked.discard(first.index)  # type: ignore[union-attr]
        assert not arena.full()
        assert arena.snapshot(3, t, SlotMeta(tree={})).index == first.index  # type: ignore[union-attr]
    finally:
        arena.close(unlink=True)
