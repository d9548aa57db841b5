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
from dataclasses import dataclass
from typing import Any

from resumable.commit import Committer
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
) -> PersistResult:
    """Write ``snapshot`` and ``tree`` as the checkpoint of ``step`` and commit it.

    Returns after the commit is durable. On failure the attempt is removed and the
    exception propagates; earlier checkpoints are untouched.
    """
    t0 = time.perf_counter()
    attempt = committer.begin(step)
    fname = attempt.key(rank_file(0))
    header = safetensors_header(
        snapshot.slots, {"format": "pt", "producer": "resumable", "step": str(step)}
    )
    data = snapshot.memory()
    start = len(header)
    tensors = {
        s.name: {
            "file": fname,
            "dtype": dtype_name(s.dtype),
            "shape": list(s.shape),
            "offsets": [start + s.begin, start + s.end],
            CHECKSUM: checksum(data[s.begin : s.end]),
        }
        for s in snapshot.slots
    }
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
        try:
            committer.abort(attempt)
        except Exception:
            pass  # the original error is the one that matters; stale() cleans up later
        raise
    return PersistResult(step, size + len(blob), time.perf_counter() - t0, replaced, manifest)
