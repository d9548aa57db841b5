"""An ``IterableDataset`` read by worker processes, resumed from each worker's own state.

Each worker iterates its own copy of the dataset, so the stream's position lives in the
workers, one state per worker. Three parts carry it to the main process and back, as
torchdata's ``StatefulDataLoader`` does, without replacing ``DataLoader``.
`WorkerStreams` is the dataset each worker iterates, starting from its saved state.
`TaggingCollate` tags each batch with its worker and that worker's ``state_dict()``.
`WorkerCursor`, in the main process, records the round robin as batches are handed out.

Contract: the batches of an epoch are those of a ``DataLoader`` over the same dataset
with the same ``num_workers``, in the same order. A resume at any batch boundary yields
the rest of them without reading a consumed sample again. The cost: a ``state_dict()``
per batch, and the end of each worker's stream arrives as a batch of its own.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from resumable.data.state import MASK64, is_int
from resumable.errors import StateMismatchError

__all__ = ["END", "Tagged", "TaggingCollate", "WorkerCursor", "WorkerStreams"]


class _End:
    """The type of `END`; compared by type, as each worker unpickles its own instance."""

    def __repr__(self) -> str:
        return "END"


END = _End()


class Tagged:
    """A batch (None for a fetch that held only end markers, or a short last batch that
    ``drop_last`` drops) with the worker it came from and that worker's dataset state after
    it."""

    __slots__ = ("batch", "ended", "state", "worker")

    def __init__(self, batch: Any, worker: int, state: Any, ended: bool) -> None:
        self.batch = batch
        self.worker = worker
        self.state = state
        self.ended = ended

    def pin_memory(self, *args: Any) -> "Tagged":
        """Called by the ``DataLoader``'s pin-memory thread: pins the batch."""
        from torch.utils.data._utils.pin_memory import pin_memory

        if self.batch is not None:
            self.batch = pin_memory(self.batch, *args)
        return self


class WorkerStreams(IterableDataset[Any]):
    """The dataset a ``DataLoader`` with workers iterates in place of the user's
    ``dataset`` (kept as `dataset`; other attributes are looked up on it)."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.resume: list[Any] | None = None
        """Per worker, the state its stream loads before the pass (None: from the start)."""
        self.ended: list[bool] | None = None
        """Per worker, whether its stream had ended: it yields only end markers."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError(f"{type(self.dataset).__name__} has no len()")
        return len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:
            raise RuntimeError("WorkerStreams is iterated by DataLoader worker processes only")
        worker = info.id
        count = 0
        if not (self.ended is not None and self.ended[worker]):
            state = None if self.resume is None else self.resume[worker]
            if state is not None:
                self.dataset.load_state_dict(state)
            for item in self.dataset:
                count += 1
                yield item
        # Complete the batch with end markers (a whole batch of them after a full one): the
        # fetcher never sees a short batch, so drop_last cannot hide the end of the stream.
        for _ in range(self.batch_size - count % self.batch_size):
            yield END


class TaggingCollate:
    """The ``collate_fn`` of a `WorkerStreams` loader: the user's, applied in the worker to
    the batch without its end markers, returning a `Tagged` batch."""

    def __init__(
        self, collate: Callable[[list[Any]], Any] | None, batch_size: int, drop_last: bool
    ) -> None:
        self.collate = collate if collate is not None else default_collate
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __call__(self, items: list[Any]) -> Tagged:
        info = get_worker_info()
        if info is None or not isinstance(info.dataset, WorkerStreams):
            raise RuntimeError("TaggingCollate runs in the workers of a WorkerStreams loader")
        real = [item for item in items if not isinstance(item, _End)]
        ended = len(real) < len(items)
        short = len(real) < self.batch_size
        keep = bool(real) and not (short and self.drop_last)
        batch = self.collate(real) if keep else None
        return Tagged(batch, info.id, info.dataset.dataset.state_dict(), ended)


class WorkerCursor:
    """Where each worker's stream stands in what was handed to the caller."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.states: list[Any] = [None] * num_workers
        self.ended = [False] * num_workers
        self.next = 0

    def reset(self) -> None:
        self.states = [None] * self.num_workers
        self.ended = [False] * self.num_workers
        self.next = 0

    def prepare(self, streams: WorkerStreams) -> None:
        """Make the next pass of ``streams`` resume each worker where this cursor stands."""
        fresh = self.next == 0 and not any(self.ended) and all(s is None for s in self.states)
        streams.resume = None if fresh else list(self.states)
        streams.ended = None if fresh else list(self.ended)

    def merged(self, inner: Iterator[Tagged]) -> Iterator[Any]:
        """The batches of ``inner`` (one `Tagged` per fetch, round robin over the workers
        from worker 0) in round-robin order from `next`, skipping ended workers; the cursor
        moves as each is handed out."""
        queues: list[deque[Tagged]] = [deque() for _ in range(self.num_workers)]
        while not all(self.ended):
            worker = self.next
            if self.ended[worker]:
                self.next = (worker + 1) % self.num_workers
                continue
            while not queues[worker]:
                tagged = next(inner, None)
                if tagged is None:
                    raise RuntimeError(
                        f"DataLoader worker {worker} stopped without its end marker; its "
                        "stream's position is unknown"
                    )
                queues[tagged.worker].append(tagged)
            tagged = queues[worker].popleft()
            self.states[worker] = tagged.state
            self.ended[worker] = tagged.ended
            self.next = (worker + 1) % self.num_workers
            if tagged.batch is not None:
                yield tagged.batch

    def state(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "next": self.next,
            "states": list(self.states),
            "ended": list(self.ended),
        }

    def load(self, state: object, what: str) -> None:
        """Check a saved `state` (from the checkpoint's JSON) and adopt it."""
        ok = (
            isinstance(state, Mapping)
            and set(state) == {"num_workers", "next", "states", "ended"}
            and is_int(state["num_workers"])
            and 1 <= state["num_workers"] <= MASK64
            and is_int(state["next"])
            and isinstance(state["states"], list)
            and isinstance(state["ended"], list)
            and all(isinstance(e, bool) for e in state["ended"])
        )
        if not ok:
            raise StateMismatchError(
                f"{what} state['dataset_state'] of an IterableDataset read by worker processes "
                "must be {'num_workers': a positive int, 'next': an int, 'states': a list, "
                f"'ended': a list of bools}}, found {state!r}; the checkpoint is damaged or "
                f"not a {what} state."
            )
        assert isinstance(state, Mapping)
        n = state["num_workers"]
        if n != self.num_workers:
            raise StateMismatchError(
                f"{what} checkpoint was saved with num_workers={n} but this {what} has "
                f"num_workers={self.num_workers}; each worker reads its own shard of the "
                f"stream, so the saved positions belong to {n} workers. Construct it with "
                f"num_workers={n}."
            )
        if len(state["states"]) != n or len(state["ended"]) != n or not state["next"] < n:
            raise StateMismatchError(
                f"{what} state['dataset_state'] holds {len(state['states'])} states, "
                f"{len(state['ended'])} end flags and next={state['next']} for {n} workers; "
                "the checkpoint is damaged."
            )
        self.states = list(state["states"])
        self.ended = list(state["ended"])
        self.next = state["next"]
