"""A state entry left out on relaunch, and put back later (issue 44 item 4): the first
restore warns that the entry keeps its fresh values and how to restore it; the relaunch
that puts it back is refused with both ways out, ``restore(strict=False)`` and
``restore(step=N)`` of the newest checkpoint that still holds it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable.errors import StateMismatchError


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1)}


def train(state: dict[str, Any]) -> None:
    model = state.get("model")
    assert isinstance(model, nn.Module)
    model(torch.randn(2, 4)).sum().backward()
    if "optim" in state:
        state["optim"].step()
        state["optim"].zero_grad()


def first_run(root: Path) -> None:
    state = make_state()
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        ck.restore()
        for step in (5, 10):
            train(state)
            ck.save(step)


def test_an_entry_left_out_on_relaunch_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    first_run(root)
    state = make_state()
    del state["optim"]  # forgotten
    caplog.set_level(logging.WARNING, logger="resumable")
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        assert ck.restore() == 10
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    line = next((m for m in warned if "['optim']" in m), "")
    assert "fresh values" in line and "Put them back in state=" in line
    assert "restore(strict=False)" in line


def test_a_partial_restore_on_purpose_only_lists_the_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    first_run(root)
    state = make_state()
    del state["optim"]
    caplog.set_level(logging.WARNING, logger="resumable")
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        assert ck.restore(strict=False) == 10
    assert "checkpoint entries ['optim'] have no key in the state" in caplog.text
    assert "fresh values" not in caplog.text


def test_putting_the_entry_back_names_both_ways_out(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    first_run(root)  # steps 5 and 10 hold the optimizer
    state = make_state()
    del state["optim"]
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        start = ck.restore()
        for step in (start + 1, start + 2):  # 11, 12 without the optimizer
            train(state)
            ck.save(step)
    state = make_state()
    with resumable.Checkpointer(root, state, persist="sync", keep=None) as ck:
        with pytest.raises(StateMismatchError) as err:
            ck.restore()
        text = str(err.value)
        assert "restore(strict=False)" in text
        assert "restore(step=10)" in text, text
        assert ck.restore(step=10) == 10  # the way back works
