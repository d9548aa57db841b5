"""`ResumableDataLoader` with a user's sampler or batch sampler, and `ResumableSampler`'s
sharding against ``DistributedSampler`` (one process; several ranks are in
`test_data_distributed`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, Sampler, SequentialSampler

from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.errors import StateMismatchError, UnsupportedStateError

Log = list[tuple[int, list[int]]]


class IndexDataset(Dataset[int]):
    """Sample ``i`` is ``i``; every ``__getitem__`` is recorded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.calls.append(index)
        return index


class PassCountingSampler(Sampler[int]):
    """A stateful sampler: each pass draws a fresh permutation from a generator seeded by
    (seed, passes so far), and ``passes`` is its state. It has no ``set_epoch``."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.n, self.seed, self.passes = n, seed, 0

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.passes)
        self.passes += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.passes = state["passes"]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length (length = index % 5 + 1), whose order and sizes depend on
    ``set_epoch`` only: a bucketing batch sampler as sequence models use."""

    def __init__(self, n: int, tokens: int, seed: int = 0) -> None:
        super().__init__()
        self.n, self.tokens, self.seed, self.epoch = n, tokens, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + 7919 * self.epoch)
        order = sorted(torch.randperm(self.n, generator=g).tolist(), key=lambda i: i % 5)
        batches: list[list[int]] = [[]]
        for i in order:
            if batches[-1] and (len(batches[-1]) + 1) * (i % 5 + 1) > self.tokens:
                batches.append([])
            batches[-1].append(i)
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[p] for p in perm]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


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


def every_boundary(make: Callable[[], ResumableDataLoader], epochs: int = 3) -> Log:
    """Interrupt after every batch; assert each run equals the uninterrupted one."""
    reference: Log = []
    drive(make(), epochs, reference)
    for k in range(1, len(reference) + 1):
        log: Log = []
        state = drive(make(), epochs, log, stop=k)
        resumed = make()
        resumed.load_state_dict(state)
        drive(resumed, epochs, log)
        assert log == reference, f"interrupted after batch {k}"
    return reference


def test_stateful_sampler_resumes_at_every_boundary() -> None:
    reference = every_boundary(
        lambda: ResumableDataLoader(IndexDataset(10), 3, sampler=PassCountingSampler(10, 1))
    )
    epochs = [[i for e, b in reference if e == k for i in b] for k in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # the sampler's state moves between epochs
    assert all(sorted(e) == list(range(10)) for e in epochs)


def test_batch_sampler_around_a_stateful_sampler_saves_the_samplers_state() -> None:
    def make() -> ResumableDataLoader:
        batches = BatchSampler(PassCountingSampler(10, 2), 3, drop_last=False)
        return ResumableDataLoader(IndexDataset(10), batch_sampler=batches)

    reference = every_boundary(make)
    epochs = [[i for e, b in reference if e == k for i in b] for k in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    state = drive(make(), 3, [], stop=5)  # in epoch 1
    assert state["sampler_state"] == {"passes": 1}


@pytest.mark.parametrize("batched", [False, True])
def test_a_state_saved_between_epochs_keeps_the_samplers_state(batched: bool) -> None:
    def make() -> ResumableDataLoader:
        sampler = PassCountingSampler(10, 3)
        if batched:
            return ResumableDataLoader(
                IndexDataset(10), batch_sampler=BatchSampler(sampler, 4, drop_last=False)
            )
        return ResumableDataLoader(IndexDataset(10), 4, sampler=sampler)

    reference: Log = []
    drive(make(), 3, reference)
    first = make()
    log: Log = []
    drive(first, 2, log)  # two whole epochs: the loader stands between epochs 1 and 2
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["position"], state["sampler_state"]) == (2, 0, {"passes": 2})
    resumed = make()
    resumed.load_state_dict(state)
    drive(resumed, 3, log)
    assert log == reference


def test_a_state_without_the_samplers_state_is_refused() -> None:
    def make() -> ResumableDataLoader:
        batches = BatchSampler(PassCountingSampler(10, 2), 3, drop_last=False)
        return ResumableDataLoader(IndexDataset(10), batch_sampler=batches)

    state = drive(make(), 3, [], stop=5)
    fresh = make()
    with pytest.raises(StateMismatchError, match="holds no sampler state_dict"):
        fresh.load_state_dict({**state, "sampler_state": None})
    assert fresh.position == 0


def test_bucketing_batch_sampler_resumes_at_every_boundary() -> None:
    reference = every_boundary(
        lambda: ResumableDataLoader(IndexDataset(23), batch_sampler=BucketBatchSampler(23, 8))
    )
    assert len({len(b) for _, b in reference}) > 1  # batches of several sizes


@pytest.mark.parametrize(
    "sampler",
    [lambda: SequentialSampler(range(9)), lambda: [8, 1, 7, 2, 6, 3, 5, 4, 0]],
    ids=["sequential", "list"],
)
def test_deterministic_samplers_without_epochs_are_accepted(
    sampler: Callable[[], Any],
) -> None:
    every_boundary(lambda: ResumableDataLoader(IndexDataset(9), 2, sampler=sampler()))


def test_resume_in_a_users_sampler_loads_no_consumed_sample() -> None:
    def make(data: IndexDataset) -> ResumableDataLoader:
        return ResumableDataLoader(data, 2, sampler=DistributedSampler(data, 1, 0, seed=4))

    first = IndexDataset(12)
    state = drive(make(first), 1, [], stop=3)
    consumed = list(first.calls)
    assert state["position"] == 6
    again = IndexDataset(12)
    log: Log = []
    drive(make(again), 1, log)
    assert again.calls[:6] == consumed
    resumed_data = IndexDataset(12)
    resumed = make(resumed_data)
    resumed.load_state_dict(state)
    drive(resumed, 1, [])
    assert resumed_data.calls == again.calls[6:]


def test_a_users_sampler_state_refuses_another_rank_or_kind() -> None:
    data = IndexDataset(8)
    loader = ResumableDataLoader(data, 2, sampler=DistributedSampler(data, 2, 0))
    state = loader.state_dict()
    assert (state["rank"], state["world_size"], state["order"]) == (0, 2, "sampler")
    other = ResumableDataLoader(data, 2, sampler=DistributedSampler(data, 2, 1))
    with pytest.raises(StateMismatchError, match="rank=1"):
        other.load_state_dict(state)
    batches = ResumableDataLoader(data, batch_sampler=BucketBatchSampler(8, 4))
    with pytest.raises(StateMismatchError, match="order"):
        batches.load_state_dict(state)
    own = ResumableDataLoader(data, 2, shuffle=True)
    with pytest.raises(StateMismatchError, match="keys"):
        own.load_state_dict(state)


def test_shuffle_with_a_sampler_is_an_error_as_in_dataloader() -> None:
    with pytest.raises(ValueError, match="shuffle=True"):
        ResumableDataLoader(IndexDataset(4), 2, shuffle=True, sampler=[0, 1, 2, 3])


def test_refusals_name_the_argument_and_the_alternative() -> None:
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 4, 4)
    with pytest.raises(UnsupportedStateError) as info:
        ResumableDataLoader(IndexDataset(4), 2, sampler=weighted)
    assert "sampler=WeightedRandomSampler" in str(info.value)
    assert "set_epoch" in str(info.value) and "seed=" in str(info.value)
    nested = BatchSampler(torch.utils.data.RandomSampler(range(4)), 2, False)
    with pytest.raises(UnsupportedStateError, match=r"batch_sampler\.sampler=RandomSampler"):
        ResumableDataLoader(IndexDataset(4), batch_sampler=nested)


