"""Positions in an epoch: one object per way an epoch's order is made.

`ResumableDataLoader` counts the batches it hands out. Its `Order` says what position
that is, how to start the next pass from one, and what to save:

- `SeededOrder` (the default): the loader's own `ResumableSampler`. The position is the
  same on every rank and valid at any world size.
- `UserOrder`: a user's sampler or batch sampler, recomputed on resume, then skipped up
  to the position without loading data (`Skipping`). The position is the rank's own.
- `IterableOrder`: an ``IterableDataset``, through its own ``state_dict()`` or a replay.

A saved state is validated like any input read from disk. A state saved at another batch
size is refused by default (`batch_size_changed`). The trade-off: ``"continue"`` is
accepted only where the position counts samples, ``"restart_epoch"`` anywhere.
Why: docs/decisions.md, "Module notes moved from docstrings".
"""

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Literal, Protocol

from torch.utils.data import BatchSampler, Sampler, SequentialSampler

from resumable.data.order import STATE_VERSION, ResumableSampler, consumed, shard_length
from resumable.data.state import MASK64, expect_same, is_int, validated_state
from resumable.data.streams import WorkerCursor, WorkerStreams
from resumable.errors import StateMismatchError

__all__ = [
    "BATCH_SAMPLER_VERSION",
    "ITERABLE_VERSION",
    "WHAT",
    "BatchSizeChange",
    "IterableOrder",
    "Order",
    "SeededOrder",
    "Skipping",
    "UserOrder",
    "batch_sampler_shape",
    "batch_size_changed",
    "has_state",
    "refusal",
    "sharded_by",
]

WHAT = "ResumableDataLoader"

BATCH_SAMPLER_VERSION = 3
"""The version of a user's batch sampler state: version 2 plus ``"batch_sampler"``, what
decides its batches (`batch_sampler_shape`). A user's sampler state stays at version 2."""

ITERABLE_VERSION = 3
"""The version of an ``IterableDataset``'s state: version 2 plus ``"num_workers"``, with
``"dataset_state"`` holding each worker's state when workers read the dataset
(`resumable.data.streams`)."""

log = logging.getLogger(__name__)

BatchSizeChange = Literal["error", "continue", "restart_epoch"]
"""What `ResumableDataLoader.load_state_dict` does with a state saved at another batch size:
``"error"`` refuses it (`StateMismatchError`); ``"continue"`` resumes the saved epoch at the
saved sample position, in batches of the new size (only where the position counts samples:
the loader's own order, a user's ``sampler=``; refused for a ``batch_sampler=`` and an
``IterableDataset``, whose positions count batches); ``"restart_epoch"`` resumes the saved
epoch from its start, with a WARNING. For a ``batch_sampler=`` the batch size compared is
the batch sampler's own (`batch_sampler_shape`)."""


def batch_size_changed(
    saved: int | None,
    current: int | None,
    policy: BatchSizeChange,
    epoch: int,
    position: int,
    cannot_continue: str | None,
    name: str = "batch_size",
    keep: str | None = None,
) -> int:
    """The position to resume epoch ``epoch`` at, for a state saved at ``position`` with
    batch size ``saved``, in a loader with batch size ``current``.

    ``name`` is what the sizes are called in messages (``"batch_sampler.batch_size"`` for a
    user's batch sampler, where None stands for a size that was not recorded), ``keep`` the
    sentence that says how to keep the saved size (default: construct the loader with it).
    ``cannot_continue`` is None when ``position`` counts samples (any batch size continues
    from it exactly), else why it does not. Raises `StateMismatchError` for ``"error"``, and
    for ``"continue"`` with a ``cannot_continue`` reason; the message names the way out.
    """
    if saved == current:
        return position
    restart = f"on_batch_size_change='restart_epoch' (epoch {epoch} again from its start)"
    keep = keep or f"Construct it with {name}={saved}"
    if policy == "error":
        options = (
            restart
            if cannot_continue is not None
            else (
                f"on_batch_size_change='continue' (the rest of epoch {epoch}, in the same "
                f"order, in batches of {current}) or {restart}"
            )
        )
        raise StateMismatchError(
            f"{WHAT} checkpoint was saved with {name}={saved} but this {WHAT} has "
            f"{name}={current}; resuming would not continue the same sample sequence. "
            f"{keep}, or pass {options}."
        )
    if policy == "continue":
        if cannot_continue is not None:
            raise StateMismatchError(
                f"{WHAT} cannot continue epoch {epoch} at {name}={current} from a state "
                f"saved at {name}={saved}: {cannot_continue}. {keep}, or pass {restart}."
            )
        log.info(
            "%s continues epoch %d at sample position %d in batches of %s (saved with %s=%s)",
            WHAT,
            epoch,
            position,
            current,
            name,
            saved,
        )
        return position
    log.warning(
        "%s state was saved with %s=%s, this loader has %s=%s: "
        "on_batch_size_change='restart_epoch' starts epoch %d over from its beginning "
        "(the saved position %d of that epoch is discarded and its data read again)",
        WHAT,
        name,
        saved,
        name,
        current,
        epoch,
        position,
    )
    return 0


