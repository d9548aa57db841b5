"""`ResumableDataLoader(on_batch_size_change=...)`: resuming a state saved at another batch
size, refused by default, continued at the same sample position, or restarted at the start
of the saved epoch; directly and through a `Checkpointer`. A user's batch sampler is checked
against its own batch size, and never continued at another."""

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, IterableDataset, Sampler

from resumable import Checkpointer
from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.errors import StateMismatchError

N = 23  # not a multiple of 4 nor of 6: the last batch of an epoch is short at both sizes
SEED = 5
SAVED, NEW = 4, 6


class IndexDataset(Dataset[int]):
    """Sample ``i`` is ``i``; every ``__getitem__`` in the main process is recorded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.calls.append(index)
        return index


class Stream(IterableDataset[int]):
    """``range(n)`` in an order drawn from (seed, epoch), with its own position as state."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.offset = n, 0, 0
        self.resume_at: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order: list[int] = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.epoch)
        ).tolist()
        self.offset, self.resume_at = self.resume_at or 0, None
        while self.offset < self.n:
            self.offset += 1
            yield order[self.offset - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_at = state["offset"]


def loader(batch_size: int, **kwargs: Any) -> ResumableDataLoader:
    kwargs.setdefault("shuffle", True)
    return ResumableDataLoader(IndexDataset(N), batch_size, seed=SEED, **kwargs)


def batches(loader: ResumableDataLoader) -> list[list[int]]:
    """The rest of the loader's current epoch, batch by batch."""
    return [batch.tolist() for batch in loader]


def saved_after(taken: int, **kwargs: Any) -> dict[str, Any]:
    """The JSON-roundtripped state of a batch-size-4 loader after ``taken`` batches of
    epoch 0."""
    source = loader(SAVED, **kwargs)
    it = iter(source)
    for _ in range(taken):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(source.state_dict()))
    return state


def order(epoch: int) -> list[int]:
    """The epoch's sample order, which an uninterrupted run reads at any batch size."""
    sampler = loader(SAVED).sampler
    assert isinstance(sampler, ResumableSampler)
    ordered: list[int] = sampler.permutation(epoch).tolist()
    return ordered


def test_default_refuses_and_names_the_options() -> None:
    state = saved_after(3)
    resumed = loader(NEW)
    before = resumed.state_dict()
    with pytest.raises(StateMismatchError) as refused:
        resumed.load_state_dict(state)
    message = str(refused.value)
    for needle in (
        "batch_size=4",
        "batch_size=6",
        "on_batch_size_change='continue'",
        "on_batch_size_change='restart_epoch'",
    ):
        assert needle in message
    assert resumed.state_dict() == before


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("taken", [1, 3, 5, 6])  # 6: the whole epoch, before exhaustion
def test_continue_reads_the_rest_of_the_epoch_in_new_batches(taken: int, num_workers: int) -> None:
    resumed = loader(NEW, on_batch_size_change="continue", num_workers=num_workers)
    resumed.load_state_dict(saved_after(taken))
    position = min(taken * SAVED, N)
    assert (resumed.epoch, resumed.position) == (0, position)
    rest = batches(resumed)
    assert all(len(b) == NEW for b in rest[:-1])
    flat = [i for b in rest for i in b]
    seen = order(0)[:position]
    assert flat == order(0)[position:]
    assert sorted(seen + flat) == list(range(N))
    assert resumed.epoch == 1
    uninterrupted = loader(NEW, num_workers=num_workers)
    batches(uninterrupted)
    assert batches(resumed) == batches(uninterrupted)
    assert [i for b in batches(resumed) for i in b] == order(2)


def test_continue_saves_the_new_batch_size_and_resumes_again() -> None:
    resumed = loader(NEW, on_batch_size_change="continue")
    resumed.load_state_dict(saved_after(3))
    next(iter(resumed))
    state = resumed.state_dict()
    assert (state["batch_size"], state["position"]) == (NEW, 3 * SAVED + NEW)
    again = loader(NEW)  # the state is at batch size 6 now: the default accepts it
    again.load_state_dict(state)
    assert [i for b in batches(again) for i in b] == order(0)[3 * SAVED + NEW :]


def test_continue_loads_no_consumed_sample() -> None:
    resumed = loader(NEW, on_batch_size_change="continue")
    resumed.load_state_dict(saved_after(3))
    batches(resumed)
    assert resumed.dataset.calls == order(0)[3 * SAVED :]  # type: ignore[attr-defined]


