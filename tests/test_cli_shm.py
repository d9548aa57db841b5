"""``resumable shm``: each slot names its checkpoint root and says whether it holds
progress that root never committed; ``--clean`` keeps such slots unless ``--force``,
and says what it kept or lost.

Slots come from real trainers SIGKILLed between commits (memory snapshot every step,
a commit every 10), in a private shared-memory directory per test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable._shm import SlotMeta
from resumable.cli import main
from resumable.snapshot import ShmArena

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, torch, resumable
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    root, shm_dir, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ck = resumable.Checkpointer(root, {"model": model, "optim": opt},
        memory_every=resumable.Every(steps=1), persist_every=resumable.Every(steps=10),
        persist="sync", shm_dir=shm_dir)
    start = ck.restore()
    print("start", start, flush=True)
    for step in range(start, stop_at):
        model(torch.randn(4, 8)).sum().backward()
        opt.step(); opt.zero_grad()
        ck.maybe_save(step + 1)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def killed_run(root: Path, shm_dir: Path, stop_at: int) -> int:
    """Train to ``stop_at`` and SIGKILL; returns the step the run started from."""
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, str(root), str(shm_dir), str(stop_at)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return int(proc.stdout.split()[1])


def shm(shm_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["shm", "--json", "--shm-dir", str(shm_dir), *extra]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def of(rows: list[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    return sorted(
        (r for r in rows if r["root"] and Path(r["root"]).resolve() == root.resolve()),
        key=lambda r: r["step"],
    )


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


def test_shm_shows_each_slots_root_and_clean_keeps_uncommitted_progress(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ahead, done = tmp_path / "ahead", tmp_path / "done"
    killed_run(ahead, shm_dir, stop_at=14)  # committed 10, memory holds 13 and 14
    killed_run(done, shm_dir, stop_at=10)  # committed 10, memory holds 9 and 10

    rows = shm(shm_dir, capsys)
    assert [(r["step"], r["newest_commit"], r["unsaved"]) for r in of(rows, ahead)] == [
        (13, 10, True),
        (14, 10, True),
    ]
    assert [(r["step"], r["newest_commit"], r["unsaved"]) for r in of(rows, done)] == [
        (9, 10, False),
        (10, 10, False),
    ]
    assert main(["shm", "--shm-dir", str(shm_dir)]) == 0
    out = capsys.readouterr().out
    assert str(ahead) in out and "committed" in out and "unsaved" in out
    assert "step 14 of " in out and "held nowhere else (newest commit: step 10)" in out

    assert main(["shm", "--clean", "--shm-dir", str(shm_dir)]) == 0
    out = capsys.readouterr().out
    kept = [line for line in out.splitlines() if line.startswith("kept ")]
    assert len(kept) == 2 and all("--clean --force" in line for line in kept)
    rows = shm(shm_dir, capsys)
    assert [r["step"] for r in of(rows, ahead)] == [13, 14], "uncommitted progress was removed"
    assert of(rows, done) == [], "slots of committed steps were kept"
    assert killed_run(ahead, shm_dir, stop_at=15) == 14, "the kept slot resumes the run"

    assert main(["shm", "--clean", "--force", "--shm-dir", str(shm_dir)]) == 0
    out = capsys.readouterr().out
    assert any(x.startswith("removed ") and "lost step 15 of " in x for x in out.splitlines())
    assert shm(shm_dir, capsys) == []
    # The resumed launch committed step 14 (recovered from memory); step 15 is gone.
    assert killed_run(ahead, shm_dir, stop_at=16) == 14, "--force removed step 15"


def test_slot_of_a_deleted_root_is_kept_unless_forced(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "gone"
    killed_run(root, shm_dir, stop_at=4)
    shutil.rmtree(root)
    rows = shm(shm_dir, capsys, "--clean")
    assert [(r["step"], r["newest_commit"], r["unsaved"], r["kept"]) for r in of(rows, root)] == [
        (3, None, True, True),
        (4, None, True, True),
    ]
    rows = shm(shm_dir, capsys, "--clean", "--force")
    assert all(r["removed"] for r in rows) and len(rows) == 2


def test_slot_without_a_recorded_root_is_kept_unless_forced(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slot written before roots were recorded: nobody can tell what it holds."""
    arena = ShmArena("0123456789ab", shm_dir=shm_dir)  # no root, as older versions wrote
    arena.snapshot(7, {"w": torch.arange(16.0)}, SlotMeta(tree={}))
    arena.close(unlink=False)
    [row] = shm(shm_dir, capsys)
    assert (row["step"], row["root"], row["unsaved"]) == (7, None, None)
    assert main(["shm", "--clean", "--shm-dir", str(shm_dir)]) == 0
    out = capsys.readouterr().out
    assert any(x.startswith("kept ") and "does not record its root" in x for x in out.splitlines())
    assert os.path.exists(row["path"])
    [row] = shm(shm_dir, capsys, "--clean", "--force")
    assert row["removed"] and not os.path.exists(row["path"])


def test_force_without_clean_is_a_usage_error(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["shm", "--force", "--shm-dir", str(shm_dir)]) == 2
    assert "--force only applies to --clean" in capsys.readouterr().err
