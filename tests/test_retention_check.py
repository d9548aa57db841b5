"""Retention's check of the checkpoint just written, before it deletes anything.

The check lists the checkpoint's directory once (`Storage.list_files`) and compares each
data file's size with its manifest's. A file cut short or missing, in the checkpoint
just written or in an earlier one it refers to, makes retention delete nothing; an
intact checkpoint lets it delete, with no data file of it opened.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable import Checkpointer, Incremental, Keep
from resumable.audit import AuditLog, read_audit
from resumable.commit import list_committed, step_dir
from resumable.format import MANIFEST
from resumable.reader import CheckpointReader
from resumable.retention import apply_retention
from resumable.storage import LocalStorage, MemoryStorage, Storage
from resumable.storage.base import ForwardingStorage

DATA = "rank-00000.safetensors"


class Recording(ForwardingStorage):
    """Notes every path that is read, sized or listed."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.seen: list[tuple[str, str]] = []

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.seen.append(("read", path))
        return super().read_range(path, offset, length)

    def size(self, path: str) -> int:
        self.seen.append(("size", path))
        return super().size(path)

    def list_files(self, path: str = "") -> dict[str, int]:
        self.seen.append(("list_files", path))
        return super().list_files(path)


def _backend(kind: str, tmp_path: Path) -> Storage:
    if kind == "local":
        return LocalStorage(tmp_path / "root")
    return MemoryStorage(f"memory://retention-check-{tmp_path.name}")


def _save(storage: Storage, steps: list[int], **options: Any) -> dict[str, torch.Tensor]:
    state = {"w": torch.zeros(4096), "b": torch.arange(16)}
    with Checkpointer(storage, state, keep=None, persist="sync", **options) as ck:
        for step in steps:
            state["w"][:8] = float(step)  # one chunk changes: an incremental refers back
            ck.save(step)
    return state


def _cut_short(storage: Storage, step: int, by: int = 1) -> None:
    path = f"{step_dir(step)}/{DATA}"
    data = storage.read(path)
    storage.write(path, [data[:-by]])


def _retain_last(storage: Storage, just_written: int) -> list[int]:
    return apply_retention(storage, Keep(last=1), AuditLog(storage), just_written=just_written)


BACKENDS = ["local", "memory"]


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_intact_checkpoint_lets_retention_delete_without_opening_its_files(
    kind: str, tmp_path: Path
) -> None:
    inner = _backend(kind, tmp_path)
    _save(inner, [1, 2, 3])
    storage = Recording(inner)

    assert sorted(_retain_last(storage, 3)) == [1, 2]

    assert list_committed(inner) == [3]
    newest = step_dir(3)
    assert ("list_files", newest) in storage.seen
    touched = {p for _, p in storage.seen if p.startswith(f"{newest}/")}
    assert touched == {f"{newest}/{MANIFEST}"}  # its data file is neither sized nor read


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda s: _cut_short(s, 3), id="cut-short-by-one-byte"),
        pytest.param(lambda s: _cut_short(s, 3, by=4000), id="cut-to-its-header"),
        pytest.param(lambda s: s.delete(f"{step_dir(3)}/{DATA}"), id="missing"),
        pytest.param(
            lambda s: s.write(f"{step_dir(3)}/{DATA}", [s.read(f"{step_dir(3)}/{DATA}"), b"x"]),
            id="one-byte-too-long",
        ),
    ],
)
def test_a_damaged_just_written_checkpoint_makes_retention_delete_nothing(
    kind: str, tmp_path: Path, damage: Callable[[Storage], None]
) -> None:
    storage = _backend(kind, tmp_path)
    _save(storage, [1, 2, 3])
    damage(storage)

    assert _retain_last(storage, 3) == []

    assert list_committed(storage) == [1, 2, 3]
    for step in (1, 2):
        CheckpointReader(storage, step).verify()
    skips = [e for e in read_audit(storage) if e["event"] == "skip"]
    assert skips[-1]["reason"] == "retention: no retained checkpoint verifies"
    assert skips[-1]["steps"] == [1, 2]


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_earlier_file_the_new_checkpoint_refers_to_is_checked_too(
    kind: str, tmp_path: Path
) -> None:
    """Step 3 is incremental: its unchanged chunks lie in step 1's file. Step 1 is kept
    (step 3 needs it) and step 2 is doomed; with step 1's file cut short, step 3 cannot
    be restored, so step 2 stays."""
    storage = _backend(kind, tmp_path)
    _save(storage, [1, 2, 3], incremental=Incremental(chunk_bytes=4096, min_bytes=0))
    assert CheckpointReader(storage, 3).manifest["refs"] == [1]
    intact = _backend(kind, tmp_path / "copy")
    for name, size in storage.list_files("").items():
        intact.write(name, [storage.read(name)])
        assert intact.size(name) == size
    _cut_short(storage, 1)

    assert _retain_last(storage, 3) == []
    assert list_committed(storage) == [1, 2, 3]

    assert _retain_last(intact, 3) == [2]  # the same, undamaged: step 2 goes
    assert list_committed(intact) == [1, 3]