def test_continue_over_a_change_of_world_size_too() -> None:
    """Saved by 2 ranks at batch size 4, continued by 3 ranks at batch size 6: each sample
    not consumed is read once (pad repeats the epoch's first, consumed, samples)."""
    source = [loader(SAVED, num_replicas=2, rank=r) for r in range(2)]
    for ranked in source:
        it = iter(ranked)
        next(it)
        next(it)
    states = [ranked.state_dict() for ranked in source]
    assert states[0] == states[1] and states[0]["position"] == 2 * 2 * SAVED
    read: list[int] = []
    for rank in range(3):
        resumed = loader(NEW, num_replicas=3, rank=rank, on_batch_size_change="continue")
        resumed.load_state_dict(states[0])
        read += [i for b in batches(resumed) for i in b]
    rest = order(0)[2 * 2 * SAVED :]
    padding = order(0)[: -len(rest) % 3]
    assert sorted(read) == sorted(rest + padding)


def test_continue_from_a_version_1_state() -> None:
    """A state written before sharding counts batches of its own size: continued from
    ``batches * saved batch size`` samples."""
    state = {k: v for k, v in saved_after(0).items() if k not in ("position", "shard_end")}
    resumed = loader(NEW, on_batch_size_change="continue")
    resumed.load_state_dict({**state, "version": 1, "epoch": 1, "batches": 2})
    assert (resumed.epoch, resumed.position) == (1, 2 * SAVED)
    assert [i for b in batches(resumed) for i in b] == order(1)[2 * SAVED :]


def test_restart_epoch_starts_the_saved_epoch_over_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resumed = loader(NEW, on_batch_size_change="restart_epoch")
    with caplog.at_level(logging.WARNING, logger="resumable.data"):
        resumed.load_state_dict(saved_after(3))
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    for needle in ("batch_size=4", "batch_size=6", "restart_epoch", "epoch 0", "position 12"):
        assert needle in warning.getMessage()
    assert (resumed.epoch, resumed.position) == (0, 0)
    uninterrupted = loader(NEW)
    assert batches(resumed) == batches(uninterrupted)
    assert batches(resumed) == batches(uninterrupted)


def test_same_batch_size_ignores_the_option(caplog: pytest.LogCaptureFixture) -> None:
    resumed = loader(SAVED, on_batch_size_change="restart_epoch")
    with caplog.at_level(logging.WARNING, logger="resumable.data"):
        resumed.load_state_dict(saved_after(3))
    assert resumed.position == 3 * SAVED and not caplog.records


def test_unknown_option_is_refused() -> None:
    with pytest.raises(ValueError, match="on_batch_size_change must be one of"):
        loader(NEW, on_batch_size_change="restart")


@pytest.mark.parametrize("policy", ["error", "continue", "restart_epoch"])
def test_checkpointer_restore_applies_the_loaders_option(tmp_path: Path, policy: str) -> None:
    source = loader(SAVED)
    it = iter(source)
    for _ in range(3):
        next(it)
    with Checkpointer(tmp_path / "ck", {"data": source}, persist="sync") as ck:
        ck.save(3)
    resumed = loader(NEW, on_batch_size_change=policy)
    with Checkpointer(tmp_path / "ck", {"data": resumed}, persist="sync") as ck:
        if policy == "error":
            with pytest.raises(StateMismatchError, match="on_batch_size_change='continue'"):
                ck.restore()
            return
        assert ck.restore() == 3
    expected = order(0)[3 * SAVED :] if policy == "continue" else order(0)
    assert [i for b in batches(resumed) for i in b] == expected


def test_a_users_sampler_continues_by_index() -> None:
    """A user's ``sampler=`` position counts its indices, so it continues exactly too."""

    def make(batch_size: int, **kwargs: Any) -> ResumableDataLoader:
        sampler: DistributedSampler[int] = DistributedSampler(
            IndexDataset(N), num_replicas=1, rank=0, shuffle=True, seed=3
        )
        return ResumableDataLoader(IndexDataset(N), batch_size, sampler=sampler, **kwargs)

    whole = [i for b in batches(make(SAVED)) for i in b]
    source = make(SAVED)
    it = iter(source)
    next(it)
    next(it)
    resumed = make(NEW)
    with pytest.raises(StateMismatchError, match="on_batch_size_change='continue'"):
        resumed.load_state_dict(source.state_dict())
    resumed = make(NEW, on_batch_size_change="continue")
    resumed.load_state_dict(source.state_dict())
    rest = batches(resumed)
    assert [len(b) for b in rest] == [6, 6, 3]
    assert [i for b in rest for i in b] == whole[2 * SAVED :]


