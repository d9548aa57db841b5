"""Uncommitted step directories (`resumable.commit`): restore names them in a warning, and
a save that finds one where it must commit moves it into ``quarantine/`` (never deletes
it, never leaves the root) instead of failing the run on every relaunch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import resumable
from resumable.commit import (
    QUARANTINE_DIR,
    Quarantined,
    RenameCommit,
    committer_for,
    list_committed,
    quarantine,
    step_dir,
    warn_uncommitted,
)
from resumable.errors import CheckpointError, StorageError
from resumable.format import MANIFEST
from resumable.storage import LocalStorage, MemoryStorage


def quarantined(root: Path) -> list[Path]:
    return sorted(p for p in (root / QUARANTINE_DIR).iterdir() if p.name != "README.txt")


def test_newest_manifest_deleted_then_that_step_saved_again(
    make_saved_root: Any, small_training_state: Any, tmp_path: Path
) -> None:
    """The issue's reproduction: the run resumed from step 2, trained to step 3, and its
    save of step 3 failed ("exists but is not a committed checkpoint") on every launch."""
    saved = make_saved_root(tmp_path / "ck")
    old_data = saved.data_file(3).read_bytes()
    saved.manifest_file(3).unlink()
    ts = small_training_state(seed=1)
    with resumable.Checkpointer(saved.path, ts.state, persist="sync", keep=None) as ck:
        assert ck.restore() == 2
        ts.train(1)
        ck.save(3)
        ck.wait()
        assert ck.steps() == [1, 2, 3]
    [moved] = quarantined(saved.path)
    assert moved.name.startswith("step-000000000003.")
    assert (moved / "rank-00000.safetensors").read_bytes() == old_data
    assert not (moved / MANIFEST).exists()
    assert "nothing reads them" in (saved.path / QUARANTINE_DIR / "README.txt").read_text()


def test_quarantine_is_reported_to_the_caller_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = LocalStorage(tmp_path)
    storage.write("step-000000000007/notes.txt", [b"mine"])
    heard: list[Quarantined] = []
    committer = committer_for(storage, on_quarantine=heard.append)
    assert isinstance(committer, RenameCommit)
    with caplog.at_level(logging.WARNING, logger="resumable.commit"):
        attempt = committer.begin(7)
    assert "moved it to" in caplog.text and "not deleted" in caplog.text
    [q] = heard
    assert (q.step, q.name) == (7, "step-000000000007")
    assert q.moved_to.startswith(f"{QUARANTINE_DIR}/step-000000000007.")
    assert storage.read(f"{q.moved_to}/notes.txt") == b"mine"
    storage.write(attempt.path("data"), [b"x"])
    committer.commit(attempt, b"{}")
    assert list_committed(storage) == [7]


def test_a_directory_that_appears_during_the_save_is_quarantined_too(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    heard: list[Quarantined] = []
    committer = RenameCommit(storage, on_quarantine=heard.append)
    attempt = committer.begin(3)
    storage.write(attempt.path("data"), [b"x"])
    storage.write("step-000000000003/other.bin", [b"other"])  # e.g. a copy landing now
    committer.commit(attempt, b"{}")
    assert [q.step for q in heard] == [3]
    assert storage.read(f"{heard[0].moved_to}/other.bin") == b"other"


def test_each_quarantine_gets_a_new_name_on_every_backend_that_renames() -> None:
    for storage in (MemoryStorage("memory://quarantine-test"),):
        names = []
        for _ in range(3):
            storage.write("step-000000000001/x", [b"1"])
            names.append(quarantine(storage, "step-000000000001"))
        assert len(set(names)) == 3
        assert not storage.exists("step-000000000001")
        assert storage.exists(f"{QUARANTINE_DIR}/README.txt")


def test_a_file_in_the_way_is_still_refused(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    (tmp_path / step_dir(4)).write_text("a file, not a directory")
    with pytest.raises(StorageError, match=r"could not be moved into quarantine/.*Move it away"):
        RenameCommit(storage).begin(4)
    assert (tmp_path / step_dir(4)).read_text() == "a file, not a directory"


def test_a_link_in_the_way_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("k")
    root.mkdir()
    (root / step_dir(5)).symlink_to(tmp_path / "outside")
    with pytest.raises(CheckpointError, match="symbolic link"):
        RenameCommit(LocalStorage(root)).begin(5)
    assert (tmp_path / "outside" / "keep").read_text() == "k"


def test_restore_warns_naming_uncommitted_directories(
    saved_root: Any, caplog: pytest.LogCaptureFixture
) -> None:
    saved_root.manifest_file(1).unlink()
    saved_root.manifest_file(3).unlink()
    storage = LocalStorage(saved_root.path)
    with caplog.at_level(logging.WARNING, logger="resumable.commit"):
        names = warn_uncommitted(storage)
    assert names == ["step-000000000001", "step-000000000003"]
    assert "step-000000000001, step-000000000003" in caplog.text
    assert "not restored" in caplog.text
    caplog.clear()
    assert warn_uncommitted(LocalStorage(saved_root.path / "nothing")) == []
    assert caplog.text == ""
