"""`ResumableDataLoader` over an ``IterableDataset``: from the dataset's own state, or by
replay when the user opts in; refusals otherwise."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

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


def test_refusals_say_what_to_do() -> None:
    with pytest.raises(UnsupportedStateError, match="replay_iterable=True") as info:
        ResumableDataLoader(PlainStream(4), 2)
    assert "state_dict()/load_state_dict()" in str(info.value)
    with pytest.raises(UnsupportedStateError, match="num_workers=0") as info:
        ResumableDataLoader(ShuffledStream(4), 2, num_workers=2)
    assert "StatefulDataLoader" in str(info.value)
    with pytest.raises(ValueError, match="shuffle=True"):
        ResumableDataLoader(ShuffledStream(4), 2, shuffle=True)


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
