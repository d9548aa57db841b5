"""What a restore says (issue 44 items 10 and 22): one line on stderr where a run
resumed from (step, tier, seconds), nothing on a fresh start or with ``quiet=True``; a
memory snapshot newer than every checkpoint that is thrown away because not every rank
can restore it is said at WARNING, with the step and why."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable.group import Group
from state_checks import shm_dir
from test_memory_tier import run_trainer

__all__ = ["shm_dir"]  # a fixture


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def test_a_resumed_run_prints_one_line_and_a_fresh_one_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    with resumable.Checkpointer(root, make_state(), persist="sync") as ck:
        assert ck.restore() == 0
        ck.save(3)
    assert capsys.readouterr().err == "", "a fresh start prints nothing"
    with resumable.Checkpointer(root, make_state(), persist="sync") as ck:
        assert ck.restore() == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"resumable: restored step 3 from {root} (storage, ")
    assert err.rstrip().endswith(" s)")


def test_quiet_keeps_the_restore_silent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    with resumable.Checkpointer(root, make_state(), persist="sync") as ck:
        ck.save(3)
    with resumable.Checkpointer(root, make_state(), persist="sync") as ck:
        assert ck.restore(quiet=True) == 3
    assert capsys.readouterr().err == ""


def test_a_restore_from_shared_memory_names_the_tier(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    killed = run_trainer(root, shm_dir, stop_at=17, mode="process")  # step 10 committed
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with resumable.Checkpointer(root, make_state(), persist="thread", shm_dir=shm_dir) as ck:
        assert ck.restore() == 17
    assert "resumable: restored step 17 from shared memory (memory, " in capsys.readouterr().err


def one_more_rank(answer: tuple[Any, ...]) -> Any:
    """`Group.all_gather` as if a second rank answered the memory tier's offer (``mine``,
    ``had``, ``why``, ``warned``, and the replicas it holds: none) with ``answer``;
    every other exchange agrees."""
    real = Group.all_gather

    def gather(self: Group, obj: Any, name: str = "") -> list[Any]:
        out = real(self, obj, name)
        if isinstance(obj, tuple) and len(obj) == 5 and isinstance(obj[2], str):
            return [*out, (*answer, [])]
        return out

    return gather


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ((None, None, "it has none", False), "rank 1: it has none"),
        ((15, 15, "", False), "rank 1: its snapshot is of step 15"),
    ],
)
def test_a_newer_snapshot_thrown_away_is_said_at_warning(
    tmp_path: Path,
    shm_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    answer: tuple[Any, ...],
    why: str,
) -> None:
    root = tmp_path / "ck"
    killed = run_trainer(root, shm_dir, stop_at=17, mode="process")  # step 10 committed
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    monkeypatch.setattr(Group, "all_gather", one_more_rank(answer))
    caplog.set_level(logging.WARNING, logger="resumable")
    with resumable.Checkpointer(root, make_state(), persist="thread", shm_dir=shm_dir) as ck:
        assert ck.restore() == 10
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = "\n".join(r.getMessage() for r in warnings)
    assert "discarding the shared-memory snapshot of step 17" in text
    assert why in text and "resumes from step 10" in text
