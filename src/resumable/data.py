"""Resume the data position exactly.

`ResumableSampler` draws the permutation of epoch ``e`` from a private ``torch.Generator``
seeded with a pure function of ``(seed, e)``, so any position of any epoch can be recomputed
without replaying the epochs before it. `ResumableDataLoader` wraps a real
``torch.utils.data.DataLoader`` around that sampler and counts the batches *handed to the
caller*, not those prefetched by workers; on restore the sampler starts at
``batches * batch_size`` of the same permutation, so consumed samples are never loaded again.

Trade-off: the position is stored as ``(epoch, batches)`` rather than as the loader's internal
state (worker processes, their RNGs, prefetch queues). That keeps the checkpoint a handful of
JSON integers and lets workers be killed freely, but randomness drawn inside workers (random
augmentation from a worker's global RNG) is reproduced only when resuming at an epoch
boundary; per-sample randomness must be derived from the sample index to be exact mid-epoch.
"""

import weakref
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from resumable.errors import StateMismatchError, UnsupportedStateError

__all__ = ["ResumableDataLoader", "ResumableSampler"]

_STATE_VERSION = 1
_MASK64 = (1 << 64) - 1
_PERMUTATION_STREAM = 1
_WORKER_STREAM = 2
_CHUNK = 1 << 16


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _derive_seed(seed: int, epoch: int, stream: int) -> int:
    """Return a 64-bit seed that is a pure function of ``(seed, epoch, stream)``.

    Distinct streams (sampler permutation, worker base seed) give unrelated seeds, and
    neighbouring epochs give unrelated seeds, unlike ``seed + epoch``.
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (epoch & _MASK64))
    return _splitmix64(h ^ (stream & _MASK64))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_u64(name: str, value: object) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    if not 0 <= value <= _MASK64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _validated_state(
    state: object, what: str, int_keys: tuple[str, ...], bool_keys: tuple[str, ...]
) -> dict[str, Any]:
    """Check the shape of a saved state: exact key set, version, types, non-negative ints."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(
            f"{what} state must be a mapping (the dict returned by state_dict()), "
            f"found {type(state).__name__}; pass the saved state_dict unchanged."
        )
    expected = {"version", *int_keys, *bool_keys}
    found = set(state)
    if found != expected:
        missing = sorted(expected - found, key=str)
        extra = sorted(found - expected, key=str)
        raise StateMismatchError(
            f"{what} state has the wrong keys: missing {missing}, unexpected {extra}; expected "
            f"exactly {sorted(expected)}. Pass the dict produced by {what}.state_dict()."
        )
    if not _is_int(state["version"]) or state["version"] != _STATE_VERSION:
        raise StateMismatchError(
            f"{what} state has version {state['version']!r}, this library reads version "
            f"{_STATE_VERSION}; restore it with the resumable version that wrote it."
        )
    for key in int_keys:
        value = state[key]
        if not _is_int(value) or not 0 <= value <= _MASK64:
            raise StateMismatchError(
                f"{what} state[{key!r}] must be an int in [0, 2**64), found "
                f"{type(value).__name__} {value!r}; the checkpoint is damaged or not a "
                f"{what} state."
            )
    for key in bool_keys:
        value = state[key]
        if not isinstance(value, bool):
            raise StateMismatchError(
                f"{what} state[{key!r}] must be a bool, found {type(value).__name__} "
                f"{value!r}; the checkpoint is damaged or not a {what} state."
            )
    return dict(state)


def _expect_same(what: str, key: str, saved: object, current: object, fix: str) -> None:
    if saved != current:
        raise StateMismatchError(
            f"{what} checkpoint was saved with {key}={saved!r} but this {what} has "
            f"{key}={current!r}; resuming would not continue the same sample sequence. {fix}"
        )


