"""Exact data-position resume: `ResumableSampler` and `ResumableDataLoader`."""

import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset, TensorDataset, get_worker_info

from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.errors import StateMismatchError, UnsupportedStateError

Event = tuple[str, int, tuple[Any, ...]]


class IndexDataset(Dataset[int]):
    """Sample ``i`` is the int ``i``; every ``__getitem__`` call is recorded (main process)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.calls.append(index)
        return index


class WorkerSeedDataset(Dataset[tuple[int, int]]):
    """Sample ``i`` is ``(i, base seed of the worker that loaded it)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = get_worker_info()
        base = -1 if info is None else (info.seed - info.id) & 0x7FFFFFFF
        return index, base


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


def _as_tuple(batch: Any) -> tuple[Any, ...]:
    if isinstance(batch, torch.Tensor):
        return tuple(batch.tolist())
    return tuple(tuple(t.tolist()) for t in batch)


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(state))
    return out


def drive(
    loader: ResumableDataLoader, epochs: int, log: list[Event], stop_after: int | None = None
) -> dict[str, Any] | None:
    """A training loop: consume batches until ``epochs`` epochs are done, logging each batch
    and each epoch end. Returns the JSON-roundtripped state after ``stop_after`` batches."""
    done = 0
    while loader.epoch < epochs:
        epoch = loader.epoch
        for batch in loader:
            log.append(("batch", epoch, _as_tuple(batch)))
            done += 1
            if done == stop_after:
                return _roundtrip(loader.state_dict())
        log.append(("end", epoch, ()))
    return None


def run(make: Callable[[], ResumableDataLoader], epochs: int, interrupts: list[int]) -> list[Event]:
    """Interrupt after each count in ``interrupts`` (batches since the previous resume),
    continuing every time from a fresh loader restored from the saved state."""
    log: list[Event] = []
    loader = make()
    for count in interrupts:
        state = drive(loader, epochs, log, stop_after=count)
        assert state is not None
        loader = make()
        loader.load_state_dict(state)
    assert drive(loader, epochs, log) is None
    return log


def n_batches(log: list[Event]) -> int:
    return sum(kind == "batch" for kind, _, _ in log)


def flat_indices(log: list[Event], epoch: int) -> list[int]:
    return [i for kind, e, batch in log if kind == "batch" and e == epoch for i in batch]


SHAPES = [(12, 4), (10, 4), (10, 3), (7, 7), (5, 8), (6, 1)]


@pytest.mark.parametrize(("n", "batch_size"), SHAPES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_batch_boundary_resumes_identically(
    n: int, batch_size: int, drop_last: bool, shuffle: bool
) -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            IndexDataset(n), batch_size, shuffle=shuffle, seed=7, drop_last=drop_last
        )

    epochs = 3
    reference = run(make, epochs, [])
    per_epoch = n // batch_size if drop_last else -(-n // batch_size)
    assert len(make()) == per_epoch
    assert n_batches(reference) == epochs * per_epoch
    for e in range(epochs):
        order = make().sampler.permutation(e).tolist()
        assert flat_indices(reference, e) == order[: per_epoch * batch_size]
    if shuffle and per_epoch > 0 and n > 1:
        assert flat_indices(reference, 0) != flat_indices(reference, 1)
    for k in range(1, n_batches(reference) + 1):
        assert run(make, epochs, [k]) == reference, f"interrupted after {k} batches"
    assert run(make, epochs, [1] * n_batches(reference)) == reference


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_with_worker_processes(drop_last: bool, shuffle: bool) -> None:
    n, batch_size, epochs = 10, 3, 2

    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            WorkerSeedDataset(n),
            batch_size,
            shuffle=shuffle,
            seed=3,
            drop_last=drop_last,
            num_workers=2,
        )

    reference = run(make, epochs, [])
    per_epoch = len(make())
    bases = {
        e: {s for kind, ep, b in reference if kind == "batch" and ep == e for s in b[1]}
        for e in (0, 1)
    }
    assert all(len(s) == 1 and -1 not in s for s in bases.values())
    assert bases[0] != bases[1]
    # mid-epoch, after the last batch of epoch 0 (before the iterator is exhausted), mid-epoch 1
    assert run(make, epochs, [1, per_epoch - 1, 2]) == reference


