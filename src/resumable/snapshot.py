"""Consistent host copies of the captured tensors, at a step boundary.

`Arena` owns one preallocated byte buffer laid out exactly like the data region of a
safetensors file (see `resumable.format.plan_layout`), so a snapshot is one copy in
and the persist writes it out with no further copy. The buffer is allocated on the
first snapshot and reused while the state's layout stays the same; it is reallocated
only when tensors appear, disappear or change shape (e.g. optimizer moments created by
the first ``optimizer.step()``). Pinned when any source tensor lives on CUDA.

This is the only part of a save that blocks training: once `Arena.snapshot` returns,
the trainer may mutate every tensor and the snapshot stays as it was.

`ShmArena` is the memory tier: the same layout in shared-memory slots (`resumable._shm`),
two alternating and a third while a persist worker process writes one out, so that the
two newest complete snapshots outlive a crash of the training process, even one during
a copy. Large copies are split across a small thread pool.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import operator
import os
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumable._dtypes import dtype_from_name
from resumable._lazy import torch_module
from resumable._shm import (
    COMPLETE,
    PREFIX,
    SHM_DIR,
    SLOTS,
    RawJSON,
    ShmSlot,
    SlotContent,
    SlotMeta,
    attach_unlocked,
    decode_meta,
    fallback_dir,
    layout_meta,
    own_dir,
    release_fd,
    replaced_size,
    slot_paths,
)
from resumable.errors import CheckpointError, CorruptCheckpointError, StorageError
from resumable.format import TensorSlot, byte_view, checksum, copy_checksum, plan_layout

if TYPE_CHECKING:
    import torch
else:
    torch = torch_module()

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """Bytes of every tensor, packed per `slots`, in ``buffer``: a uint8 CPU tensor, or
    the bytes themselves (the persist worker's view of a shared-memory slot, which
    writes them without importing torch)."""

    slots: list[TensorSlot]
    buffer: torch.Tensor | memoryview

    @property
    def nbytes(self) -> int:
        return self.slots[-1].end if self.slots else 0

    def memory(self) -> memoryview:
        """The packed bytes, without a copy."""
        if self.nbytes == 0:
            return memoryview(b"")
        if isinstance(self.buffer, memoryview):
            return self.buffer[: self.nbytes]
        return byte_view(self.buffer[: self.nbytes])

    def tensor(self, slot: TensorSlot) -> torch.Tensor:
        """A view of one tensor inside the arena (valid until the next snapshot)."""
        buf = self.buffer
        if isinstance(buf, memoryview):
            buf = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0)
        return tensor_view(buf, slot)


def tensor_view(buf: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return buf[slot.begin : slot.end].view(dtype_from_name(slot.dtype)).view(slot.shape)


class CopyPlan:
    """The layout of one state structure, and the copy of its tensors into a buffer laid out
    by it: planned once, reused at every snapshot while the structure stays the same.

    The structure is the tensors' names in order and each one's dtype, shape and device;
    `matches` compares all of them, so a tensor that
    appears (optimizer moments at the first step), disappears, is resized or changes dtype
    makes a new plan, and a plan is never used for a state it was not made for. The layout
    is encoded to JSON once (``layout_json``), and the destination views of each buffer
    are made once: a snapshot of many small tensors is one ``torch._foreach_copy_`` call
    (`copy`), not one Python-level copy per tensor. Measured in ``docs/performance.md``
    ("Snapshots of many small tensors").

    Where torch has them, the tensors are compared by the C++ checks ``torch.compile``
    guards its graphs with (``torch._C._dynamo.guards.TensorGuards``: class, dispatch
    keys, dtype, device, ``requires_grad``, sizes and strides, ~50 ns a tensor against
    ~150 ns for reading dtype, shape and device from Python); it is a private API, so it
    is used only if it builds and accepts the very tensors it was built from, else the
    Python comparison is.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], last: Collection[str] = ()) -> None:
        self.names = list(tensors)
        self._guard = _tensor_guard(list(tensors.values()))
        self.specs = _specs(tensors)
        # each tensor's device where any is not on the CPU (reading it allocates)
        self.devices = None if all(cpu for _, _, cpu in self.specs) else _devices(tensors)
        self.slots = plan_layout(tensors, last)
        self.nbytes = self.slots[-1].end if self.slots else 0
        self.layout_json = RawJSON(
            json.dumps(layout_meta(self.slots), separators=(",", ":"), allow_nan=False)
        )
        # the start of every snapshot's metadata object with this layout (`ShmSlot.finish_write`)
        self.meta_head = ('{"layout":' + self.layout_json + ",").encode()
        self.on_cuda = self.devices is not None and any(d.type == "cuda" for d in self.devices)
        by_name = {s.name: s for s in self.slots}
        self._in_order = [by_name[n] for n in self.names]  # each tensor's slot, dict order
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._share_cache: dict[
            tuple[int, int],
            tuple[torch.Tensor, list[tuple[list[torch.Tensor], list[tuple[str, int, int]]]]],
        ] = {}

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` has exactly the structure this plan was made for."""
        if list(tensors) != self.names:
            return False
        if self._guard is not None:
            return self._guard.check(list(tensors.values()))
        return _specs(tensors) == self.specs and (
            self.devices is None or _devices(tensors) == self.devices
        )

    def copy(
        self,
        buf: torch.Tensor,
        tensors: Mapping[str, torch.Tensor],
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """Copy ``tensors`` (of this plan's structure) into ``buf``; done on return.

        On the CPU: from `SHARED_COPY_MIN_BYTES`, with torch on one intra-op thread and
        a ``pool``, shared among the pool's threads (`_copy_shared`); from
        `_PARALLEL_MIN_BYTES` otherwise by `copy_into` (torch's threads, or chunks);
        else one ``torch._foreach_copy_`` on this thread."""
        if self.on_cuda:
            copy_into(buf, self.slots, tensors, pool)  # side streams
            return
        if pool is not None and self.nbytes >= SHARED_COPY_MIN_BYTES:
            if torch.get_num_threads() == 1 and self._copy_shared(buf, tensors, pool):
                return
            if self.nbytes >= _PARALLEL_MIN_BYTES:
                copy_into(buf, self.slots, tensors, pool)  # torch's threads, or chunks
                return
        if not self.names:
            return  # torch._foreach_copy_ refuses empty lists
        with torch.no_grad():
            torch._foreach_copy_(self.views(buf), list(tensors.values()))

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Views of each tensor's place in ``buf``, in the tensors' order (made once per
        buffer; a plan serves at most the `SLOTS` slots of a `ShmArena`)."""
        hit = self._views.get(id(buf))
        if hit is None or hit[0] is not buf:
            if len(self._views) >= SLOTS:
                self._views.clear()
            hit = self._views[id(buf)] = (buf, [tensor_view(buf, s) for s in self._in_order])
        return hit[1]

    def _copy_shared(
        self, buf: torch.Tensor, tensors: Mapping[str, torch.Tensor], pool: ThreadPoolExecutor
    ) -> bool:
        """`copy_into`'s share-out among ``pool``'s threads (torch with one intra-op
        thread), planned once per buffer (`_chunks`): the copy in chunks of about a
        piece each, one ``torch._foreach_copy_`` a chunk, which the calling thread and
        the pool's threads take in turn from one iterator until none is left: a thread
        that wakes late takes fewer chunks instead of finishing a fixed share late while
        the calling thread waits for it (``docs/decisions.md``, "Copy chunks taken in
        turn"). False where a tensor to split is not contiguous (nothing copied)."""
        chunks = self._chunks(buf, pool._max_workers)
        jobs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        for dsts, what in chunks:
            pieces: list[torch.Tensor] = []
            for name, lo, hi in what:
                src = tensors[name]
                if hi < 0:
                    pieces.append(src)
                elif src.is_contiguous():
                    pieces.append(src.view(-1)[lo:hi])
                else:
                    return False
            jobs.append((dsts, pieces))
        todo = iter(jobs)  # one chunk to each next(): a list iterator is atomic

        def run() -> None:
            with torch.no_grad():
                for dsts, srcs in todo:
                    torch._foreach_copy_(dsts, srcs)

        futures = [pool.submit(run) for _ in range(1, min(pool._max_workers, len(jobs)))]
        try:
            run()
        finally:
            for f in futures:
                f.result()  # waited for even when this thread failed: nothing copies after
        return True

    def _chunks(
        self, buf: torch.Tensor, n: int
    ) -> list[tuple[list[torch.Tensor], list[tuple[str, int, int]]]]:
        """The chunks of a copy shared among ``n`` threads, in layout order: each one's
        destination views in ``buf`` and, for each, the source's name and the element
        range copied (``hi`` -1: all of it); tensors larger than a piece
        (`share_piece_bytes`) in pieces of about that size, and consecutive pieces and
        tensors together until a chunk holds a piece's bytes."""
        key = (id(buf), n)
        hit = self._share_cache.get(key)
        if hit is not None and hit[0] is buf:
            return hit[1]
        piece_bytes = share_piece_bytes(self.nbytes, n)
        chunks: list[tuple[list[torch.Tensor], list[tuple[str, int, int]]]] = []
        dsts: list[torch.Tensor] = []
        what: list[tuple[str, int, int]] = []
        held = 0
        for slot in self.slots:
            dst = tensor_view(buf, slot)
            if slot.nbytes > piece_bytes and dst.dim() > 0:
                flat = dst.view(-1)
                step = max(1, piece_bytes // max(1, dst.element_size()))
                parts = [
                    (flat[i : i + step], (slot.name, i, min(i + step, flat.numel())))
                    for i in range(0, flat.numel(), step)
                ]
            else:
                parts = [(dst, (slot.name, 0, -1))]
            for view, span in parts:
                dsts.append(view)
                what.append(span)
                held += view.numel() * view.element_size()
                if held >= piece_bytes:
                    chunks.append((dsts, what))
                    dsts, what, held = [], [], 0
        if dsts:
            chunks.append((dsts, what))
        if len(self._share_cache) >= SLOTS:
            self._share_cache.clear()
        self._share_cache[key] = (buf, chunks)
        return chunks

    def forget(self) -> None:
        """Drop the views (they keep a buffer, and a shared-memory mapping, alive)."""
        self._views.clear()
        self._share_cache.clear()


class _TensorGuard:
    """``TensorGuards`` over the distinct tensors of a plan (see `CopyPlan`): it refuses
    one tensor given twice, as a tied weight is, so repeats are checked to be the same
    object as their first place instead."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        from torch._C._dynamo.guards import TensorGuards

        first: dict[int, int] = {}
        for i, t in enumerate(tensors):
            first.setdefault(id(t), i)
        own = sorted(first.values())
        repeats = [(i, first[id(t)]) for i, t in enumerate(tensors) if first[id(t)] != i]
        self._own = _getter(own) if len(own) != len(tensors) else None
        self._repeat = _getter([i for i, _ in repeats]) if repeats else None
        self._of = _getter([j for _, j in repeats]) if repeats else None
        distinct = [tensors[i] for i in own]
        self._guard = TensorGuards(
            *distinct,
            dynamic_dims_sizes=[list(t.shape) for t in distinct],  # type: ignore[misc]
            dynamic_dims_strides=[list(t.stride()) for t in distinct],  # type: ignore[misc]
        )

    def check(self, tensors: list[torch.Tensor]) -> bool:
        if self._own is None:
            return self._guard.check(*tensors) is True
        if self._repeat is not None and self._of is not None:
            if any(a is not b for a, b in zip(self._repeat(tensors), self._of(tensors))):
                return False
        return self._guard.check(*self._own(tensors)) is True


def _getter(indices: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The items of a list at ``indices``, as a tuple (one C call)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda xs: (xs[i],)
    return operator.itemgetter(*indices)


def _tensor_guard(tensors: list[torch.Tensor]) -> _TensorGuard | None:
    """A `_TensorGuard` of ``tensors`` if it builds and accepts them, else None."""
    if not tensors:
        return None
    try:
        guard = _TensorGuard(tensors)
        if guard.check(tensors):
            return guard
    except Exception:  # private API: absent, changed, or refusing these tensors
        log.debug("TensorGuards unavailable; tensor structure checked in Python")
    return None


_SPEC = operator.attrgetter("dtype", "shape", "is_cpu")
_DEVICE = operator.attrgetter("device")


def _devices(tensors: Mapping[str, torch.Tensor]) -> list[torch.device]:
    return list(map(_DEVICE, tensors.values()))


def _specs(tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.dtype, Any, bool]]:
    """Each tensor's dtype, shape and whether it is on the CPU (one C-level pass)."""
    return list(map(_SPEC, tensors.values()))


class Arena:
    """A reusable host buffer for snapshots. Used from the training thread only."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._plan: CopyPlan | None = None
        self.allocations = 0

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        """Copy ``tensors`` into the arena; returns when the copy is complete."""
        plan = self._plan
        if plan is None or self._buffer is None or not plan.matches(tensors):
            plan = self._plan = CopyPlan(tensors)
            pin = plan.on_cuda and torch.cuda.is_available()
            self._buffer = _host_buffer(plan.nbytes, pin)
            self.allocations += 1
        plan.copy(self._buffer, tensors)
        return Snapshot(plan.slots, self._buffer)


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` (1 at least). Unpinned, it is an anonymous
    mapping: page-aligned, so that a local disk writes it with ``O_DIRECT`` straight
    from where the snapshot lies (`resumable.storage.direct`); torch's allocator aligns
    to 64 bytes only. Pinned memory (CUDA's host allocator) is page-aligned already."""
    if pin or nbytes < 1 << 20:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # keeps the map alive


# --------------------------------------------------------------------------- memory tier

_PARALLEL_MIN_BYTES = 32 << 20
# From this size, with one intra-op thread, a snapshot's copy is shared among the copy
# threads (`CopyPlan.copy`); below it, one `_foreach_copy_` on the calling thread costs
# less than handing a share to another thread (``docs/decisions.md``, "Copy threads
# from 8 MiB").
SHARED_COPY_MIN_BYTES = 8 << 20
_CHUNK_BYTES = 16 << 20
_HASH_ALONE_BYTES = 1 << 20  # a restore hashes tensors from this size on a copy thread


def share_piece_bytes(nbytes: int, threads: int) -> int:
    """The size of the pieces (and chunks, `CopyPlan._chunks`) a copy of ``nbytes``
    shared among ``threads`` cuts its tensors into: `_CHUNK_BYTES`, or less in a state
    under ``4 * threads`` of them, down to 1 MiB (a state of 10 MiB whose largest tensor
    holds 8 is still shared evenly, and a thread that starts late takes fewer chunks)."""
    return min(_CHUNK_BYTES, max(1 << 20, nbytes // (4 * max(1, threads))))


def copy_threads() -> int:
    """Threads for one rank's large host copies (snapshots, a restore's hashing): the
    cores this process may run on, shared with the other ranks of its node (torchrun's
    ``LOCAL_WORLD_SIZE``) unless a launcher already pinned it to a share of them, and at
    most 4. Two ranks on two cores copy on one thread each: two threads apiece would
    only take turns on the cores, while the other rank copies too."""
    total = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = total
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if cores >= total:  # not pinned: the node's cores, shared by its ranks
        cores //= local
    return max(1, min(4, cores))


def copy_into(
    buf: torch.Tensor,
    slots: list[TensorSlot],
    tensors: Mapping[str, torch.Tensor],
    pool: ThreadPoolExecutor | None,
) -> None:
    """Copy every tensor into its slot of ``buf``; CUDA sources are copied with
    ``non_blocking`` and synchronised once at the end.

    torch already splits a large CPU copy across its intra-op threads. Only when it runs
    with one intra-op thread (as many data-loader-heavy or multi-process jobs do) is a
    large state split into ~16 MiB chunks copied by ``pool``'s threads (``copy_``
    releases the GIL); two thread pools at once would oversubscribe the cores."""
    on_cuda = any(t.is_cuda for t in tensors.values())
    total = slots[-1].end if slots else 0
    if pool is None or on_cuda or total < _PARALLEL_MIN_BYTES or torch.get_num_threads() > 1:
        with torch.no_grad():
            for slot in slots:
                tensor_view(buf, slot).copy_(tensors[slot.name], non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        return
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for slot in slots:
        dst, src = tensor_view(buf, slot), tensors[slot.name]
        if src.is_contiguous() and slot.nbytes > _CHUNK_BYTES and src.dim() > 0:
            flat_d, flat_s = dst.view(-1), src.view(-1)
            step = max(1, _CHUNK_BYTES // max(1, src.element_size()))
            jobs.extend(
                (flat_d[i : i + step], flat_s[i : i + step]) for i in range(0, flat_s.numel(), step)
            )
        else:
            jobs.append((dst, src))

    def run(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for d, s in pairs:
                d.copy_(s)

    n = pool._max_workers
    buckets: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    loads = [0] * n
    for d, s in sorted(jobs, key=lambda ds: -ds[1].numel() * ds[1].element_size()):
        i = loads.index(min(loads))
        buckets[i].append((d, s))
        loads[i] += s.numel() * s.element_size()
    for f in [pool.submit(run, b) for b in buckets if b]:
        f.result()


@dataclass(frozen=True)
class MemorySnapshot:
    """A published snapshot in slot ``index`` of a `ShmArena`."""

    index: int
    seq: int
    step: int
    nbytes: int


class ShmArena:
    """The shared-memory slots of one run and rank: two alternating, and a third while
    the persist worker holds one.

    The trainer writes snapshots; the persist worker reads the slots it was handed
    (``locked``). A snapshot never goes to a locked slot nor to the newest complete one,
    and of the others to the one with the oldest snapshot, so the newest complete
    snapshot and the one before it survive a kill during the next copy: when ranks are
    killed while some of them copy step s+1, every rank still holds step s (the restore
    agrees on the newest step every rank holds; `resumable.pipeline.restorer`). While a
    persist holds one of the two slots, the third is made (one more snapshot's worth of
    shared memory, kept until `close`); if shared memory cannot hold it, the newest
    snapshot is overwritten after all, with a WARNING, and a kill during that copy goes
    back to the step being persisted. Used from the training thread only, but for the
    slot maker's thread, which makes a slot beyond the first two ahead of the snapshot
    that needs it (`_make_spare`); the training thread takes it in (`settle_spare`)
    before it looks at the slots.

    The slots live in this user's `own_dir` of ``shm_dir`` (``directory``), or in a
    fresh `fallback_dir` if that cannot be trusted; a slot that cannot be created where
    it should moves to a fallback directory too, so a file in the way costs the run the
    adoption of that slot, never the run.

    ``root`` (the checkpoint root's URL) is recorded in every snapshot's metadata, so
    that ``resumable shm`` can tell whose progress a slot holds and whether that root
    has committed it; slots written before it was recorded simply lack it.
    """

    def __init__(
        self, key: str, *, rank: int = 0, shm_dir: Path | None = None, root: str | None = None
    ) -> None:
        self.shm_dir = shm_dir or SHM_DIR
        self._key, self._rank = key, rank
        self.root = root
        self._held: list[int] = []  # locks on the fallback directories in use
        self.directory = own_dir(self.shm_dir) or self._fallback()
        self.paths = slot_paths(key, rank, self.directory)
        self.slots: list[ShmSlot | None] = [None] * SLOTS
        self._third = True  # whether more than two slots may be made (False: no room)
        # How many newest complete snapshots a new one never overwrites: 1, or 2 with
        # replicas (a peer's replica of a rank may be one snapshot behind it).
        self.keep = 1
        self.locked: set[int] = set()
        self.newest: MemorySnapshot | None = None
        threads = copy_threads()
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="resumable-copy")
            if threads > 1
            else None
        )
        self.allocations = 0
        self._plan: CopyPlan | None = None
        # A slot beyond the first two being made on `_maker`'s thread: its index, its
        # capacities and the future of the slot (`_make_spare`, `settle_spare`).
        self._spare: tuple[int, dict[str, int], Future[ShmSlot]] | None = None
        self._maker: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- adoption

    def adopt(self, *, wait_s: float = 60.0) -> list[tuple[int, SlotContent]]:
        """Attach slot files left by an earlier launch of this run; returns the complete
        snapshots found (index, content), newest first.

        A slot is taken over only once no other process holds its lock; the persist
        worker of a dead launch may still be finishing its last commit, so this waits up
        to ``wait_s`` for it, then raises `CheckpointError` (another trainer of this run
        holds it). A slot this process already maps elsewhere is shared, as before. A
        file at a slot name that is not a private slot of this user is ignored with a
        WARNING and replaced by the next snapshot."""
        self.settle_spare()
        found = []
        for i, path in enumerate(self.paths):
            if self.slots[i] is not None or not os.path.lexists(path):
                continue
            slot = attach_unlocked(path)
            if slot is None:
                continue
            try:
                taken = _take_over(slot, wait_s)
            except BaseException:
                slot.close()
                raise
            if not taken:  # removed by a cleaner while we waited
                slot.close()
                continue
            slot.claim()
            self.slots[i] = slot
            content = slot.read()
            if content is not None:
                found.append((i, content))
        found.sort(key=lambda ic: -ic[1].step)
        if found and self.newest is None:
            i, content = found[0]
            self.newest = MemorySnapshot(i, content.seq, content.step, _nbytes(content.slots))
        return found

    # ---------------------------------------------------------------- snapshots

    def snapshot(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        meta: SlotMeta,
        *,
        deferred: Collection[str] = (),
        executor: ThreadPoolExecutor | None = None,
        plan: CopyPlan | None = None,
    ) -> MemorySnapshot | Future[MemorySnapshot]:
        """Copy ``tensors`` into a free slot and publish it with ``meta`` (which gets the
        layout and `root` added); returns the published snapshot. ``plan``: what `plan` returned
        for these ``tensors`` (else it is called here).

        Without ``deferred`` the copy is done when this returns. With ``deferred`` names
        and an ``executor`` (overlap mode), the other tensors are copied now and the
        deferred ones by the executor, which then publishes the slot; a future of the
        snapshot is returned: the caller must not change those tensors until it is
        resolved, and must resolve it before the next call. Raises `CheckpointError` if
        both slots are locked by the persist worker."""
        self.settle_spare()
        if plan is None:
            plan = self.plan(tensors)[0]
        layout, nbytes = plan.slots, plan.nbytes
        # '{"layout":[...],' then the rest of the object: the head is the plan's
        blob = meta.encode(step, root=self.root)[1:]
        head = plan.meta_head
        index = self._choose(step)
        slot = self.slots[index]
        if slot is None or not slot.fits(len(head) + len(blob), len(layout), nbytes):
            try:
                slot = self._allocate(index, len(head) + len(blob), len(layout), nbytes)
            except StorageError as exc:
                if index < 2:
                    raise
                self._third = False
                index = self._choose(step)
                log.warning(
                    "no room for a third shared-memory snapshot slot while a persist holds "
                    "one (%s): this snapshot overwrites the newest one, so a kill during "
                    "its copy goes back to the step being persisted",
                    exc,
                )
                slot = self.slots[index]
                if slot is None or not slot.fits(len(head) + len(blob), len(layout), nbytes):
                    slot = self._allocate(index, len(head) + len(blob), len(layout), nbytes)
        slot.begin_write()
        data = slot.data_tensor()
        later = [s for s in layout if s.name in deferred] if deferred and executor else []
        if later:
            copy_into(data, [s for s in layout if s.name not in deferred], tensors, self._pool)
        else:
            plan.copy(data, tensors, self._pool)
        self._ahead(index)

        def publish() -> MemorySnapshot:
            if later:
                copy_into(data, later, tensors, None)
            seq = slot.finish_write(step=step, blob=blob, data_len=nbytes, head=head)
            self.newest = MemorySnapshot(index, seq, step, nbytes)
            return self.newest

        if later and executor is not None:
            return executor.submit(publish)
        return publish()

    def install(self, step: int, meta: bytes, data: Any) -> MemorySnapshot:
        """Write a snapshot received whole (a peer's replica of this rank's snapshot:
        its slot metadata JSON and data region, checked by digest on the way) into a
        slot, as `snapshot` writes one, and publish it as the newest. Raises
        `CorruptCheckpointError` if ``meta`` is not a slot's metadata for ``data``
        (`decode_meta`), before any slot is written."""
        view = memoryview(data).cast("B")
        nbytes = len(view)
        try:
            layout = decode_meta(meta, nbytes)[1]
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"a received snapshot is refused: {exc}") from None
        self.settle_spare()
        index = self._choose(step)
        slot = self.slots[index]
        if slot is None or not slot.fits(len(meta), len(layout), nbytes):
            slot = self._allocate(index, len(meta), len(layout), nbytes)
        slot.begin_write()
        if nbytes:
            slot.data_view(nbytes)[:] = view
        seq = slot.finish_write(step=step, blob=meta, data_len=nbytes)
        self.newest = MemorySnapshot(index, seq, step, nbytes)
        return self.newest

    def plan(
        self,
        tensors: Mapping[str, torch.Tensor],
        last: Callable[[], Collection[str]] = tuple,
    ) -> tuple[CopyPlan, bool]:
        """The copy plan for ``tensors``: the last one if they have its structure, else
        a new one (then True), laying out the tensors ``last()`` names after the others
        (`plan_layout`; asked only for a new plan)."""
        plan = self._plan
        if plan is not None and plan.matches(tensors):
            return plan, False
        if plan is not None:
            plan.forget()
        plan = self._plan = CopyPlan(tensors, last())
        return plan, True

    def _choose(self, step: int) -> int:
        """The slot the snapshot of ``step`` goes to: not a locked one, not one of the
        `keep` newest complete ones, and of the others the one with the oldest snapshot
        (an empty or incomplete one first, or one of a step not before ``step``: left by
        a timeline a restore went back from). A slot beyond the first two is made only
        when those are taken (a persist holds one, the other is kept); a kept snapshot
        is overwritten only when there is no room for another slot."""
        newest = self.newest
        if (
            not self.locked
            and self.keep == 1
            and newest is not None
            and newest.index < 2
            and all(s is None for s in self.slots[2:])
        ):  # the usual case: of the first two slots, the one not holding the newest
            return 1 - newest.index
        return self._choose_any(step)

    def _choose_any(self, step: int) -> int:
        """`_choose` in every case (its usual one included)."""
        free = [i for i in range(SLOTS) if i not in self.locked]
        if not free:
            raise CheckpointError("every snapshot slot is being persisted")
        kept = self._kept(step)
        spare = [i for i in free if i not in kept]
        made = [i for i in spare if i < 2 or self.slots[i] is not None]
        if made:
            return min(made, key=lambda i: self._age(i, step))
        if spare and self._third:
            return spare[0]
        existing = [i for i in free if i < 2 or self.slots[i] is not None]
        return min(existing or free, key=lambda i: self._age(i, step))

    def _kept(self, step: int) -> set[int]:
        """The slots a snapshot of ``step`` must not overwrite: the newest, and with
        `keep` > 1 the `keep` newest complete snapshots of steps before ``step``."""
        kept = {self.newest.index} if self.newest is not None else set()
        if self.keep > 1:
            done = []
            for i, slot in enumerate(self.slots):
                if slot is None:
                    continue
                c = slot.control()
                if c.state == COMPLETE and c.seq % 2 == 0 and c.step < step:
                    done.append((c.step, i))
            kept |= {i for _, i in sorted(done, reverse=True)[: self.keep]}
        return kept

    def _age(self, index: int, step: int) -> tuple[int, int]:
        """Sort key, oldest first: a missing, incomplete or stale slot, then by step."""
        slot = self.slots[index]
        if slot is None:
            return (0, index)
        c = slot.control()
        if c.state != COMPLETE or c.seq % 2 or c.step >= step:
            return (0, index)
        return (1, c.step)

    def complete(self) -> list[tuple[MemorySnapshot, SlotContent]]:
        """Every complete snapshot in the slots (with its slot's content), newest first."""
        self.settle_spare()
        out = []
        for i, slot in enumerate(self.slots):
            content = slot.read() if slot is not None else None
            if content is not None:
                out.append(
                    (MemorySnapshot(i, content.seq, content.step, _nbytes(content.slots)), content)
                )
        out.sort(key=lambda sc: -sc[0].step)
        return out

    def forget_after(self, step: int, keep: MemorySnapshot | None = None) -> None:
        """A restore went back to ``step`` (from ``keep``, a snapshot here, which becomes
        the newest): snapshots of later steps, of a timeline this launch left, are
        marked incomplete, so no restore finds them and the next snapshots overwrite
        them first."""
        self.settle_spare()
        for i, slot in enumerate(self.slots):
            if slot is None or i in self.locked or (keep is not None and i == keep.index):
                continue
            c = slot.control()
            if c.state == COMPLETE and c.seq % 2 == 0 and c.step > step:
                slot.begin_write()
                if self.newest is not None and self.newest.index == i:
                    self.newest = None
        if keep is not None:
            self.newest = keep

    def reserve_spare(self, taken: int) -> bool:
        """Whether the next snapshot still finds a slot once slot ``taken`` is handed to a
        persist while the locked ones still are (a persist queued behind a running one).
        A slot other than those is made if there is none, as large as ``taken``: on the
        slot maker's thread (`_make_spare`), so that the save asking does not wait for its
        pages to be reserved and touched; the next snapshot takes it (`settle_spare`).
        False, and nothing is made, if shared memory has no room for it, or if replicas
        need the two newest snapshots kept (`keep` > 1): then the caller waits instead."""
        busy = self.locked | {taken}
        free = [i for i in range(SLOTS) if i not in busy]
        if self.keep > 1 or not free:
            return False
        if self._spare is not None and self._spare[0] in free:
            return True  # being made (`_ahead`)
        self.settle_spare()
        if any(self.slots[i] is not None for i in free):
            return True
        like = self.slots[taken]
        if like is None or (free[0] >= 2 and not self._third):
            return False
        return self._make_spare(free[0], like)

    def _ahead(self, index: int) -> None:
        """After a snapshot into slot ``index``, while a persist holds the other slots:
        make the slot the next snapshot will need (it may not overwrite ``index``, the
        newest) now, on the slot maker's thread, rather than in that snapshot's own time.
        Only with one snapshot kept (`keep`) and room for a slot beyond the first two."""
        if self.keep > 1 or not self.locked or not self._third or self._spare is not None:
            return
        free = [i for i in range(SLOTS) if i not in self.locked and i != index]
        if not free or any(i < 2 or self.slots[i] is not None for i in free):
            return
        like = self.slots[index]
        if like is not None:
            self._make_spare(free[0], like)

    def _make_spare(self, index: int, like: ShmSlot) -> bool:
        """Start making slot ``index`` as large as ``like`` on the slot maker's thread,
        once shared memory is found to have room for it (else False: no room for a slot
        beyond the first two from now on)."""
        c = like.control()
        caps = {"meta_cap": c.meta_cap, "sums_cap": c.sums_cap, "data_cap": c.data_cap}
        try:
            ShmSlot.check_room(self.paths[index], **caps)
        except (StorageError, CheckpointError) as exc:
            if isinstance(exc, StorageError) and index >= 2:
                self._third = False
            log.info("no spare snapshot slot can be made (%s): the persist waits its turn", exc)
            return False
        if self._maker is None:
            self._maker = ThreadPoolExecutor(1, thread_name_prefix="resumable-slot")
        path = self.paths[index]
        self._spare = (index, caps, self._maker.submit(lambda: ShmSlot.create(path, **caps)))
        return True

    def settle_spare(self, *, quiet: bool = False) -> None:
        """Take in the slot being made on the slot maker's thread, waiting for it if it
        is not made yet. Made in vain (shared memory filled up meanwhile): no slot beyond
        the first two from now on, as if there had never been room; a snapshot then
        finds every slot locked (`full`), and its caller waits for a persist to end. A
        slot file that could not be made where it should is made in a fallback
        directory, here (`_create`)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        index, caps, made = spare
        try:
            try:
                slot = made.result()
            except CheckpointError:
                if quiet:
                    return
                self._create(index, caps)  # in a fallback directory
                return
        except StorageError as exc:
            if index >= 2:
                self._third = False
            if not quiet:
                log.warning("no room for a spare snapshot slot after all (%s)", exc)
            return
        self._register(index, slot)

    def full(self) -> bool:
        """Whether the next snapshot would find no slot: every one made (and each of the
        first two) is locked by a persist, and no other may be made (a spare slot was made
        in vain, `settle_spare`). The caller must wait for a persist to end first."""
        if self._spare is not None:
            self.settle_spare()
        if self._third or not self.locked:
            return False
        usable = [i for i in range(SLOTS) if i < 2 or self.slots[i] is not None]
        return all(i in self.locked for i in usable)

    def _allocate(self, index: int, meta_len: int, n_tensors: int, nbytes: int) -> ShmSlot:
        old = self.slots[index]
        if self._plan is not None:
            self._plan.forget()  # its views keep the old mapping alive
        if old is not None:
            old.close()
        self.slots[index] = None
        return self._create(
            index,
            {
                "meta_cap": meta_len + meta_len // 4 + 65536,
                "sums_cap": 16 * n_tensors + 4096,
                "data_cap": nbytes,
            },
        )

    def _create(self, index: int, caps: dict[str, int]) -> ShmSlot:
        """Make slot ``index`` (empty now) with capacities ``caps``."""
        try:
            slot = ShmSlot.create(self.paths[index], **caps)
        except StorageError:
            raise
        except CheckpointError as exc:
            elsewhere = self._fallback()
            log.warning("%s; putting this snapshot slot in %s instead", exc, elsewhere)
            self.paths[index] = slot_paths(self._key, self._rank, elsewhere)[index]
            slot = ShmSlot.create(self.paths[index], **caps)
        return self._register(index, slot)

    def _register(self, index: int, slot: ShmSlot) -> ShmSlot:
        """Put ``slot``, just made, at ``index``."""
        self.slots[index] = slot
        if self.newest is not None and self.newest.index == index:
            self.newest = None
        self.allocations += 1
        return slot

    def _fallback(self) -> Path:
        path, fd = fallback_dir(self.shm_dir)
        self._held.append(fd)
        return path

    def existing_bytes(self) -> int:
        """Bytes of the slot files now at this arena's slot names (freed when replaced)."""
        self.settle_spare()
        return sum(replaced_size(p) for p in self.paths)

    def still(self, index: int, seq: int) -> bool:
        """Whether slot ``index`` still holds snapshot ``seq``, complete."""
        slot = self.slots[index]
        return slot is not None and slot.still(seq)

    def content(self, index: int) -> SlotContent | None:
        slot = self.slots[index]
        return slot.read() if slot is not None else None

    def checksums(self, data: memoryview, slots: list[TensorSlot]) -> list[str]:
        """The XXH3-64 of each slot's bytes in ``data``. A large state is hashed on the
        copy threads, the largest tensors first (the hash releases the GIL): a restore
        from shared memory checks every tensor before it copies one, and on one thread
        the hashing took longer than the copy."""
        if self._pool is None or (slots[-1].end if slots else 0) < _PARALLEL_MIN_BYTES:
            return [checksum(data[s.begin : s.end]) for s in slots]
        futures: dict[int, Future[str]] = {}
        for i in sorted(range(len(slots)), key=lambda i: slots[i].begin - slots[i].end):
            if slots[i].end - slots[i].begin >= _HASH_ALONE_BYTES:
                futures[i] = self._pool.submit(checksum, data[slots[i].begin : slots[i].end])
        return [
            futures[i].result() if i in futures else checksum(data[s.begin : s.end])
            for i, s in enumerate(slots)
        ]

    def copy_checked(
        self, data: torch.Tensor, slots: list[TensorSlot], dests: list[torch.Tensor | None]
    ) -> list[str]:
        """The XXH3-64 of each slot's bytes in ``data`` (a slot's data tensor), as
        `checksums` gives them, each slot copied on the way into its destination in
        ``dests`` (a contiguous CPU tensor of its bytes; None: hashed only). A block of
        `CHECKED_BLOCK` bytes at a time is copied, then hashed while it is still in the
        cache, so the snapshot is read from memory once, not once to hash it and again
        to copy it (`docs/decisions.md`). The slots are shared by bytes among the copy
        threads, the largest first (one tensor is hashed in order, on one thread)."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise CheckpointError("copy_checked takes a slot's flat byte tensor")
        jobs: list[tuple[int, int, int, int]] = []  # (slot index, source, dest, bytes)
        base = data.data_ptr()
        for i, (s, d) in enumerate(zip(slots, dests, strict=True)):
            n = s.end - s.begin
            if s.begin < 0 or n < 0 or s.end > data.numel():
                raise CorruptCheckpointError(f"tensor {s.name!r} lies outside its slot")
            if d is not None and (not d.is_cpu or d.nbytes != n or not d.is_contiguous()):
                raise CheckpointError(f"no contiguous CPU destination of {n} bytes for {s.name!r}")
            jobs.append((i, base + s.begin, 0 if d is None else d.data_ptr(), n))
        mem = data.numpy().data
        sums: list[str] = [""] * len(slots)

        def run(part: list[tuple[int, int, int, int]]) -> None:
            for i, src, dst, n in part:
                sums[i] = copy_checksum(src, mem[src - base : src - base + n], dst)

        total = sum(n for *_, n in jobs)
        if self._pool is None or total < _PARALLEL_MIN_BYTES:
            run(jobs)
            return sums
        n_parts = self._pool._max_workers
        parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_parts)]
        loads = [0] * n_parts
        for job in sorted(jobs, key=lambda j: -j[3]):
            k = loads.index(min(loads))
            parts[k].append(job)
            loads[k] += job[3]
        futures = [self._pool.submit(run, p) for p in parts[1:] if p]
        try:
            run(parts[0])
        finally:
            for f in futures:
                f.result()  # waited for even when this thread failed: nothing copies after
        return sums

    def tensors(
        self, index: int, content: SlotContent, *, skip: Collection[str] = ()
    ) -> dict[str, torch.Tensor]:
        """Views of a slot's tensors (valid until the slot is rewritten: clone them),
        but those named in ``skip``."""
        slot = self.slots[index]
        assert slot is not None
        data = slot.data_tensor()
        return {s.name: tensor_view(data, s) for s in content.slots if s.name not in skip}

    def close(self, *, unlink: bool) -> None:
        self.settle_spare(quiet=True)
        if self._maker is not None:
            self._maker.shutdown(wait=True)
            self._maker = None
        if self._plan is not None:
            self._plan.forget()
        for i, slot in enumerate(self.slots):
            if slot is not None:
                if unlink:
                    slot.unlink()
                else:
                    slot.close()
                self.slots[i] = None
        for fd in self._held:
            release_fd(fd)
        self._held.clear()
        if unlink:
            for directory in {p.parent for p in self.paths}:
                if directory.name != f"{PREFIX}{os.geteuid()}":
                    with contextlib.suppress(OSError):
                        directory.rmdir()  # a fallback directory, if now empty
        self.newest = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _nbytes(slots: list[TensorSlot]) -> int:
    return slots[-1].end if slots else 0


def _take_over(slot: ShmSlot, wait_s: float) -> bool:
    """Hold ``slot``'s shared lock, once no other process holds it; False if the file
    was removed or replaced meanwhile."""
    deadline = time.monotonic() + wait_s
    while not slot.lock_exclusive():
        owner = slot.control().owner_pid
        if owner == os.getpid():
            break  # another arena of this process maps it
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"the shared-memory snapshot {slot.path} of this run is still in use after "
                f"{wait_s:.0f} s (its owner recorded pid {owner}): another trainer of this "
                "run is running, or the persist worker of an earlier launch is stuck. Stop "
                "it, or use another checkpoint directory"
            )
        time.sleep(0.05)
    slot.lock_shared()
    return slot.linked()