class ResumableSampler(Sampler[int]):
    """Sampler whose epoch permutation is a pure function of ``(seed, epoch, len)``.

    Each ``__iter__`` draws the permutation of the current epoch from a fresh
    ``torch.Generator`` seeded with ``(seed, epoch)``; the global torch, Python and
    NumPy RNGs are never read or advanced. ``start_at(i)`` makes the *next* ``__iter__`` begin
    at offset ``i`` of that permutation (a one-shot offset, reset to 0 once an iterator has been
    created). ``shuffle=False`` yields ``range(len)`` from the offset.

    The sampler does not observe what its consumer has actually used (a DataLoader prefetches),
    so its state is its configuration plus the pending ``(epoch, start)``; tracking the
    consumed position is `ResumableDataLoader`'s job.
    """

    resumable_per_rank = True  # a position in the data: each rank has its own

    def __init__(
        self, data_source_or_len: Sized | int, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        super().__init__()
        if _is_int(data_source_or_len):
            assert isinstance(data_source_or_len, int)
            if data_source_or_len < 0:
                raise ValueError(f"length must be >= 0, got {data_source_or_len}")
            self._source: Sized | None = None
            self._length = data_source_or_len
        elif isinstance(data_source_or_len, Sized):
            self._source = data_source_or_len
            self._length = 0
        else:
            raise TypeError(
                "data_source_or_len must be an int or a sized data source (with __len__), "
                f"got {type(data_source_or_len).__name__}"
            )
        self._shuffle = _check_bool("shuffle", shuffle)
        self._seed = _check_u64("seed", seed)
        self._epoch = 0
        self._start = 0

    @property
    def num_samples(self) -> int:
        """Samples per full epoch (the data source's current length)."""
        return len(self._source) if self._source is not None else self._length

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def start(self) -> int:
        """Offset at which the next ``__iter__`` begins."""
        return self._start

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation used by the next ``__iter__``; keeps a pending offset."""
        self._epoch = _check_u64("epoch", epoch)

    def start_at(self, index_in_epoch: int) -> None:
        """Make the next ``__iter__`` yield from ``permutation[index_in_epoch:]``.

        ``index_in_epoch == len`` is allowed and yields nothing.
        """
        index = _check_u64("index_in_epoch", index_in_epoch)
        if index > self.num_samples:
            raise ValueError(
                f"index_in_epoch must be in [0, {self.num_samples}] (the epoch length), got {index}"
            )
        self._start = index

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The full index order (int64 tensor) of ``epoch`` (default: the current epoch)."""
        e = self._epoch if epoch is None else _check_u64("epoch", epoch)
        n = self.num_samples
        if not self._shuffle:
            return torch.arange(n, dtype=torch.int64)
        generator = torch.Generator()
        generator.manual_seed(_derive_seed(self._seed, e, _PERMUTATION_STREAM))
        return torch.randperm(n, generator=generator)

    def __iter__(self) -> Iterator[int]:
        start = self._start
        if start > self.num_samples:
            raise StateMismatchError(
                f"sampler offset {start} is past the end of the data source "
                f"(length {self.num_samples}); the data source shrank after start_at()."
            )
        self._start = 0
        return _iter_chunks(self.permutation()[start:])

    def __len__(self) -> int:
        """Length of the iterator the next ``__iter__`` returns (``len - start``)."""
        return max(self.num_samples - self._start, 0)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: pending epoch and offset, seed, shuffle and length."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "start": self._start,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore epoch and offset; raises `StateMismatchError` if the state is malformed or
        its seed, shuffle or length differ from this sampler's (nothing is changed then)."""
        what = "ResumableSampler"
        s = _validated_state(
            state_dict, what, ("epoch", "start", "seed", "num_samples"), ("shuffle",)
        )
        _expect_same(what, "num_samples", s["num_samples"], self.num_samples, "Use the same data.")
        _expect_same(what, "seed", s["seed"], self._seed, f"Construct it with seed={s['seed']}.")
        _expect_same(
            what,
            "shuffle",
            s["shuffle"],
            self._shuffle,
            f"Construct it with shuffle={s['shuffle']}.",
        )
        if s["start"] > s["num_samples"]:
            raise StateMismatchError(
                f"{what} state has start={s['start']} past the epoch length "
                f"{s['num_samples']}; the checkpoint is damaged."
            )
        self._epoch = s["epoch"]
        self._start = s["start"]


def _iter_chunks(indices: torch.Tensor) -> Iterator[int]:
    for chunk in indices.split(_CHUNK):
        yield from chunk.tolist()


class _EpochIterator(Iterator[Any]):
    """One pass over the rest of the current epoch of a `ResumableDataLoader`."""

    def __init__(
        self, owner: "ResumableDataLoader", generation: int, inner: Iterator[Any] | None
    ) -> None:
        self._owner = owner
        self._generation = generation
        self._inner = inner
        self._done = False

    def __next__(self) -> Any:
        if self._owner._generation != self._generation:
            raise RuntimeError(
                "this ResumableDataLoader iterator is stale: iter(loader) or "
                "load_state_dict() was called after it was created. Iterate the new one."
            )
        if self._done:
            raise StopIteration
        if self._inner is not None:
            try:
                batch = next(self._inner)
            except StopIteration:
                pass
            else:
                self._owner._batches += 1
                return batch
        self._close()
        self._done = True
        self._owner._epoch += 1
        self._owner._batches = 0
        raise StopIteration

    def _close(self) -> None:
        """Drop the inner DataLoader iterator, which shuts its worker processes down."""
        self._inner = None


class ResumableDataLoader:
    """A ``torch.utils.data.DataLoader`` whose position survives a restart exactly.

    Each ``iter(loader)`` covers the *rest* of the current epoch: after ``load_state_dict`` of
    a state taken when ``k`` batches of epoch ``e`` had been handed out, it yields batch ``k``
    onward of epoch ``e`` - the same batches, of the same permutation, that an uninterrupted
    run would have produced - and ``__getitem__`` is never called for earlier samples. When an
    iterator is exhausted, ``epoch`` increases by one and the position resets to 0. Breaking
    out of a loop and calling ``iter`` again continues where the caller stopped; a state taken
    after the last batch but before the iterator was exhausted resumes with an empty pass that
    then moves to the next epoch, exactly as the uninterrupted loop would.

    The inner DataLoader gets a private generator reseeded from ``(seed, epoch)`` at every
    ``iter``, so iteration never touches the global torch, Python or NumPy RNG and the
    worker base seed is a pure function of ``(seed, epoch)``.

    Not supported (raise `UnsupportedStateError`): ``sampler``, ``batch_sampler``,
    ``generator`` (the loader owns them), ``persistent_workers=True`` (workers would keep the
    seed of the epoch they were started in), ``in_order=False``, ``batch_size=None`` and
    iterable-style datasets.
    """

    resumable_per_rank = True  # a position in the data: each rank has its own

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        **dataloader_kwargs: Any,
    ) -> None:
        owned = sorted({"sampler", "batch_sampler", "generator"} & dataloader_kwargs.keys())
        if owned:
            raise UnsupportedStateError(
                f"ResumableDataLoader does not accept {owned}: it owns the sampler and the "
                "generator so that the position can be resumed exactly. Use shuffle= and "
                "seed= instead, or a plain DataLoader if you need a custom sampler."
            )
        if dataloader_kwargs.get("persistent_workers", False):
            raise UnsupportedStateError(
                "ResumableDataLoader does not support persistent_workers=True: persistent "
                "workers keep the RNG seed of the epoch in which they were started, so a "
                "resumed run would seed them differently. Use persistent_workers=False."
            )
        if not dataloader_kwargs.get("in_order", True):
            raise UnsupportedStateError(
                "ResumableDataLoader does not support in_order=False: batch order would "
                "depend on worker timing and could not be resumed. Use in_order=True."
            )
        if isinstance(dataset, IterableDataset):
            raise UnsupportedStateError(
                "ResumableDataLoader needs a map-style dataset (__getitem__ and __len__); "
                f"{type(dataset).__name__} is an IterableDataset, whose position cannot be "
                "resumed without replaying it."
            )
        if not isinstance(dataset, Sized):
            raise UnsupportedStateError(
                f"ResumableDataLoader needs a dataset with __len__; {type(dataset).__name__} "
                "has none."
            )
        if batch_size is None:
            raise UnsupportedStateError(
                "ResumableDataLoader does not support batch_size=None (no automatic "
                "batching); use batch_size=1 and unpack the batch."
            )
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self._dataset = dataset
        self._batch_size = batch_size
        self._drop_last = _check_bool("drop_last", drop_last)
        self._sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed)
        self._generator = torch.Generator()
        self._loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            generator=self._generator,
            **dataloader_kwargs,
        )
        self._epoch = 0
        self._batches = 0
        self._generation = 0
        self._active: weakref.ref[_EpochIterator] | None = None

    @property
    def dataset(self) -> Dataset[Any]:
        return self._dataset

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def num_workers(self) -> int:
        return self._loader.num_workers

    @property
    def seed(self) -> int:
        return self._sampler.seed

    @property
    def shuffle(self) -> bool:
        return self._sampler.shuffle

    @property
    def sampler(self) -> ResumableSampler:
        return self._sampler

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches(self) -> int:
        """Batches of the current epoch already handed to the caller."""
        return self._batches

    def __len__(self) -> int:
        """Batches per full epoch."""
        n = self._sampler.num_samples
        if self._drop_last:
            return n // self._batch_size
        return -(-n // self._batch_size)

    def __iter__(self) -> Iterator[Any]:
        self._invalidate()
        per_epoch = len(self)
        if self._batches > per_epoch:
            raise StateMismatchError(
                f"position {self._batches} batches is past the end of an epoch "
                f"({per_epoch} batches); the dataset shrank after the state was loaded."
            )
        inner: Iterator[Any] | None = None
        if self._batches < per_epoch:
            self._sampler.set_epoch(self._epoch)
            self._sampler.start_at(self._batches * self._batch_size)
            self._generator.manual_seed(_derive_seed(self.seed, self._epoch, _WORKER_STREAM))
            inner = iter(self._loader)
        iterator = _EpochIterator(self, self._generation, inner)
        self._active = weakref.ref(iterator)
        return iterator

    def _invalidate(self) -> None:
        """Make every existing iterator stale and stop the workers of the live one.

        The loader holds its iterator weakly: a strong reference would form a cycle that keeps
        worker processes alive until the cyclic garbage collector runs.
        """
        self._generation += 1
        active = self._active() if self._active is not None else None
        if active is not None:
            active._close()
        self._active = None

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: ``epoch`` and ``batches`` handed out in it, plus the
        configuration checked on load (seed, shuffle, batch_size, drop_last, dataset_len)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "batches": self._batches,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self._batch_size,
            "drop_last": self._drop_last,
            "dataset_len": self._sampler.num_samples,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next ``iter`` resume at the saved ``(epoch, batches)``.

        Raises `StateMismatchError`, changing nothing, if the state is malformed or was saved
        with a different seed, shuffle, batch_size, drop_last or dataset length. Any iterator
        created before the call becomes stale.
        """
        what = "ResumableDataLoader"
        s = _validated_state(
            state_dict,
            what,
            ("epoch", "batches", "seed", "batch_size", "dataset_len"),
            ("shuffle", "drop_last"),
        )
        _expect_same(
            what,
            "dataset_len",
            s["dataset_len"],
            self._sampler.num_samples,
            "Resume with the same dataset.",
        )
        for key, current in (
            ("batch_size", self._batch_size),
            ("drop_last", self._drop_last),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            _expect_same(what, key, s[key], current, f"Construct it with {key}={s[key]!r}.")
        per_epoch = len(self)
        if s["batches"] > per_epoch:
            raise StateMismatchError(
                f"{what} state has batches={s['batches']} but an epoch has only {per_epoch} "
                "batches; the checkpoint is damaged."
            )
        self._invalidate()
        self._epoch = s["epoch"]
        self._batches = s["batches"]
