"""Incremental checkpoints: a persist writes only the chunks that changed since the last
checkpoint its writer committed, and refers to the rest where it already lies.

Each writer (a rank's persist worker, or the in-process one) keeps a `DeltaBase`, the
tensor index of its last commit. It holds an XXH3-128 hash of every chunk (``chunk_bytes``
of a tensor) and where each chunk's bytes lie. At the next persist every chunk is hashed
again (`chunk_hashes`). A chunk whose tensor kept its dtype and shape, and whose hash is
the same, is not written. The manifest (format version 3, ``docs/format.md``) refers to
the earlier bytes. Every reference carries the tensor's XXH3-64 checksum, checked on read.

The trade-off: a reference ties a checkpoint to an older one, which retention must keep.
So a persist that saves little is written whole (``min_saving``), and an old checkpoint
is released once too little of it is reused (``min_live``). Nothing is remembered across
processes: a process's first persist is written whole.

Why content hashes, XXH3-128 and these thresholds: docs/incremental.md.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash

from resumable.format import CHUNK_HASH, TensorSlot
from resumable.retention import referenced

__all__ = ["CHUNK_HASH", "Chunk", "DeltaBase", "EarlyPlan", "Incremental", "Plan", "Record"]


@dataclass(frozen=True)
class Incremental:
    """How a `Checkpointer` writes incremental checkpoints (``incremental=`` argument;
    ``incremental=False`` writes every checkpoint whole).

    Args:
        chunk_bytes: the unit of "changed": a tensor is compared and written in pieces
            of this many bytes (a multiple of 8, at least 4 KiB). Smaller chunks write
            less of a partly changed tensor (an embedding table whose touched rows are
            clustered) and make larger manifests (one entry per chunk).
        min_saving: write a checkpoint incrementally only if the bytes it does not
            write are at least this fraction of the state's bytes (0 to 1).
        min_bytes: ... and at least this many bytes: a state of a few MiB, mostly
            random streams and counters that do not change, gains nothing worth tying
            its checkpoints to older ones.
        whole_every: write every this many-th persist whole (0: never), so no more than
            that many checkpoints ever depend on one earlier data file (whose damage
            would make all of them fall back) and retention can release old chains.
        min_live: reuse the chunks of an earlier checkpoint only while at least this
            fraction of its data bytes is still reused (0 to 1); below it they are
            written again so retention can release it.
        max_overhead: a checkpoint keeps alive every checkpoint it refers to, and what
            those refer to in turn (retention keeps them all, so that each stays
            loadable); when the data they hold that this checkpoint does not use would
            exceed this many times the state's bytes, the checkpoint is written whole
            instead, which lets retention release the chain. Bounds the disk an
            incremental root takes to about (1 + max_overhead) times a whole checkpoint
            per checkpoint kept.

    Raises:
        ValueError: a value of the wrong type or out of range.
    """

    chunk_bytes: int = 4 << 20
    min_saving: float = 0.25
    min_live: float = 0.25
    max_overhead: float = 1.0
    min_bytes: int = 1 << 20
    whole_every: int = 10

    def __post_init__(self) -> None:
        if (
            isinstance(self.chunk_bytes, bool)
            or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < 4096
            or self.chunk_bytes % 8
        ):
            raise ValueError(
                f"Incremental(chunk_bytes=...) must be an int multiple of 8 of at least "
                f"4096, got {self.chunk_bytes!r}"
            )
        for name in ("min_saving", "min_live"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value <= 1
            ):
                raise ValueError(f"Incremental({name}=...) must be between 0 and 1, got {value!r}")
        for name in ("min_bytes", "whole_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Incremental({name}=...) must be an int >= 0, got {value!r}")
        value = self.max_overhead
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
            raise ValueError(f"Incremental(max_overhead=...) must be >= 0, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        """The options as JSON values, for the persist worker's configuration.

        Returns:
            Every field, by name.
        """
        return {
            "chunk_bytes": self.chunk_bytes,
            "min_saving": self.min_saving,
            "min_live": self.min_live,
            "max_overhead": self.max_overhead,
            "min_bytes": self.min_bytes,
            "whole_every": self.whole_every,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Incremental | None:
        """The options `to_json` wrote.

        Args:
            d: what `to_json` returned, or None.

        Returns:
            The options, or None when ``d`` is None.

        Raises:
            ValueError: a value of the wrong type or out of range.
        """
        return None if d is None else cls(**d)


class Chunk(NamedTuple):
    """Where one chunk of a tensor lies: ``step`` None while it is this persist's own.
    (A tuple: a persist makes one per chunk, 65,536 for 256 MiB at 4 KiB chunks.)"""

    hash: str
    step: int | None
    file: str  # the data file's basename
    begin: int  # absolute byte offsets in that file
    end: int


@dataclass(frozen=True)
class Record:
    dtype: str  # the safetensors name
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    checksum: str  # the tensor's XXH3-64, as in the manifest


@dataclass
class SlotPlan:
    """One tensor of a persist: its chunks' ranges (relative to the tensor), hashes, and
    the earlier chunk each reuses (None: written now)."""

    slot: TensorSlot
    ranges: list[tuple[int, int]]
    hashes: list[str]
    reuse: list[Chunk | None]
    checksum: str | None = None  # the XXH3-64 it had, if every chunk is unchanged

    @property
    def whole(self) -> bool:
        return all(r is None for r in self.reuse)


@dataclass
class Plan:
    slots: list[SlotPlan]
    incremental: bool
    reused_bytes: int
    total_bytes: int
    records: dict[str, Record] = field(default_factory=dict)  # filled by the writer
    held: int = 0  # bytes of data this persist's own file holds
    # A plan made before its chunks were hashed (`DeltaBase.whole_plan`): every tensor
    # written whole, the hashes filled in while the file is written (`hash_whole`).
    deferred: bool = False

    @property
    def refs(self) -> list[int]:
        return sorted(
            {c.step for p in self.slots for c in p.reuse if c is not None and c.step is not None}
        )


class EarlyPlan(NamedTuple):
    """`DeltaBase.plan_early`: the plan if the cold chunks hash as they did, the tensors
    and their chunks, every chunk's hash (the cold ones guessed), and the cold chunks:
    their indices among all and their arena ranges."""

    plan: Plan
    slots: list[TensorSlot]
    slot_ranges: list[list[tuple[int, int]]]
    hashes: list[str]
    cold: list[int]
    cold_ranges: list[tuple[int, int]]


EARLY_MIN_BYTES = 32 << 20
"""Bytes of chunks guessed unchanged from which a persist writes its file while it
hashes them (`DeltaBase.plan_early`): below it, the hashing is over before a write
started beside it would gain anything."""

_HASH_ALONE_BYTES = 1 << 20
"""Chunks from this size are hashed on several threads (when there are enough bytes of
them, `_HASH_PARALLEL_MIN_BYTES`); smaller ones on the calling thread, where a thread's
hand-over would cost more than the hash."""
_HASH_PARALLEL_MIN_BYTES = 32 << 20
_pools: tuple[int, dict[int, ThreadPoolExecutor]] = (-1, {})  # (pid, workers -> pool)
_pools_lock = threading.Lock()


def _hash_pool(workers: int) -> ThreadPoolExecutor:
    """The threads that hash chunks beside the calling one, made once per process and
    count (a process forked after they started has none of them: it makes its own)."""
    global _pools
    with _pools_lock:
        if _pools[0] != os.getpid():
            _pools = (os.getpid(), {})
        pools = _pools[1]
        if workers not in pools:
            pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="resumable-hash")
        return pools[workers]


def chunk_hashes(
    data: memoryview, ranges: list[tuple[int, int]], threads: int | None = None
) -> list[str]:
    """The XXH3-128 of each ``[begin, end)`` of ``data``, in order. A persist hashes
    every chunk of the state to find the few that changed: a pass over memory that was
    more than half of a fine-tuning job's incremental commit on one thread (profiled,
    `docs/decisions.md`). Where there are enough large chunks, they are cut into ``threads``
    runs of about equal bytes, in order (the hash releases the GIL), one of them hashed
    on the calling thread; ``threads`` defaults to the cores this rank may use
    (`resumable.snapshot.copy_threads`)."""
    from resumable.snapshot import copy_threads

    n = copy_threads() if threads is None else threads
    big = [i for i, (b, e) in enumerate(ranges) if e - b >= _HASH_ALONE_BYTES]
    big_bytes = sum(ranges[i][1] - ranges[i][0] for i in big)
    if n < 2 or big_bytes < _HASH_PARALLEL_MIN_BYTES:
        return [xxhash.xxh3_128_hexdigest(data[b:e]) for b, e in ranges]
    out: list[str] = [""] * len(ranges)
    runs: list[list[int]] = [[] for _ in range(n)]
    done = 0
    for i in big:  # in order: run k holds the k-th n-th of the large chunks' bytes
        runs[min(n - 1, done * n // big_bytes)].append(i)
        done += ranges[i][1] - ranges[i][0]

    def run(indices: list[int]) -> None:
        for i in indices:
            b, e = ranges[i]
            out[i] = xxhash.xxh3_128_hexdigest(data[b:e])

    futures = [_hash_pool(n - 1).submit(run, r) for r in runs[1:] if r]
    try:
        run(runs[0])
        alone = set(big)
        run([i for i in range(len(ranges)) if i not in alone])
    finally:
        wait(futures)  # none still reads ``data`` once this returns or raises
    for f in futures:
        f.result()  # a thread's error
    return out


class DeltaBase:
    """The writer's memory of its last committed checkpoint (see the module doc)."""

    def __init__(self, config: Incremental) -> None:
        self.config = config
        self.step: int | None = None
        self.records: dict[str, Record] = {}
        self.held: dict[int, int] = {}  # step -> bytes of data its own files hold
        self.refs_of: dict[int, tuple[int, ...]] = {}  # step -> the steps it refers to
        self.since_whole = 0  # incremental persists since the last one written whole
        # Whether the last comparison of chunk hashes found too little to reuse (None:
        # nothing compared yet): see `expect_whole`.
        self._little_reused: bool | None = None
        # The tensors that changed at the last comparison (None: nothing compared yet):
        # see `plan_early`.
        self.changed: frozenset[str] | None = None

    def reset(self) -> None:
        """Forget everything: the next persist is written whole."""
        self.step, self.records, self.held, self.refs_of = None, {}, {}, {}
        self.since_whole = 0
        self._little_reused = None
        self.changed = None

    @property
    def expect_whole(self) -> bool:
        """Whether the next persist will be written whole whatever its hashes say: there
        is nothing to refer to (no checkpoint committed by this writer), or the last
        persist's chunks, compared with the one before, were too few to reuse (every
        tensor of a job that trains them all changes at every step). Such a persist
        is written at once, its chunks hashed while the file is written
        (`whole_plan`, `hash_whole`), instead of hashing the whole state before the
        first byte goes to the disk. A persist after one that had nothing to compare
        hashes first, so a state that stopped changing is found at the second persist."""
        if not self.records:
            return True
        return bool(self._little_reused)

    def closure(self, steps: Iterable[int]) -> set[int]:
        """``steps`` and every step they refer to, directly or through others: what
        retention keeps for a checkpoint that refers to ``steps``."""
        start = set(steps)
        return start | referenced(start, self.refs_of)

    def _ranges(self, slots: list[TensorSlot]) -> list[list[tuple[int, int]]]:
        """Each tensor's chunks, as byte ranges relative to the tensor."""
        cb = self.config.chunk_bytes
        return [
            [(b, min(b + cb, s.end - s.begin)) for b in range(0, s.end - s.begin, cb)] or [(0, 0)]
            for s in slots
        ]

    def plan(self, slots: list[TensorSlot], data: memoryview, step: int) -> Plan:
        """Hash every chunk of the snapshot and decide what to reuse."""
        slot_ranges = self._ranges(slots)
        all_hashes = chunk_hashes(
            data, [(s.begin + b, s.begin + e) for s, r in zip(slots, slot_ranges) for b, e in r]
        )
        return self._decide(slots, slot_ranges, all_hashes, step)

    def plan_early(self, slots: list[TensorSlot], data: memoryview, step: int) -> EarlyPlan | None:
        """A plan made before most of the state is hashed, for a persist that writes its
        file while the rest is hashed (`resumable.pipeline.write`): the chunks of the tensors
        that changed at the last comparison ("hot": the adapters, the head and their
        optimizer moments of a fine-tuning job) are hashed now; those of the others
        ("cold": the frozen base) are taken to hash as they did. `confirm` then hashes
        the cold chunks and says whether the guess held. None where it would not pay:
        nothing compared yet, or fewer than `EARLY_MIN_BYTES` bytes of cold chunks."""
        if self.changed is None or not self.records:
            return None
        if sum(s.end - s.begin for s in slots if s.name not in self.changed) < EARLY_MIN_BYTES:
            return None  # before cutting chunks: a table of 4 KiB chunks has 65,536
        slot_ranges = self._ranges(slots)
        hot: list[int] = []  # indices into the chunks of all slots, in order
        cold: list[int] = []
        guessed: list[str] = []
        ranges: list[tuple[int, int]] = []  # arena ranges of every chunk
        cold_bytes = 0
        for s, r in zip(slots, slot_ranges, strict=True):
            prev = self.records.get(s.name)
            quiet = (
                s.name not in self.changed
                and prev is not None
                and s.end > s.begin
                and prev.dtype == s.dtype
                and prev.shape == tuple(s.shape)
                and len(prev.chunks) == len(r)
            )
            for j, (b, e) in enumerate(r):
                (cold if quiet else hot).append(len(ranges))
                if quiet:
                    assert prev is not None
                    guessed.append(prev.chunks[j].hash)
                    cold_bytes += e - b
                ranges.append((s.begin + b, s.begin + e))
        if cold_bytes < EARLY_MIN_BYTES:
            return None
        hashes = [""] * len(ranges)
        for i, h in zip(hot, chunk_hashes(data, [ranges[i] for i in hot]), strict=True):
            hashes[i] = h
        for i, h in zip(cold, guessed, strict=True):
            hashes[i] = h
        plan = self._decide(slots, slot_ranges, hashes, step)
        return EarlyPlan(plan, slots, slot_ranges, hashes, cold, [ranges[i] for i in cold])

    def confirm(self, early: EarlyPlan, data: memoryview, step: int) -> Plan | None:
        """Hash the cold chunks of ``early``: None if each hashes as guessed (``early.plan``
        is then the plan `plan` would have made), else the plan for the real hashes."""
        got = chunk_hashes(data, early.cold_ranges)
        hashes = list(early.hashes)
        wrong = False
        for i, h in zip(early.cold, got, strict=True):
            wrong = wrong or hashes[i] != h
            hashes[i] = h
        return self._decide(early.slots, early.slot_ranges, hashes, step) if wrong else None

    def whole_plan(self, slots: list[TensorSlot]) -> Plan:
        """A plan that writes every tensor whole, made before any chunk is hashed (where
        `expect_whole`): the file is laid out and written at once, and `hash_whole`
        fills in the chunk hashes meanwhile."""
        plans = [SlotPlan(s, r, [], [None] * len(r)) for s, r in zip(slots, self._ranges(slots))]
        return Plan(plans, False, 0, sum(s.end - s.begin for s in slots), deferred=True)

    def hash_whole(self, plan: Plan, data: memoryview, step: int) -> None:
        """Hash the chunks of a `whole_plan` (on the calling thread: it runs beside the
        write and the checksums), and compare them with the base as `plan` would, to
        know whether the next persist can expect to be whole too."""
        slots = [p.slot for p in plan.slots]
        ranges = [p.ranges for p in plan.slots]
        all_hashes = chunk_hashes(
            data, [(s.begin + b, s.begin + e) for s, r in zip(slots, ranges) for b, e in r], 1
        )
        compared = self._decide(slots, ranges, all_hashes, step)  # for `expect_whole` only
        for p, q in zip(plan.slots, compared.slots, strict=True):
            p.hashes = q.hashes

    def _decide(
        self,
        slots: list[TensorSlot],
        slot_ranges: list[list[tuple[int, int]]],
        all_hashes: list[str],
        step: int,
    ) -> Plan:
        """The plan for chunks of these hashes: which to reuse, and whether the persist
        is incremental at all."""
        plans: list[SlotPlan] = []
        changed: set[str] = set()
        live: dict[int, int] = defaultdict(int)
        total = 0
        matched = 0  # bytes of chunks that hash as before, reused or not
        at = 0
        for s, ranges in zip(slots, slot_ranges, strict=True):
            n = s.end - s.begin
            total += n
            hashes = all_hashes[at : at + len(ranges)]
            at += len(ranges)
            prev = self.records.get(s.name)
            same = (
                prev is not None
                and n > 0
                and prev.dtype == s.dtype
                and prev.shape == tuple(s.shape)
                and len(prev.chunks) == len(hashes)
            )
            reuse: list[Chunk | None] = []
            unchanged = (
                same
                and prev is not None
                and all(c.hash == h for c, h in zip(prev.chunks, hashes, strict=True))
            )
            for i, h in enumerate(hashes):
                old = prev.chunks[i] if same and prev is not None else None
                if old is not None and old.hash == h and old.step is not None and old.step < step:
                    reuse.append(old)
                    live[old.step] += old.end - old.begin
                    matched += old.end - old.begin
                else:
                    reuse.append(None)
            if not unchanged:
                changed.add(s.name)
            plans.append(
                SlotPlan(s, ranges, hashes, reuse, prev.checksum if unchanged and prev else None)
            )
        self.changed = frozenset(changed)
        dead = {k for k, v in live.items() if v < self.config.min_live * self.held.get(k, v)}
        reused = 0
        for p in plans:
            for i, c in enumerate(p.reuse):
                if c is not None and c.step in dead:
                    p.reuse[i] = None
                elif c is not None:
                    reused += c.end - c.begin
        cfg = self.config
        # The next persist is expected whole when few chunks hash as before, whatever
        # this one reuses: unchanged chunks of an old checkpoint written again now
        # (`min_live`) are reusable next time.
        if self.records:
            self._little_reused = not (
                matched > 0 and matched >= cfg.min_saving * total and matched >= cfg.min_bytes
            )
        else:
            self._little_reused = None
        incremental = (
            reused > 0
            and reused >= cfg.min_saving * total
            and reused >= cfg.min_bytes
            and not (cfg.whole_every and self.since_whole + 1 >= cfg.whole_every)
        )
        if incremental:
            holders = {
                c.step for p in plans for c in p.reuse if c is not None and c.step is not None
            }
            kept = sum(self.held.get(k, 0) for k in self.closure(holders))
            if kept - reused > self.config.max_overhead * total:
                incremental = False  # the chain would keep too much alive: start anew
        if not incremental:
            for p in plans:
                p.reuse = [None] * len(p.reuse)
            reused = 0
        return Plan(plans, incremental, reused, total)

    def committed(self, step: int, plan: Plan) -> None:
        """``plan``'s checkpoint was committed as ``step``: it becomes the base."""
        self.records = {
            name: Record(
                r.dtype,
                r.shape,
                tuple(
                    c if c.step is not None else Chunk(c.hash, step, c.file, c.begin, c.end)
                    for c in r.chunks
                ),
                r.checksum,
            )
            for name, r in plan.records.items()
        }
        self.step = step
        self.held[step] = plan.held
        self.refs_of[step] = tuple(plan.refs)
        self.since_whole = self.since_whole + 1 if plan.incremental else 0
        alive = self.closure([step])  # what any later reference can bring along
        self.held = {k: v for k, v in self.held.items() if k in alive}
        self.refs_of = {k: v for k, v in self.refs_of.items() if k in alive}
