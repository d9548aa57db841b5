"""A restore from shared memory checks each tensor while it copies it (issue 15):
`ShmArena.copy_checked`, and the restore that uses it (`Restorer._fused`): every kind of
value put back bit-identical, the live tensors filled in place, an optimizer's new
moments its own, and a byte found damaged halfway through falls back to the committed
checkpoint, raises where only memory was asked for, and, where nothing else could be
restored, is found before anything live is touched."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import resumable
from resumable._shm import SlotMeta
from resumable.errors import CheckpointError
from resumable.pipeline.memory import MemoryTier
from resumable.snapshot import ShmArena
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often a restore copied while checking, and checked before copying."""
    seen = {"fused": 0, "first": 0}
    fused, first = MemoryTier.copy_verified, ShmArena.checksums

    def counted_fused(self: Any, *a: Any, **kw: Any) -> Any:
        seen["fused"] += 1
        return fused(self, *a, **kw)

    def counted_first(self: Any, *a: Any, **kw: Any) -> Any:
        seen["first"] += 1
        return first(self, *a, **kw)

    monkeypatch.setattr(MemoryTier, "copy_verified", counted_fused)
    monkeypatch.setattr(ShmArena, "checksums", counted_first)
    return seen


@pytest.mark.parametrize("threads", [True, False])
def test_copy_checked_copies_each_slot_and_hashes_it_as_checksums_does(
    shm_dir: Path, threads: bool
) -> None:
    torch.manual_seed(0)
    tensors = {
        "big": torch.randn(10 << 20),  # 40 MiB: the threads share the slots
        "odd": torch.randn(700_001),  # blocks and a remainder
        "block": torch.randn(128 << 10),  # one block exactly
        "tiny": torch.arange(3, dtype=torch.int8),
        "empty": torch.empty(0),
        "flags": torch.tensor([True, False, True]),
    }
    arena = ShmArena("fused", shm_dir=shm_dir)
    try:
        if not threads and arena._pool is not None:
            arena._pool.shutdown(wait=True)
            arena._pool = None
        snap = arena.snapshot(1, tensors, SlotMeta(tree={}))
        assert not isinstance(snap, bool)
        content = arena.content(snap.index)
        slot = arena.slots[snap.index]
        assert content is not None and slot is not None
        data = slot.data_tensor()
        want = arena.checksums(data.numpy().data, content.slots)
        dests: list[torch.Tensor | None] = [
            None if s.name == "odd" else torch.full((s.end - s.begin,), 7, dtype=torch.uint8)
            for s in content.slots
        ]
        assert arena.copy_checked(data, content.slots, dests) == want
        for s, d in zip(content.slots, dests):
            if d is not None:
                assert torch.equal(d, data[s.begin : s.end]), s.name
        # A destination of another size is refused before anything is copied.
        wrong = [torch.zeros(1, dtype=torch.uint8) if d is not None else None for d in dests]
        with pytest.raises(CheckpointError, match="no contiguous CPU destination"):
            arena.copy_checked(data, content.slots, wrong)
        assert all(int(w.sum()) == 0 for w in wrong if w is not None)
    finally:
        arena.close(unlink=True)


class Adding:
    """A stateful object that loads by adding what it is given to what it holds: its
    tensor must not be filled in place by the restore before it loads."""

    def __init__(self) -> None:
        self.t = torch.ones(4)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t += sd["t"]


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 8))
    return {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "extra": {"scale": torch.randn(1000), "parts": [torch.randn(3, 5), torch.arange(6)]},
        "ema": torch.randn(64, 256),
        "box": {"adding": Adding()},
        "table": np.arange(10.0),
    }


def train(state: dict[str, Any], steps: int) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        model(torch.randn(16, 64)).sum().backward()
        optim.step()
        optim.zero_grad()
    with torch.no_grad():
        state["extra"]["scale"].mul_(1.5)
        state["extra"]["parts"][0].add_(1)
        state["ema"].add_(0.25)
    state["box"]["adding"].t.fill_(3.0)
    state["table"][:] += 1


def flat(state: dict[str, Any]) -> dict[str, Any]:
    """Every value of ``state`` that a restore puts back, copied."""
    out: dict[str, Any] = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, per in state["optim"].state.items():
        for k, v in per.items():
            out[f"optim/{i}/{k}"] = v.clone()
    out["extra/scale"] = state["extra"]["scale"].clone()
    out["extra/parts"] = [t.clone() for t in state["extra"]["parts"]]
    out["ema"] = state["ema"].clone()
    out["adding"] = state["box"]["adding"].t.clone()
    out["table"] = state["table"].copy()
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), k
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), k
        else:
            assert torch.equal(x, y), k


def saved_to_memory(root: Path, shm_dir: Path, steps: int = 2) -> dict[str, Any]:
    """Steps 1..``steps`` saved and persisted (the slot of the last one has the
    checksums its persist recorded); the checkpointer closed without removing its
    snapshots, as by a killed job. Returns what step ``steps`` holds."""
    state = build(0)
    ck = resumable.Checkpointer(
        root, state, memory_every=resumable.Every(steps=1), persist="thread", shm_dir=shm_dir
    )
    for step in range(1, steps + 1):
        train(state, 2)
        ck.save(step)
        ck.wait()
    want = flat(state)
    want["rng"] = torch.get_rng_state()
    ck._memory.arena.close(unlink=False)  # type: ignore[union-attr]
    ck._memory = None
    ck.close()
    return want


