"""`ResumableDataLoader`: a ``torch.utils.data.DataLoader`` whose position survives a restart.

The loader counts the batches *handed to the caller*, not those prefetched by workers, and
turns them into a position in the epoch through an `Order` (`resumable.data.positions`):
its own seeded, sharded order, a user's sampler or batch sampler, or an iterable dataset.

Trade-off: the state is a handful of JSON values rather than the DataLoader's internals
(worker processes, their RNGs, prefetch queues), so workers can be killed freely; randomness
drawn inside workers from their global RNG is not part of it (see docs/data.md, "Limits").
"""

import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, get_args

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from resumable.data.order import (
    WORKER_STREAM,
    ResumableSampler,
    SeededEpochs,
    ShardEnd,
    derive_seed,
    world,
)
from resumable.data.positions import (
    WHAT,
    BatchSizeChange,
    IterableOrder,
    Order,
    SeededOrder,
    UserOrder,
    has_state,
    refusal,
    sharded_by,
)
from resumable.data.seeding import PerSampleSeeding
from resumable.data.state import check_bool, is_int
from resumable.data.streams import TaggingCollate
from resumable.errors import UnsupportedStateError

__all__ = ["ResumableDataLoader"]

log = logging.getLogger(__name__)


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


class ResumableDataLoader(DataLoader[Any], SeededEpochs):
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

    ``reseed_per_sample=True`` makes random augmentations in worker processes exact at any
    resume point (`resumable.data.seeding`).

    ``on_batch_size_change`` decides what ``load_state_dict`` does with a state saved at
    another ``batch_size`` (`BatchSizeChange`): ``"error"`` (the default) refuses it;
    ``"continue"`` resumes the saved epoch at the saved sample position, so every sample of
    the epoch is still read once and only the batch boundaries move (the loader's own order
    and a user's ``sampler=``; refused for a ``batch_sampler=`` and an ``IterableDataset``,
    whose positions count batches); ``"restart_epoch"`` resumes the saved epoch from its
    start, with a WARNING. With a ``batch_sampler=`` the size compared is the batch
    sampler's own ``batch_size`` (and its ``drop_last`` must match), where it has an integer
    one as ``torch.utils.data.BatchSampler`` has; one without (a bucketing batch sampler)
    cannot be checked. It lives on the loader so that ``Checkpointer.restore()`` applies it
    too.

    An ``IterableDataset`` with ``state_dict()``/``load_state_dict()`` resumes from its own
    state, without re-reading anything: with worker processes, from each worker's state
    (`resumable.data.streams`; ``loader.dataset`` is then a wrapper whose ``.dataset`` is
    yours, and ``persistent_workers=True`` is refused). With ``replay_iterable=True`` any
    iterable dataset resumes by re-reading the consumed batches (WARNING with the count),
    workers or not.

    Args:
        dataset: as for ``DataLoader``; so are the other arguments not listed here.
        seed: the seed of every epoch's order and of the workers' base seed.
        num_replicas: the world size; default the default process group's, or 1.
        rank: this rank; default the default process group's, or 0.
        shard_end: ``"pad"`` or ``"drop"``: ``DistributedSampler``'s ``drop_last``.
        replay_iterable: resume any iterable dataset by re-reading consumed batches.
        reseed_per_sample: exact random augmentations in worker processes.
        on_batch_size_change: ``"error"``, ``"continue"`` or ``"restart_epoch"``.

    Raises:
        UnsupportedStateError: ``generator`` (the loader owns it; use ``seed``), a
            sampler or batch sampler whose order cannot be recomputed (`refusal`),
            ``in_order=False``, ``batch_size=None``, and an ``IterableDataset`` that
            cannot be resumed as above. The message says what to use instead.
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
        reseed_per_sample: bool = False,
        on_batch_size_change: BatchSizeChange = "error",
    ) -> None:
        if generator is not None:
            raise UnsupportedStateError(
                f"{WHAT} does not accept generator=: it owns the generator that seeds the "
                "order and the workers, so that both are a function of (seed, epoch). Use "
                "seed= instead."
            )
        if not in_order:
            raise UnsupportedStateError(
                f"{WHAT} does not support in_order=False: batch order would depend on "
                "worker timing and could not be resumed. Use in_order=True."
            )
        if batch_size is None:
            raise UnsupportedStateError(
                f"{WHAT} does not support batch_size=None (no automatic batching); use "
                "batch_size=1 and unpack the batch."
            )
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if on_batch_size_change not in get_args(BatchSizeChange):
            raise ValueError(
                "on_batch_size_change must be one of "
                f"{list(get_args(BatchSizeChange))}, got {on_batch_size_change!r}"
            )
        check_bool("drop_last", drop_last)
        check_bool("replay_iterable", replay_iterable)
        if check_bool("reseed_per_sample", reseed_per_sample):
            if persistent_workers:
                raise UnsupportedStateError(
                    f"{WHAT} cannot combine reseed_per_sample=True with persistent_workers="
                    "True: persistent workers keep the base seed of the epoch they started in, "
                    "so a resumed run would seed samples differently. Use persistent_workers="
                    "False."
                )
            if isinstance(dataset, IterableDataset):
                raise UnsupportedStateError(
                    f"{WHAT} reseeds per sample by index; an IterableDataset has no indices. "
                    "Derive its randomness from its own position instead."
                )
            worker_init_fn = PerSampleSeeding(worker_init_fn)
        world_size, my_rank = world(num_replicas, rank)
        order: Order
        if isinstance(dataset, IterableDataset):
            if sampler is not None or batch_sampler is not None or shuffle:
                raise ValueError(
                    "an IterableDataset takes no sampler=, batch_sampler= or shuffle=True (as "
                    "in DataLoader); it orders and shards itself."
                )
            name = type(dataset).__name__
            if not replay_iterable and not has_state(dataset):
                raise UnsupportedStateError(
                    f"{WHAT} cannot resume {name}: an IterableDataset without "
                    "state_dict()/load_state_dict() can only be resumed by re-reading the "
                    "consumed batches. Give it state_dict()/load_state_dict() (as Hugging Face "
                    "datasets.IterableDataset and torchdata's nodes have), or pass "
                    "replay_iterable=True to re-read and discard them on resume."
                )
            if persistent_workers and num_workers > 0:
                raise UnsupportedStateError(
                    f"{WHAT} cannot resume {name} read by persistent_workers=True: each "
                    "persistent worker keeps the copy of the dataset it started with, so "
                    "neither set_epoch() nor a resumed position reaches it. Use "
                    "persistent_workers=False."
                )
            iterable = IterableOrder(
                dataset,
                batch_size,
                drop_last,
                replay_iterable,
                world_size,
                my_rank,
                num_workers,
            )
            order = iterable
            sampler_args: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
            if iterable.streams is not None:
                # Workers read it: each reports its own state with every batch.
                dataset = iterable.streams
                collate_fn = TaggingCollate(collate_fn, batch_size, drop_last)
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
            why = refusal(user, kind)
            if why is not None:
                raise UnsupportedStateError(f"{WHAT} cannot resume {why}.")
            assert user is not None
            unit = 1 if batch_sampler is not None else batch_size
            user_world, user_rank = sharded_by(user) or (world_size, my_rank)
            user_order = UserOrder(user, kind, unit, user_world, user_rank)
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
                    f"{WHAT} needs a dataset with __len__ to make its order; "
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
            order = SeededOrder(own, batch_size, drop_last)
            sampler_args = {"batch_size": batch_size, "sampler": own, "drop_last": drop_last}
        self._order = order
        self._on_batch_size_change: BatchSizeChange = on_batch_size_change
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
    def position(self) -> int:
        """Where the current epoch stands: with the loader's own order, samples of the
        epoch's order consumed by all ranks together; with a user's sampler (batch sampler),
        indices (batches) this rank took from it."""
        return self._order.position(self._pass_start, self._pass_batches)

    @property
    def batches(self) -> int:
        """This rank's batches of the current epoch handed to the caller (after a change of
        world size, counted as if the new world size had read the epoch from its start)."""
        return self._order.batches_before(self._pass_start) + self._pass_batches

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
        if isinstance(self._order, IterableOrder):
            inner = self._order.merged(inner)
        replay = self._order.replay()
        if replay:
            inner = self._replayed(inner, replay)
        iterator = _EpochIterator(self, self._generation, inner)
        self._active = weakref.ref(iterator)
        return iterator

    def _replayed(self, inner: Iterator[Any], batches: int) -> Iterator[Any]:
        """``inner`` after re-reading and discarding its first ``batches`` batches."""
        skipped = sum(1 for _ in itertools.islice(inner, batches))
        log.warning(
            "%s resumed %s by replay: re-read and discarded %d batch(es) (%d sample(s) at "
            "batch_size=%d) of epoch %d",
            WHAT,
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
        """The position. With the loader's own order it is the same on every rank that
        consumed as many batches (one per step, as in data-parallel training).

        Returns:
            A few JSON values: ``epoch`` and ``position``, plus the configuration checked
            on load.
        """
        return self._order.state(self._epoch, self.position)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next ``iter`` resume at the saved position, dealt over this loader's
        world size (which may differ from the saving one with the loader's own order).

        Any iterator created before the call becomes stale. A different ``batch_size`` is
        handled as ``on_batch_size_change`` says.

        Args:
            state_dict: what `state_dict` returned.

        Raises:
            StateMismatchError: the state is malformed or was saved with a different
                configuration. Nothing is changed then.
        """
        epoch, position = self._order.load(state_dict, self._on_batch_size_change)
        self._invalidate()
        self._epoch = epoch
        self._pass_start = position
        self._pass_batches = 0
