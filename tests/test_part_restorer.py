"""`Restorer` alone (issue 46 item 5), built as `Checkpointer` builds it over a root of
committed checkpoints (the ``saved_root`` fixture: steps 1, 2 and 3), a mirror and a
memory tier: it restores the newest valid state among the tiers, skips a corrupt
checkpoint with a WARNING and an audit entry, and raises when checkpoints exist but none
is valid, without touching the live state."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import SavedRoot, TrainingState, build_training_state
from resumable.audit import AuditLog, read_audit
from resumable.errors import CorruptCheckpointError, NoCheckpointError
from resumable.group import Group
from resumable.pipeline.memory import MemoryTier
from resumable.pipeline.restorer import Restorer
from resumable.storage import LocalStorage, Storage


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A private directory standing in for /dev/shm."""
    d = Path("/dev/shm") / f"resumable-part-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def restorer(
    ts: TrainingState,
    storage: Storage,
    *,
    mirror: Storage | None = None,
    memory: MemoryTier | None = None,
) -> Restorer:
    return Restorer(
        ts.state,
        storage,
        mirror=mirror,
        memory=memory,
        coordination=Group(0, 1),
        audit=AuditLog(storage),
    )


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # in the tensors' bytes: the checksum no longer matches
    path.write_bytes(bytes(data))


def fresh() -> TrainingState:
    return build_training_state(seed=7, steps=0)


# ------------------------------------------------------------------ storage


def test_restores_the_newest_checkpoint(saved_root: SavedRoot) -> None:
    storage = LocalStorage(saved_root.path)
    ts = fresh()
    r = restorer(ts, storage)
    assert sorted(r.roots_by_step()) == [1, 2, 3]
    done = r.restore(None, map_location=None, tier="auto", reset_per_rank=False)
    assert (done.step, done.tier, done.skipped) == (3, "local", [])
    assert done.newest_committed == 3
    assert ts.mismatches(saved_root.expected[3]) == []
    restores = [e for e in read_audit(storage) if e["event"] == "restore"]
    assert [(e["step"], e["tier"]) for e in restores] == [(3, "storage")]


def test_restores_the_step_asked_for(saved_root: SavedRoot) -> None:
    ts = fresh()
    done = restorer(ts, LocalStorage(saved_root.path)).restore(
        1, map_location=None, tier="storage", reset_per_rank=False
    )
    assert done.step == 1
    assert ts.mismatches(saved_root.expected[1]) == []


def test_nothing_to_restore_is_step_0(tmp_path: Path) -> None:
    ts = fresh()
    before = ts.tensors()
    done = restorer(ts, LocalStorage(tmp_path)).restore(
        None, map_location=None, tier="auto", reset_per_rank=False
    )
    assert (done.step, done.tier) == (0, "none")
    assert ts.mismatches(before) == []


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    saved_root: SavedRoot, caplog: pytest.LogCaptureFixture
) -> None:
    flip_a_byte(saved_root.data_file(3))
    storage = LocalStorage(saved_root.path)
    ts = fresh()
    with caplog.at_level(logging.WARNING):
        done = restorer(ts, storage).restore(
            None, map_location=None, tier="auto", reset_per_rank=False
        )
    assert done.step == 2
    assert ts.mismatches(saved_root.expected[2]) == []
    assert len(done.skipped) == 1 and "step-000000000003" in done.skipped[0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("skipping corrupt checkpoint step-000000000003" in r.getMessage() for r in warnings)
    skips = [e for e in read_audit(storage) if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [3]


def test_checkpoints_but_none_valid_raise_and_leave_the_state(saved_root: SavedRoot) -> None:
    for step in saved_root.steps:
        flip_a_byte(saved_root.data_file(step))
    ts = fresh()
    before = ts.tensors()
    with pytest.raises(CorruptCheckpointError, match=r"3 checkpoint\(s\) .* none is valid"):
        restorer(ts, LocalStorage(saved_root.path)).restore(
            None, map_location=None, tier="auto", reset_per_rank=False
        )
    assert ts.mismatches(before) == []


def test_a_corrupt_checkpoint_asked_for_raises(saved_root: SavedRoot) -> None:
    flip_a_byte(saved_root.data_file(2))
    with pytest.raises(CorruptCheckpointError):
        restorer(fresh(), LocalStorage(saved_root.path)).restore(
            2, map_location=None, tier="storage", reset_per_rank=False
        )


def test_an_unknown_tier_is_refused(saved_root: SavedRoot) -> None:
    with pytest.raises(ValueError, match="tier must be one of"):
        restorer(fresh(), LocalStorage(saved_root.path)).restore(
            None, map_location=None, tier="disk", reset_per_rank=False
        )


# ------------------------------------------------------------------ mirror


def test_the_mirror_holds_the_newest(saved_root: SavedRoot, tmp_path: Path) -> None:
    mirror = saved_root.copy_to(tmp_path / "mirror")
    shutil.rmtree(saved_root.step_dir(3))  # the local root lost it (retention, a disk)
    ts = fresh()
    r = restorer(ts, LocalStorage(saved_root.path), mirror=LocalStorage(mirror.path))
    done = r.restore(None, map_location=None, tier="auto", reset_per_rank=False)
    assert (done.step, done.tier) == (3, "mirror")
    assert ts.mismatches(saved_root.expected[3]) == []


def test_a_corrupt_local_copy_falls_back_to_the_mirrors(
    saved_root: SavedRoot, tmp_path: Path
) -> None:
    mirror = saved_root.copy_to(tmp_path / "mirror")
    flip_a_byte(saved_root.data_file(3))
    ts = fresh()
    r = restorer(ts, LocalStorage(saved_root.path), mirror=LocalStorage(mirror.path))
    done = r.restore(None, map_location=None, tier="auto", reset_per_rank=False)
    assert (done.step, done.tier) == (3, "mirror")
    assert len(done.skipped) == 1 and str(saved_root.path) in done.skipped[0]
    assert ts.mismatches(saved_root.expected[3]) == []


# ------------------------------------------------------------------ memory tier


def test_a_memory_snapshot_newer_than_storage_wins(saved_root: SavedRoot, shm_dir: Path) -> None:
    storage = LocalStorage(saved_root.path)
    audit = AuditLog(storage)
    memory = MemoryTier(storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=audit)
    try:
        trained = build_training_state(seed=3, steps=5)
        memory.take(trained.state, 5, None, rng=False)
        expected = trained.tensors()

        ts = fresh()
        done = restorer(ts, storage, memory=memory).restore(
            None, map_location=None, tier="auto", reset_per_rank=False
        )
        assert (done.step, done.tier) == (5, "memory")
        assert done.snapshot is not None and done.snapshot.step == 5
        assert done.newest_committed == 3
        assert ts.mismatches(expected) == []

        ts = fresh()
        done = restorer(ts, storage, memory=memory).restore(
            None, map_location=None, tier="storage", reset_per_rank=False
        )
        assert (done.step, done.tier) == (3, "local")
        assert ts.mismatches(saved_root.expected[3]) == []
    finally:
        memory.close(unlink=True)


def test_a_memory_step_not_held_raises(tmp_path: Path, shm_dir: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    memory = MemoryTier(
        storage, rank=0, world_size=1, shm_dir=shm_dir, overlap=False, audit=AuditLog(storage)
    )
    try:
        with pytest.raises(NoCheckpointError, match="no memory snapshot of step 4"):
            restorer(fresh(), storage, memory=memory).restore(
                4, map_location=None, tier="memory", reset_per_rank=False
            )
    finally:
        memory.close(unlink=True)