def damage(shm_dir: Path, root: Path, name: str) -> None:
    """Flip a byte in the middle of tensor ``name`` of the newest snapshot."""
    state = build(1)
    with resumable.Checkpointer(
        root, state, memory_every=resumable.Every(steps=1), persist="sync", shm_dir=shm_dir
    ) as ck:
        memory = ck._memory
        assert memory is not None
        memory.adopt()
        snap = memory.newest
        assert snap is not None
        content = memory.readable(snap)
        slot = memory.arena.slots[snap.index]
        assert content is not None and content.checksums is not None and slot is not None
        sl = next(s for s in content.slots if s.name == name)
        slot.data_tensor()[(sl.begin + sl.end) // 2] ^= 0x10
        memory.arena.close(unlink=False)
        ck._memory = None


def test_every_kind_of_value_comes_back_bit_identical_into_the_live_tensors(
    tmp_path: Path, shm_dir: Path, calls: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    want = saved_to_memory(tmp_path / "ck", shm_dir)
    state = build(1)
    live = {
        "params": [p for p in state["model"].parameters()],
        "scale": state["extra"]["scale"],
        "part0": state["extra"]["parts"][0],
        "ema": state["ema"],
    }
    caplog.set_level(logging.INFO, logger="resumable")
    with resumable.Checkpointer(
        tmp_path / "ck", state, memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as ck:
        assert ck.restore() == 2
        memory = ck._memory
        assert memory is not None and memory.newest is not None
        slot = memory.arena.slots[memory.newest.index]
        assert slot is not None
        lo = slot.data_tensor().data_ptr()
        hi = lo + slot.data_tensor().numel()
        got = flat(state)
        got["rng"] = want["rng"]  # compared below, by drawing from it
        same(want, {**got, "adding": got["adding"] - 1})  # its own + the saved 3.0
        assert torch.equal(got["adding"], torch.full((4,), 4.0))
        assert torch.equal(torch.get_rng_state(), want["rng"])
        assert calls == {"fused": 1, "first": 0}
        # The live tensors were filled in place; what the objects keep is their own,
        # none of it in the slot the next snapshot rewrites.
        assert all(p is q for p, q in zip(state["model"].parameters(), live["params"]))
        assert state["extra"]["scale"] is live["scale"]
        assert state["extra"]["parts"][0] is live["part0"] and state["ema"] is live["ema"]
        kept = [v for per in state["optim"].state.values() for v in per.values()]
        kept += [*state["model"].state_dict().values(), *state["extra"]["parts"]]
        assert kept and all(not lo <= t.data_ptr() < hi for t in kept)
    assert "restored step 2 from shared memory" in caplog.text


def test_a_byte_damaged_halfway_falls_back_to_the_committed_checkpoint(
    tmp_path: Path, shm_dir: Path, calls: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The damaged tensor was copied (with the flipped byte) before its check ended;
    the checkpoint restored next overwrites it and everything else copied."""
    want = saved_to_memory(tmp_path / "ck", shm_dir)
    damage(shm_dir, tmp_path / "ck", "model/0.weight")
    state = build(1)
    caplog.set_level(logging.INFO, logger="resumable")
    with resumable.Checkpointer(
        tmp_path / "ck", state, memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as ck:
        assert ck.restore() == 2
    assert calls["fused"] == 1
    got = flat(state)
    del want["rng"], want["adding"], got["adding"]  # "adding" loads by adding
    same(want, got)
    assert "checksum mismatch in tensor 'model/0.weight'" in caplog.text
    assert "found while copying" in caplog.text
    assert "restored step 2 from" in caplog.text
    assert "restored step 2 from shared memory" not in caplog.text


def test_asked_for_memory_only_a_damaged_byte_raises(
    tmp_path: Path, shm_dir: Path, calls: dict[str, int]
) -> None:
    saved_to_memory(tmp_path / "ck", shm_dir)
    damage(shm_dir, tmp_path / "ck", "ema")
    state = build(1)
    with resumable.Checkpointer(
        tmp_path / "ck", state, memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as ck:
        with pytest.raises(resumable.CorruptCheckpointError, match="now holds part of it"):
            ck.restore(tier="memory")
        assert calls["fused"] == 1
        # The committed checkpoint is loaded over it when asked.
        assert ck.restore() == 2


def test_with_nothing_else_to_restore_the_check_comes_before_the_copy(
    tmp_path: Path, shm_dir: Path, calls: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """No committed checkpoint left to fall back to: the snapshot is checked whole
    first, and the damaged one leaves the live state as constructed."""
    saved_to_memory(tmp_path / "ck", shm_dir, steps=1)
    shutil.rmtree(tmp_path / "ck" / "step-000000000001")
    damage(shm_dir, tmp_path / "ck", "model/0.weight")
    state = build(1)
    before = flat(state)
    caplog.set_level(logging.INFO, logger="resumable")
    with resumable.Checkpointer(
        tmp_path / "ck", state, memory_every=resumable.Every(steps=1), shm_dir=shm_dir
    ) as ck:
        assert ck.restore() == 0
    assert calls == {"fused": 0, "first": 1}
    same(before, flat(state))
    assert "checksum mismatch in tensor 'model/0.weight'" in caplog.text


def test_a_tree_with_a_tensor_recorded_on_a_gpu_is_checked_first() -> None:
    """Such tensors are moved off the CPU when decoded: the restore checks the snapshot
    first rather than decode them from destinations it has not filled yet."""
    from resumable.pipeline._restore_values import on_cpu

    cpu = {"dict": [["a", {"tensor": "a", "device": "cpu"}], ["b", {"list": [{"tensor": "b"}]}]]}
    assert on_cpu(cpu)
    gpu = {"dict": [["a", {"tensor": "a", "device": "cpu"}], ["b", {"list": [
        {"stateful": {"dict": [["w", {"tensor": "w", "device": "cuda:0"}]]}}
    ]}]]}  # fmt: skip
    assert not on_cpu(gpu)
    assert not on_cpu({"dict": [["g", {"global": "m.w", "device": "cuda:1"}]]})