def test_continue_is_refused_for_an_iterable_dataset(caplog: pytest.LogCaptureFixture) -> None:
    """An iterable dataset's position counts batches: ``"continue"`` refuses, naming
    ``"restart_epoch"``, which starts the saved epoch over."""
    source = ResumableDataLoader(Stream(N), SAVED)
    it = iter(source)
    next(it)
    next(it)
    state = source.state_dict()
    with pytest.raises(StateMismatchError) as refused:
        ResumableDataLoader(Stream(N), NEW).load_state_dict(state)
    assert "restart_epoch" in str(refused.value) and "'continue'" not in str(refused.value)
    resumed = ResumableDataLoader(Stream(N), NEW, on_batch_size_change="continue")
    with pytest.raises(StateMismatchError, match="counts this rank's batches of 4") as refused:
        resumed.load_state_dict(state)
    assert "on_batch_size_change='restart_epoch'" in str(refused.value)
    assert resumed.position == 0
    resumed = ResumableDataLoader(Stream(N), NEW, on_batch_size_change="restart_epoch")
    with caplog.at_level(logging.WARNING, logger="resumable.data"):
        resumed.load_state_dict(state)
    assert "batch_size=4" in caplog.text and "batch_size=6" in caplog.text
    flat = [i for b in batches(resumed) for i in b]
    assert flat == torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()


def batched(size: int, drop_last: bool = False, **kwargs: Any) -> ResumableDataLoader:
    """A loader over a user's ``BatchSampler`` of ``size`` around a seeded, shuffling
    ``DistributedSampler`` on one process."""
    data = IndexDataset(N)
    sampler: DistributedSampler[int] = DistributedSampler(data, 1, 0, shuffle=True, seed=3)
    return ResumableDataLoader(data, batch_sampler=BatchSampler(sampler, size, drop_last), **kwargs)


def batched_state(taken: int = 3, **kwargs: Any) -> dict[str, Any]:
    """The JSON-roundtripped state of a batch sampler of 4 after ``taken`` batches."""
    source = batched(SAVED, **kwargs)
    it = iter(source)
    for _ in range(taken):
        next(it)
    state: dict[str, Any] = json.loads(json.dumps(source.state_dict()))
    return state


def test_a_batch_samplers_state_records_its_batch_size() -> None:
    state = batched_state(drop_last=True)
    assert state["version"] == 3 and state["position"] == 3
    assert state["batch_sampler"] == {"batch_size": SAVED, "drop_last": True}
    whole = [i for b in batches(batched(SAVED, drop_last=True)) for i in b]
    resumed = batched(SAVED, drop_last=True)
    resumed.load_state_dict(state)
    assert [i for b in batches(resumed) for i in b] == whole[3 * SAVED :]
    with pytest.raises(StateMismatchError, match=r"batch_sampler\.drop_last=False"):
        batched(SAVED).load_state_dict(state)


def test_a_batch_samplers_new_batch_size_is_refused_by_default() -> None:
    """Batches of 4 resumed as batches of 6 would skip samples 8-11 of the saved order."""
    resumed = batched(NEW)
    before = resumed.state_dict()
    with pytest.raises(StateMismatchError) as refused:
        resumed.load_state_dict(batched_state())
    message = str(refused.value)
    for needle in (
        "batch_sampler.batch_size=4",
        "batch_sampler.batch_size=6",
        "on_batch_size_change='restart_epoch'",
    ):
        assert needle in message
    assert "'continue'" not in message  # not offered: it is refused for a batch sampler
    assert resumed.state_dict() == before


def test_a_batch_sampler_restarts_the_epoch_at_its_new_size_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resumed = batched(NEW, on_batch_size_change="restart_epoch")
    with caplog.at_level(logging.WARNING, logger="resumable.data"):
        resumed.load_state_dict(batched_state())
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    for needle in ("batch_size=4", "batch_size=6", "restart_epoch", "epoch 0"):
        assert needle in warning.getMessage()
    assert (resumed.epoch, resumed.position) == (0, 0)
    assert batches(resumed) == batches(batched(NEW))
    assert resumed.state_dict()["batch_sampler"] == {"batch_size": NEW, "drop_last": False}


