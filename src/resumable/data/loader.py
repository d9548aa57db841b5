"""`ResumableDataLoader`: a ``torch.utils.data.DataLoader`` whose position survives a restart.

The loader counts the batches *handed to the caller*, not those prefetched by workers, and
turns them into a position in the epoch through an `_Order`, one object per way the order of
an epoch is made:

- `_SeededOrder` (the default, ``shuffle=`` and ``seed=``): the loader's own
  `ResumableSampler`; the position is the number of entries of the epoch's permutation that
  all ranks together consumed, so it is the same on every rank and carries over a change of
  world size (see `resumable.data.order`).
- `_SamplerOrder` and `_BatchSamplerOrder` (a user's ``sampler=`` or ``batch_sampler=``): the
  position is how many indices (batches) this rank took from the user's order of the epoch,
  which is recomputed on resume by ``set_epoch(epoch)`` or by loading the sampler's
  ``state_dict()`` taken when the epoch began, and skipped up to the position without loading
  any data. Such a position is this rank's own: it resumes at the same world size only.

Trade-off: the state is a handful of JSON values rather than the DataLoader's internals
(worker processes, their RNGs, prefetch queues), so workers can be killed freely; randomness
drawn inside workers from their global RNG is not part of it (see docs/data.md, "Limits").
"""

import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, Protocol

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from resumable.data.order import (
    STATE_VERSION,
    WORKER_STREAM,
    ResumableSampler,
    ShardEnd,
    consumed,
    derive_seed,
    shard_length,
    world,
)
from resumable.data.state import check_bool, expect_same, is_int, validated_state
from resumable.errors import StateMismatchError, UnsupportedStateError

__all__ = ["ResumableDataLoader"]

log = logging.getLogger(__name__)

_WHAT = "ResumableDataLoader"


