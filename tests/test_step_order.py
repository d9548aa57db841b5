"""Steps only go forward (issue 44 item 2): a step older than the newest one restored
or saved is refused with `StepOrderError`, never dropped in silence; the same step again
stays allowed (a save after the snapshot of its step, a framework's final save). The
schedule is tested alone, then through the `Checkpointer`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable.coordination import Agreement
from resumable.errors import CheckpointError, StepOrderError
from resumable.group import Group
from resumable.pipeline.schedule import Schedule


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def train(state: dict[str, Any]) -> None:
    state["model"](torch.randn(2, 4)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


def schedule() -> Schedule:
    return Schedule(None, resumable.Every(steps=100), Agreement(Group(0, 1), None))


# ------------------------------------------------------------------ the schedule alone


def test_the_schedule_refuses_a_step_older_than_the_restored_one() -> None:
    s = schedule()
    s.check_order(0, "maybe_save")  # nothing restored or saved yet: anything goes
    s.restored(100)
    s.check_order(100, "maybe_save")
    s.check_order(101, "maybe_save")
    with pytest.raises(
        StepOrderError, match=r"maybe_save\(1\) after restore\(\) returned step 100"
    ):
        s.check_order(1, "maybe_save")


def test_the_schedule_refuses_a_step_older_than_the_newest_saved() -> None:
    s = schedule()
    s.persisted(10)
    s.snapshotted(12)
    s.check_order(12, "save")
    with pytest.raises(StepOrderError, match=r"save\(5\) after step 12 was saved already"):
        s.check_order(5, "save")
    s.restored(3)  # restore(step=3): going back on purpose
    s.check_order(4, "save")


# ------------------------------------------------------------------ through the Checkpointer


def test_a_loop_that_ignores_the_restored_step_is_refused_at_its_first_save(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    state = make_state()
    with resumable.Checkpointer(root, state, persist="sync") as ck:
        ck.restore()
        for step in range(1, 101):
            train(state)
            ck.maybe_save(step)
    state = make_state()
    ck = resumable.Checkpointer(root, state, persist="sync")
    assert ck.restore() == 100
    with pytest.raises(StepOrderError) as err:
        for step in range(1, 21):  # restore()'s return value ignored
            train(state)
            ck.maybe_save(step)
    assert isinstance(err.value, ValueError) and isinstance(err.value, CheckpointError)
    text = str(err.value)
    assert "maybe_save(1)" in text and "step 100" in text and "range(start" in text
    ck.close()
    assert ck.steps() == [100]


def test_save_of_an_older_step_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = make_state()
    with resumable.Checkpointer(root, state, persist="sync") as ck:
        ck.save(10)
        train(state)
        with pytest.raises(StepOrderError, match=r"save\(5\) after step 10 was saved"):
            ck.save(5)
        assert ck.steps() == [10]


def test_the_same_step_again_is_allowed(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = make_state()
    with resumable.Checkpointer(
        root, state, persist="thread", memory_every=resumable.Every(steps=1)
    ) as ck:
        ck.restore()
        ck.maybe_save(1)
        ck.snapshot(1)  # what the framework integrations do before a final save
        assert ck.save(1)
        ck.wait()
        assert not ck.maybe_save(1)  # nothing new: a no-op
        ck.save(1)
        ck.wait()
    with resumable.Checkpointer(root, make_state(), persist="sync") as ck:
        assert ck.steps() == [1]


def test_restore_of_an_older_step_on_purpose_lets_steps_go_on_from_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    state = make_state()
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        ck.save(5)
        ck.save(10)
    state = make_state()
    ck = resumable.Checkpointer(root, state, persist="sync", keep=None)
    assert ck.restore(step=5) == 5
    train(state)
    ck.maybe_save(6)  # allowed: the state is step 5's now
    with caplog.at_level(logging.WARNING, logger="resumable"):
        ck.close()
    # The next launch would restore step 10: close() says it did not checkpoint step 6.
    assert "closing" in caplog.text and "step 6: not checkpointed" in caplog.text
    assert "newer checkpoint (step 10)" in caplog.text
