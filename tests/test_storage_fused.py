"""A restore from storage copies each tensor into its live one while it checks it, where
an older checkpoint is left to restore over what a failed check leaves
(`CheckpointReader.tensors`' ``fuse``, `CheckpointReader.fill`): every kind of value
put back bit-identical into the same live tensors, an optimizer's moments its own; a
byte damaged in the newest checkpoint found while copying, and the older one restored
over it; with nothing older, or a step asked for, the check before any copy; with
every checkpoint damaged, an error that says the live state holds part of one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import resumable
import resumable.reader as reader_mod
from resumable import Checkpointer, CorruptCheckpointError
from resumable.reader import CheckpointReader
from resumable.storage import open_storage

pytestmark = pytest.mark.usefixtures("sync_persist")


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every tensor a restore copied while checking it."""
    seen: list[int] = []
    job = reader_mod._copy_job

    def counted(src: torch.Tensor, dst: torch.Tensor) -> str:
        seen.append(src.numel())
        return job(src, dst)

    monkeypatch.setattr(reader_mod, "_copy_job", counted)
    return seen


class Adding:
    """Loads by adding what it is given: its tensor must not be filled in place."""

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
        "big": torch.randn(3 << 20),  # 12 MiB: the copies shared among threads, warm
    }


def train(state: dict[str, Any], steps: int) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        model(torch.randn(16, 64)).sum().backward()
        optim.step()
        optim.zero_grad()
    with torch.no_grad():
        for t in (state["extra"]["scale"], state["ema"], state["big"]):
            t.mul_(1.5).add_(0.25)
        state["extra"]["parts"][0].add_(1)
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
    out["big"] = state["big"].clone()
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


def saved(root: Path, steps: int = 2) -> list[dict[str, Any]]:
    """Steps 1..``steps`` saved, every tensor changed in between; what each held."""
    state = build(0)
    train(state, 1)  # the optimizer has moments: live tensors to restore into
    held = []
    with Checkpointer(root, state, keep=None, incremental=False) as ck:
        for step in range(1, steps + 1):
            train(state, 2)
            ck.save(step)
            held.append(flat(state))
    return held


