"""The parts of `replicas=R` a single process can check: the option's refusals, a slot's
bytes read as a replica carries them and written back into another arena (what a
replaced node does with a fetched replica), and a hostile replica refused there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resumable import Checkpointer, Every
from resumable.errors import CheckpointError, ReplicaPlacementError
from resumable.replicas.peers import check_option
from resumable.snapshot import ShmArena
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_replicas_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        check_option(bad)


def test_replicas_need_the_memory_tier(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the memory tier"):
        Checkpointer(tmp_path / "ck", {"w": torch.zeros(2)}, persist="sync", replicas=2)


def test_more_copies_than_nodes_is_refused_with_what_to_do(tmp_path: Path, shm_dir: Path) -> None:
    """One process is one node: two copies need two."""
    with pytest.raises(ReplicaPlacementError, match="replicas=2 needs 2 distinct nodes"):
        Checkpointer(
            tmp_path / "ck",
            {"w": torch.zeros(2)},
            memory_every=Every(steps=1),
            persist="thread",
            shm_dir=shm_dir,
            replicas=2,
        )
    # nothing held: the root takes another Checkpointer at once
    with Checkpointer(tmp_path / "ck", {"w": torch.zeros(2)}, persist="sync") as ck:
        assert ck.restore() == 0


def test_a_slot_read_as_a_replica_installs_in_another_arena_bit_for_bit(shm_dir: Path) -> None:
    src = ShmArena("src", shm_dir=shm_dir)
    dst = ShmArena("dst", shm_dir=shm_dir)
    t = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.tensor([7], dtype=torch.int64)}
    try:
        snap = src.snapshot(3, t, {"step": 3, "tree": {"x": 1}})
        assert not isinstance(snap, type(None))
        slot = src.slots[snap.index]
        assert slot is not None
        got = slot.replica_bytes(snap.seq)
        assert got is not None
        meta, data = got
        installed = dst.install(3, meta, bytes(data))
        content = dst.content(installed.index)
        assert content is not None and content.step == 3 and content.meta["tree"] == {"x": 1}
        views = dst.tensors(installed.index, content)
        assert torch.equal(views["w"], t["w"]) and torch.equal(views["b"], t["b"])
        assert dst.newest is installed
        # a slot rewritten since: no bytes for the old snapshot
        src.snapshot(4, t, {"step": 4, "tree": {}})
        src.snapshot(5, t, {"step": 5, "tree": {}})
        assert slot.replica_bytes(snap.seq) is None
        del data
    finally:
        src.close(unlink=True)
        dst.close(unlink=True)


@pytest.mark.parametrize(
    "meta",
    [
        b"not json",
        b"[1, 2]",
        json.dumps({"tree": {}, "layout": "x"}).encode(),
        json.dumps(
            {
                "tree": {},
                "layout": [{"name": "w", "dtype": "F32", "shape": [100], "begin": 0, "end": 400}],
            }
        ).encode(),  # longer than the data it came with
    ],
)
def test_a_hostile_replica_is_refused_before_any_slot_is_written(
    shm_dir: Path, meta: bytes
) -> None:
    arena = ShmArena("hostile", shm_dir=shm_dir)
    try:
        with pytest.raises(CheckpointError, match="received snapshot"):
            arena.install(1, meta, b"\0" * 16)
        assert arena.newest is None and all(s is None for s in arena.slots)
    finally:
        arena.close(unlink=True)