def test_end_of_epoch_state_either_side_of_exhaustion() -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(IndexDataset(10), 4, shuffle=True, seed=1)

    reference: list[int] = []
    loader = make()
    for _ in range(2):
        reference += [i for b in loader for i in b.tolist()]

    inside = make()
    first = [i for _, b in zip(range(3), inside) for i in b.tolist()]
    state_inside = _roundtrip(inside.state_dict())
    assert (state_inside["epoch"], state_inside["position"]) == (0, 10)
    assert inside.batches == 3
    assert list(inside) == []
    state_after = _roundtrip(inside.state_dict())
    assert (state_after["epoch"], state_after["position"]) == (1, 0)

    for state in (state_inside, state_after):
        resumed = make()
        resumed.load_state_dict(state)
        rest: list[int] = []
        while resumed.epoch < 2:
            rest += [i for b in resumed for i in b.tolist()]
        assert first + rest == reference


def test_state_dict_counts_batches_handed_out() -> None:
    loader = ResumableDataLoader(
        IndexDataset(10), 3, shuffle=True, seed=5, drop_last=True, num_workers=2
    )
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    assert state == {
        "version": 2,
        "epoch": 0,
        "position": 6,
        "seed": 5,
        "shuffle": True,
        "batch_size": 3,
        "drop_last": True,
        "dataset_len": 10,
        "shard_end": "pad",
    }
    assert _roundtrip(state) == state
    assert (loader.epoch, loader.batches, loader.batch_size, len(loader)) == (0, 2, 3, 3)
    assert isinstance(loader.dataset, IndexDataset)


def test_resume_never_loads_consumed_samples() -> None:
    n, batch_size = 11, 3
    reference_log: list[Event] = []
    drive(ResumableDataLoader(IndexDataset(n), batch_size, True, seed=2), 2, reference_log)
    for drop_last in (False, True):
        for k in range(1, 7):
            first = ResumableDataLoader(
                IndexDataset(n), batch_size, True, seed=2, drop_last=drop_last
            )
            state = drive(first, 2, [], stop_after=k)
            assert state is not None
            dataset = IndexDataset(n)
            resumed = ResumableDataLoader(dataset, batch_size, True, seed=2, drop_last=drop_last)
            resumed.load_state_dict(state)
            log: list[Event] = []
            drive(resumed, 2, log)
            yielded = [i for kind, _, batch in log if kind == "batch" for i in batch]
            assert dataset.calls == yielded
            epoch, skip = state["epoch"], state["position"]
            consumed = set(flat_indices(reference_log, epoch)[:skip])
            assert consumed.isdisjoint(flat_indices(log, epoch))