def flip(root: Path, step: int, name: str) -> None:
    """Flip a byte in the middle of tensor ``name``'s bytes in step ``step``'s file."""
    info = CheckpointReader(open_storage(str(root)), step).manifest["tensors"][name]
    begin, end = info["offsets"]
    path = root / f"step-{step:012d}" / info["file"]
    data = bytearray(path.read_bytes())
    data[(begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def fresh() -> dict[str, Any]:
    state = build(1)
    train(state, 1)  # moments exist, of the saved shapes
    return state


@pytest.mark.parametrize("warm", [True, False])
def test_every_kind_of_value_comes_back_bit_identical_into_the_live_tensors(
    tmp_path: Path, copies: list[int], warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm: the copies shared among the copy threads; cold (some pages not in
    memory): one thread, in the file's order."""
    if not warm:
        monkeypatch.setattr(reader_mod, "_resident", lambda address, length: False)
    want = saved(tmp_path)[-1]
    state = fresh()
    live = {
        "params": list(state["model"].parameters()),
        "moments": [v for per in state["optim"].state.values() for v in per.values()],
        "scale": state["extra"]["scale"],
        "part0": state["extra"]["parts"][0],
        "ema": state["ema"],
        "big": state["big"],
    }
    with Checkpointer(tmp_path, state, keep=None) as ck:
        assert ck.restore() == 2
    got = flat(state)
    same(want, got)
    assert torch.equal(state["box"]["adding"].t, torch.full((4,), 6.0))  # its 3 + the saved 3
    # filled in place: the same objects, holding the checkpoint's bytes
    assert all(p is q for p, q in zip(state["model"].parameters(), live["params"]))
    moments = [v for per in state["optim"].state.values() for v in per.values()]
    assert len(moments) == len(live["moments"])
    assert all(a is b for a, b in zip(moments, live["moments"]))
    assert state["extra"]["scale"] is live["scale"] and state["ema"] is live["ema"]
    assert state["extra"]["parts"][0] is live["part0"] and state["big"] is live["big"]
    # every parameter, moment, buffer and plain tensor went through the checked copy;
    # the stateful object that adds did not (it gets a value of its own)
    assert (3 << 20) * 4 in copies
    assert len(copies) == len(want) - 1 + len(want["extra/parts"]) - 1
    assert 16 not in copies  # Adding's 4 floats


def test_a_byte_damaged_in_the_newest_falls_back_to_the_older_over_it(
    tmp_path: Path, copies: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """The damaged tensor was copied (with the flipped byte) before its check ended, and
    others after it; the older checkpoint is restored over all of them."""
    held = saved(tmp_path)
    flip(tmp_path, 2, "big")
    state = fresh()
    caplog.set_level(logging.INFO, logger="resumable")
    with Checkpointer(tmp_path, state, keep=None) as ck:
        assert ck.restore() == 1
    same(held[0], flat(state))
    assert "checksum mismatch in tensor 'big'" in caplog.text
    assert "found while copying into the live state" in caplog.text
    # step 2 was copied while checked; step 1, with nothing older, checked first
    assert copies.count((3 << 20) * 4) == 1


def test_a_byte_damaged_in_the_local_copy_restores_the_same_step_from_the_mirror(
    tmp_path: Path, copies: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Found while copying from the local root, the damage sends the restore to the
    mirror's copy of the same step, not to an older step (a step would be lost)."""
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    state = build(0)
    train(state, 1)
    held = []
    with Checkpointer(local, state, keep=None, incremental=False, mirror=str(mirror)) as ck:
        for step in (1, 2):
            train(state, 2)
            ck.save(step)
            held.append(flat(state))
    flip(local, 2, "big")
    state = fresh()
    caplog.set_level(logging.INFO, logger="resumable")
    with Checkpointer(local, state, keep=None, mirror=str(mirror)) as ck:
        assert ck.restore() == 2
    assert "restored step 2 from the mirror" in caplog.text
    same(held[1], flat(state))
    assert "found while copying into the live state" in caplog.text
    assert copies.count((3 << 20) * 4) == 2  # the local copy's, then the mirror's


def test_with_nothing_older_the_check_comes_before_any_copy(
    tmp_path: Path, copies: list[int]
) -> None:
    saved(tmp_path, steps=1)
    flip(tmp_path, 1, "big")
    state = fresh()
    before = flat(state)
    with (
        Checkpointer(tmp_path, state, keep=None) as ck,
        pytest.raises(CorruptCheckpointError, match="none is valid") as info,
    ):
        ck.restore()
    assert "live state holds part" not in str(info.value)
    assert copies == []
    same(before, flat(state))  # as constructed


def test_a_step_asked_for_is_checked_before_any_copy(tmp_path: Path, copies: list[int]) -> None:
    saved(tmp_path)
    flip(tmp_path, 2, "ema")
    state = fresh()
    before = flat(state)
    with (
        Checkpointer(tmp_path, state, keep=None) as ck,
        pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'ema'"),
    ):
        ck.restore(step=2)
    assert copies == []
    same(before, flat(state))


def test_every_checkpoint_damaged_says_the_live_state_holds_part_of_one(
    tmp_path: Path, copies: list[int]
) -> None:
    saved(tmp_path)
    flip(tmp_path, 2, "ema")
    flip(tmp_path, 1, "ema")
    state = fresh()
    with (
        Checkpointer(tmp_path, state, keep=None) as ck,
        pytest.raises(CorruptCheckpointError, match="none is valid") as info,
    ):
        ck.restore()
    assert "The live state holds part of step-000000000002" in str(info.value)
    assert copies  # step 2's were copied while checked


def test_fill_copies_every_tensor_then_names_the_first_damaged_one(tmp_path: Path) -> None:
    """At the reader: `tensors(fuse=True)` returns the live tensors unchanged and checks
    nothing; `fill` copies every one, then raises for the first mismatch in file order
    (the others are filled all the same: the caller restores something over them)."""
    state = {"a": torch.randn(1000), "b": torch.randn(2 << 20), "c": torch.arange(7)}
    with Checkpointer(tmp_path, state, keep=None, incremental=False) as ck:
        ck.save(1)
    flip(tmp_path, 1, "a")
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    got = reader.tensors(into=live, fuse=True)
    assert all(got[k] is live[k] for k in live)
    assert all(int(t.count_nonzero()) == 0 for t in live.values())
    assert reader.owned == frozenset(id(t) for t in live.values())
    assert not reader.fused_started
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'a'"):
        reader.fill()
    assert reader.fused_started
    assert torch.equal(live["b"], state["b"]) and torch.equal(live["c"], state["c"])
    assert not torch.equal(live["a"], state["a"])  # the damaged bytes, as read
    # without fuse the check comes first and nothing is left to fill
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    with pytest.raises(CorruptCheckpointError, match="tensor 'a'"):
        reader.tensors(into={k: torch.zeros_like(v) for k, v in state.items()})
    assert reader.owned == frozenset()


def test_a_destination_of_another_shape_is_read_as_before(tmp_path: Path) -> None:
    state = {"a": torch.randn(10, 10), "b": torch.randn(5)}
    with Checkpointer(tmp_path, state, keep=None, incremental=False) as ck:
        ck.save(1)
    live = {"a": torch.zeros(100), "b": torch.zeros(5, dtype=torch.float64)}
    reader = CheckpointReader(open_storage(str(tmp_path)), 1)
    got = reader.tensors(into=live, fuse=True)
    assert got["a"] is not live["a"] and torch.equal(got["a"], state["a"])
    assert got["b"] is not live["b"] and torch.equal(got["b"], state["b"])
    assert reader.owned == frozenset()
    reader.fill()
    assert not reader.fused_started
    assert int(live["a"].count_nonzero()) == 0


def test_resumable_exports_the_error() -> None:
    assert resumable.CorruptCheckpointError is CorruptCheckpointError
