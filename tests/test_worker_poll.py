"""`maybe_save` takes in the persist worker's replies at every call. With no job
outstanding and no mirror, the worker has nothing to send, so the socket is not
polled (a syscall per training step); a worker that died meanwhile is still said at
once, and the next persist starts another one. With a mirror, reports arrive after the
commit they follow, and are still taken in while no job is outstanding."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable import Checkpointer, Every
from resumable.commit import list_committed
from resumable.errors import PersistError
from resumable.pipeline import _worker
from resumable.storage.local import LocalStorage
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture


class _NoSelect:
    """Stands in for the `select` module: any poll of the socket fails the test."""

    calls = 0

    def select(self, *args: Any) -> Any:
        type(self).calls += 1
        raise AssertionError("the worker's socket was polled with nothing to read")


def _worker_of(ck: Checkpointer) -> Any:
    worker = ck._persister._worker  # type: ignore[attr-defined]
    assert worker is not None and worker.mode == "process"
    return worker


def test_an_idle_worker_is_not_polled_and_a_dead_one_is_replaced(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.arange(1000.0)}
    with Checkpointer(
        tmp_path / "root",
        state,
        persist="process",
        memory_every=Every(steps=1),
        persist_every=Every(steps=10**6),
        shm_dir=shm_dir,
        on_busy="wait",
    ) as ck:
        ck.save(1)
        ck.wait()
        worker = _worker_of(ck)
        assert not worker.outstanding
        real = _worker.select
        monkeypatch.setattr(_worker, "select", _NoSelect())
        for step in range(2, 6):
            state["w"] += 1
            assert ck.maybe_save(step) is False  # snapshots, takes in nothing
        monkeypatch.setattr(_worker, "select", real)

        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while worker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.alive
        state["w"] += 1
        with pytest.raises(PersistError, match="persist process"):
            ck.maybe_save(6)  # its death is said at once, though nothing was lost
        ck.save(7)  # a new worker takes it
        ck.wait()
        assert _worker_of(ck).pid != worker.pid
    assert list_committed(LocalStorage(tmp_path / "root")) == [1, 7]
    with Checkpointer(tmp_path / "root", {"w": torch.zeros(1000)}) as again:
        assert again.restore() == 7
        assert torch.equal(again.state["w"], torch.arange(1000.0) + 5)


def test_a_job_outstanding_is_still_polled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(1000.0)}
    with Checkpointer(tmp_path / "root", state, persist="process", on_busy="wait") as ck:
        ck.save(1)
        worker = _worker_of(ck)
        assert worker.outstanding  # its reply is taken in by the next poll
        monkeypatch.setattr(_worker, "select", _NoSelect())
        with pytest.raises(AssertionError, match="polled"):
            worker.poll()
        monkeypatch.undo()
        ck.wait()
        assert not worker.outstanding


def test_mirror_reports_are_taken_in_with_nothing_outstanding(tmp_path: Path) -> None:
    state = {"w": torch.arange(1000.0)}
    with Checkpointer(
        tmp_path / "root", state, persist="process", mirror=str(tmp_path / "mirror")
    ) as ck:
        ck.save(1)
        ck.wait()
        worker = _worker_of(ck)
        assert not worker._answers_only
        deadline = time.monotonic() + 60
        while ck.monitor.stats["mirrored"] < 1 and time.monotonic() < deadline:
            assert not worker.outstanding
            ck.maybe_save(2)  # nothing due: takes in the mirror's report
            time.sleep(0.05)
        assert ck.monitor.stats["mirrored"] == 1