@pytest.mark.parametrize("n", [0, 1, 7, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("drop", [False, True])
def test_unshuffled_shards_equal_distributed_samplers(n: int, world: int, drop: bool) -> None:
    for rank in range(world):
        ours = ResumableSampler(
            n, shuffle=False, num_replicas=world, rank=rank, shard_end="drop" if drop else "pad"
        )
        theirs = DistributedSampler(range(n), world, rank, shuffle=False, drop_last=drop)  # type: ignore[arg-type]
        assert list(ours) == list(theirs)
        assert len(ResumableSampler(n, num_replicas=world, rank=rank)) == len(
            DistributedSampler(range(n), world, rank)  # type: ignore[arg-type]
        )


def test_sharded_loader_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="rank"):
        ResumableDataLoader(IndexDataset(4), 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        ResumableDataLoader(IndexDataset(4), 2, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="shard_end"):
        ResumableDataLoader(IndexDataset(4), 2, shard_end="wrap")  # type: ignore[arg-type]


def test_restore_at_another_world_size_in_one_process() -> None:
    """The state after 2 batches on each of 3 ranks restores on 2: the 12 samples left are
    read once (the deal is the same as under torchrun; see test_data_distributed)."""
    n = 24

    def make(world: int, rank: int) -> ResumableDataLoader:
        return ResumableDataLoader(IndexDataset(n), 2, True, seed=5, num_replicas=world, rank=rank)

    states, before = [], []
    for rank in range(3):
        loader = make(3, rank)
        log: Log = []
        states.append(drive(loader, 1, log, stop=2))
        before += [i for _, b in log for i in b]
    assert all(s == states[0] for s in states)
    after = []
    for rank in range(2):
        loader = make(2, rank)
        loader.load_state_dict(states[0])
        assert loader.batches == 3  # 12 consumed, counted in batches of 2 ranks
        log = []
        drive(loader, 1, log)
        after += [i for _, b in log for i in b]
    assert sorted(before + after) == list(range(n))


def test_sampler_state_v1_loads_and_v2_carries_the_shard_end() -> None:
    sampler = ResumableSampler(10, seed=3, num_replicas=2, rank=1, shard_end="drop")
    sampler.set_epoch(2)
    sampler.start_at(4)
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state == {
        "version": 2,
        "epoch": 2,
        "start": 4,
        "seed": 3,
        "shuffle": True,
        "num_samples": 10,
        "shard_end": "drop",
    }
    other = ResumableSampler(10, seed=3, num_replicas=3, rank=0, shard_end="drop")
    other.load_state_dict(state)  # another world size: the position is global
    assert (other.epoch, other.start, len(other)) == (2, 4, 2)
    with pytest.raises(StateMismatchError, match="shard_end='drop'"):
        ResumableSampler(10, seed=3).load_state_dict(state)
    v1 = {k: v for k, v in state.items() if k != "shard_end"} | {"version": 1}
    fresh = ResumableSampler(10, seed=3)
    fresh.load_state_dict(v1)
    assert (fresh.epoch, fresh.start) == (2, 4)