def test_tensor_dataset_batches_are_bit_identical() -> None:
    data = TensorDataset(torch.randn(9, 3, generator=torch.Generator().manual_seed(0)))

    def make() -> ResumableDataLoader:
        return ResumableDataLoader(data, 2, seed=11)

    loader = make()
    got = [b[0] for _, b in zip(range(4), loader)]
    state = _roundtrip(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    while resumed.epoch < 2:
        got += [b[0] for b in resumed]
    reference = [b[0] for b in make_epochs(make(), 2)]
    assert len(got) == len(reference)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


def make_epochs(loader: ResumableDataLoader, epochs: int) -> list[Any]:
    return [b for _ in range(epochs) for b in loader]


def _global_rng_states() -> tuple[torch.Tensor, object, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _assert_same_rng(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert torch.equal(before[0], after[0])
    assert before[1] == after[1]
    np_before, np_after = before[2], after[2]
    assert np_before[0] == np_after[0]
    assert np.array_equal(np_before[1], np_after[1])
    assert np_before[2:] == np_after[2:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iteration_leaves_global_rngs_untouched(num_workers: int) -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = _global_rng_states()
    loader = ResumableDataLoader(IndexDataset(8), 3, seed=4, num_workers=num_workers)
    make_epochs(loader, 1)
    it = iter(loader)
    next(it)
    resumed = ResumableDataLoader(IndexDataset(8), 3, seed=4, num_workers=num_workers)
    resumed.load_state_dict(_roundtrip(loader.state_dict()))
    list(resumed)
    sampler = ResumableSampler(8, seed=9)
    sampler.set_epoch(3)
    list(sampler)
    _assert_same_rng(before, _global_rng_states())


class NoisyDataset(IndexDataset):
    """Sample ``i`` is ``i`` plus noise from the global torch RNG."""

    def __getitem__(self, index: int) -> Any:
        self.calls.append(index)
        return index + torch.rand(()).item()


def test_global_rng_augmentation_is_exact_without_workers() -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(NoisyDataset(7), 2, seed=6)

    torch.manual_seed(0)
    reference = [b.tolist() for b in make_epochs(make(), 2)]
    for k in (1, 3, 4, 6):
        torch.manual_seed(0)
        loader = make()
        got = [b.tolist() for _, b in zip(range(k), loader)]
        state, rng = _roundtrip(loader.state_dict()), torch.get_rng_state()
        torch.manual_seed(99)
        resumed = make()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        while resumed.epoch < 2:
            got += [b.tolist() for b in resumed]
        assert got == reference


def test_break_and_iterate_again_continues() -> None:
    loader = ResumableDataLoader(IndexDataset(10), 3, seed=8)
    got: list[int] = []
    for i, batch in enumerate(loader):
        got += batch.tolist()
        if i == 1:
            break
    while loader.epoch < 2:
        got += [i for b in loader for i in b.tolist()]
    reference = ResumableDataLoader(IndexDataset(10), 3, seed=8)
    assert got == [i for b in make_epochs(reference, 2) for i in b.tolist()]


def test_stale_iterator_raises() -> None:
    loader = ResumableDataLoader(IndexDataset(10), 3, seed=8)
    old = iter(loader)
    first = next(old)
    new = iter(loader)
    with pytest.raises(RuntimeError, match="stale"):
        next(old)
    second = next(new)
    order = loader.sampler.permutation(0).tolist()
    assert first.tolist() + second.tolist() == order[:6]
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="stale"):
        next(new)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 23),
    batch_size=st.integers(1, 9),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    epochs=st.integers(1, 3),
    data=st.data(),
)
def test_property_interrupted_equals_uninterrupted(
    n: int,
    batch_size: int,
    drop_last: bool,
    shuffle: bool,
    seed: int,
    epochs: int,
    data: st.DataObject,
) -> None:
    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            IndexDataset(n), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )

    reference = run(make, epochs, [])
    total = n_batches(reference)
    if total == 0:
        return
    points = data.draw(st.lists(st.integers(1, total), unique=True, max_size=6).map(sorted))
    counts = [b - a for a, b in zip([0, *points], points)]
    assert run(make, epochs, counts) == reference


def test_sampler_permutation_is_deterministic_and_private() -> None:
    a, b = ResumableSampler(20, seed=1), ResumableSampler(list(range(20)), seed=1)
    assert list(a) == list(b)
    assert sorted(a) == list(range(20))
    a.set_epoch(1)
    assert list(a) != list(b)
    assert list(ResumableSampler(20, seed=2)) != list(b)
    assert list(ResumableSampler(20, shuffle=False, seed=1)) == list(range(20))
    assert list(ResumableSampler(0)) == []