def test_a_batch_sampler_refuses_continue_and_names_restart_epoch() -> None:
    """Its position counts batches: 3 of 4 end at sample 12, not a count of batches of 6
    in general, so ``"continue"`` is refused rather than approximated."""
    resumed = batched(NEW, on_batch_size_change="continue")
    with pytest.raises(StateMismatchError) as refused:
        resumed.load_state_dict(batched_state())
    message = str(refused.value)
    for needle in ("cannot continue", "on_batch_size_change='restart_epoch'", "sampler="):
        assert needle in message
    assert (resumed.epoch, resumed.position) == (0, 0)


def test_a_version_2_batch_sampler_state_loads_unchecked_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Written before the batch size was recorded: it resumes as before (its batch size is
    not known), and says once that it could not be checked."""
    state = {k: v for k, v in batched_state().items() if k != "batch_sampler"}
    state["version"] = 2
    whole = [i for b in batches(batched(SAVED)) for i in b]
    resumed = batched(SAVED)
    with caplog.at_level(logging.WARNING, logger="resumable.data"):
        resumed.load_state_dict(state)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "version 2" in warning.getMessage() and "not checked" in warning.getMessage()
    assert [i for b in batches(resumed) for i in b] == whole[3 * SAVED :]
    assert resumed.state_dict()["version"] == 3


class Buckets(Sampler[list[int]]):
    """A batch sampler without a ``batch_size``: batches of 1, 2, 3, ... samples, the same
    every epoch."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self) -> Iterator[list[int]]:
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start, size = start + size, size + 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


def test_a_batch_sampler_without_a_batch_size_is_not_checked() -> None:
    source = ResumableDataLoader(IndexDataset(N), batch_sampler=Buckets(N))
    it = iter(source)
    next(it)
    next(it)
    state = source.state_dict()
    assert state["batch_sampler"] is None
    resumed = ResumableDataLoader(IndexDataset(N), batch_sampler=Buckets(N))
    resumed.load_state_dict(state)
    assert batches(resumed)[0] == [3, 4, 5]
    with pytest.raises(StateMismatchError, match=r"batch_sampler\.batch_size=None"):
        batched(SAVED).load_state_dict(state)  # a size now, none recorded: not the same


@pytest.mark.parametrize(
    "entry",
    [
        {"batch_size": 0, "drop_last": False},
        {"batch_size": 4},
        {"batch_size": 4, "drop_last": 1},
        4,
    ],
    ids=["zero", "no-drop-last", "int-drop-last", "not-a-mapping"],
)
def test_a_damaged_batch_sampler_entry_is_refused(entry: Any) -> None:
    resumed = batched(SAVED)
    with pytest.raises(StateMismatchError, match=r"state\['batch_sampler'\] must be"):
        resumed.load_state_dict({**batched_state(), "batch_sampler": entry})
    assert resumed.position == 0


def test_a_samplers_state_stays_at_version_2() -> None:
    data = IndexDataset(N)
    made = ResumableDataLoader(data, SAVED, sampler=DistributedSampler(data, 1, 0, seed=3))
    state = made.state_dict()
    assert state["version"] == 2 and "batch_sampler" not in state
    with pytest.raises(StateMismatchError, match="damaged"):
        made.load_state_dict({**state, "version": 3, "batch_sampler": None})


@pytest.mark.parametrize("policy", ["error", "continue", "restart_epoch"])
def test_checkpointer_restore_checks_a_batch_samplers_size(tmp_path: Path, policy: str) -> None:
    source = batched(SAVED)
    it = iter(source)
    for _ in range(3):
        next(it)
    with Checkpointer(tmp_path / "ck", {"data": source}, persist="sync") as ck:
        ck.save(3)
    resumed = batched(NEW, on_batch_size_change=policy)
    with Checkpointer(tmp_path / "ck", {"data": resumed}, persist="sync") as ck:
        if policy != "restart_epoch":
            with pytest.raises(StateMismatchError, match=r"batch_sampler\.batch_size=4"):
                ck.restore()
            return
        assert ck.restore() == 3
    assert batches(resumed) == batches(batched(NEW))