def batch_sampler_shape(batch_sampler: object) -> dict[str, Any] | None:
    """What decides the batches of a batch sampler that says so, as saved in its state:
    ``{"batch_size": int, "drop_last": bool | None}`` from its ``batch_size`` (a positive
    int) and ``drop_last`` (a bool, else None) attributes, as ``torch.utils.data.BatchSampler``
    has them. None for a batch sampler without an integer ``batch_size`` (a bucketing one):
    its batches cannot be checked."""
    size = getattr(batch_sampler, "batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MASK64:
        return None
    drop_last = getattr(batch_sampler, "drop_last", None)
    return {"batch_size": size, "drop_last": drop_last if isinstance(drop_last, bool) else None}


def saved_shape(value: object) -> dict[str, Any] | None:
    """The ``"batch_sampler"`` entry of a saved state, checked like `validated_state` checks
    the rest."""
    if value is None:
        return None
    ok = (
        isinstance(value, Mapping)
        and set(value) == {"batch_size", "drop_last"}
        and is_int(value["batch_size"])
        and 1 <= value["batch_size"] <= MASK64
        and (value["drop_last"] is None or isinstance(value["drop_last"], bool))
    )
    if not ok:
        raise StateMismatchError(
            f"{WHAT} state['batch_sampler'] must be None or {{'batch_size': a positive int, "
            f"'drop_last': a bool or None}}, found {value!r}; the checkpoint is damaged or not "
            f"a {WHAT} state."
        )
    assert isinstance(value, Mapping)
    return dict(value)


class Order(Protocol):
    """How an epoch's order is made and a position in it is counted.

    The loader calls `begin` before each pass (in the main process, before the DataLoader
    iterator exists), then `replay` once, `position` after each batch it hands out,
    `end_of_epoch` when a pass is exhausted, and `state`/`load` from its own
    ``state_dict``/``load_state_dict``.
    """

    per_rank: bool

    def begin(self, epoch: int, position: int) -> None:
        """Make the next iteration of the DataLoader's sampler yield from ``position``."""

    def position(self, start: int, batches: int) -> int:
        """The position after this rank took ``batches`` batches of a pass begun at
        ``start``."""

    def batches_from(self, position: int) -> int | None:
        """Batches of a pass begun at ``position`` (None when the order has no length)."""

    def batches_before(self, position: int) -> int:
        """This rank's batches that ``position`` stands for."""

    def replay(self) -> int:
        """Batches the pass `begin` prepared must re-read and throw away first (once)."""

    def end_of_epoch(self) -> None: ...

    def state(self, epoch: int, position: int) -> dict[str, Any]: ...

    def load(
        self, state: Mapping[str, Any], on_batch_size_change: BatchSizeChange
    ) -> tuple[int, int]:
        """Check ``state`` against this order; return the ``(epoch, position)`` to resume
        at (`batch_size_changed` decides it for a state saved at another batch size)."""


class SeededOrder:
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

    def batches_before(self, position: int) -> int:
        return -(-position // (self.batch_size * self.sampler.num_replicas))

    def replay(self) -> int:
        return 0

    def end_of_epoch(self) -> None:
        pass

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

    def load(
        self, state: Mapping[str, Any], on_batch_size_change: BatchSizeChange
    ) -> tuple[int, int]:
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
            WHAT,
            (1, STATE_VERSION),
            {1: {**common, "batches": int}, 2: {**common, "position": int, "shard_end": str}},
        )
        n = self.sampler.num_samples
        expect_same(WHAT, "dataset_len", s["dataset_len"], n, "Resume with the same dataset.")
        checks: list[tuple[str, object]] = [
            ("drop_last", self.drop_last),
            ("seed", self.sampler.seed),
            ("shuffle", self.sampler.shuffle),
        ]
        if s["version"] == 2:
            checks.append(("shard_end", self.sampler.shard_end))
        for key, current in checks:
            expect_same(WHAT, key, s[key], current, f"Construct it with {key}={s[key]!r}.")
        saved_batch = s["batch_size"]
        if s["version"] == 1:  # one process, (epoch, batches of the saved size handed out)
            whole, short = divmod(n, saved_batch)
            per_epoch = whole if self.drop_last or not short else whole + 1
            if self.sampler.num_replicas == 1 and s["batches"] > per_epoch:
                raise StateMismatchError(
                    f"{WHAT} state has batches={s['batches']} but an epoch has only "
                    f"{per_epoch} batches; the checkpoint is damaged."
                )
            position = min(s["batches"] * saved_batch, n)
        else:
            position = s["position"]
            if position > n:
                raise StateMismatchError(
                    f"{WHAT} state has position={position} but an epoch has only {n} "
                    "samples; the checkpoint is damaged."
                )
        # The position is a prefix of the epoch's order in samples: any batch size goes on
        # from it exactly.
        position = batch_size_changed(
            saved_batch, self.batch_size, on_batch_size_change, s["epoch"], position, None
        )
        return s["epoch"], position


def refusal(obj: object, arg: str) -> str | None:
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
        return refusal(obj.sampler, f"{arg}.sampler")
    return (
        f"{arg}={type(obj).__name__} has neither state_dict()/load_state_dict() nor "
        "set_epoch(epoch), so the order it yields after a restart cannot be known to be the "
        "one it yielded before (RandomSampler, WeightedRandomSampler and SubsetRandomSampler "
        "draw from a generator whose state is not saved). Use shuffle=True with seed= "
        "instead, or give the sampler a set_epoch(epoch) that seeds its own torch.Generator "
        "from (seed, epoch), or state_dict()/load_state_dict()"
    )


def sharded_by(obj: object) -> tuple[int, int] | None:
    """``(num_replicas, rank)`` of a ``DistributedSampler``-like sampler (or of the sampler
    inside a batch sampler), None for one that does not shard."""
    for candidate in (obj, getattr(obj, "sampler", None)):
        size, rank = getattr(candidate, "num_replicas", None), getattr(candidate, "rank", None)
        if is_int(size) and is_int(rank):
            assert isinstance(size, int) and isinstance(rank, int)
            return size, rank
    return None


class _PerRankOrder:
    """What the orders whose position is one rank's own share (`UserOrder`,
    `IterableOrder`): the keys they save, and the check that a state resumes at the
    same world size and rank. A subclass sets ``kind`` (saved as ``"order"``),
    ``batch_size``, ``world_size`` and ``rank``."""

    per_rank = True
    kind: str
    batch_size: int
    world_size: int
    rank: int

    @staticmethod
    def _keys(state_key: str, **extra: type) -> dict[str, type]:
        """The keys of a saved state besides ``version``, for `validated_state`:
        ``state_key`` holds the order's own state (anything), ``extra`` the subclass's."""
        return {
            "order": str,
            "epoch": int,
            "position": int,
            state_key: object,
            "batch_size": int,
            **extra,
            "world_size": int,
            "rank": int,
        }

    def _state(
        self, version: int, epoch: int, position: int, state_key: str, value: Any, **extra: Any
    ) -> dict[str, Any]:
        """A state with the keys of `_keys`, in that order."""
        return {
            "version": version,
            "order": self.kind,
            "epoch": epoch,
            "position": position,
            state_key: value,
            "batch_size": self.batch_size,
            **extra,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def _expect_same_rank(self, s: Mapping[str, Any], fix: str) -> None:
        """`StateMismatchError` (with ``fix``) unless ``s`` was saved at this world size
        and rank."""
        for key, current in (("world_size", self.world_size), ("rank", self.rank)):
            expect_same(WHAT, key, s[key], current, fix)

    def _resume_position(
        self,
        s: Mapping[str, Any],
        on_batch_size_change: BatchSizeChange,
        cannot_continue: str | None,
    ) -> int:
        """The position to resume the saved epoch at (`batch_size_changed` with the saved
        and this order's ``batch_size``)."""
        return batch_size_changed(
            s["batch_size"],
            self.batch_size,
            on_batch_size_change,
            s["epoch"],
            s["position"],
            cannot_continue,
        )


class UserOrder(_PerRankOrder):
    """A user's sampler (``unit`` = 1 index) or batch sampler (``unit`` = 1 batch), wrapped
    so that its next iteration starts at a position. The DataLoader iterates `Skipping`.

    A batch sampler's state (version `BATCH_SAMPLER_VERSION`) also records
    `batch_sampler_shape`, checked on load; version-2 states, written before it was
    recorded, load unchecked with a WARNING."""

    def __init__(
        self, inner: Iterable[Any], kind: str, batch_size: int, world_size: int, rank: int
    ) -> None:
        self.inner = inner
        self.kind = kind
        self.batch_size = batch_size  # indices per batch; 1 for a batch sampler
        self.world_size = world_size
        self.rank = rank
        self.skipping = Skipping(inner)
        self.pass_state: Any = None
        self.shape = batch_sampler_shape(inner) if kind == "batch_sampler" else None

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
    def _state_target(self) -> Any:
        """What holds the order's state: the sampler itself, or the sampler inside a
        ``BatchSampler`` (which has no state of its own); None for a stateless order."""
        if has_state(self.inner):
            return self.inner
        if isinstance(self.inner, BatchSampler) and has_state(self.inner.sampler):
            return self.inner.sampler
        return None

    def begin(self, epoch: int, position: int) -> None:
        target = self._epoch_target
        if target is not None:
            target.set_epoch(epoch)
        stateful = self._state_target
        if stateful is not None:
            if self.pass_state is not None:
                stateful.load_state_dict(self.pass_state)
            else:
                self.pass_state = stateful.state_dict()
        self.skipping.skip = position

    def end_of_epoch(self) -> None:
        self.pass_state = None

    def _pass_state(self) -> Any:
        """The sampler's state at the start of the current pass: the one taken when it
        began, or, between passes, the state the next pass will begin from."""
        if self.pass_state is not None:
            return self.pass_state
        stateful = self._state_target
        return None if stateful is None else stateful.state_dict()

    def batches_before(self, position: int) -> int:
        return -(-position // self.batch_size)

    def replay(self) -> int:
        return 0

    def position(self, start: int, batches: int) -> int:
        taken = start + batches * self.batch_size
        total = len(self.inner) if isinstance(self.inner, Sized) else None
        return taken if total is None else min(taken, total)

    def batches_from(self, position: int) -> int | None:
        return None  # the DataLoader's own len() applies

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        state = self._state(STATE_VERSION, epoch, position, "sampler_state", self._pass_state())
        if self.kind == "batch_sampler":
            state["version"] = BATCH_SAMPLER_VERSION
            state["batch_sampler"] = None if self.shape is None else dict(self.shape)
        return state

    def load(
        self, state: Mapping[str, Any], on_batch_size_change: BatchSizeChange
    ) -> tuple[int, int]:
        spec = self._keys("sampler_state")
        s = validated_state(
            state,
            WHAT,
            (STATE_VERSION, BATCH_SAMPLER_VERSION),
            {STATE_VERSION: spec, BATCH_SAMPLER_VERSION: {**spec, "batch_sampler": object}},
        )
        expect_same(WHAT, "order", s["order"], self.kind, f"Pass {s['order']}= as before.")
        if self.kind != "batch_sampler" and s["version"] == BATCH_SAMPLER_VERSION:
            raise StateMismatchError(
                f"{WHAT} state has version {BATCH_SAMPLER_VERSION}, which only a batch "
                f"sampler's state has, but order={s['order']!r}; the checkpoint is damaged."
            )
        self._expect_same_rank(
            s,
            f"A position in a user's {self.kind} is one rank's own; it resumes only at the "
            "same world size and rank. Use shuffle=/seed= (the loader's own sharded order) "
            "to resume at another world size.",
        )
        stateful = self._state_target is not None
        if s["sampler_state"] is not None and not stateful:
            raise StateMismatchError(
                f"{WHAT} state holds a sampler state_dict but this {self.kind} "
                f"({type(self.inner).__name__}) has no state_dict()/load_state_dict(); pass "
                f"the same kind of {self.kind} as before."
            )
        if s["sampler_state"] is None and stateful:
            raise StateMismatchError(
                f"{WHAT} state holds no sampler state_dict but the sampler of this "
                f"{self.kind} ({type(self.inner).__name__}) has state_dict()/"
                "load_state_dict(), so the order of the saved pass cannot be recomputed: "
                "either another kind of sampler saved it, or an earlier resumable version, "
                "which did not save the state of a sampler inside a BatchSampler, nor a "
                "sampler's state between epochs. Pass the same kind of sampler as before, or "
                "start the run over."
            )
        # A sampler's position counts its indices, which any batch size goes on from; a
        # batch sampler's batch size is its own (the loader's is 1 and does not change).
        position = self._resume_position(s, on_batch_size_change, None)
        if self.kind == "batch_sampler":
            position = self._batches_changed(s, on_batch_size_change, position)
        self.pass_state = s["sampler_state"]
        return s["epoch"], position

    def _batches_changed(
        self, s: Mapping[str, Any], on_batch_size_change: BatchSizeChange, position: int
    ) -> int:
        """`batch_size_changed` for the batch sampler's own batch size. Its position counts
        its batches, so another size never continues: the samples read end at
        ``position * saved size``, in general inside a batch of the new size, which a count
        of batches cannot express."""
        current = self.shape
        if s["version"] == STATE_VERSION:
            if current is not None and position:
                log.warning(
                    "%s state (version %d) was written before a batch sampler's batch size "
                    "was recorded: the batch_size=%d of this %s was not checked against the "
                    "one that counted the saved %d batch(es); if it differs, the resume is not "
                    "at the saved sample",
                    WHAT,
                    STATE_VERSION,
                    current["batch_size"],
                    type(self.inner).__name__,
                    position,
                )
            return position
        saved = saved_shape(s["batch_sampler"])
        if saved is not None and current is not None:
            expect_same(
                WHAT,
                "batch_sampler.drop_last",
                saved["drop_last"],
                current["drop_last"],
                f"Construct the batch sampler with drop_last={saved['drop_last']!r}.",
            )
        return batch_size_changed(
            None if saved is None else saved["batch_size"],
            None if current is None else current["batch_size"],
            on_batch_size_change,
            s["epoch"],
            position,
            "a batch sampler's position counts its own batches, and the samples in "
            f"{position} of them are not a whole number of batches of another size in "
            "general (pass sampler= and batch_size= to the loader instead of a "
            "BatchSampler: that position counts samples and continues at any batch size)",
            name="batch_sampler.batch_size",
            keep=(
                "Pass the same kind of batch sampler as before"
                if saved is None
                else f"Give it a batch sampler with batch_size={saved['batch_size']}"
            ),
        )


def has_state(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class IterableOrder(_PerRankOrder):
    """An ``IterableDataset``: the position is this rank's batches of the epoch.

    With ``state_dict()``/``load_state_dict()`` on the dataset, nothing is replayed:

    - without worker processes the dataset's own state is taken when the loader's is
      (nothing is prefetched then, so it is exactly after the last batch handed out) and
      loaded before the next pass;
    - with workers, each worker's copy of the dataset reports its state with every batch,
      and the loader keeps the state of each worker's last batch handed out, which workers'
      streams ended and which worker is next (`resumable.data.streams`); a resumed pass
      loads each worker's own state and goes on with the round robin where it stood.

    Otherwise, when the user opted in (``replay_iterable=True``), the pass re-reads and
    discards the consumed batches, with a WARNING. The dataset shards itself over ranks and
    workers (``get_worker_info``, ``split_dataset_by_node``), so the position is per rank,
    and the number of workers is checked on load (version `ITERABLE_VERSION`; version-2
    states, written before it was recorded, load unchecked where they used workers).
    """

    kind = "iterable"

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        drop_last: bool,
        replay: bool,
        world_size: int,
        rank: int,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.world_size = world_size
        self.rank = rank
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.by_replay = replay
        self.num_workers = num_workers
        self.streams: WorkerStreams | None = None
        self.cursor: WorkerCursor | None = None
        if num_workers > 0 and not replay:
            self.streams = WorkerStreams(dataset, batch_size)
            self.cursor = WorkerCursor(num_workers)
        self.pending: Any = None  # the dataset state to load before the next pass
        self.skip = 0  # batches to re-read and discard at the start of the next pass

    def begin(self, epoch: int, position: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        if self.by_replay:
            self.skip = position
        elif self.cursor is not None:
            assert self.streams is not None
            if not position:
                self.cursor.reset()
            elif self.pending is not None:
                self.cursor.load(self.pending, WHAT)
            self.cursor.prepare(self.streams)
        elif position:
            # A pass begun again mid-epoch (a loop broken out of, a state just loaded):
            # the dataset goes on from where the batches handed out left it.
            state = self.pending if self.pending is not None else self.dataset.state_dict()
            self.dataset.load_state_dict(state)
        self.pending = None

    def merged(self, inner: Iterator[Any]) -> Iterator[Any]:
        """The batches of a pass, in the order a ``DataLoader`` gives them (workers' batches
        handed out through the cursor)."""
        return inner if self.cursor is None else self.cursor.merged(inner)

    def position(self, start: int, batches: int) -> int:
        return start + batches

    def batches_from(self, position: int) -> int | None:
        return None

    def batches_before(self, position: int) -> int:
        return position

    def replay(self) -> int:
        skip, self.skip = self.skip, 0
        return skip

    def end_of_epoch(self) -> None:
        pass

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        dataset_state = None
        if not self.by_replay and position:
            if self.pending is not None:
                dataset_state = self.pending
            elif self.cursor is not None:
                dataset_state = self.cursor.state()
            else:
                dataset_state = self.dataset.state_dict()
        return self._state(
            ITERABLE_VERSION,
            epoch,
            position,
            "dataset_state",
            dataset_state,
            drop_last=self.drop_last,
            replay=self.by_replay,
            num_workers=self.num_workers,
        )

    def load(
        self, state: Mapping[str, Any], on_batch_size_change: BatchSizeChange
    ) -> tuple[int, int]:
        spec = self._keys("dataset_state", drop_last=bool, replay=bool)
        s = validated_state(
            state,
            WHAT,
            (STATE_VERSION, ITERABLE_VERSION),
            {STATE_VERSION: spec, ITERABLE_VERSION: {**spec, "num_workers": int}},
        )
        configuration: tuple[tuple[str, object], ...] = (
            ("order", self.kind),
            ("drop_last", self.drop_last),
            ("replay", self.by_replay),
        )
        for key, current in configuration:
            expect_same(WHAT, key, s[key], current, f"Construct it with {key}={s[key]!r}.")
        self._check_workers(s)
        self._expect_same_rank(
            s,
            "A position in an IterableDataset is one rank's own (the dataset shards "
            "itself); it resumes only at the same world size and rank.",
        )
        if not self.by_replay and s["position"] and s["dataset_state"] is None:
            raise StateMismatchError(
                f"{WHAT} state has position={s['position']} but no dataset_state; the "
                "checkpoint is damaged."
            )
        if self.cursor is not None and s["position"]:
            WorkerCursor(self.num_workers).load(s["dataset_state"], WHAT)  # check only
        position = self._resume_position(
            s,
            on_batch_size_change,
            f"the position in an IterableDataset counts this rank's batches of "
            f"{s['batch_size']}, and its samples are known only through the dataset's own "
            f"state or by re-reading batches of that size",
        )
        self.pending = s["dataset_state"] if position else None
        return s["epoch"], position

    def _check_workers(self, s: Mapping[str, Any]) -> None:
        """The saved number of workers against this loader's: each worker reads its own
        shard, so both the workers' states and a replay's batch order depend on it."""
        if s["version"] == ITERABLE_VERSION:
            saved = s["num_workers"]
        elif not s["replay"]:
            saved = 0  # version 2 resumed a dataset's own state only without workers
        else:
            if s["position"]:
                log.warning(
                    "%s state (version %d) was written before the number of workers was "
                    "recorded: num_workers=%d was not checked against the one that read the "
                    "%d batch(es) to replay; if it differs, the replay is not the saved "
                    "sequence",
                    WHAT,
                    STATE_VERSION,
                    self.num_workers,
                    s["position"],
                )
            return
        expect_same(
            WHAT,
            "num_workers",
            saved,
            self.num_workers,
            f"Each worker reads its own shard of the stream; construct it with "
            f"num_workers={saved}.",
        )


class Skipping(Sampler[Any]):
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
