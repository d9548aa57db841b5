"""Persists expected to be written whole are written at once, their chunks hashed while
the file is written (`DeltaBase.expect_whole`, `whole_plan`, `hash_whole`): the first
persist of a writer, and every persist after one whose chunks were too few to reuse
(a job that trains every tensor). A persist after one that had nothing to compare hashes
first, so a state that stops changing is found one persist later, and fine-tuning keeps
writing only what changed."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable.incremental as inc_mod
import resumable.pipeline.write as write_mod
from resumable import Checkpointer, Incremental, Keep, StorageError
from resumable.commit import list_committed
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage
from resumable.storage.base import ForwardingStorage

INC = Incremental(chunk_bytes=4096, min_bytes=0)


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(256, 256, generator=g),  # 256 KiB
        "head": torch.randn(64, generator=g),
        "count": torch.zeros((), dtype=torch.int64),
    }


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which way each persist was planned: "whole" (at once) or "hashed" (hashes
    first)."""
    seen: list[str] = []
    real_plan, real_whole = inc_mod.DeltaBase.plan, inc_mod.DeltaBase.whole_plan

    def plan(self: inc_mod.DeltaBase, *a: Any, **k: Any) -> inc_mod.Plan:
        seen.append("hashed")
        return real_plan(self, *a, **k)

    def whole_plan(self: inc_mod.DeltaBase, *a: Any, **k: Any) -> inc_mod.Plan:
        seen.append("whole")
        return real_whole(self, *a, **k)

    monkeypatch.setattr(inc_mod.DeltaBase, "plan", plan)
    monkeypatch.setattr(inc_mod.DeltaBase, "whole_plan", whole_plan)
    return seen


def refs(root: Path, step: int) -> list[int]:
    return list(CheckpointReader(LocalStorage(root), step).manifest.get("refs", []))


def check_restores(root: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    for step in list_committed(LocalStorage(root)):
        fresh = make_state(99)
        with Checkpointer(root, fresh, keep=None, persist="sync", capture_rng=False) as ck:
            assert ck.restore(step) == step
        for name, want in expected[step].items():
            assert torch.equal(fresh[name], want), (step, name)


def run(
    root: Path, state: dict[str, torch.Tensor], steps: int, keep: int, change: Any
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, int]]:
    """Save ``steps`` steps, ``change(step)`` before each: the state saved at each step,
    and the bytes of each checkpoint's own data files."""
    expected, sizes = {}, {}
    with Checkpointer(
        root, state, persist="sync", capture_rng=False, incremental=INC, keep=Keep(last=keep)
    ) as ck:
        for step in range(1, steps + 1):
            with torch.no_grad():
                change(step)
            ck.save(step)
            expected[step] = {k: v.clone() for k, v in state.items()}
            m = CheckpointReader(LocalStorage(root), step).manifest
            sizes[step] = sum(f["size"] for f in m["files"].values())
    return expected, sizes


def test_a_job_that_trains_everything_writes_at_once_after_one_comparison(
    tmp_path: Path, paths: list[str]
) -> None:
    state = make_state(1)

    def train_all(step: int) -> None:
        for t in state.values():
            t.add_(1)

    expected, _ = run(tmp_path, state, 6, 3, train_all)
    # first: nothing to compare; second: compared (nothing reusable); then at once
    assert paths == ["whole", "hashed", "whole", "whole", "whole", "whole"]
    for step in list_committed(LocalStorage(tmp_path)):
        assert refs(tmp_path, step) == []
    check_restores(tmp_path, expected)


def test_fine_tuning_hashes_first_from_the_second_persist(tmp_path: Path, paths: list[str]) -> None:
    state = make_state(2)

    def fine_tune(step: int) -> None:
        state["head"].add_(1)  # "big" is frozen
        state["count"].add_(1)

    expected, _ = run(tmp_path, state, 5, 2, fine_tune)
    assert paths == ["whole", "hashed", "hashed", "hashed", "hashed"]
    assert refs(tmp_path, 5) == [1]  # the frozen bytes still lie in the first checkpoint
    check_restores(tmp_path, expected)


