"""Retention beside another deleter: ``resumable prune`` run (in another process) while a
job's retention runs on the same root. A checkpoint the other process deleted first is
an outcome both wanted: no warning, no ``failure`` entry, no exception; a real failure
on a checkpoint that is still there is still raised.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resumable import Checkpointer, Keep
from resumable.audit import AuditLog, read_audit
from resumable.commit import RenameCommit, list_committed
from resumable.errors import StorageError
from resumable.retention import apply_retention
from resumable.storage import LocalStorage
from resumable.storage.base import ForwardingStorage

REPO = Path(__file__).resolve().parents[1]


def prune_in_another_process(root: Path, keep_last: int) -> str:
    """``resumable prune`` as an operator runs it: a process of its own."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "resumable.cli", "prune", str(root), "--keep-last", str(keep_last)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_job_s_retention_is_quiet_when_prune_deleted_its_checkpoints_first(
    tmp_path: Path,
    small_training_state: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The job keeps the last two; after its commit of step 4 its retention lists steps
    1-4 and dooms 1 and 2. Right then (between its listing and its delete) an operator's
    ``resumable prune --keep-last 2`` deletes them in another process."""
    root = tmp_path / "run"
    ts = small_training_state()
    original = RenameCommit.delete
    pruned: list[str] = []

    def delete_after_a_prune(self: RenameCommit, step: int) -> None:
        if not pruned:
            pruned.append(prune_in_another_process(root, 2))
        original(self, step)

    caplog.set_level(logging.INFO, logger="resumable")
    with Checkpointer(str(root), ts.state, keep=Keep(last=2), persist="thread") as ck:
        ck.restore()
        for step in (1, 2, 3):
            ts.train()
            ck.save(step)
            ck.wait()
        assert list_committed(LocalStorage(root)) == [2, 3]  # step 1 deleted by the job
        monkeypatch.setattr(RenameCommit, "delete", delete_after_a_prune)
        ts.train()
        ck.save(4)
        ck.wait()
        ts.train()
        ck.save(5)  # the next retention runs as usual
        ck.wait()

    assert pruned and "deleted step-000000000002" in pruned[0]
    assert list_committed(LocalStorage(root)) == [4, 5]
    assert warnings_of(caplog) == []
    entries = read_audit(LocalStorage(root))
    assert [e for e in entries if e["event"] == "failure"] == []
    deletes = [e["step"] for e in entries if e["event"] == "delete"]
    assert sorted(deletes) == [1, 2, 3]  # step 2 once: by the prune, which deleted it
    assert any("already deleted by another process" in r.getMessage() for r in caplog.records)


class PruneOnFirstManifestRead(ForwardingStorage):
    """A local root on which, at the first manifest read of a retention pass (after it
    listed the committed steps), another process prunes to the newest ``keep_last``."""

    def __init__(self, root: Path, keep_last: int) -> None:
        super().__init__(LocalStorage(root))
        self.root = root
        self.keep_last = keep_last
        self.pruned = False

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if not self.pruned and path.startswith("step-") and path.endswith("manifest.json"):
            self.pruned = True
            prune_in_another_process(self.root, self.keep_last)
        return self.inner.read_range(path, offset, length)

    def size(self, path: str) -> int:
        if not self.pruned and path.startswith("step-") and path.endswith("manifest.json"):
            self.pruned = True
            prune_in_another_process(self.root, self.keep_last)
        return self.inner.size(path)


def test_checkpoints_deleted_between_listing_and_reading_are_not_warned_about(
    tmp_path: Path, make_saved_root: Any, caplog: pytest.LogCaptureFixture
) -> None:
    saved = make_saved_root(tmp_path / "run", steps=(1, 2, 3, 4, 5))
    storage = PruneOnFirstManifestRead(saved.path, keep_last=2)
    caplog.set_level(logging.INFO, logger="resumable")
    deleted = apply_retention(storage, Keep(last=3), AuditLog(storage), just_written=5)
    assert storage.pruned
    assert deleted == []  # 4 and 5 are left, and Keep(last=3) keeps both
    assert list_committed(storage) == [4, 5]
    assert warnings_of(caplog) == []


class FailingRename(ForwardingStorage):
    """A root whose renames fail (a permission problem), the checkpoint still there."""

    def rename_dir(self, src: str, dst: str) -> None:
        raise StorageError(errno.EACCES, f"could not rename {src} to {dst}: Permission denied")


def test_a_real_failure_on_a_checkpoint_still_there_is_still_raised(
    tmp_path: Path, make_saved_root: Any
) -> None:
    saved = make_saved_root(tmp_path / "run", steps=(1, 2, 3))
    storage = FailingRename(LocalStorage(saved.path))
    with pytest.raises(StorageError, match="Permission denied"):
        apply_retention(storage, Keep(last=1), AuditLog(storage), just_written=3)
    assert list_committed(storage) == [1, 2, 3]
