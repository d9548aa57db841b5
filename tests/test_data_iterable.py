"""`ResumableDataLoader` over an ``IterableDataset``: from the dataset's own state, or by
replay when the user opts in; refusals otherwise."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from resumable.data import ResumableDataLoader
from resumable.errors import StateMismatchError, UnsupportedStateError

Log = list[tuple[int, list[int]]]


class ShuffledStream(IterableDataset[int]):
    """A stream of ``range(n)`` in an order drawn from (seed, epoch), sharded over workers,
    that tracks its own position like Hugging Face's and torchdata's iterables: ``state_dict``
    is where the stream stands, ``load_state_dict`` makes the *next* pass start there.
    Everything it produces is recorded in ``produced`` (main process only)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self.offset = 0
        self.resume_at: int | None = None
        self.produced: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100 + self.epoch)
        order: list[int] = torch.randperm(self.n, generator=g).tolist()
        info = get_worker_info()
        return order if info is None else order[info.id :: info.num_workers]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        self.offset = self.resume_at or 0
        self.resume_at = None
        while self.offset < len(order):
            item = order[self.offset]
            self.offset += 1
            self.produced.append(item)
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_at = state["offset"]


class PlainStream(ShuffledStream):
    """The same stream with no way to save its position."""

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def drive(loader: ResumableDataLoader, epochs: int, log: Log, stop: int | None = None) -> Any:
    done = 0
    while loader.epoch < epochs:
        epoch = loader.epoch
        for batch in loader:
            log.append((epoch, batch.tolist()))
            done += 1
            if done == stop:
                return json.loads(json.dumps(loader.state_dict()))
    return None


def every_boundary(
    make: Callable[[], ResumableDataLoader], epochs: int = 3, only: list[int] | None = None
) -> None:
    """Interrupt after every batch (or after each count in ``only``); each run must equal
    the uninterrupted one."""
    reference: Log = []
    drive(make(), epochs, reference)
    assert reference
    for k in only or range(1, len(reference) + 1):
        log: Log = []
        state = drive(make(), epochs, log, stop=k)
        resumed = make()
        resumed.load_state_dict(state)
        drive(resumed, epochs, log)
        assert log == reference, f"interrupted after batch {k}"


@pytest.mark.parametrize(("n", "batch_size"), [(10, 3), (12, 4), (5, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_stateful_stream_resumes_at_every_boundary(
    n: int, batch_size: int, drop_last: bool
) -> None:
    every_boundary(
        lambda: ResumableDataLoader(ShuffledStream(n, 3), batch_size, drop_last=drop_last)
    )


def test_a_stateful_stream_replays_nothing() -> None:
    first = ResumableDataLoader(ShuffledStream(11, 1), 2)
    log: Log = []
    state = drive(first, 2, log, stop=3)
    assert state["dataset_state"] == {"epoch": 0, "offset": 6}
    stream = ShuffledStream(11, 1)
    resumed = ResumableDataLoader(stream, 2)
    resumed.load_state_dict(state)
    drive(resumed, 1, log)
    consumed = [i for _, b in log[:3] for i in b]
    assert stream.produced == [i for _, b in log[3:] for i in b]
    assert not set(consumed) & set(stream.produced)
    assert sorted(consumed + stream.produced) == list(range(11))


def test_replay_with_workers_resumes_at_every_boundary_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(PlainStream(9, 2), 2, num_workers=2, replay_iterable=True)

    every_boundary(make, epochs=2, only=[1, 4, 6])  # mid-epoch 0, its last batch, epoch 1
    loader = make()
    state = drive(loader, 2, [], stop=3)
    resumed = make()
    resumed.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="resumable"):
        next(iter(resumed))
    assert "re-read and discarded 3 batch(es) (6 sample(s)" in caplog.text


class LoggedStream(ShuffledStream):
    """`ShuffledStream` that appends every item it produces, in whichever process, to a
    file of ``log_dir`` named after that process."""

    def __init__(self, n: int, seed: int, log_dir: Path) -> None:
        super().__init__(n, seed)
        self.log_dir = log_dir

    def __iter__(self) -> Iterator[int]:
        with (self.log_dir / f"{os.getpid()}.log").open("a") as out:
            for item in super().__iter__():
                out.write(f"{item}\n")
                out.flush()
                yield item


def produced(log_dir: Path) -> list[int]:
    return [int(x) for f in log_dir.glob("*.log") for x in f.read_text().split()]


@pytest.mark.parametrize(
    ("n", "batch_size", "workers"), [(10, 3, 2), (11, 2, 2), (13, 3, 3), (9, 2, 2), (8, 3, 2)]
)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_stateful_stream_read_by_workers_resumes_at_every_boundary(
    n: int, batch_size: int, workers: int, drop_last: bool
) -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            ShuffledStream(n, 3), batch_size, num_workers=workers, drop_last=drop_last
        )

    reference: Log = []
    drive(make(), 2, reference)
    # The batches, and their order, are a plain DataLoader's over the same stream.
    plain = DataLoader(ShuffledStream(n, 3), batch_size, num_workers=workers, drop_last=drop_last)
    assert [b for e, b in reference if e == 0] == [b.tolist() for b in plain]
    every_boundary(make, epochs=2)


def test_workers_read_no_consumed_sample_after_resume(tmp_path: Path) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    log: Log = []
    state = drive(ResumableDataLoader(LoggedStream(23, 5, before), 3, num_workers=2), 1, log, 4)
    assert state["num_workers"] == 2
    assert [w["offset"] for w in state["dataset_state"]["states"]] == [6, 6]
    resumed = ResumableDataLoader(LoggedStream(23, 5, after), 3, num_workers=2)
    resumed.load_state_dict(state)
    drive(resumed, 1, log)
    consumed = [i for _, b in log[:4] for i in b]
    rest = [i for _, b in log[4:] for i in b]
    assert sorted(consumed + rest) == list(range(23))
    assert sorted(produced(after)) == sorted(rest)  # nothing read twice, nothing missed


@pytest.mark.parametrize("workers", [0, 2])
def test_breaking_out_and_iterating_again_continues(workers: int) -> None:
    loader = ResumableDataLoader(ShuffledStream(10, 3), 3, num_workers=workers)
    first = next(iter(loader)).tolist()
    rest = [b.tolist() for b in loader]
    uninterrupted = ResumableDataLoader(ShuffledStream(10, 3), 3, num_workers=workers)
    assert [first, *rest] == [b.tolist() for b in uninterrupted]
    assert loader.epoch == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_between_epochs_starts_the_next_epoch(workers: int) -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(ShuffledStream(7, 2), 2, num_workers=workers)

    reference: Log = []
    drive(make(), 3, reference)
    first = make()
    log: Log = []
    drive(first, 1, log)  # epoch 0 to its end: the loader has moved to epoch 1
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["position"], state["dataset_state"]) == (1, 0, None)
    resumed = make()
    resumed.load_state_dict(state)
    drive(resumed, 3, log)
    assert log == reference