def test_a_state_that_stops_changing_is_found_one_persist_later(
    tmp_path: Path, paths: list[str]
) -> None:
    """Three persists of a state that changes everywhere, then "big" is frozen: the
    persist right after is still written whole (it was expected so), and its hashes
    show the next one what to reuse: it refers to it, and restores bit-identical."""
    state = make_state(3)

    def freeze_after_three(step: int) -> None:
        if step <= 3:
            state["big"].mul_(1.5)
        state["head"].add_(1)

    expected, sizes = run(tmp_path, state, 6, 4, freeze_after_three)
    assert paths == ["whole", "hashed", "whole", "whole", "hashed", "hashed"]
    assert refs(tmp_path, 4) == []
    assert refs(tmp_path, 5) == [4] and refs(tmp_path, 6) == [4]
    assert sizes[5] < sizes[4] / 10  # only what changed
    check_restores(tmp_path, expected)


class SignalsWrite(ForwardingStorage):
    """Sets ``started`` when a data file's write begins."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.started = threading.Event()

    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            self.started.set()
        return super().write(path, chunks)


def test_the_write_starts_before_the_chunks_are_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk hashing that waits for the data file's write to begin: it must not block
    the write (if the write waited for the hashes, both would wait until the timeout
    and the persist would fail)."""
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    storage = SignalsWrite(LocalStorage(tmp_path))
    real = inc_mod.chunk_hashes
    threads: list[str] = []

    def after_the_write_began(*a: Any, **k: Any) -> list[str]:
        threads.append(threading.current_thread().name)
        if not storage.started.wait(10):
            raise AssertionError("the write did not begin before the chunks were hashed")
        return real(*a, **k)

    monkeypatch.setattr(inc_mod, "chunk_hashes", after_the_write_began)
    state = make_state(4)
    with Checkpointer(storage, state, persist="sync", capture_rng=False, incremental=INC) as ck:
        ck.save(1)
    assert threads == ["resumable-chunk-hashes"]
    assert list_committed(LocalStorage(tmp_path)) == [1]


def test_a_failed_chunk_hashing_fails_the_persist_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    real = inc_mod.chunk_hashes
    state = make_state(5)
    ck = Checkpointer(tmp_path, state, persist="sync", capture_rng=False, incremental=INC)

    def failing(*a: Any, **k: Any) -> list[str]:
        if threading.current_thread().name == "resumable-chunk-hashes":
            raise MemoryError("injected: the chunk hashing failed")
        return real(*a, **k)

    monkeypatch.setattr(inc_mod, "chunk_hashes", failing)
    with pytest.raises(MemoryError, match="injected"):
        ck.save(1)
    assert list_committed(LocalStorage(tmp_path)) == []
    monkeypatch.setattr(inc_mod, "chunk_hashes", real)
    ck.save(2)
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == [2]
    fresh = make_state(6)
    with Checkpointer(tmp_path, fresh, persist="sync", capture_rng=False) as again:
        assert again.restore() == 2
    assert all(torch.equal(fresh[k], state[k]) for k in state)


class FailingWrite(ForwardingStorage):
    def write(self, path: str, chunks: Any) -> int:
        if path.endswith(".safetensors"):
            raise StorageError(errno.ENOSPC, f"injected: could not write {path}")
        return super().write(path, chunks)


def test_no_chunk_hashing_outlives_a_persist_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot is reused once a persist returns: hashing still running after a
    failed write would read the next one."""
    monkeypatch.setattr(write_mod, "CHECKSUMS_BEHIND_MIN_BYTES", 1)
    real = inc_mod.chunk_hashes
    spans: list[tuple[float, float]] = []

    def slow(*a: Any, **k: Any) -> list[str]:
        t0 = time.monotonic()
        time.sleep(0.3)
        out = real(*a, **k)
        spans.append((t0, time.monotonic()))
        return out

    monkeypatch.setattr(inc_mod, "chunk_hashes", slow)
    ck = Checkpointer(
        FailingWrite(LocalStorage(tmp_path)),
        make_state(7),
        persist="sync",
        capture_rng=False,
        incremental=INC,
    )
    with pytest.raises(StorageError, match="injected"):
        ck.save(1)
    failed_at = time.monotonic()
    assert spans and all(end <= failed_at for _, end in spans)
    ck.close()
    assert list_committed(LocalStorage(tmp_path)) == []
