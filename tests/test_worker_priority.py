"""The persist worker process runs at a lower CPU priority than the trainer once it has
started (``RESUMABLE_WORKER_NICE``, default +10), and still commits; a bad value is
refused before the root is touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from resumable import Checkpointer
from resumable.pipeline._worker import DEFAULT_WORKER_NICE, WORKER_NICE_ENV, PersistWorker


def _worker_nice(tmp_path: Path, expected: int) -> int:
    """The worker's niceness once it is ready (it lowers its priority after its
    start-up), waiting up to a minute for ``expected``."""
    worker = PersistWorker(url=str(tmp_path / "root"), mode="process", keep=None)
    try:
        deadline = time.monotonic() + 60
        while not worker._ready and time.monotonic() < deadline:
            worker.poll(0.1)
        assert worker._ready
        time.sleep(0.2)  # Ready is sent just before the worker lowers its priority
        while time.monotonic() < deadline:
            nice = os.getpriority(os.PRIO_PROCESS, worker.pid)
            if nice == expected:
                break
            time.sleep(0.05)
        return nice
    finally:
        worker.stop()


def test_the_worker_runs_at_a_lower_priority_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WORKER_NICE_ENV, raising=False)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + DEFAULT_WORKER_NICE)
    assert _worker_nice(tmp_path, expected) == expected


@pytest.mark.parametrize(("value", "added"), [("0", 0), ("3", 3), (" 19 ", 19)])
def test_the_increment_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, added: int
) -> None:
    monkeypatch.setenv(WORKER_NICE_ENV, value)
    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + added)
    assert _worker_nice(tmp_path, expected) == expected


def test_a_niced_worker_commits_what_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WORKER_NICE_ENV, "19")
    state = {"w": torch.arange(1000.0)}
    with Checkpointer(tmp_path / "root", state, persist="process", on_busy="wait") as ckpt:
        assert ckpt.persist_mode == "process"
        for step in (1, 2, 3):
            state["w"].add_(1)
            assert ckpt.save(step)
        ckpt.wait()
        assert ckpt.steps() == [1, 2, 3]
    state["w"].zero_()
    with Checkpointer(tmp_path / "root", state, persist="process") as ckpt:
        assert ckpt.restore() == 3
    assert torch.equal(state["w"], torch.arange(1000.0) + 3)


@pytest.mark.parametrize("value", ["-5", "20", "ten", "1.5"])
def test_a_bad_value_is_refused_before_the_root_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(WORKER_NICE_ENV, value)
    root = tmp_path / "root"
    with pytest.raises(ValueError, match=f"{WORKER_NICE_ENV} must be an integer from 0"):
        Checkpointer(root, {"w": torch.zeros(2)}, persist="process")
    assert not root.exists()
