"""The write path: one snapshot's bytes as data files and a manifest, then the commit.

`write_checkpoint` (one process) and `write_distributed` (several ranks, each writing
its own file, rank 0 committing for all) lay out safetensors files, hash every tensor
while its file is written, build the manifest and commit it through a `Committer`.
They read only the snapshot given, never live training state, so the same code runs
on the training thread and in the persist worker. On any failure the attempt is
removed: no half-written checkpoint becomes visible.

What they leave to their callers (`resumable.pipeline.persister` and
`resumable.pipeline._worker_jobs.JobRunner`): when to persist, retries, retention and
the mirror. Data files are named per rank (``rank-00000.safetensors``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, cast

from resumable.commit import Attempt, Committer, abort_quietly, step_dir
from resumable.coordination import STAGED
from resumable.errors import PersistError
from resumable.format import (
    CHECKSUM,
    MANIFEST,
    TensorSlot,
    build_manifest,
    check_segments,
    checksum,
    encode_manifest,
    safetensors_header,
    tensor_ranges,
)
from resumable.incremental import Chunk, DeltaBase, Plan, Record
from resumable.nodes import NodeObjects, Staging, node_file
from resumable.parts import build_top, encode_part, part_entry, part_file
from resumable.pieces import Piece, balance, owned_tensors
from resumable.snapshot import Arena, Snapshot
from resumable.storage import direct
from resumable.storage.base import Storage

log = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class WriteRequest:
    """What one persist writes: the snapshot of ``step``, its state tree and metrics, and,
    with several ranks, where this rank's global tensors lie (``pieces``, by tensor
    name) and which rank writes each replicated tensor this rank does not
    (``holders``: `replicated_holders`). Built once by the caller and handed down
    unchanged."""

    step: int
    snapshot: Snapshot
    tree: Any
    metrics: Mapping[str, Any] | None = None
    pieces: Mapping[str, Piece] | None = None
    holders: Mapping[str, int] | None = None


@dataclass(frozen=True)
class LateRequest:
    """A `WriteRequest` of ``step`` made by ``make`` only once rank 0 opened the attempt,
    as the write begins: a persist worker reads its snapshot's metadata then, not
    while the other ranks still take their snapshots (`write_distributed`). An error
    ``make`` raises is this rank's report, as a failed write's is."""

    step: int
    make: Callable[[], WriteRequest]


def rank_share(
    arena: Arena, snapshot: Snapshot, replicated: Collection[str], rank: int, world_size: int
) -> Snapshot:
    """What ``rank`` writes of ``snapshot`` in a coordinated persist, copied into
    ``arena`` (the source may be rewritten once this returns): every tensor but the
    ``replicated`` ones that `owned_tensors` gives another rank."""
    views = {s.name: snapshot.tensor(s) for s in snapshot.slots}
    return arena.snapshot(owned_tensors(views, replicated, rank, world_size))


def share_prefix(slots: Sequence[TensorSlot], holders: Collection[str]) -> list[TensorSlot] | None:
    """The slots of a rank's share of a coordinated persist if they are the first of
    ``slots`` (the trainer lays the tensors ``holders`` names, which other ranks write,
    last: `resumable.format.plan_layout`), so that the share is the snapshot's first
    bytes and is written from them without a copy; else None (copied out: `rank_share`)."""
    mine = len(slots) - len(holders)
    if mine <= 0 or any(s.name in holders for s in slots[:mine]):
        return None
    return list(slots[:mine])


def replicated_holders(
    sizes: Mapping[str, int], replicated: Collection[str], rank: int, world_size: int
) -> dict[str, int]:
    """The rank that writes each ``replicated`` tensor that ``rank`` does not (by name;
    ``sizes``: every tensor's bytes), as `owned_tensors` shares them out. A rank's part of
    a split manifest records it, so that a restore reads only the parts it needs."""
    if world_size == 1:
        return {}
    owner = balance({n: sizes[n] for n in replicated if n in sizes}, world_size)
    return {n: r for n, r in owner.items() if r != rank}


@dataclass(frozen=True)
class _DataFile:
    """Where one rank's data file of an attempt goes: ``path`` in ``storage``, named
    ``key`` in the manifest."""

    storage: Storage
    path: str
    key: str

    @classmethod
    def of(cls, storage: Storage, attempt: Attempt, rank: int) -> _DataFile:
        name = rank_file(rank)
        return cls(storage, attempt.path(name), attempt.key(name))


@dataclass(frozen=True)
class PersistResult:
    """What a persist committed. ``manifest`` is held only by the rank that built it (the
    only one, or rank 0 of a coordinated persist); the others get None and the
    manifest's ``digest``, so that the outcome every rank reads stays O(1) bytes."""

    step: int
    nbytes: int
    seconds: float
    replaced: bool
    manifest: dict[str, Any] | None
    digest: str


def write_checkpoint(
    storage: Storage,
    committer: Committer,
    request: WriteRequest,
    *,
    before_commit: Callable[[], None] | None = None,
    base: DeltaBase | None = None,
) -> PersistResult:
    """Write ``request`` as the checkpoint of its step and commit it.

    Returns after the commit is durable. On failure the attempt is removed (unless its
    manifest landed all the same: `MarkerCommit.abort`) and the exception propagates;
    earlier checkpoints are untouched. ``before_commit`` runs right before the commit.
    With a ``base``, only what changed since its commit is written
    (`resumable.incremental`), and the base moves to this commit.
    """
    t0 = time.perf_counter()
    step = request.step
    attempt = committer.begin(step)
    file = _DataFile.of(storage, attempt, 0)
    try:
        size, tensors, plan = _write_data_file(file, request, base)
        manifest = build_manifest(
            step=step,
            metrics=request.metrics,
            trees=[request.tree],
            files={file.key: {"size": size, "rank": 0}},
            tensors=tensors,
        )
        blob = encode_manifest(manifest)
        if before_commit is not None:
            before_commit()
        replaced = committer.commit(attempt, blob)
    except BaseException:
        abort_quietly(committer, attempt)
        raise
    if base is not None and plan is not None:
        base.committed(step, plan)
    seconds = time.perf_counter() - t0
    return PersistResult(step, size + len(blob), seconds, replaced, manifest, manifest["digest"])


class Checksums:
    """The XXH3-64 of every tensor of a data file, hashed on a thread of its own while the
    file is written (the hash and the writes release the GIL), where there are enough
    bytes for it to pay: a persist's CPU work and the disk's then overlap, instead of the
    write waiting for a pass over the whole snapshot. ``known`` are checksums already
    known (tensors whose every chunk hashes as before)."""

    def __init__(
        self,
        data: memoryview,
        slots: list[TensorSlot],
        known: Mapping[str, str],
        chunks: Callable[[], None] | None = None,
    ):
        """``chunks``: the chunk hashing of a plan made before it (`DeltaBase.hash_whole`),
        run on a thread of its own beside the checksums."""
        self._sums = {s.name: known[s.name] for s in slots if s.name in known}
        todo = [s for s in slots if s.name not in known]
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []
        if sum(s.end - s.begin for s in todo) < CHECKSUMS_BEHIND_MIN_BYTES:
            self._hash(data, todo)
            if chunks is not None:
                chunks()
            return
        jobs = [("resumable-checksums", lambda: self._hash(data, todo))]
        if chunks is not None:
            jobs.append(("resumable-chunk-hashes", chunks))
        for name, job in jobs:
            self._threads.append(
                threading.Thread(target=self._guarded, args=(job,), name=name, daemon=True)
            )
            self._threads[-1].start()

    def _hash(self, data: memoryview, todo: list[TensorSlot]) -> None:
        for s in todo:
            self._sums[s.name] = checksum(data[s.begin : s.end])

    def _guarded(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # handed to whoever asks for the result
            self._errors.append(exc)

    def join(self) -> None:
        """Wait until nothing hashes any more (the snapshot may be reused after)."""
        threads, self._threads = self._threads, []
        for t in threads:
            t.join()

    def result(self) -> dict[str, str]:
        """Every tensor's checksum, by name (waits for the hashing; raises its error)."""
        self.join()
        if self._errors:
            raise self._errors[0]
        return self._sums


CHECKSUMS_BEHIND_MIN_BYTES = 8 << 20
"""Below this many bytes to hash, a file's checksums are computed before it is written
(a thread would cost more than it hides)."""


def _fill_checksums(
    tensors: dict[str, dict[str, Any]], plan: Plan | None, sums: Mapping[str, str]
) -> None:
    """Put each tensor's checksum into its manifest entry and the plan's record. A plan
    written whole gets its records here, once its chunks are hashed (a plan made before
    them hashes them while the file is written): where every chunk now lies."""
    for name, entry in tensors.items():
        entry[CHECKSUM] = sums[name]
    if plan is None:
        return
    if not plan.incremental:
        for p in plan.slots:
            entry = tensors[p.slot.name]
            b0, base_name = entry["offsets"][0], entry["file"].rsplit("/", 1)[-1]
            plan.records[p.slot.name] = Record(
                p.slot.dtype,
                tuple(p.slot.shape),
                tuple(
                    Chunk(h, None, base_name, b0 + b, b0 + e)
                    for (b, e), h in zip(p.ranges, p.hashes, strict=True)
                ),
                sums[p.slot.name],
            )
        return
    for name, record in plan.records.items():
        plan.records[name] = replace(record, checksum=sums[name])


def _write_data_file(
    file: _DataFile, request: WriteRequest, base: DeltaBase | None
) -> tuple[int, dict[str, dict[str, Any]], Plan | None]:
    """One rank's data file written, each tensor's checksum in its manifest entry (and in
    the plan's record): its size, the tensor entries and the plan. Nothing reads the
    snapshot once this returns."""
    size, tensors, plan, sums = _index_and_write(file, request, base)
    try:
        _fill_checksums(tensors, plan, sums.result())
    finally:
        sums.join()
    return size, tensors, plan


def _index_and_write(
    file: _DataFile, request: WriteRequest, base: DeltaBase | None
) -> tuple[int, dict[str, dict[str, Any]], Plan | None, Checksums]:
    """Lay out and write one data file: its size, the manifest's tensor entries, the
    plan and the `Checksums` being computed (the caller joins them).

    An incremental persist whose state has many bytes that did not change at the last
    comparison (a fine-tuning job's frozen base) writes its file while it hashes those
    (`DeltaBase.plan_early`): laid out as if they hash as before, which they do unless
    someone changed frozen weights; where one does not, the file is written again
    from the plan of the real hashes. The write then costs the persist no time of its
    own where the hashing takes longer."""
    if base is None or base.expect_whole:
        return _write_file(file, request, base, None)
    snapshot, step = request.snapshot, request.step
    early = base.plan_early(snapshot.slots, snapshot.memory(), step)
    if early is None:
        return _write_file(file, request, base, None)
    if not early.plan.incremental or not check_refs(file.storage, early.plan.refs):
        # the usual way, with every hash (a plan of no reuse, or a deleted reference)
        plan = base.confirm(early, snapshot.memory(), step) or early.plan
        return _write_file(file, request, base, plan)
    header, data, tensors, _, sums = file_index(request, file.key, base, early.plan)
    written: dict[str, Any] = {}

    def write() -> None:
        try:
            written["size"] = file.storage.write(file.path, [header, *data])
        except BaseException as exc:  # handed to the persist below
            written["error"] = exc

    writer = threading.Thread(target=write, name="resumable-early-write", daemon=True)
    try:
        writer.start()
        try:
            final = base.confirm(early, snapshot.memory(), step)
        finally:
            writer.join()  # nothing writes the file once this returns
    except BaseException:
        sums.join()
        raise
    if final is None:
        if "error" in written:
            sums.join()
            raise written["error"]
        return int(written["size"]), tensors, early.plan, sums
    sums.join()
    if "error" in written:
        log.warning(
            "the early write of step %d failed (%s); writing it again", step, written["error"]
        )
    return _write_file(file, request, base, final)


def _write_file(
    file: _DataFile, request: WriteRequest, base: DeltaBase | None, plan: Plan | None
) -> tuple[int, dict[str, dict[str, Any]], Plan | None, Checksums]:
    """`_index_with_refs` (with ``plan``, if made already), then the file written."""
    header, data, tensors, plan, sums = _index_with_refs(file, request, base, plan)
    try:
        size = file.storage.write(file.path, [header, *data])
    except BaseException:
        sums.join()
        raise
    return size, tensors, plan, sums


def _index_with_refs(
    file: _DataFile, request: WriteRequest, base: DeltaBase | None, plan: Plan | None
) -> tuple[bytes, list[Any], dict[str, dict[str, Any]], Plan | None, Checksums]:
    """`file_index`, written whole if a checkpoint it would refer to was deleted."""
    out = file_index(request, file.key, base, plan)
    plan = out[3]
    if base is not None and plan is not None and plan.incremental:
        try:
            gone = not check_refs(file.storage, plan.refs)
        except BaseException:
            out[4].join()  # the caller never sees these checksums: stop them here
            raise
        if gone:
            log.warning(
                "a checkpoint among steps %s was deleted by someone else; step %d is written whole",
                plan.refs,
                request.step,
            )
            out[4].join()
            base.reset()
            out = file_index(request, file.key, base)
    return out


def file_index(
    request: WriteRequest,
    fname: str,
    base: DeltaBase | None = None,
    plan: Plan | None = None,
) -> tuple[bytes, list[Any], dict[str, dict[str, Any]], Plan | None, Checksums]:
    """The safetensors header, the data buffers and the manifest's tensor entries of
    ``request``'s data file, named ``fname`` (its ``pieces`` go into the entries), and
    its `Checksums`, being hashed: `_fill_checksums` puts them into the entries (and the
    plan's records) once the file is written.

    With a ``base`` (incremental checkpoints), chunks unchanged since the base's commit
    are not in the file: their entries refer to the earlier checkpoint (format version
    2); the returned `Plan` becomes the base once the checkpoint is committed. ``plan``:
    one made already (`DeltaBase.plan_early`, `DeltaBase.confirm`)."""
    snapshot, step = request.snapshot, request.step
    data = snapshot.memory()
    meta = {"format": "pt", "producer": "resumable", "step": str(step)}
    chunks: Callable[[], None] | None = None
    if plan is not None:
        pass
    elif base is not None and base.expect_whole:
        # written whole whatever the hashes say: written at once, hashed meanwhile
        plan = base.whole_plan(snapshot.slots)
        chunks = functools.partial(base.hash_whole, plan, data, step)
    elif base is not None:
        plan = base.plan(snapshot.slots, data, step)
    # A tensor whose every chunk hashes as before has the checksum it had (its bytes
    # are the same): hashing a frozen model's bytes once per persist is enough.
    known = {p.slot.name: p.checksum for p in plan.slots if p.checksum} if plan else {}
    checksums = Checksums(data, snapshot.slots, known, chunks)
    try:
        header, buffers, tensors = _layout(snapshot, data, fname, meta, plan)
    except BaseException:
        checksums.join()
        raise
    for name, entry in tensors.items():
        piece = (request.pieces or {}).get(name)
        if piece is not None:
            entry["fqn"] = piece.fqn
            entry["global_shape"] = list(piece.global_shape)
            entry["global_offset"] = list(piece.global_offset)
    return header, buffers, tensors, plan, checksums


def _layout(
    snapshot: Snapshot, data: memoryview, fname: str, meta: dict[str, str], plan: Plan | None
) -> tuple[bytes, list[Any], dict[str, dict[str, Any]]]:
    """The header, buffers and tensor entries of a data file, and the plan's records,
    with empty checksums (`_fill_checksums` fills them in)."""
    sums = {s.name: "" for s in snapshot.slots}  # placeholders, in the entries' key order
    if plan is not None and plan.incremental:
        header, buffers, tensors = _incremental_file(snapshot, data, fname, meta, sums, plan)
    else:
        header = safetensors_header(snapshot.slots, meta, align=_header_align(snapshot.nbytes))
        start = len(header)
        buffers = [data]
        tensors = {
            s.name: {
                "file": fname,
                "dtype": s.dtype,
                "shape": list(s.shape),
                "offsets": [start + s.begin, start + s.end],
                CHECKSUM: sums[s.name],
            }
            for s in snapshot.slots
        }
        if plan is not None:  # its records once its chunks are hashed: `_fill_checksums`
            plan.held = snapshot.nbytes
    return header, buffers, tensors


def _incremental_file(
    snapshot: Snapshot,
    data: memoryview,
    fname: str,
    meta: dict[str, str],
    sums: Mapping[str, str],
    plan: Plan,
) -> tuple[bytes, list[Any], dict[str, dict[str, Any]]]:
    """Lay out the chunks ``plan`` writes: tensors written whole first (as in a full
    file, largest element size first, so each stays aligned to its element size), then
    the changed chunks of partly reused tensors, each run of consecutive ones as one
    ``U8`` entry named ``<tensor>#chunk<first index>`` (readers go by their offsets,
    never by these names). The file stays a valid safetensors file. A partly reused
    tensor's entry is version 3's: its sources and extents, chunks that lie back to
    back in one file merged into one extent."""
    names = {s.name for s in snapshot.slots}
    file_slots: list[TensorSlot] = []
    spans: list[tuple[int, int]] = []  # arena ranges, in file order
    # Where each tensor's own bytes lie, as data offsets in the file: for a tensor
    # written whole, where it starts; else, per chunk, where it lies (None: reused).
    starts: dict[str, int] = {}
    own_at: dict[str, list[int | None]] = {}
    offset = 0
    for p in plan.slots:
        if p.whole:
            n = p.slot.end - p.slot.begin
            file_slots.append(
                TensorSlot(p.slot.name, p.slot.dtype, p.slot.shape, offset, offset + n)
            )
            spans.append((p.slot.begin, p.slot.end))
            starts[p.slot.name] = offset
            offset += n
    for p in plan.slots:
        if p.whole:
            continue
        # changed chunks lie back to back in the file; each run of them is one entry
        runs: list[list[int]] = []  # [first chunk, data offset, bytes]
        at: list[int | None] = []
        after_changed = False
        for i, ((b, e), old) in enumerate(zip(p.ranges, p.reuse, strict=True)):
            if old is not None:
                at.append(None)
                after_changed = False
                continue
            at.append(offset)
            spans.append((p.slot.begin + b, p.slot.begin + e))
            if after_changed:
                runs[-1][2] += e - b
            else:
                runs.append([i, offset, e - b])
            after_changed = True
            offset += e - b
        own_at[p.slot.name] = at
        for first, begin, size in runs:
            name, n = f"{p.slot.name}#chunk{first}", 0
            while name in names:  # a name is only a header key: any unused one will do
                n += 1
                name = f"{p.slot.name}#chunk{first}.{n}"
            names.add(name)
            file_slots.append(TensorSlot(name, "U8", (size,), begin, begin + size))
    header = safetensors_header(file_slots, meta, align=_header_align(offset))
    start = len(header)
    base_name = fname.rsplit("/", 1)[-1]
    tensors: dict[str, dict[str, Any]] = {}
    for p in plan.slots:
        name = p.slot.name
        entry = {"dtype": p.slot.dtype, "shape": list(p.slot.shape)}
        entry[CHECKSUM] = sums[name]
        if p.whole:  # one extent of its own file
            at0 = start + starts[name]
            entry["sources"] = [{"file": fname}]
            entry["extents"] = [0, at0, at0 + p.slot.end - p.slot.begin]
            records = [
                Chunk(h, None, base_name, at0 + b, at0 + e)
                for (b, e), h in zip(p.ranges, p.hashes, strict=True)
            ]
        else:
            sources: dict[tuple[int | None, str], int] = {}  # (step, file) -> index
            extents: list[int] = []  # (source, begin, end) triples; adjacent ones merged
            records = []
            ats = own_at[name]
            for (b, e), h, old, own in zip(p.ranges, p.hashes, p.reuse, ats, strict=True):
                if old is not None:
                    key, begin, end = (old.step, old.file), old.begin, old.end
                    records.append(old)
                else:
                    assert own is not None
                    key, begin, end = (None, fname), start + own, start + own + e - b
                    records.append(Chunk(h, None, base_name, begin, end))
                src = sources.setdefault(key, len(sources))
                if extents and extents[-3] == src and extents[-1] == begin:
                    extents[-1] = end
                else:
                    extents += (src, begin, end)
            entry["sources"] = [
                {"file": f} if step is None else {"step": step, "file": f} for step, f in sources
            ]
            entry["extents"] = extents
        tensors[name] = entry
        plan.records[name] = Record(p.slot.dtype, tuple(p.slot.shape), tuple(records), sums[name])
    plan.held = offset
    buffers: list[Any] = []
    for b, e in _coalesce(spans):
        buffers.append(data[b:e])
    return header, buffers, tensors


def _header_align(nbytes: int) -> int:
    """The alignment of a data file's header for ``nbytes`` of data: a page where the file
    is large enough to be written with ``O_DIRECT`` (`resumable.storage.direct`), so that
    its data leaves the page-aligned arena for the disk without a copy; else 8 bytes."""
    return direct.ALIGN if nbytes >= direct.DIRECT_MIN_BYTES else 8


def _coalesce(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent arena ranges merged, so a file is written with few large buffers."""
    out: list[tuple[int, int]] = []
    for b, e in spans:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], e)
        elif e > b:
            out.append((b, e))
    return out


def check_refs(storage: Storage, refs: list[int]) -> bool:
    """Whether every checkpoint a new one would refer to is still committed (something
    outside this writer, ``resumable prune`` or a user, may have deleted one)."""
    return all(storage.exists(f"{step_dir(k)}/{MANIFEST}") for k in refs)


def _write_part(
    file: _DataFile,
    attempt: Attempt,
    request: WriteRequest,
    rank: int,
    size: int,
    tensors: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Write ``rank``'s part of the split manifest beside its data file; returns its
    report to rank 0: O(1) bytes (the data file, the part's entry, the steps referred to)."""
    name = part_file(rank)
    blob, json_size = encode_part(
        step=request.step,
        rank=rank,
        file=file.key,
        tree=request.tree,
        tensors=tensors,
        holders=request.holders or {},
    )
    file.storage.write(attempt.path(name), [blob])
    refs = sorted({s for t in tensors.values() for s, *_ in tensor_ranges(t) if s is not None})
    report = {
        "file": file.key,
        "size": size,
        "part": part_entry(rank, attempt.key(name), blob, json_size),
        "refs": refs,
        "step": request.step,
    }
    return report


class Coordination(Protocol):
    """The exchanges of a coordinated persist (`resumable.coordination`)."""

    rank: int
    world_size: int

    @property
    def coordinator(self) -> bool: ...

    def broadcast(self, obj: Any, name: str) -> Any: ...

    def gather(self, obj: Any, name: str) -> list[Any]: ...

    def gather_to(self, obj: Any, name: str, leader: int, members: list[int]) -> list[Any]: ...

    def abandon(self, reason: str) -> None: ...


def write_distributed(
    group: Coordination,
    storage: Storage,
    committer: Committer,
    request: WriteRequest | LateRequest,
    *,
    check: Callable[[], None] | None = None,
    base: DeltaBase | None = None,
    nodes: NodeObjects | None = None,
) -> PersistResult:
    """The coordinated commit of several ranks (called on every rank at the same step,
    through a `Group` on the training threads or a `StoreCoordinator` in the workers).

    Rank 0 opens the attempt and tells every rank where to write; each rank writes its
    own data file (its shards, its share of the replicated tensors, its per-rank state)
    and its part of the manifest (`resumable.parts`, format version 4), and reports
    their names, sizes and the part's checksum, or its error; rank 0 commits a top
    manifest naming the parts only if every rank succeeded, and
    tells everyone the outcome: the bytes, whether it replaced a commit, the manifest's
    digest. The manifest stays on rank 0 (`PersistResult.manifest` is None on the
    others), so each rank reads O(1) bytes of outcome. Any failure, on any rank, means
    nothing is committed, the attempt is removed, and every rank raises `PersistError`:
    the previous checkpoint stays the newest. ``check`` runs on every rank before it
    reports success and on rank 0 before it commits (a worker whose trainer died
    reports an error instead). With ``nodes``, the ranks of each node share one object
    (`resumable.nodes`, format version 6; every checkpoint whole, ``base`` unused).
    A `LateRequest` is made as this rank's write begins.
    """
    t0 = time.perf_counter()
    step = request.step
    opened: dict[str, Any] | None = None
    if group.coordinator:
        try:
            opened = asdict(committer.begin(step))
        except Exception as exc:
            opened = {"error": f"rank 0 could not open an attempt: {type(exc).__name__}: {exc}"}
    shared = group.broadcast(opened, "attempt")
    if "error" in shared:
        raise PersistError(f"step {step} was not committed: {shared['error']}")
    attempt = Attempt(**shared)
    staging = Staging(nodes, attempt.path("")) if nodes is not None else None
    if staging is not None:
        base = None
    report: dict[str, Any]
    plan: Plan | None = None
    metrics = request.metrics if isinstance(request, WriteRequest) else None
    try:
        if isinstance(request, LateRequest):
            request = request.make()  # of ``step``: the caller's make checks
            metrics = request.metrics
        if staging is None:
            file = _DataFile.of(storage, attempt, group.rank)
        else:  # the staging files are written like a root's, without fsync
            name = rank_file(group.rank)
            file = _DataFile(cast("Storage", staging), attempt.path(name), attempt.key(name))
        size, tensors, plan = _write_data_file(file, request, base)
        report = _write_part(file, attempt, request, group.rank, size, tensors)
        if check is not None:
            check()
    except Exception as exc:
        report = {"error": f"rank {group.rank}: {type(exc).__name__}: {exc}", "step": step}
    try:
        if nodes is not None and staging is not None:
            report = _node_object(group, storage, attempt, nodes, staging, report)
        outcome, manifest = _commit_reports(group, committer, attempt, step, metrics, report, check)
    finally:
        if staging is not None:
            staging.remove([rank_file(group.rank), part_file(group.rank)])
    if "error" in outcome:
        raise PersistError(f"step {step} was not committed on any rank: {outcome['error']}")
    if base is not None and plan is not None:
        base.committed(step, plan)
    return PersistResult(
        step,
        outcome["nbytes"],
        time.perf_counter() - t0,
        outcome["replaced"],
        manifest,
        outcome["digest"],
    )


def _commit_reports(
    group: Coordination,
    committer: Committer,
    attempt: Attempt,
    step: int,
    metrics: Mapping[str, Any] | None,
    report: dict[str, Any],
    check: Callable[[], None] | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Every rank's ``report`` to rank 0, rank 0's commit of them (with ``metrics``, its
    own request's), and the outcome on every rank (with the manifest on rank 0, None
    elsewhere)."""
    try:
        reports = group.gather(report, "reports")
    except PersistError as exc:  # a rank died or hung: nobody will commit
        if group.coordinator:
            group.abandon(str(exc))
            abort_quietly(committer, attempt)
        raise
    outcome: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None  # rank 0's alone
    if group.coordinator:
        errors = [r["error"] for r in reports if "error" in r]
        steps = [r.get("step") for r in reports]
        if len(set(steps)) != 1:  # never mix the states of different steps in one commit
            errors.append(f"the ranks saved different steps {steps}")
        if not errors:
            try:
                manifest, blob = build_top(
                    step=step,
                    metrics=metrics,
                    files={
                        r["file"]: {"size": r["size"], "rank": i} for i, r in enumerate(reports)
                    },
                    parts=[r["part"] for r in reports],
                    refs=[k for r in reports for k in r["refs"]],
                    world_size=group.world_size,
                    **_segments(reports),
                )
                if "segments" in manifest:  # every file and part in one node's object
                    check_segments(manifest, f"the manifest of step {step}")
                if check is not None:
                    check()
                replaced = committer.commit(attempt, blob)
                nbytes = sum(r["size"] + r["part"]["size"] for r in reports) + len(blob)
                # Not the manifest: every rank reads the outcome (O(N) bytes each, O(N²)
                # in all); only rank 0 uses the manifest, and keeps it.
                outcome = {"nbytes": nbytes, "replaced": replaced, "digest": manifest["digest"]}
            except Exception as exc:
                errors.append(f"rank 0 could not commit: {type(exc).__name__}: {exc}")
        if errors:
            abort_quietly(committer, attempt)
            outcome = {"error": "; ".join(errors)}
    return group.broadcast(outcome, "outcome"), manifest


def _segments(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """`build_top`'s ``objects`` and ``segments`` from the node leaders' reports (none
    where no rank wrote a node's object)."""
    nodes = [r["node"] for r in reports if "node" in r]
    if not nodes:
        return {}
    return {
        "objects": {n["object"]: {"size": n["size"]} for n in nodes},
        "segments": {k: v for n in nodes for k, v in n["segments"].items()},
    }


def _node_object(
    group: Coordination,
    storage: Storage,
    attempt: Attempt,
    nodes: NodeObjects,
    staging: Staging,
    report: dict[str, Any],
) -> dict[str, Any]:
    """Each rank tells its node's leader what it staged (its report, and its node);
    the leader uploads the node's staged files as one object and returns its report
    with where each file and part lies in it (``node``), or an error. The others'
    reports are unchanged."""
    step, rank = report["step"], group.rank
    try:
        got = group.gather_to({**report, "node": nodes.node}, STAGED, nodes.leader, nodes.members)
    except PersistError as exc:
        if rank != nodes.leader:
            raise
        return {"error": str(exc), "step": step}
    if rank != nodes.leader or "error" in report:
        return report
    errors = [r["error"] for r in got if "error" in r]
    strangers = [m for m, r in zip(nodes.members, got, strict=True) if r.get("node") != nodes.node]
    if strangers and not errors:
        errors.append(
            f"rank(s) {strangers} run on another node than {nodes.node!r}: one object per "
            "node needs the ranks of a node numbered one after the other (torchrun's "
            "numbering; LOCAL_WORLD_SIZE ranks from RANK - LOCAL_RANK)"
        )
    if errors:
        return {"error": f"rank {rank}: no object for its node: {'; '.join(errors)}", "step": step}
    name = node_file(nodes.leader)
    key = attempt.key(name)
    segments: dict[str, dict[str, Any]] = {}
    chunks: list[Any] = []
    offset = 0
    try:
        for r in got:
            for fkey, size in ((r["file"], r["size"]), (r["part"]["file"], r["part"]["size"])):
                segments[fkey] = {"object": key, "offset": offset}
                chunks.append(staging.mapped(fkey.rsplit("/", 1)[-1], size))
                offset += size
        storage.write(attempt.path(name), chunks)
    except Exception as exc:
        return {
            "error": f"rank {rank}: the object of its node: {type(exc).__name__}: {exc}",
            "step": step,
        }
    finally:
        for c in chunks:
            if hasattr(c, "close"):
                c.close()
    return {**report, "node": {"object": key, "size": offset, "segments": segments}}