def test_refusals_say_what_to_do() -> None:
    with pytest.raises(UnsupportedStateError, match="replay_iterable=True") as info:
        ResumableDataLoader(PlainStream(4), 2)
    assert "state_dict()/load_state_dict()" in str(info.value)
    with pytest.raises(UnsupportedStateError, match="persistent_workers=False"):
        ResumableDataLoader(ShuffledStream(4), 2, num_workers=2, persistent_workers=True)
    with pytest.raises(ValueError, match="shuffle=True"):
        ResumableDataLoader(ShuffledStream(4), 2, shuffle=True)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_another_number_of_workers_is_refused() -> None:
    state = drive(ResumableDataLoader(ShuffledStream(12), 2, num_workers=2), 1, [], stop=3)
    for workers in (0, 3):
        other = ResumableDataLoader(ShuffledStream(12), 2, num_workers=workers)
        with pytest.raises(StateMismatchError, match="num_workers=2"):
            other.load_state_dict(state)
        assert other.state_dict()["position"] == 0
    replayed = drive(
        ResumableDataLoader(PlainStream(12), 2, num_workers=2, replay_iterable=True), 1, [], 3
    )
    with pytest.raises(StateMismatchError, match="num_workers=2"):
        ResumableDataLoader(PlainStream(12), 2, replay_iterable=True).load_state_dict(replayed)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: None,
        lambda d: {**d, "num_workers": 0},
        lambda d: {**d, "next": 2},
        lambda d: {**d, "ended": [False]},
        lambda d: {**d, "ended": ["no", False]},
        lambda d: {**d, "states": {"0": None}},
        lambda d: {k: v for k, v in d.items() if k != "next"},
        lambda d: d["states"][0],  # a state saved without workers
    ],
)
def test_a_damaged_worker_state_is_refused(damage: Callable[[Any], Any]) -> None:
    state = drive(ResumableDataLoader(ShuffledStream(12), 2, num_workers=2), 1, [], stop=3)
    fresh = ResumableDataLoader(ShuffledStream(12), 2, num_workers=2)
    with pytest.raises(StateMismatchError, match=r"dataset_state|damaged"):
        fresh.load_state_dict({**state, "dataset_state": damage(state["dataset_state"])})
    assert fresh.state_dict()["position"] == 0


def test_version_2_states_load_and_warn_where_workers_were_not_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = drive(ResumableDataLoader(ShuffledStream(12, 4), 2), 1, [], stop=2)
    v2 = {k: v for k, v in own.items() if k != "num_workers"} | {"version": 2}
    resumed = ResumableDataLoader(ShuffledStream(12, 4), 2)
    resumed.load_state_dict(v2)
    assert resumed.position == 2
    with pytest.raises(StateMismatchError, match="num_workers=0"):
        ResumableDataLoader(ShuffledStream(12, 4), 2, num_workers=2).load_state_dict(v2)
    replayed = drive(ResumableDataLoader(PlainStream(12), 2, replay_iterable=True), 1, [], 2)
    v2 = {k: v for k, v in replayed.items() if k != "num_workers"} | {"version": 2}
    with caplog.at_level(logging.WARNING, logger="resumable"):
        ResumableDataLoader(
            PlainStream(12), 2, num_workers=2, replay_iterable=True
        ).load_state_dict(v2)
    assert "num_workers=2 was not checked" in caplog.text


def test_a_damaged_or_foreign_state_is_refused() -> None:
    loader = ResumableDataLoader(ShuffledStream(10), 2)
    state = drive(loader, 1, [], stop=2)
    fresh = ResumableDataLoader(ShuffledStream(10), 2)
    with pytest.raises(StateMismatchError, match="dataset_state"):
        fresh.load_state_dict({**state, "dataset_state": None})
    with pytest.raises(StateMismatchError, match="batch_size=3"):
        fresh.load_state_dict({**state, "batch_size": 3})
    replaying = ResumableDataLoader(ShuffledStream(10), 2, replay_iterable=True)
    with pytest.raises(StateMismatchError, match="replay=False"):
        replaying.load_state_dict(state)
    assert fresh.state_dict()["position"] == 0