class _Order(Protocol):
    """How an epoch's order is made and a position in it is counted.

    The loader calls `begin` before each pass (in the main process, before the DataLoader
    iterator exists), `position` after each batch it hands out, and `state`/`load` from its
    own ``state_dict``/``load_state_dict``.
    """

    per_rank: bool

    def begin(self, epoch: int, position: int) -> None:
        """Make the next iteration of the DataLoader's sampler yield from ``position``."""

    def position(self, start: int, batches: int) -> int:
        """The position after this rank took ``batches`` batches of a pass begun at
        ``start``."""

    def batches_from(self, position: int) -> int | None:
        """Batches of a pass begun at ``position`` (None when the order has no length)."""

    def state(self, epoch: int, position: int) -> dict[str, Any]: ...

    def load(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """Check ``state`` against this order; return its ``(epoch, position)``."""


class _SeededOrder:
    per_rank = False

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def _items(self, start: int) -> int:
        s = self.sampler
        return shard_length(s.num_samples, start, s.num_replicas, s.shard_end)

    def begin(self, epoch: int, position: int) -> None:
        self.sampler.set_epoch(epoch)
        self.sampler.start_at(position)

    def position(self, start: int, batches: int) -> int:
        s = self.sampler
        return consumed(
            s.num_samples, start, s.num_replicas, s.shard_end, batches * self.batch_size
        )

    def batches_from(self, position: int) -> int:
        items = self._items(position)
        if self.drop_last:
            return items // self.batch_size
        return -(-items // self.batch_size)

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        s = self.sampler
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "dataset_len": s.num_samples,
            "shard_end": s.shard_end,
        }

    def load(self, state: Mapping[str, Any]) -> tuple[int, int]:
        common = {
            "epoch": int,
            "seed": int,
            "shuffle": bool,
            "batch_size": int,
            "drop_last": bool,
            "dataset_len": int,
        }
        s = validated_state(
            state,
            _WHAT,
            (1, STATE_VERSION),
            {1: {**common, "batches": int}, 2: {**common, "position": int, "shard_end": str}},
        )
        n = self.sampler.num_samples
        expect_same(_WHAT, "dataset_len", s["dataset_len"], n, "Resume with the same dataset.")
        checks: list[tuple[str, object]] = [
            ("batch_size", self.batch_size),
            ("drop_last", self.drop_last),
            ("seed", self.sampler.seed),
            ("shuffle", self.sampler.shuffle),
        ]
        if s["version"] == 2:
            checks.append(("shard_end", self.sampler.shard_end))
        for key, current in checks:
            expect_same(_WHAT, key, s[key], current, f"Construct it with {key}={s[key]!r}.")
        if s["version"] == 1:  # one process, (epoch, batches handed out)
            per_epoch = self.batches_from(0) if self.sampler.num_replicas == 1 else None
            if per_epoch is not None and s["batches"] > per_epoch:
                raise StateMismatchError(
                    f"{_WHAT} state has batches={s['batches']} but an epoch has only "
                    f"{per_epoch} batches; the checkpoint is damaged."
                )
            return s["epoch"], min(s["batches"] * self.batch_size, n)
        if s["position"] > n:
            raise StateMismatchError(
                f"{_WHAT} state has position={s['position']} but an epoch has only {n} "
                "samples; the checkpoint is damaged."
            )
        return s["epoch"], s["position"]


def _refusal(obj: object, arg: str) -> str | None:
    """Why the order of ``obj`` (a user's sampler or batch sampler) cannot be recomputed
    after a restart, or None when it can."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return None
    if callable(getattr(obj, "set_epoch", None)):
        return None
    if isinstance(obj, (SequentialSampler, range, list, tuple)):
        return None
    if isinstance(obj, BatchSampler):
        return _refusal(obj.sampler, f"{arg}.sampler")
    return (
        f"{arg}={type(obj).__name__} has neither state_dict()/load_state_dict() nor "
        "set_epoch(epoch), so the order it yields after a restart cannot be known to be the "
        "one it yielded before (RandomSampler, WeightedRandomSampler and SubsetRandomSampler "
        "draw from a generator whose state is not saved). Use shuffle=True with seed= "
        "instead, or give the sampler a set_epoch(epoch) that seeds its own torch.Generator "
        "from (seed, epoch), or state_dict()/load_state_dict()"
    )


def _sharded_by(obj: object) -> tuple[int, int] | None:
    """``(num_replicas, rank)`` of a ``DistributedSampler``-like sampler (or of the sampler
    inside a batch sampler), None for one that does not shard."""
    for candidate in (obj, getattr(obj, "sampler", None)):
        size, rank = getattr(candidate, "num_replicas", None), getattr(candidate, "rank", None)
        if is_int(size) and is_int(rank):
            assert isinstance(size, int) and isinstance(rank, int)
            return size, rank
    return None


class _UserOrder:
    """A user's sampler (``unit`` = 1 index) or batch sampler (``unit`` = 1 batch), wrapped
    so that its next iteration starts at a position. The DataLoader iterates `_Skipping`."""

    per_rank = True

    def __init__(
        self, inner: Iterable[Any], kind: str, batch_size: int, world_size: int, rank: int
    ) -> None:
        self.inner = inner
        self.kind = kind
        self.batch_size = batch_size  # indices per batch; 1 for a batch sampler
        self.world_size = world_size
        self.rank = rank
        self.skipping = _Skipping(inner)
        self.pass_state: Any = None

    @property
    def _epoch_target(self) -> Any:
        if callable(getattr(self.inner, "set_epoch", None)):
            return self.inner
        if isinstance(self.inner, BatchSampler):
            return (
                self.inner.sampler
                if callable(getattr(self.inner.sampler, "set_epoch", None))
                else None
            )
        return None

    @property
    def _stateful(self) -> bool:
        return callable(getattr(self.inner, "state_dict", None))

    def begin(self, epoch: int, position: int) -> None:
        target = self._epoch_target
        if target is not None:
            target.set_epoch(epoch)
        if self.pass_state is not None:
            self.inner.load_state_dict(self.pass_state)  # type: ignore[attr-defined]
        elif self._stateful:
            self.pass_state = self.inner.state_dict()  # type: ignore[attr-defined]
        self.skipping.skip = position

    def end_of_epoch(self) -> None:
        self.pass_state = None

    def position(self, start: int, batches: int) -> int:
        taken = start + batches * self.batch_size
        total = len(self.inner) if isinstance(self.inner, Sized) else None
        return taken if total is None else min(taken, total)

    def batches_from(self, position: int) -> int | None:
        return None  # the DataLoader's own len() applies

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "order": self.kind,
            "epoch": epoch,
            "position": position,
            "sampler_state": self.pass_state,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load(self, state: Mapping[str, Any]) -> tuple[int, int]:
        spec = {
            "order": str,
            "epoch": int,
            "position": int,
            "sampler_state": object,
            "batch_size": int,
            "world_size": int,
            "rank": int,
        }
        s = validated_state(state, _WHAT, (STATE_VERSION,), {STATE_VERSION: spec})
        expect_same(_WHAT, "order", s["order"], self.kind, f"Pass {s['order']}= as before.")
        expect_same(
            _WHAT, "batch_size", s["batch_size"], self.batch_size, "Use the same batch_size."
        )
        for key, current in (("world_size", self.world_size), ("rank", self.rank)):
            expect_same(
                _WHAT,
                key,
                s[key],
                current,
                f"A position in a user's {self.kind} is one rank's own; it resumes only at the "
                "same world size and rank. Use shuffle=/seed= (the loader's own sharded order) "
                "to resume at another world size.",
            )
        if s["sampler_state"] is not None and not self._stateful:
            raise StateMismatchError(
                f"{_WHAT} state holds a {self.kind} state_dict but this {self.kind} "
                f"({type(self.inner).__name__}) has no load_state_dict; pass the same kind "
                f"of {self.kind} as before."
            )
        self.pass_state = s["sampler_state"]
        return s["epoch"], s["position"]


def _has_state(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class _IterableOrder:
    """An ``IterableDataset``: the position is this rank's batches of the epoch.

    With ``state_dict()``/``load_state_dict()`` on the dataset and no worker processes, the
    dataset's own state is taken when the loader's is (nothing is prefetched then, so it is
    exactly after the last batch handed out) and loaded before the next pass: nothing is
    replayed. Otherwise, when the user opted in (``replay_iterable=True``), the pass re-reads
    and discards the consumed batches, with a WARNING. The dataset shards itself over ranks
    and workers (``get_worker_info``, ``split_dataset_by_node``), so the position is per rank.
    """

    per_rank = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        drop_last: bool,
        replay: bool,
        world_size: int,
        rank: int,
    ) -> None:
        self.dataset = dataset
        self.world_size = world_size
        self.rank = rank
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.replay = replay
        self.pending: Any = None  # the dataset state to load before the next pass
        self.skip = 0  # batches to re-read and discard at the start of the next pass

    def begin(self, epoch: int, position: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        if self.replay:
            self.skip = position
        elif position and self.pending is not None:
            self.dataset.load_state_dict(self.pending)
        self.pending = None

    def position(self, start: int, batches: int) -> int:
        return start + batches

    def batches_from(self, position: int) -> int | None:
        return None

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        dataset_state = None
        if not self.replay and position:
            dataset_state = self.pending if self.pending is not None else self.dataset.state_dict()
        return {
            "version": STATE_VERSION,
            "order": "iterable",
            "epoch": epoch,
            "position": position,
            "dataset_state": dataset_state,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "replay": self.replay,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load(self, state: Mapping[str, Any]) -> tuple[int, int]:
        spec = {
            "order": str,
            "epoch": int,
            "position": int,
            "dataset_state": object,
            "batch_size": int,
            "drop_last": bool,
            "replay": bool,
            "world_size": int,
            "rank": int,
        }
        s = validated_state(state, _WHAT, (STATE_VERSION,), {STATE_VERSION: spec})
        for key, current in (
            ("order", "iterable"),
            ("batch_size", self.batch_size),
            ("drop_last", self.drop_last),
            ("replay", self.replay),
        ):
            expect_same(_WHAT, key, s[key], current, f"Construct it with {key}={s[key]!r}.")
        for key, current in (("world_size", self.world_size), ("rank", self.rank)):
            expect_same(
                _WHAT,
                key,
                s[key],
                current,
                "A position in an IterableDataset is one rank's own (the dataset shards "
                "itself); it resumes only at the same world size and rank.",
            )
        if not self.replay and s["position"] and s["dataset_state"] is None:
            raise StateMismatchError(
                f"{_WHAT} state has position={s['position']} but no dataset_state; the "
                "checkpoint is damaged."
            )
        self.pending = s["dataset_state"]
        return s["epoch"], s["position"]


class _Skipping(Sampler[Any]):
    """Iterates a user's order from ``skip`` on (then resets ``skip`` to 0); ``len`` is what
    is left."""

    def __init__(self, inner: Iterable[Any]) -> None:
        super().__init__()
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.inner), skip, None)

    def __len__(self) -> int:
        if not isinstance(self.inner, Sized):
            raise TypeError(f"{type(self.inner).__name__} has no len()")
        return max(len(self.inner) - self.skip, 0)


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
        owner = self._owner
        if owner._generation != self._generation:
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
                owner._pass_batches += 1
                return batch
        self._close()
        self._done = True
        owner._next_epoch()
        raise StopIteration

    def __len__(self) -> int:
        """Batches left in this pass."""
        return len(self._inner) if isinstance(self._inner, Sized) else 0

    def _close(self) -> None:
        """Drop the inner DataLoader iterator, which shuts its worker processes down (unless
        they are persistent: the DataLoader keeps those)."""
        self._inner = None


class ResumableDataLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` whose position survives a restart exactly.

    Takes ``DataLoader``'s arguments with its defaults, plus ``seed`` (the order of every
    epoch and the workers' base seed derive from it), and ``num_replicas``, ``rank`` and
    ``shard_end`` as ``DistributedSampler`` has them (world size and rank default to the
    default process group's, or one process when there is none). With ``shuffle`` and no
    sampler, each rank reads its share of the epoch, dealt like ``DistributedSampler``.

    Each ``iter(loader)`` covers the *rest* of the current epoch: after ``load_state_dict`` it
    yields, on every rank, what an uninterrupted run would have yielded next, and
    ``__getitem__`` is never called for samples already consumed. When an iterator is
    exhausted, ``epoch`` increases by one and the position resets to 0. Breaking out of a loop
    and calling ``iter`` again continues where the caller stopped. A user's sampler or
    batch sampler gets ``set_epoch(loader.epoch)`` before each pass.

    An ``IterableDataset`` with ``state_dict()``/``load_state_dict()`` resumes from its own
    state with ``num_workers=0``; with ``replay_iterable=True`` any iterable dataset resumes by
    re-reading the consumed batches (WARNING with the count), workers or not.

    Refused with `UnsupportedStateError` (the message says what to use instead):
    ``generator`` (the loader owns it; use ``seed``), a sampler or batch sampler whose order
    cannot be recomputed (`_refusal`), ``in_order=False``, ``batch_size=None``, and an
    ``IterableDataset`` that cannot be resumed as above.
    """

    resumable_per_rank = False
    """Read by the `Checkpointer`: with the loader's own order the state is the same on every
    rank and carries over a change of world size. A user's sampler makes it per-rank."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard_end: ShardEnd = "pad",
        replay_iterable: bool = False,
    ) -> None:
        if generator is not None:
            raise UnsupportedStateError(
                f"{_WHAT} does not accept generator=: it owns the generator that seeds the "
                "order and the workers, so that both are a function of (seed, epoch). Use "
                "seed= instead."
            )
        if not in_order:
            raise UnsupportedStateError(
                f"{_WHAT} does not support in_order=False: batch order would depend on "
                "worker timing and could not be resumed. Use in_order=True."
            )
        if batch_size is None:
            raise UnsupportedStateError(
                f"{_WHAT} does not support batch_size=None (no automatic batching); use "
                "batch_size=1 and unpack the batch."
            )
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        check_bool("drop_last", drop_last)
        check_bool("replay_iterable", replay_iterable)
        world_size, my_rank = world(num_replicas, rank)
        order: _Order
        if isinstance(dataset, IterableDataset):
            if sampler is not None or batch_sampler is not None or shuffle:
                raise ValueError(
                    "an IterableDataset takes no sampler=, batch_sampler= or shuffle=True (as "
                    "in DataLoader); it orders and shards itself."
                )
            name = type(dataset).__name__
            if not replay_iterable and not _has_state(dataset):
                raise UnsupportedStateError(
                    f"{_WHAT} cannot resume {name}: an IterableDataset without "
                    "state_dict()/load_state_dict() can only be resumed by re-reading the "
                    "consumed batches. Give it state_dict()/load_state_dict() (as Hugging Face "
                    "datasets.IterableDataset and torchdata's nodes have), or pass "
                    "replay_iterable=True to re-read and discard them on resume."
                )
            if not replay_iterable and num_workers > 0:
                raise UnsupportedStateError(
                    f"{_WHAT} cannot resume {name} read by num_workers={num_workers} worker "
                    "processes exactly: its position is in the workers' copies, out of reach. "
                    "Use num_workers=0, or torchdata's StatefulDataLoader (put it in the "
                    "Checkpointer's state as it is), or pass replay_iterable=True to re-read "
                    "and discard the consumed batches on resume."
                )
            order = _IterableOrder(
                dataset, batch_size, drop_last, replay_iterable, world_size, my_rank
            )
            sampler_args: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
        elif batch_sampler is not None or sampler is not None:
            if shuffle:
                raise ValueError(
                    "shuffle=True cannot be combined with sampler= or batch_sampler= (as in "
                    "DataLoader); shuffle inside the sampler, or drop the sampler."
                )
            user, kind = (
                (batch_sampler, "batch_sampler")
                if batch_sampler is not None
                else (sampler, "sampler")
            )
            why = _refusal(user, kind)
            if why is not None:
                raise UnsupportedStateError(f"{_WHAT} cannot resume {why}.")
            assert user is not None
            unit = 1 if batch_sampler is not None else batch_size
            user_world, user_rank = _sharded_by(user) or (world_size, my_rank)
            user_order = _UserOrder(user, kind, unit, user_world, user_rank)
            order = user_order
            if batch_sampler is not None:
                sampler_args = {"batch_sampler": user_order.skipping}
            else:
                sampler_args = {
                    "batch_size": batch_size,
                    "sampler": user_order.skipping,
                    "drop_last": drop_last,
                }
        else:
            if not isinstance(dataset, Sized):
                raise UnsupportedStateError(
                    f"{_WHAT} needs a dataset with __len__ to make its order; "
                    f"{type(dataset).__name__} has none. Give it __len__, or pass a sampler."
                )
            own = ResumableSampler(
                dataset,
                shuffle=bool(shuffle),
                seed=seed,
                num_replicas=world_size,
                rank=my_rank,
                shard_end=shard_end,
            )
            order = _SeededOrder(own, batch_size, drop_last)
            sampler_args = {"batch_size": batch_size, "sampler": own, "drop_last": drop_last}
        self._order = order
        self.resumable_per_rank = order.per_rank
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._private_generator = torch.Generator()
        self._epoch = 0
        self._pass_start = 0
        self._pass_batches = 0
        self._generation = 0
        self._active: weakref.ref[_EpochIterator] | None = None
        super().__init__(
            dataset,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=self._private_generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
            **sampler_args,
        )

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def position(self) -> int:
        """Where the current epoch stands: with the loader's own order, samples of the
        epoch's order consumed by all ranks together; with a user's sampler (batch sampler),
        indices (batches) this rank took from it."""
        return self._order.position(self._pass_start, self._pass_batches)

    @property
    def batches(self) -> int:
        """This rank's batches of the current epoch handed to the caller (after a change of
        world size, counted as if the new world size had read the epoch from its start)."""
        per_batch = self.batch_size or 1
        if isinstance(self._order, _SeededOrder):
            per_batch *= self._order.sampler.num_replicas
        return -(-self._pass_start // per_batch) + self._pass_batches

    def __len__(self) -> int:
        """This rank's batches per full epoch."""
        per_epoch = self._order.batches_from(0)
        return per_epoch if per_epoch is not None else super().__len__()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # counts what it yields
        self._invalidate()
        self._pass_start = self.position
        self._pass_batches = 0
        self._order.begin(self._epoch, self._pass_start)
        self._private_generator.manual_seed(derive_seed(self._seed, self._epoch, WORKER_STREAM))
        inner: Iterator[Any] = super().__iter__()
        if isinstance(self._order, _IterableOrder) and self._order.skip:
            inner = self._replayed(inner, self._order.skip)
            self._order.skip = 0
        iterator = _EpochIterator(self, self._generation, inner)
        self._active = weakref.ref(iterator)
        return iterator

    def _replayed(self, inner: Iterator[Any], batches: int) -> Iterator[Any]:
        """``inner`` after re-reading and discarding its first ``batches`` batches."""
        skipped = sum(1 for _ in itertools.islice(inner, batches))
        log.warning(
            "%s resumed %s by replay: re-read and discarded %d batch(es) (%d sample(s) at "
            "batch_size=%d) of epoch %d",
            _WHAT,
            type(self.dataset).__name__,
            skipped,
            skipped * (self.batch_size or 1),
            self.batch_size,
            self._epoch,
        )
        return inner

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._pass_start = 0
        self._pass_batches = 0
        if isinstance(self._order, _UserOrder):
            self._order.end_of_epoch()

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
        """The position as a few JSON values: ``epoch`` and ``position`` plus the
        configuration checked on load. With the loader's own order it is the same on every
        rank that consumed as many batches (one per step, as in data-parallel training)."""
        return self._order.state(self._epoch, self.position)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next ``iter`` resume at the saved position, dealt over this loader's
        world size (which may differ from the saving one with the loader's own order).

        Raises `StateMismatchError`, changing nothing, if the state is malformed or was saved
        with a different configuration. Any iterator created before the call becomes stale.
        """
        epoch, position = self._order.load(state_dict)
        self._invalidate()
        self._epoch = epoch
        self._pass_start = position
        self._pass_batches = 0
