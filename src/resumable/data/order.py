"""The order of an epoch, and each rank's share of what is left of it.

`ResumableSampler` draws epoch ``e``'s permutation from a ``torch.Generator`` seeded by
a pure function of ``(seed, e)``. So any position is recomputed without replaying the
epochs before it. A position (``start``) is one number: the entries all ranks consumed
together. The rest is dealt as ``DistributedSampler`` deals an epoch: padded or cut to a
multiple of the world size, rank ``r`` taking ``r, r + world, ...``. The consumed set is
thus a prefix of the epoch's order. A restart at another world size deals what is left
over the new ranks, each entry exactly once.

Trade-off: a prefix needs every rank to consume at the same pace (one batch per rank per
step). Ranks that drift apart still resume exactly at the same world size. But their
position is then per-rank state, which a world-size change cannot carry over.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from collections.abc import Iterator, Mapping, Sized
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from resumable.data.state import (
    MASK64,
    check_bool,
    check_u64,
    expect_same,
    is_int,
    validated_state,
)
from resumable.errors import StateMismatchError

__all__ = [
    "ResumableSampler",
    "SeededEpochs",
    "ShardEnd",
    "derive_seed",
    "shard",
    "shard_length",
    "world",
]

ShardEnd = Literal["pad", "drop"]
"""What to do with the end of an epoch that does not divide by the world size:
``"pad"`` repeats the epoch's first entries (``DistributedSampler(drop_last=False)``),
``"drop"`` leaves the last few out (``DistributedSampler(drop_last=True)``)."""

STATE_VERSION = 2
PERMUTATION_STREAM = 1
WORKER_STREAM = 2
_CHUNK = 1 << 16


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, epoch: int, stream: int) -> int:
    """Return a 64-bit seed that is a pure function of ``(seed, epoch, stream)``.

    Distinct streams (sampler permutation, worker base seed) give unrelated seeds, and
    neighbouring epochs give unrelated seeds, unlike ``seed + epoch``.
    """
    h = _splitmix64(seed & MASK64)
    h = _splitmix64(h ^ (epoch & MASK64))
    return _splitmix64(h ^ (stream & MASK64))


def world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(world_size, rank)``: the given ones, else the default process group's, else (1, 0)."""
    initialized = dist.is_available() and dist.is_initialized()
    size = (
        num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
    )
    me = rank if rank is not None else (dist.get_rank() if initialized else 0)
    if not is_int(size) or size < 1:
        raise ValueError(f"num_replicas must be a positive int, got {size!r}")
    if not is_int(me) or not 0 <= me < size:
        raise ValueError(f"rank must be an int in [0, {size}), got {me!r}")
    return size, me


def _check_shard_end(value: object) -> ShardEnd:
    if value == "pad":
        return "pad"
    if value == "drop":
        return "drop"
    raise ValueError(f"shard_end must be 'pad' or 'drop', got {value!r}")


