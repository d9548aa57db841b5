"""An incremental persist whose state has many bytes that did not change at the last
comparison (a fine-tuning job's frozen base) writes its data file while it hashes those
bytes (`DeltaBase.plan_early`, `DeltaBase.confirm`, `write._index_and_write`): laid out
as if they hash as before. Where one does not (someone changed frozen weights), the
file is written again from the real hashes. Either way the checkpoint restores
bit-identical; a failed early write fails the persist unless the file is written again
anyway; nothing writes after the persist returned."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable.incremental as inc_mod
from resumable import Checkpointer, Incremental, Keep, StorageError
from resumable._dtypes import dtype_name
from resumable.commit import list_committed
from resumable.format import TensorSlot
from resumable.incremental import DeltaBase
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage
from resumable.storage.base import ForwardingStorage

INC = Incremental(chunk_bytes=4096, min_bytes=0, whole_every=0)


@pytest.fixture(autouse=True)
def early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small states take the early way too (the library's bound is 32 MiB)."""
    monkeypatch.setattr(inc_mod, "EARLY_MIN_BYTES", 64 << 10)


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base": torch.randn(512, 256, generator=g),  # 512 KiB, frozen
        "adapter": torch.randn(64, 32, generator=g),
        "count": torch.zeros((), dtype=torch.int64),
    }


