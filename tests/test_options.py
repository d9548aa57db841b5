"""`resumable.options`: each part accepts good values and refuses bad ones with an
`OptionError` naming the option; the builder and ``options=`` give the same
`Checkpointer`; both at once are refused."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from resumable import Checkpointer, CheckpointError, CheckpointOptions, Every, Incremental, Keep
from resumable.errors import OptionError
from resumable.options import (
    DEFAULT_KEEP,
    CaptureOptions,
    DistributedOptions,
    MemoryOptions,
    MonitorOptions,
    PersistOptions,
    RetentionOptions,
    RootOptions,
    ScheduleOptions,
)
from resumable.preemption import Preemption


@pytest.fixture(autouse=True)
def _no_persist_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESUMABLE_PERSIST", raising=False)


GOOD: list[tuple[type[Any], dict[str, Any]]] = [
    (ScheduleOptions, {"persist_every": Every(seconds=5), "memory_every": Every(steps=1)}),
    (ScheduleOptions, {"on_busy": "wait"}),
    (RetentionOptions, {"keep": None, "mirror_keep": Keep(last=1)}),
    (RootOptions, {"storage_options": {"endpoint_url": "http://x"}, "mirror": "s3://b/p"}),
    (PersistOptions, {"mode": "sync", "incremental": False, "save_on_close": False}),
    (PersistOptions, {"mode": "thread", "incremental": Incremental()}),
    (MemoryOptions, {"shm_dir": "/dev/shm", "overlap": True, "replicas": 2}),
    (CaptureOptions, {"capture_rng": False, "map_location": "cpu"}),
    (MonitorOptions, {"alert": print, "max_commit_age_s": 60}),
    (DistributedOptions, {"timeout_s": 30.0}),
]


@pytest.mark.parametrize(("part", "kwargs"), GOOD)
def test_each_part_accepts_good_values(part: type[Any], kwargs: dict[str, Any]) -> None:
    built = part(**kwargs)
    assert built == part(**kwargs)  # a value: equal when built alike
    with pytest.raises(AttributeError):
        built.foo = 1  # frozen


BAD: list[tuple[type[Any], dict[str, Any], str]] = [
    (ScheduleOptions, {"persist_every": 100}, "persist_every must be an Every"),
    (ScheduleOptions, {"memory_every": "1"}, "memory_every must be an Every"),
    (ScheduleOptions, {"on_busy": "block"}, "on_busy must be 'skip' or 'wait', got 'block'"),
    (RetentionOptions, {"keep": 3}, "keep must be a resumable.Keep or None, got 3"),
    (RetentionOptions, {"mirror_keep": "all"}, "mirror_keep must be a resumable.Keep"),
    (RootOptions, {"storage_options": [("a", 1)]}, "storage_options must be a mapping"),
    (RootOptions, {"mirror": 42}, "mirror must be a URL"),
    (PersistOptions, {"mode": "fork"}, "persist must be one of"),
    (PersistOptions, {"incremental": "yes"}, "incremental must be an Incremental"),
    (PersistOptions, {"save_on_close": 1}, "save_on_close must be True or False"),
    (MemoryOptions, {"shm_dir": 3}, "shm_dir must be a path"),
    (MemoryOptions, {"overlap": "yes"}, 'overlap must be True, False or "auto"'),
    (MemoryOptions, {"replicas": 0}, "replicas must be an integer >= 1"),
    (MemoryOptions, {"replicas": True}, "replicas must be an integer >= 1"),
    (CaptureOptions, {"capture_rng": None}, "capture_rng must be True or False"),
    (MonitorOptions, {"alert": "log"}, "alert must be a callable"),
    (MonitorOptions, {"max_commit_age_s": 0}, "max_commit_age_s must be a number"),
    (MonitorOptions, {"max_commit_age_s": "1h"}, "max_commit_age_s must be a number"),
    (DistributedOptions, {"timeout_s": -1}, "dist_timeout_s must be a number"),
]


@pytest.mark.parametrize(("part", "kwargs", "match"), BAD)
def test_each_part_refuses_bad_values_naming_the_option(
    part: type[Any], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(OptionError, match=match) as caught:
        part(**kwargs)
    assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, ValueError)
    assert "got " in str(caught.value)  # what was found, besides what was expected


def test_the_persist_override_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_PERSIST", "sync")
    assert PersistOptions().mode == "sync"
    assert PersistOptions(mode="thread").mode == "thread"  # only "auto" is overridden
    monkeypatch.setenv("RESUMABLE_PERSIST", "fork")
    with pytest.raises(OptionError, match="RESUMABLE_PERSIST must be one of"):
        PersistOptions()


def test_incremental_is_normalised() -> None:
    assert PersistOptions(incremental=True).writer == Incremental()
    assert PersistOptions(incremental=False).writer is None


@pytest.mark.parametrize("kwargs", [{"replicas": 2}, {"overlap": True}, {"overlap": "auto"}])
def test_what_needs_the_memory_tier_is_refused_without_it(kwargs: dict[str, Any]) -> None:
    with pytest.raises(OptionError, match="needs the memory tier"):
        CheckpointOptions.from_kwargs(persist="sync", **kwargs)
    assert CheckpointOptions.from_kwargs(persist="sync", memory_every=Every(steps=1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "tier"),
    [
        ({}, True),
        ({"persist": "thread"}, True),
        ({"persist": "sync"}, False),
        ({"persist": "sync", "memory_every": Every(steps=5)}, True),
    ],
)
def test_the_memory_tier_rule(kwargs: dict[str, Any], tier: bool) -> None:
    assert CheckpointOptions.from_kwargs(**kwargs).memory_tier is tier


def test_from_kwargs_fills_the_parts_with_checkpointers_defaults() -> None:
    built = CheckpointOptions.from_kwargs()
    assert built == CheckpointOptions()
    assert built.retention.keep == DEFAULT_KEEP
    assert built.schedule.persist_every == Every(steps=100)
    assert built.preemption is None
    with pytest.raises(OptionError, match=r"preemption must be a resumable\.Preemption"):
        CheckpointOptions.from_kwargs(preemption="default")  # type: ignore[arg-type]


def test_the_builder_takes_exactly_the_checkpointer_keywords() -> None:
    ours = dict(inspect.signature(CheckpointOptions.from_kwargs).parameters)
    theirs = dict(inspect.signature(Checkpointer.__init__).parameters)
    for name in ("self", "url", "state", "options"):
        theirs.pop(name)
    assert {n: p.default for n, p in ours.items()} == {n: p.default for n, p in theirs.items()}


def test_storage_options_apply_to_object_storage_roots_only() -> None:
    root = RootOptions(storage_options={"endpoint_url": "http://x"})
    assert root.for_url("s3://bucket/run") == {"endpoint_url": "http://x"}
    assert root.for_url("/tmp/run") is None
    assert RootOptions().for_url("s3://bucket/run") is None


KWARGS: dict[str, Any] = {
    "persist": "sync",
    "memory_every": Every(steps=2),
    "persist_every": Every(steps=4),
    "keep": Keep(last=2),
    "on_busy": "wait",
    "capture_rng": False,
    "incremental": False,
    "preemption": Preemption(signals=("SIGUSR1",), exit=False),
}


def test_options_and_keywords_build_the_same_checkpointer(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    with Checkpointer(tmp_path / "a", state, **KWARGS) as by_keywords:
        pass
    options = CheckpointOptions.from_kwargs(**KWARGS)
    with Checkpointer(tmp_path / "b", state, options=options) as by_options:
        assert by_options.options == by_keywords.options == options
        assert by_options.persist_mode == by_keywords.persist_mode == "sync"
        assert by_options.memory_every == Every(steps=2)
        assert by_options.persist_every == Every(steps=4)
        for step in range(1, 5):
            by_options.maybe_save(step)
        by_options.wait()
        assert by_options.steps() == [4]


def test_options_with_keywords_at_once_are_refused(tmp_path: Path) -> None:
    options = CheckpointOptions.from_kwargs(persist="sync")
    with pytest.raises(OptionError, match=r"options= was given together with keep=, on_busy="):
        Checkpointer(
            tmp_path / "ck",
            {"w": torch.zeros(1)},
            options=options,
            keep=Keep(last=1),
            on_busy="wait",
        )
    assert not (tmp_path / "ck").exists()  # refused before anything was opened


def test_options_must_be_checkpoint_options(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match=r"options must be a resumable\.CheckpointOptions"):
        Checkpointer(tmp_path / "ck", {"w": torch.zeros(1)}, options={"persist": "sync"})  # type: ignore[arg-type]


def test_a_bad_keyword_of_the_checkpointer_is_an_option_error(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="on_busy must be 'skip' or 'wait'"):
        Checkpointer(tmp_path / "ck", {"w": torch.zeros(1)}, on_busy="later")
    assert not (tmp_path / "ck").exists()
