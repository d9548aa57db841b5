"""Small things a newcomer trips over in the command line: ``demo --help`` describes the
demo and shows defaults; ``ls`` shows one row per step, saying where it lives; ``export``
does not offer the internal ``__classes__`` key; both "shared memory too small"
messages give one remedy."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import resumable
import resumable._shm_slot
import resumable.pipeline.memory
from resumable._shm import SHM_REMEDY, ShmSlot
from resumable.cli import main
from resumable.errors import StorageError


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    d = Path("/dev/shm") / f"resumable-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    shutil.rmtree(d)


def test_demo_help_describes_it_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "main job" not in text
    assert "Kill it and run it again" in text
    assert "(default: 600)" in text  # --steps
    assert "(default: None)" not in text  # --dir is required, --mirror has none
    assert main(["--help"]) == 0
    assert "main job" not in capsys.readouterr().out


def test_ls_shows_one_row_per_step(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(4, 4)
    ck = resumable.Checkpointer(
        tmp_path / "ck", {"model": model}, persist="thread", shm_dir=shm_dir, keep=None
    )
    ck.save(1)
    ck.wait()
    ck.snapshot(2)
    try:
        assert main(["ls", str(tmp_path / "ck"), "--json", "--shm-dir", str(shm_dir)]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["step"] for r in rows] == [1, 2]
        one, two = rows
        assert (one["status"], one["where"]) == ("committed", ["storage", "memory"])
        assert one["memory_path"].startswith(str(shm_dir))
        assert (two["status"], two["where"]) == ("memory", ["memory"])
        assert [r["restore"] for r in rows] == [False, True]
        assert main(["ls", str(tmp_path / "ck"), "--shm-dir", str(shm_dir)]) == 0
        lines = capsys.readouterr().out.splitlines()
        [row1] = [x for x in lines if x.split()[:1] == ["1"]]
        assert "committed" in row1 and "storage, memory" in row1
    finally:
        ck.close()


def test_export_does_not_offer_the_classes_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESUMABLE_PERSIST", "sync")
    ck = resumable.Checkpointer(tmp_path / "ck", {"model": torch.nn.Linear(2, 2)}, keep=None)
    ck.save(1)
    ck.close()
    out = tmp_path / "m.safetensors"
    for key in ("nope", "__classes__"):
        assert main(["export", str(tmp_path / "ck"), "--key", key, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "available keys: model" in err
        assert "__classes__" not in err.split("available keys:")[1]


def test_shared_memory_too_small_gives_one_remedy(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resumable._shm_slot, "shm_free_bytes", lambda directory: 0)
    with pytest.raises(StorageError) as slot:
        ShmSlot.create(
            shm_dir / "resumable-x-r0-s0", meta_cap=4096, sums_cap=4096, data_cap=1 << 20
        )
    monkeypatch.setattr(resumable.pipeline.memory, "shm_free_bytes", lambda directory: 0)
    ck = resumable.Checkpointer(
        tmp_path / "ck", {"model": torch.nn.Linear(64, 64)}, persist="thread", shm_dir=shm_dir
    )
    try:
        with pytest.raises(StorageError) as preflight:
            ck.restore()
    finally:
        ck.close()
    for info in (slot, preflight):
        assert info.value.errno == errno.ENOSPC
        assert str(info.value).endswith(SHM_REMEDY), str(info.value)
