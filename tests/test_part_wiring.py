"""The small parts the facade is wired from, alone: the persist mode and the roots
picked from the options (`resumable.pipeline.wiring`), the last step close checkpoints
(`resumable.pipeline.last_step`), and the warnings of the first save
(`resumable.pipeline.first_save`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from resumable import CheckpointOptions, Keep
from resumable.errors import OptionError
from resumable.pipeline.first_save import FirstSaveChecks
from resumable.pipeline.last_step import LastStep, check_step
from resumable.pipeline.wiring import open_roots, persist_mode
from resumable.storage import LocalStorage, MemoryStorage


@pytest.fixture(autouse=True)
def _no_persist_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESUMABLE_PERSIST", raising=False)


def test_auto_is_a_thread_for_in_process_stores_and_a_process_otherwise(tmp_path: Path) -> None:
    auto = CheckpointOptions.from_kwargs()
    local = LocalStorage(tmp_path / "ck")
    assert persist_mode(auto, local, None) == "process"
    assert persist_mode(auto, MemoryStorage("wiring-a"), None) == "thread"
    assert persist_mode(auto, local, MemoryStorage("wiring-b")) == "thread"
    assert persist_mode(CheckpointOptions.from_kwargs(persist="sync"), local, None) == "sync"


def test_the_mirror_must_be_another_root(tmp_path: Path) -> None:
    storage, mirror = open_roots(tmp_path / "a", CheckpointOptions.from_kwargs())
    assert mirror is None and storage.url.endswith("a")
    same = CheckpointOptions.from_kwargs(mirror=str(tmp_path / "a"))
    with pytest.raises(OptionError, match="mirror must be another root"):
        open_roots(tmp_path / "a", same)


def test_close_checkpoints_the_last_step_unless_an_optimizer_stepped_since(
    caplog: pytest.LogCaptureFixture,
) -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.SGD([weight], lr=0.1)
    seen = LastStep({"optim": optim})
    assert seen.final(None, None, "root") is None
    seen.saw(5, {"loss": 1.0})
    assert seen.final(None, None, "root") == (5, {"loss": 1.0})
    weight.grad = torch.ones(2)
    optim.step()
    with caplog.at_level(logging.WARNING):
        assert seen.final(None, None, "root") is None
    assert "an optimizer stepped after" in caplog.text
    assert seen.final(7, None, "root") == (7, None)  # an explicit step wins
    seen.forget()
    assert seen.final(None, None, "root") is None
    seen.close()


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3", None])
def test_steps_are_non_negative_ints(bad: object) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        check_step(bad)


def test_the_best_metric_warning_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    checks = FirstSaveChecks(MemoryStorage("wiring-c"), Keep(best=("val", "min", 1)), rank=0)
    with caplog.at_level(logging.WARNING):
        checks.metrics(1, {"loss": 1.0})
        checks.metrics(2, {"loss": 1.0})
    assert caplog.text.count("reported no such metric") == 1
    quiet = FirstSaveChecks(MemoryStorage("wiring-d"), Keep(last=2), rank=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quiet.metrics(1, None)
        quiet.before_save(1)  # an empty root: nothing to say
    assert caplog.text == ""