def shard_length(n: int, start: int, world_size: int, shard_end: ShardEnd) -> int:
    """Entries each rank gets from the rest ``[start, n)`` of an epoch of ``n``."""
    rest = max(n - start, 0)
    if shard_end == "drop":
        return rest // world_size
    return -(-rest // world_size)


def shard(
    order: torch.Tensor, start: int, world_size: int, rank: int, shard_end: ShardEnd
) -> torch.Tensor:
    """This rank's share of ``order[start:]``, dealt as described in the module docstring."""
    n = order.numel()
    per = shard_length(n, start, world_size, shard_end)
    rest = order[start : start + per * world_size]
    pad = per * world_size - rest.numel()
    if pad > 0:  # only with "pad": repeat the epoch from its beginning, as DistributedSampler
        rest = torch.cat([rest, order.repeat(-(-pad // n))[:pad]])
    return rest[rank::world_size]


def consumed(n: int, start: int, world_size: int, shard_end: ShardEnd, taken: int) -> int:
    """The epoch position after each rank took ``taken`` entries of its share from ``start``."""
    per = shard_length(n, start, world_size, shard_end)
    return start + min(world_size * min(taken, per), n - start)


class SeededEpochs:
    """The read-only ``seed``, ``shuffle`` and ``epoch`` of an object whose order of each
    epoch is a pure function of ``(seed, epoch)`` (`ResumableSampler`,
    `ResumableDataLoader`). The object sets ``_seed``, ``_shuffle`` and ``_epoch``."""

    _seed: int
    _shuffle: bool
    _epoch: int

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def epoch(self) -> int:
        """The epoch the next ``__iter__`` draws its order from."""
        return self._epoch


class ResumableSampler(Sampler[int], SeededEpochs):
    """Sampler whose epoch permutation is a pure function of ``(seed, epoch, len)``, sharded
    over ranks like ``DistributedSampler``.

    Each ``__iter__`` draws the permutation of the current epoch from a fresh
    ``torch.Generator`` seeded with ``(seed, epoch)``; the global torch, Python and NumPy RNGs
    are never read or advanced. ``start_at(i)`` makes the *next* ``__iter__`` deal
    ``permutation[i:]`` over the ranks (a one-shot offset, reset to 0 once an iterator has
    been created); ``i`` counts entries consumed by all ranks together. ``shuffle=False``
    deals ``range(len)``. ``num_replicas`` and ``rank`` default to the default process
    group's, or one process.

    The sampler does not observe what its consumer has actually used (a DataLoader
    prefetches), so its state is its configuration plus the pending ``(epoch, start)``;
    tracking the consumed position is `ResumableDataLoader`'s job.

    Args:
        data_source_or_len: the data source (anything with ``__len__``) or its length.
        shuffle: a seeded permutation per epoch; False deals ``range(len)``.
        seed: the seed every epoch's permutation derives from (an unsigned 64-bit int).
        num_replicas: the world size; default the default process group's, or 1.
        rank: this rank; default the default process group's, or 0.
        shard_end: ``"pad"`` (repeat the epoch's first entries) or ``"drop"``.

    Raises:
        ValueError: a negative length, or a value out of range.
        TypeError: ``data_source_or_len`` neither an int nor sized, or a value of the
            wrong type.
    """

    def __init__(
        self,
        data_source_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard_end: ShardEnd = "pad",
    ) -> None:
        super().__init__()
        if is_int(data_source_or_len):
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
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_u64("seed", seed)
        self._world, self._rank = world(num_replicas, rank)
        self._shard_end = _check_shard_end(shard_end)
        self._epoch = 0
        self._start = 0

    @property
    def num_samples(self) -> int:
        """Entries per full epoch, all ranks together (the data source's current length)."""
        return len(self._source) if self._source is not None else self._length

    @property
    def start(self) -> int:
        """Epoch position (entries consumed by all ranks) at which the next ``__iter__``
        begins."""
        return self._start

    @property
    def num_replicas(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def shard_end(self) -> ShardEnd:
        return self._shard_end

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation used by the next ``__iter__``; keeps a pending offset.

        Args:
            epoch: the epoch (an unsigned 64-bit int).
        """
        self._epoch = check_u64("epoch", epoch)

    def start_at(self, index_in_epoch: int) -> None:
        """Make the next ``__iter__`` deal ``permutation[index_in_epoch:]`` over the ranks.

        Args:
            index_in_epoch: entries consumed by all ranks together. The epoch's length is
                allowed and yields nothing.

        Raises:
            ValueError: ``index_in_epoch`` past the epoch's length.
        """
        index = check_u64("index_in_epoch", index_in_epoch)
        if index > self.num_samples:
            raise ValueError(
                f"index_in_epoch must be in [0, {self.num_samples}] (the epoch length), got {index}"
            )
        self._start = index

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The full index order of an epoch, before sharding.

        Args:
            epoch: the epoch; default the current one.

        Returns:
            An int64 tensor of the epoch's indices.
        """
        e = self._epoch if epoch is None else check_u64("epoch", epoch)
        n = self.num_samples
        if not self._shuffle:
            return torch.arange(n, dtype=torch.int64)
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self._seed, e, PERMUTATION_STREAM))
        return torch.randperm(n, generator=generator)

    def __iter__(self) -> Iterator[int]:
        start = self._start
        if start > self.num_samples:
            raise StateMismatchError(
                f"sampler offset {start} is past the end of the data source "
                f"(length {self.num_samples}); the data source shrank after start_at()."
            )
        self._start = 0
        if start == self.num_samples:
            return iter(())
        mine = shard(self.permutation(), start, self._world, self._rank, self._shard_end)
        return _iter_chunks(mine)

    def __len__(self) -> int:
        """Length of the iterator the next ``__iter__`` returns: this rank's share of the rest
        of the epoch."""
        return shard_length(self.num_samples, self._start, self._world, self._shard_end)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, the same on every rank.

        Returns:
            JSON-serialisable values: the pending epoch and offset, and the configuration
            that fixes the order (seed, shuffle, length, shard_end).
        """
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "start": self._start,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_samples": self.num_samples,
            "shard_end": self._shard_end,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore epoch and offset, at this sampler's world size (which may differ from
        the saving one). Version-1 states (one process, before sharding) load as
        ``shard_end="pad"``.

        Args:
            state_dict: what `state_dict` returned.

        Raises:
            StateMismatchError: the state is malformed, or its seed, shuffle, length or
                shard_end differ from this sampler's. Nothing is changed then.
        """
        what = "ResumableSampler"
        v1 = {"epoch": int, "start": int, "seed": int, "num_samples": int, "shuffle": bool}
        s = validated_state(
            state_dict, what, (1, STATE_VERSION), {1: v1, 2: {**v1, "shard_end": str}}
        )
        expect_same(what, "num_samples", s["num_samples"], self.num_samples, "Use the same data.")
        expect_same(what, "seed", s["seed"], self._seed, f"Construct it with seed={s['seed']}.")
        expect_same(
            what,
            "shuffle",
            s["shuffle"],
            self._shuffle,
            f"Construct it with shuffle={s['shuffle']}.",
        )
        if s["version"] == 2:
            expect_same(
                what,
                "shard_end",
                s["shard_end"],
                self._shard_end,
                f"Construct it with shard_end={s['shard_end']!r}.",
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