def test_sampler_start_at_is_one_shot() -> None:
    sampler = ResumableSampler(10, seed=3)
    sampler.set_epoch(2)
    order = sampler.permutation().tolist()
    assert order == sampler.permutation(2).tolist()
    sampler.start_at(4)
    assert len(sampler) == 6
    assert list(sampler) == order[4:]
    assert len(sampler) == 10
    assert list(sampler) == order
    sampler.start_at(10)
    assert list(sampler) == []
    with pytest.raises(ValueError):
        sampler.start_at(11)
    with pytest.raises(ValueError):
        sampler.start_at(-1)


def test_sampler_state_roundtrip_and_validation() -> None:
    sampler = ResumableSampler(10, seed=3)
    sampler.set_epoch(5)
    sampler.start_at(7)
    state = _roundtrip(sampler.state_dict())
    other = ResumableSampler(10, seed=3)
    other.load_state_dict(state)
    assert (other.epoch, other.start) == (5, 7)
    assert list(other) == list(sampler)
    for bad in (
        {**state, "seed": 4},
        {**state, "num_samples": 11},
        {**state, "shuffle": False},
        {**state, "start": 11},
        {**state, "epoch": -1},
        {**state, "start": "7"},
        {k: v for k, v in state.items() if k != "epoch"},
    ):
        with pytest.raises(StateMismatchError):
            ResumableSampler(10, seed=3).load_state_dict(bad)


GOOD = {
    "version": 2,
    "epoch": 1,
    "position": 6,
    "seed": 0,
    "shuffle": True,
    "batch_size": 3,
    "drop_last": False,
    "dataset_len": 10,
    "shard_end": "pad",
}


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ([1, 2], "mapping"),
        ({k: v for k, v in GOOD.items() if k != "position"}, "missing"),
        ({**GOOD, "extra": 1}, "unexpected"),
        ({**GOOD, "version": 3}, "version"),
        ({**GOOD, "version": True}, "version"),
        ({**GOOD, "epoch": -1}, "epoch"),
        ({**GOOD, "epoch": 1.0}, "epoch"),
        ({**GOOD, "epoch": "1"}, "epoch"),
        ({**GOOD, "position": True}, "position"),
        ({**GOOD, "position": -3}, "position"),
        ({**GOOD, "position": 11}, "only 10 samples"),
        ({**GOOD, "batch_size": 4}, "batch_size=4"),
        ({**GOOD, "dataset_len": 11}, "dataset_len=11"),
        ({**GOOD, "drop_last": True}, "drop_last=True"),
        ({**GOOD, "drop_last": 0}, "drop_last"),
        ({**GOOD, "seed": 1}, "seed=1"),
        ({**GOOD, "shuffle": False}, "shuffle=False"),
        ({**GOOD, "shard_end": "drop"}, "shard_end='drop'"),
        ({**GOOD, "shard_end": 0}, "shard_end"),
    ],
)
def test_bad_state_raises_and_changes_nothing(bad: Any, needle: str) -> None:
    loader = ResumableDataLoader(IndexDataset(10), 3, shuffle=True)
    loader.load_state_dict(GOOD)
    with pytest.raises(StateMismatchError, match=needle):
        loader.load_state_dict(bad)
    assert loader.state_dict() == GOOD


def test_version_1_states_still_load() -> None:
    """A state written before sharding, ``(epoch, batches)``, resumes at the same place."""
    old = {k: v for k, v in GOOD.items() if k not in ("position", "shard_end")}
    loader = ResumableDataLoader(IndexDataset(10), 3, shuffle=True)
    loader.load_state_dict({**old, "version": 1, "batches": 2})
    assert loader.state_dict() == GOOD
    loader.load_state_dict({**old, "version": 1, "batches": 4})  # after the short last batch
    assert loader.state_dict()["position"] == 10
    with pytest.raises(StateMismatchError, match="only 4 batches"):
        loader.load_state_dict({**old, "version": 1, "batches": 5})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sampler": torch.utils.data.RandomSampler(range(4))}, "sampler=RandomSampler"),
        (
            {
                "batch_sampler": torch.utils.data.BatchSampler(
                    torch.utils.data.RandomSampler(range(4)), 2, False
                )
            },
            "batch_sampler.sampler=RandomSampler",
        ),
        (
            {"sampler": torch.utils.data.WeightedRandomSampler([1.0] * 4, 4)},
            "WeightedRandomSampler",
        ),
        ({"generator": torch.Generator()}, "seed="),
        ({"num_workers": 1, "in_order": False}, "in_order=True"),
        ({"batch_size": None}, "batch_size=1"),
    ],
)
def test_unsupported_arguments_are_rejected(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedStateError, match=needle):
        ResumableDataLoader(IndexDataset(4), **kwargs)