class Writes(ForwardingStorage):
    """Records, per data file written, the thread that wrote it; ``fail`` makes the
    next data file write on the early-write thread raise (a full disk)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, str, float]] = []  # (path, thread, time it ended)
        self.fail = False

    def write(self, path: str, chunks: Any) -> int:
        thread = threading.current_thread().name
        if path.endswith(".safetensors") and self.fail and thread == "resumable-early-write":
            self.fail = False
            time.sleep(0.05)  # still writing while the cold chunks are hashed
            raise StorageError(errno.ENOSPC, f"injected: could not write {path}")
        n = super().write(path, chunks)
        if path.endswith(".safetensors"):
            self.log.append((path, thread, time.monotonic()))
        return n


def fine_tune(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        state["adapter"].add_(0.5)
        state["count"].add_(1)


def check_restores(root: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    for step in list_committed(LocalStorage(root)):
        fresh = make_state(99)
        with Checkpointer(root, fresh, keep=None, persist="sync", capture_rng=False) as ck:
            assert ck.restore(step) == step
        for name, want in expected[step].items():
            assert torch.equal(fresh[name], want), (step, name)


def own_bytes(root: Path, step: int) -> int:
    m = CheckpointReader(LocalStorage(root), step).manifest
    return sum(int(f["size"]) for f in m["files"].values())


def test_fine_tuning_writes_its_file_while_the_frozen_base_is_hashed(tmp_path: Path) -> None:
    storage = Writes(LocalStorage(tmp_path))
    state = make_state(1)
    expected = {}
    with Checkpointer(
        storage, state, persist="sync", capture_rng=False, incremental=INC, keep=Keep(last=3)
    ) as ck:
        for step in range(1, 7):
            fine_tune(state)
            ck.save(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
    threads = [t for _, t, _ in storage.log]
    # first: whole, nothing to compare; second: compared (all hot); then early
    assert threads[:2] == ["MainThread", "MainThread"]
    assert threads[2:] == ["resumable-early-write"] * 4
    for step in (4, 5, 6):
        assert CheckpointReader(LocalStorage(tmp_path), step).manifest["refs"] == [1]
        assert own_bytes(tmp_path, step) < 64 << 10  # the adapter, not the base
    check_restores(tmp_path, expected)


def test_a_frozen_tensor_that_changed_is_written_again_from_the_real_hashes(
    tmp_path: Path,
) -> None:
    """The guess fails at step 4 (someone changed the frozen base): the early file is
    written again, with the changed rows, and step 4 restores what was saved."""
    storage = Writes(LocalStorage(tmp_path))
    state = make_state(2)
    expected = {}
    with Checkpointer(
        storage, state, persist="sync", capture_rng=False, incremental=INC, keep=None
    ) as ck:
        for step in range(1, 7):
            fine_tune(state)
            if step == 4:
                with torch.no_grad():
                    state["base"][100:110].mul_(-3.0)  # 10 KiB of the base
            ck.save(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
    by_step: dict[str, list[str]] = {}
    for path, thread, _ in storage.log:
        by_step.setdefault(path.split("/")[0], []).append(thread)
    steps = sorted(by_step)
    assert by_step[steps[3]] == ["resumable-early-write", "MainThread"]  # guessed wrong
    assert by_step[steps[4]] == ["MainThread"]  # "base" changed last time: hot
    assert by_step[steps[5]] == ["resumable-early-write"]  # quiet again
    assert own_bytes(tmp_path, 4) < 64 << 10  # the changed chunks only, still
    check_restores(tmp_path, expected)


def two_saved(root: Path, seed: int) -> tuple[Writes, dict[str, torch.Tensor], Checkpointer]:
    """A checkpointer (sync persists) whose next persist goes the early way: two saved."""
    storage = Writes(LocalStorage(root))
    state = make_state(seed)
    ck = Checkpointer(storage, state, persist="sync", capture_rng=False, incremental=INC)
    for step in (1, 2):
        fine_tune(state)
        ck.save(step)
    return storage, state, ck


def test_a_failed_early_write_fails_the_persist_and_commits_nothing(tmp_path: Path) -> None:
    storage, state, ck = two_saved(tmp_path, 3)
    storage.fail = True
    fine_tune(state)
    with pytest.raises(StorageError, match="injected"):
        ck.save(3)
    assert list_committed(LocalStorage(tmp_path)) == [1, 2]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir() if p.is_dir())
    fine_tune(state)
    ck.save(4)
    want = {k: v.clone() for k, v in state.items()}
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == [1, 2, 4]
    check_restores(tmp_path, {1: {}, 2: {}, 4: want})


def test_a_failed_early_write_whose_guess_failed_is_written_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage, state, ck = two_saved(tmp_path, 4)
    storage.fail = True
    fine_tune(state)
    with torch.no_grad():
        state["base"][0].add_(1.0)
    with caplog.at_level(logging.WARNING, logger="resumable"):
        ck.save(3)
    want = {k: v.clone() for k, v in state.items()}
    ck.close()
    assert any("early write of step 3 failed" in r.getMessage() for r in caplog.records)
    assert list_committed(LocalStorage(tmp_path)) == [1, 2, 3]
    check_restores(tmp_path, {1: {}, 2: {}, 3: want})


def test_a_failed_hashing_of_the_cold_chunks_waits_for_the_write_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, state, ck = two_saved(tmp_path, 5)
    real = inc_mod.chunk_hashes
    calls = []

    def failing(data: Any, ranges: Any, threads: Any = None) -> list[str]:
        calls.append(len(ranges))
        if len(calls) == 2:  # the hot chunks first, then the cold ones
            raise MemoryError("injected: the hashing failed")
        return real(data, ranges, threads)

    monkeypatch.setattr(inc_mod, "chunk_hashes", failing)
    fine_tune(state)
    with pytest.raises(MemoryError, match="injected"):
        ck.save(3)
    returned = time.monotonic()
    assert storage.log[-1][1] == "resumable-early-write"
    assert storage.log[-1][2] <= returned  # the early write ended before save returned
    assert list_committed(LocalStorage(tmp_path)) == [1, 2]
    monkeypatch.setattr(inc_mod, "chunk_hashes", real)
    fine_tune(state)
    ck.save(4)
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == [1, 2, 4]


def slots_of(state: dict[str, torch.Tensor]) -> tuple[list[TensorSlot], memoryview]:
    flat, slots, at = [], [], 0
    for name, t in state.items():
        raw = t.reshape(-1).view(torch.uint8)
        slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), at, at + raw.numel()))
        flat.append(raw)
        at += raw.numel()
    return slots, memoryview(torch.cat(flat).numpy())


def test_the_early_plan_is_the_plan_when_the_guess_holds_and_not_otherwise() -> None:
    state = make_state(6)
    base = DeltaBase(INC)
    for step in (1, 2):  # the first compares nothing; the second finds what changes
        fine_tune(state)
        slots, data = slots_of(state)
        assert base.plan_early(slots, data, step) is None
        plan = base.plan(slots, data, step)
        plan.records = {
            p.slot.name: inc_mod.Record(
                p.slot.dtype,
                tuple(p.slot.shape),
                tuple(
                    inc_mod.Chunk(h, old.step if old else None, "f", 8 + b, 8 + e)
                    for (b, e), h, old in zip(p.ranges, p.hashes, p.reuse, strict=True)
                ),
                "x",
            )
            for p in plan.slots
        }
        base.committed(step, plan)
    assert base.changed == {"adapter", "count"}
    fine_tune(state)
    slots, data = slots_of(state)
    early = base.plan_early(slots, data, 3)
    assert early is not None and early.plan.incremental
    assert base.confirm(early, data, 3) is None
    want = base.plan(slots, data, 3)
    assert [p.reuse for p in early.plan.slots] == [p.reuse for p in want.slots]
    with torch.no_grad():
        state["base"][7].add_(1.0)
    slots, data = slots_of(state)
    early = base.plan_early(slots, data, 3)
    assert early is not None
    got = base.confirm(early, data, 3)
    assert got is not None
    want = base.plan(slots, data, 3)
    assert [p.reuse for p in got.slots] == [p.reuse for p in want.slots]
    assert [p.hashes for p in got.slots] == [p.hashes for p in want.slots]
    assert base.changed == {"adapter", "count", "base"}
