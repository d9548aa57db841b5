"""The parts of `replicas=R` a single process can check: the option's refusals, a slot's
bytes read as a replica carries them and written back into another arena (what a
replaced node does with a fetched replica), and a hostile replica refused there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from resumable import Checkpointer, Every
from resumable._shm import SlotMeta
from resumable.errors import CheckpointError, OptionError, ReplicaPlacementError
from resumable.options import MemoryOptions
from resumable.replicas.peers import own_snapshot, rate_from_env, tensor_ranges
from resumable.replicas.store import ReplicaStore, plan_pieces, remove_dead_stores
from resumable.replicas.transport import ReplicaClient, ReplicaServer
from resumable.snapshot import CopyPlan, ShmArena
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture

SECRET = b"s" * 32


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_replicas_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(OptionError, match="replicas must be an integer >= 1"):
        MemoryOptions(replicas=bad)  # type: ignore[arg-type]


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
        snap = src.snapshot(3, t, SlotMeta(tree={"x": 1}))
        assert not isinstance(snap, type(None))
        slot = src.slots[snap.index]
        assert slot is not None
        got = slot.replica_bytes(snap.seq)
        assert got is not None
        meta, data = got
        installed = dst.install(3, meta, bytes(data))
        content = dst.content(installed.index)
        assert content is not None and content.step == 3 and content.meta.tree == {"x": 1}
        views = dst.tensors(installed.index, content)
        assert torch.equal(views["w"], t["w"]) and torch.equal(views["b"], t["b"])
        assert dst.newest is installed
        # a slot rewritten since: no bytes for the old snapshot
        src.snapshot(4, t, SlotMeta(tree={}))
        src.snapshot(5, t, SlotMeta(tree={}))
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


def test_a_peer_is_sent_only_the_pieces_its_own_snapshot_lacks(shm_dir: Path) -> None:
    """A receiver holding the same step in its own slots (a DDP peer: the same
    parameters and moments) fills those pieces from there, each proven by its digest;
    the per-rank tensor and the metadata travel. The stored replica is the sender's,
    byte for byte."""
    sender = ShmArena("a", shm_dir=shm_dir, rank=0)
    receiver = ShmArena("b", shm_dir=shm_dir, rank=1)
    w = torch.arange(100_000, dtype=torch.float32)
    try:
        snap = sender.snapshot(
            3,
            {"w": w, "rng": torch.full((5000,), 1, dtype=torch.uint8)},
            SlotMeta(tree={}, replicated=("w",)),
        )
        receiver.snapshot(
            3,
            {"w": w, "rng": torch.full((5000,), 2, dtype=torch.uint8)},
            SlotMeta(tree={}, replicated=("w",)),
        )
        slot = sender.slots[snap.index]
        assert slot is not None
        got = slot.replica_bytes(snap.seq)
        assert got is not None
        meta, data = got
        ranges = tensor_ranges(meta, len(data))
        assert ranges == [(0, 400_000), (400_000, 5000)]
        pieces = plan_pieces(meta, data, ranges=ranges)
        with (
            ReplicaStore(shm_dir / "store", "run") as store,
            ReplicaServer(
                store,
                secret=SECRET,
                rank=1,
                local=lambda step, n: own_snapshot(receiver, step, n, wait_s=0.0),
            ) as server,
        ):
            assert server.address is not None
            with ReplicaClient(server.address, secret=SECRET, run_id="run", rank=0) as client:
                client.push(3, meta, data, pieces=pieces)
                assert client.skipped_bytes == 400_000
                assert client.sent_bytes == len(meta) + 5000
                stored = store.read(0, 3)
                assert bytes(stored.data) == bytes(data) and stored.meta == meta
                # a receiver without that step (another step in its slots): all travels
                client.push(4, meta, data, pieces=pieces)
                assert client.skipped_bytes == 400_000
                assert client.sent_bytes == 2 * len(meta) + 5000 + 405_000
        del data
    finally:
        sender.close(unlink=True)
        receiver.close(unlink=True)


def _slot_meta(tensors: dict[str, torch.Tensor], replicated: tuple[str, ...]) -> bytes:
    """A slot's metadata as the arena writes it: the copy plan's layout, then the rest."""
    return CopyPlan(tensors).meta_head + SlotMeta(tree={}, replicated=replicated).encode(1)[1:]


def test_tensor_ranges_keep_per_rank_tensors_out_of_replicated_pieces() -> None:
    tensors = {
        "a": torch.zeros(25),
        "b": torch.zeros(18),
        "rng": torch.zeros(44, dtype=torch.uint8),
        "c": torch.zeros(20),
    }
    n = CopyPlan(tensors).nbytes
    meta = _slot_meta(tensors, ("a", "b", "c"))
    begins = {t["name"]: t["begin"] for t in json.loads(meta)["layout"]}
    got = tensor_ranges(meta, n)
    # The replicated tensors (small) merge; rng, this rank's own, is a piece alone.
    assert got is not None and sum(length for _, length in got) == n
    assert (begins["rng"], 44) in got  # pieces cover the data once: none overlaps it
    # a tensor larger than a chunk is split into chunks, not merged with its neighbours
    big = {"a": torch.zeros(75_000), "b": torch.zeros(1)}
    n = CopyPlan(big).nbytes
    assert tensor_ranges(_slot_meta(big, ("a", "b")), n, chunk=100_000) == [
        (0, 100_000),
        (100_000, 100_000),
        (200_000, 100_000),
        (300_000, n - 300_000),
    ]
    assert tensor_ranges(b"not json", 10) is None


def test_the_lightning_callback_passes_replicas_to_its_checkpointer(tmp_path: Path) -> None:
    """The option reaches the `Checkpointer` the callback opens: one process is one node,
    so two copies are refused there, by the same error."""
    pytest.importorskip("lightning")
    from resumable.integrations.lightning import ResumableCheckpoint

    cb = ResumableCheckpoint(
        tmp_path / "ck", memory_every=Every(steps=1), persist="thread", replicas=2
    )
    with pytest.raises(ReplicaPlacementError, match="replicas=2 needs 2 distinct nodes"):
        cb._open()


@pytest.mark.parametrize("bad", ["abc", "-1", "inf", "nan", "1e400"])
def test_a_bad_replica_rate_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("RESUMABLE_REPLICA_RATE", bad)
    with pytest.raises(ValueError, match="RESUMABLE_REPLICA_RATE should be MiB per second"):
        rate_from_env()


def test_the_replica_rate_is_mib_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_REPLICA_RATE", "2.5")
    assert rate_from_env() == 2.5 * 2**20
    monkeypatch.setenv("RESUMABLE_REPLICA_RATE", "0")
    assert rate_from_env() is None
    monkeypatch.delenv("RESUMABLE_REPLICA_RATE")
    assert rate_from_env() is None


def test_with_replicas_a_rank_keeps_its_two_newest_snapshots_while_copying_the_next(
    shm_dir: Path,
) -> None:
    """A peer's replica of a rank may be one snapshot behind the rank's newest, and the
    other ranks may be one snapshot ahead: each keeps its two newest complete snapshots
    while it copies the next (three slots in rotation, a fourth while a persist holds
    one), so the step a replica holds is still on every rank."""
    arena = ShmArena("keep2", shm_dir=shm_dir)
    arena.keep = 2
    t = {"w": torch.zeros(256)}
    try:
        for step in range(1, 6):
            t["w"].fill_(step)
            arena.snapshot(step, t, SlotMeta(tree={}))
            assert sorted(sn.step for sn, _ in arena.complete())[-3:] == list(
                range(max(1, step - 2), step + 1)
            )
        assert [s is not None for s in arena.slots] == [True, True, True, False]
        assert arena.newest is not None
        arena.locked.add(arena.newest.index)  # a persist of step 5
        arena.snapshot(6, t, SlotMeta(tree={}))
        arena.snapshot(7, t, SlotMeta(tree={}))
        assert sorted(sn.step for sn, _ in arena.complete()) == [5, 6, 7]
        assert arena.slots[3] is None  # the persisted one was among the kept so far
        arena.snapshot(8, t, SlotMeta(tree={}))  # 5 held, 6 and 7 kept: a fourth
        assert arena.slots[3] is not None
        assert sorted(sn.step for sn, _ in arena.complete()) == [5, 6, 7, 8]
        arena.locked.clear()
        arena.snapshot(9, t, SlotMeta(tree={}))  # overwrites the oldest: step 5
        assert sorted(sn.step for sn, _ in arena.complete()) == [6, 7, 8, 9]
    finally:
        arena.close(unlink=True)


def test_store_directories_of_dead_runs_are_removed_and_a_clean_close_removes_its_own(
    tmp_path: Path,
) -> None:
    """A store nobody holds, unchanged for the stale age, is removed (a run that crashed
    and was never relaunched); a held one and a recent one are not; a store closed with
    ``remove`` (a run that finished cleanly) leaves nothing behind."""
    dead = ReplicaStore(tmp_path / "replicas-dead-r0", "run")
    (dead.directory / "r1-s3.replica").write_bytes(b"x")
    dead.close()
    held = ReplicaStore(tmp_path / "replicas-held-r0", "run")
    recent = ReplicaStore(tmp_path / "replicas-recent-r0", "run")
    recent.close()
    other = tmp_path / "not-a-store"
    other.mkdir()
    old = 1_000_000_000
    for d in (dead.directory, held.directory, other):
        for e in [d, *d.iterdir()]:
            os.utime(e, (old, old))
    try:
        removed = remove_dead_stores(tmp_path, "replicas-", 3600.0)
        assert removed == [dead.directory]
        assert not dead.directory.exists()
        assert held.directory.exists() and recent.directory.exists() and other.exists()
    finally:
        held.close(remove=True)
    assert not held.directory.exists()