def test_invalid_datasets_and_sizes_are_rejected() -> None:
    with pytest.raises(UnsupportedStateError, match="IterableDataset"):
        ResumableDataLoader(Stream())
    with pytest.raises(ValueError):
        ResumableDataLoader(IndexDataset(4), 0)
    with pytest.raises(ValueError):
        ResumableSampler(4, seed=-1)


def test_is_a_dataloader_with_dataloaders_arguments_and_defaults() -> None:
    """Drop-in: an ``isinstance`` check passes, every DataLoader parameter is accepted under
    the same name, position and default, and ``shuffle`` defaults to off as in DataLoader."""
    import inspect

    loader = ResumableDataLoader(IndexDataset(10), 4)
    assert isinstance(loader, torch.utils.data.DataLoader)
    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    ours = inspect.signature(ResumableDataLoader.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (loader.batch_size, loader.drop_last, len(loader), loader.epoch) == (4, False, 3, 1)
    positional = ResumableDataLoader(IndexDataset(10), 4, False, None, None, 0, None, False, True)
    assert [b.tolist() for b in positional] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_persistent_workers_resume_exactly() -> None:
    """Persistent workers are reused across epochs and restarts alike; the position, which
    is counted in the main process, stays exact."""

    def make() -> ResumableDataLoader:
        return ResumableDataLoader(
            IndexDataset(11), 3, True, num_workers=2, persistent_workers=True, seed=4
        )

    reference = run(make, 3, [])
    for interrupts in ([1], [4, 3], [2, 2, 2]):
        assert run(make, 3, interrupts) == reference


class AugmentedDataset(Dataset[tuple[int, float, float, float]]):
    """Sample ``i`` with a random "augmentation" from each global RNG of the process that
    loads it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        return index, torch.rand(()).item(), random.random(), float(np.random.rand())


def _augmented(reseed: bool) -> Callable[[], ResumableDataLoader]:
    return lambda: ResumableDataLoader(
        AugmentedDataset(), 2, True, num_workers=2, seed=3, reseed_per_sample=reseed
    )


def _tuples(batch: Any) -> tuple[Any, ...]:
    return tuple(tuple(t.tolist()) for t in batch)


def _augmented_run(make: Callable[[], ResumableDataLoader], interrupt: int | None) -> list[Any]:
    out: list[Any] = []
    loader = make()
    if interrupt is not None:
        for _, batch in zip(range(interrupt), loader):
            out.append(_tuples(batch))
        state = _roundtrip(loader.state_dict())
        loader = make()
        loader.load_state_dict(state)
    while loader.epoch < 2:
        out += [_tuples(b) for b in loader]
    return out


def test_reseed_per_sample_makes_worker_augmentation_exact_mid_epoch() -> None:
    reference = _augmented_run(_augmented(True), None)
    for k in (1, 3, 8):
        assert _augmented_run(_augmented(True), k) == reference, f"interrupted after {k}"
    # Without it, a mid-epoch resume hands batches to other workers: other values.
    assert _augmented_run(_augmented(False), 1) != _augmented_run(_augmented(False), None)
    with pytest.raises(UnsupportedStateError, match="persistent_workers"):
        ResumableDataLoader(
            AugmentedDataset(), 2, num_workers=1, persistent_workers=True, reseed_per_sample=True
        )
