"""Persist: turn a snapshot into files in storage and commit them.

`write_checkpoint` is the unit of persist work: format (safetensors header, per-tensor
checksums, manifest) + storage writes + commit. It is called synchronously by the
manager today and is written to run unchanged in a background worker: it reads only the
snapshot it is given, never the live training state, and on any failure it aborts the
attempt so no half-written checkpoint becomes visible.

Data files are named per rank (``rank-00000.safetensors``) so that several ranks can
write their shards into one checkpoint directory side by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from resumable.commit import Attempt, Committer, abort_quietly
from resumable.distributed import Piece
from resumable.errors import PersistError
from resumable.format import (
    CHECKSUM,
    build_manifest,
    checksum,
    dtype_name,
    encode_manifest,
    safetensors_header,
)
from resumable.snapshot import Snapshot
from resumable.storage.base import Storage


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class PersistResult:
    step: int
    nbytes: int
    seconds: float
    replaced: bool
    manifest: dict[str, Any]


def write_checkpoint(
    storage: Storage,
    committer: Committer,
    *,
    step: int,
    snapshot: Snapshot,
    tree: Any,
    metrics: Mapping[str, Any] | None = None,
    before_commit: Callable[[], None] | None = None,
    pieces: Mapping[str, Piece] | None = None,
) -> PersistResult:
    """Write ``snapshot`` and ``tree`` as the checkpoint of ``step`` and commit it.

    Returns after the commit is durable. On failure the attempt is removed (unless its
    manifest landed all the same: `MarkerCommit.abort`) and the exception propagates;
    earlier checkpoints are untouched.
    """
    t0 = time.perf_counter()
    attempt = committer.begin(step)
    fname = attempt.key(rank_file(0))
    header, data, tensors = file_index(snapshot, fname, step, pieces)
    try:
        size = storage.write(attempt.path(rank_file(0)), [header, data])
        manifest = build_manifest(
            step=step,
            metrics=metrics,
            trees=[tree],
            files={fname: {"size": size, "rank": 0}},
            tensors=tensors,
        )
        blob = encode_manifest(manifest)
        if before_commit is not None:
            before_commit()
        replaced = committer.commit(attempt, blob)
    except BaseException:
        abort_quietly(committer, attempt)
        raise
    return PersistResult(step, size + len(blob), time.perf_counter() - t0, replaced, manifest)


def file_index(
    snapshot: Snapshot, fname: str, step: int, pieces: Mapping[str, Piece] | None = None
) -> tuple[bytes, Any, dict[str, dict[str, Any]]]:
    """The safetensors header, the data and the manifest's tensor entries of one data
    file (``pieces``: where global tensors lie, for several ranks)."""
    header = safetensors_header(
        snapshot.slots, {"format": "pt", "producer": "resumable", "step": str(step)}
    )
    data = snapshot.memory()
    start = len(header)
    tensors: dict[str, dict[str, Any]] = {}
    for s in snapshot.slots:
        entry: dict[str, Any] = {
            "file": fname,
            "dtype": dtype_name(s.dtype),
            "shape": list(s.shape),
            "offsets": [start + s.begin, start + s.end],
            CHECKSUM: checksum(data[s.begin : s.end]),
        }
        piece = (pieces or {}).get(s.name)
        if piece is not None:
            entry["fqn"] = piece.fqn
            entry["global_shape"] = list(piece.global_shape)
            entry["global_offset"] = list(piece.global_offset)
        tensors[s.name] = entry
    return header, data, tensors


class Coordination(Protocol):
    """The exchanges of a coordinated persist (`resumable.coordination`)."""

    rank: int
    world_size: int

    @property
    def coordinator(self) -> bool: ...

    def broadcast(self, obj: Any, name: str) -> Any: ...

    def gather(self, obj: Any, name: str) -> list[Any]: ...

    def abandon(self, reason: str) -> None: ...


def write_distributed(
    group: Coordination,
    storage: Storage,
    committer: Committer,
    *,
    step: int,
    snapshot: Snapshot,
    tree: Any,
    pieces: Mapping[str, Piece],
    metrics: Mapping[str, Any] | None = None,
    check: Callable[[], None] | None = None,
) -> PersistResult:
    """The coordinated commit of several ranks (called on every rank at the same step,
    through a `Group` on the training threads or a `StoreCoordinator` in the workers).

    Rank 0 opens the attempt and tells every rank where to write; each rank writes its
    own data file (its shards, its share of the replicated tensors, its per-rank state)
    and reports it, or its error; rank 0 commits only if every rank succeeded, and
    tells everyone the outcome. Any failure, on any rank, means nothing is committed, the
    attempt is removed, and every rank raises `PersistError`: the previous checkpoint
    stays the newest. ``check`` runs on every rank before it reports success and on
    rank 0 before it commits (a worker whose trainer died reports an error instead).
    """
    t0 = time.perf_counter()
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
    report: dict[str, Any]
    try:
        fname = attempt.key(rank_file(group.rank))
        header, data, tensors = file_index(snapshot, fname, step, pieces)
        size = storage.write(attempt.path(rank_file(group.rank)), [header, data])
        if check is not None:
            check()
        report = {"file": fname, "size": size, "tensors": tensors, "tree": tree, "step": step}
    except Exception as exc:
        report = {"error": f"rank {group.rank}: {type(exc).__name__}: {exc}", "step": step}
    try:
        reports = group.gather(report, "reports")
    except PersistError as exc:  # a rank died or hung: nobody will commit
        if group.coordinator:
            group.abandon(str(exc))
            abort_quietly(committer, attempt)
        raise
    outcome: dict[str, Any] | None = None
    if group.coordinator:
        errors = [r["error"] for r in reports if "error" in r]
        steps = [r.get("step") for r in reports]
        if len(set(steps)) != 1:  # never mix the states of different steps in one commit
            errors.append(f"the ranks saved different steps {steps}")
        manifest: dict[str, Any] = {}
        if not errors:
            try:
                index: dict[str, Any] = {}
                for r in reports:
                    index.update(r["tensors"])
                manifest = build_manifest(
                    step=step,
                    metrics=metrics,
                    trees=[r["tree"] for r in reports],
                    files={
                        r["file"]: {"size": r["size"], "rank": i} for i, r in enumerate(reports)
                    },
                    tensors=index,
                    world_size=group.world_size,
                )
                blob = encode_manifest(manifest)
                if check is not None:
                    check()
                replaced = committer.commit(attempt, blob)
                nbytes = sum(r["size"] for r in reports) + len(blob)
                outcome = {"nbytes": nbytes, "replaced": replaced, "manifest": manifest}
            except Exception as exc:
                errors.append(f"rank 0 could not commit: {type(exc).__name__}: {exc}")
        if errors:
            abort_quietly(committer, attempt)
            outcome = {"error": "; ".join(errors)}
    outcome = group.broadcast(outcome, "outcome")
    if "error" in outcome:
        raise PersistError(f"step {step} was not committed on any rank: {outcome['error']}")
    return PersistResult(
        step, outcome["nbytes"], time.perf_counter() - t0, outcome["replaced"], outcome["manifest"]
    )
