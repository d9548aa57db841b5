"""`RootClaim` alone: one writer per root, one run id per root, a refused root leaves
nothing held, and a mirror that cannot be used is only a WARNING. (Several ranks: the
claim goes through rank 0 and its outcome reaches every rank; tests/test_distributed.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from resumable.audit import AuditLog, read_audit
from resumable.errors import CheckpointError, RootInUseError, StorageError
from resumable.group import Group
from resumable.pipeline.root_claim import RootClaim, remove_stale
from resumable.storage import LocalStorage
from resumable.storage.base import ForwardingStorage


def test_one_claim_per_root_and_the_run_id_stays(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    first = RootClaim(storage, None, Group(0, 1))
    try:
        with pytest.raises(RootInUseError):
            RootClaim(LocalStorage(tmp_path / "root"), None, Group(0, 1))
        first.check()  # still this job's
        assert first.fence() is None  # a filesystem lock needs no lease fence
    finally:
        first.release()
    first.release()  # idempotent
    again = RootClaim(LocalStorage(tmp_path / "root"), None, Group(0, 1))
    try:
        assert again.run_id == first.run_id, "the run id is the root's, not the launch's"
    finally:
        again.release()


def test_a_checkpoint_passed_as_root_is_refused_and_nothing_is_held(tmp_path: Path) -> None:
    step_dir = tmp_path / "run" / "step-000000000007"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is a checkpoint, not a checkpoint directory"):
        RootClaim(LocalStorage(step_dir), None, Group(0, 1))
    # The refusal released what it took: the parent is free, and so is the step itself.
    RootClaim(LocalStorage(tmp_path / "run"), None, Group(0, 1)).release()
    assert not (step_dir / ".resumable-lock").exists()


class Unreachable(ForwardingStorage):
    def check_root(self) -> None:
        raise StorageError(111, "injected: connection refused")


def test_a_mirror_that_cannot_be_used_is_a_warning_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mirror = Unreachable(LocalStorage(tmp_path / "mirror"))
    with caplog.at_level(logging.WARNING):
        claim = RootClaim(LocalStorage(tmp_path / "root"), mirror, Group(0, 1))
    claim.release()
    assert "cannot be used now" in caplog.text and "connection refused" in caplog.text


def test_stale_staging_of_dead_writers_is_removed_and_recorded(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    claim = RootClaim(storage, None, Group(0, 1))
    try:
        dead = tmp_path / "root" / ".tmp-step-000000000003.999999999.abcdef"
        dead.mkdir()
        (dead / "rank-00000.safetensors").write_bytes(b"x")
        audit = AuditLog(storage)
        remove_stale(storage, audit)
        assert not dead.exists()
        assert [e["name"] for e in read_audit(storage) if e["event"] == "stale_removed"] == [
            dead.name
        ]
    finally:
        claim.release()
