"""``resumable shm --root DIR``: lists and cleans only the segments of that checkpoint
root (named for it on this host, or recording it), never another job's; ``--all`` also
takes in segments that record no root."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable._shm import SlotMeta, run_key_for
from resumable.cli import main
from resumable.snapshot import ShmArena
from resumable.storage import LocalStorage


def _snapshot(shm_dir: Path, key: str, root: Path | None, step: int) -> None:
    arena = ShmArena(key, shm_dir=shm_dir, root=None if root is None else str(root))
    arena.snapshot(step, {"w": torch.arange(16.0)}, SlotMeta(tree={}))
    arena.close(unlink=False)


def _rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["shm", "--json", *argv]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def _steps(rows: list[dict[str, Any]]) -> set[int]:
    return {r["step"] for r in rows if r["step"] is not None}


@pytest.fixture
def two_roots(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Root A (step 1, and step 3 written under another host name), root B (step 2),
    and a slot that records no root (step 4), all orphaned in one directory."""
    shm_dir, a, b = tmp_path / "shm", tmp_path / "a", tmp_path / "b"
    for d in (shm_dir, a, b):
        d.mkdir()
    _snapshot(shm_dir, run_key_for(LocalStorage(a).location), a, 1)
    _snapshot(shm_dir, run_key_for(LocalStorage(b).location), b, 2)
    _snapshot(shm_dir, "0000feedface", a, 3)  # another container's host name
    _snapshot(shm_dir, "0123456789ab", None, 4)  # an older version recorded no root
    return shm_dir, a, b


def test_root_lists_only_its_segments(
    two_roots: tuple[Path, Path, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shm_dir, a, b = two_roots
    every = _rows(capsys, "--shm-dir", str(shm_dir))
    assert _steps(every) == {1, 2, 3, 4}
    mine = _rows(capsys, "--shm-dir", str(shm_dir), "--root", str(a))
    assert _steps(mine) == {1, 3}
    assert {r["root"] for r in mine} <= {str(a), None}
    assert _steps(_rows(capsys, "--shm-dir", str(shm_dir), "--root", str(b))) == {2}
    with_unknown = _rows(capsys, "--shm-dir", str(shm_dir), "--root", str(a), "--all")
    assert _steps(with_unknown) == {1, 3, 4}
    # a relative spelling of the same directory
    monkeypatch.chdir(a.parent)
    assert _steps(_rows(capsys, "--shm-dir", str(shm_dir), "--root", "a/../a")) == {1, 3}


def test_clean_with_root_leaves_other_jobs_segments(
    two_roots: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    shm_dir, a, _ = two_roots
    rows = _rows(capsys, "--shm-dir", str(shm_dir), "--root", str(a), "--clean", "--force")
    assert _steps(rows) == {1, 3}
    assert all(r["removed"] for r in rows)
    left = _rows(capsys, "--shm-dir", str(shm_dir))
    assert _steps(left) == {2, 4}
    assert all(os.path.exists(r["path"]) for r in left)
    assert not any(Path(r["path"]).name.startswith(f"resumable-{_key(a)}") for r in left)


def test_clean_with_root_and_all_takes_unattributed_segments(
    two_roots: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    shm_dir, a, _ = two_roots
    _rows(capsys, "--shm-dir", str(shm_dir), "--root", str(a), "--all", "--clean", "--force")
    assert _steps(_rows(capsys, "--shm-dir", str(shm_dir))) == {2}


def test_all_without_root_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["shm", "--all", "--shm-dir", str(tmp_path)]) == 2
    assert "--all only applies to --root" in capsys.readouterr().err


def test_root_with_no_segments_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "shm").mkdir()
    capsys.readouterr()
    assert main(["shm", "--shm-dir", str(tmp_path / "shm"), "--root", str(tmp_path / "r")]) == 0
    assert f"no resumable shared-memory segments of {tmp_path / 'r'}" in capsys.readouterr().out


def _key(root: Path) -> str:
    return run_key_for(LocalStorage(root).location)
