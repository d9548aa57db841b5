"""Typed messages between the trainer and its persist worker.

The trainer sends *jobs* (`PersistJob`, `MirrorFlushJob`, `StopJob`); the worker sends
*replies* (`Ready`, `Committed`, `Failed`, `MirrorFlushed`) and, from its mirror thread,
*reports* (`Mirrored`, `MirrorFailed`). On the socket of a worker process each message
travels as one JSON object with a ``kind`` tag (`encode`, `decode`: never pickle); a
worker thread passes the objects themselves. `decode` refuses an unknown kind or a
missing field with `CheckpointError`, so a message from another version of the library
is an error, not a silent misreading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from resumable.errors import CheckpointError


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to start: where to write, retention, and the mirror."""

    kind: ClassVar[str] = "config"
    url: str
    keep: dict[str, Any] | None = None
    rank: int = 0
    audit: bool = True
    parent_pid: int = 0
    storage_options: dict[str, Any] | None = None
    mirror: str | None = None
    mirror_keep: dict[str, Any] | None = None
    mirror_options: dict[str, Any] | None = None
    incremental: dict[str, Any] | None = None  # `Incremental.to_json`; None: whole
    nice: int = 0  # added to the worker's niceness once it is ready (`_worker.worker_nice`)
    world_size: int = 1  # the job's ranks: with several, the worker loads torch early
    # torch's and NumPy's versions in the trainer, for the manifests (`format.tell_versions`)
    versions: dict[str, str] | None = None


@dataclass(frozen=True)
class PersistJob:
    """Persist the snapshot ``seq`` found in the shared-memory slot at ``slot``.

    ``group`` names the coordination store and key of a persist of several ranks
    (`resumable.coordination`); None for one process."""

    kind: ClassVar[str] = "persist"
    slot: str
    seq: int
    step: int
    group: dict[str, Any] | None = None
    id: int = 0


@dataclass(frozen=True)
class MirrorFlushJob:
    """Wait (up to ``timeout`` s) until the newest commit is mirrored, and say so."""

    kind: ClassVar[str] = "mirror_flush"
    timeout: float | None = None
    id: int = 0


@dataclass(frozen=True)
class StopJob:
    kind: ClassVar[str] = "stop"
    id: int = 0


@dataclass(frozen=True)
class Ready:
    kind: ClassVar[str] = "ready"
    pid: int


@dataclass(frozen=True)
class Committed:
    kind: ClassVar[str] = "committed"
    step: int
    seconds: float
    bytes: int = 0
    replaced: bool = False
    deleted: list[int] = field(default_factory=list)
    id: int = 0


@dataclass(frozen=True)
class Failed:
    kind: ClassVar[str] = "failed"
    step: int | None
    error: str
    errno: int | None = None
    traceback: str = ""
    id: int = 0


@dataclass(frozen=True)
class MirrorFlushed:
    kind: ClassVar[str] = "mirror_flushed"
    newest: int | None
    error: str | None
    id: int = 0


@dataclass(frozen=True)
class Mirrored:
    kind: ClassVar[str] = "mirrored"
    step: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class MirrorFailed:
    kind: ClassVar[str] = "mirror_failed"
    step: int
    error: str


Job = PersistJob | MirrorFlushJob | StopJob
Reply = Committed | Failed | MirrorFlushed
Report = Mirrored | MirrorFailed
Message = WorkerConfig | Job | Ready | Reply | Report

_KINDS: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (
        WorkerConfig,
        PersistJob,
        MirrorFlushJob,
        StopJob,
        Ready,
        Committed,
        Failed,
        MirrorFlushed,
        Mirrored,
        MirrorFailed,
    )
}

_FIELDS: dict[str, tuple[str, ...]] = {
    kind: tuple(f.name for f in dataclasses.fields(cls)) for kind, cls in _KINDS.items()
}


def encode(msg: Message) -> dict[str, Any]:
    """``msg`` as a JSON object with its ``kind``. Every field holds JSON values already
    (no nested dataclass), so the fields are taken as they are: `dataclasses.asdict`
    would deep-copy each dict, on the training thread at every persist's hand-off, only
    for `json.dumps` to read it once."""
    return {"kind": msg.kind, **{name: getattr(msg, name) for name in _FIELDS[msg.kind]}}


def decode(obj: Any) -> Message:
    """The message a JSON object encodes; `CheckpointError` if it encodes none."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"expected a message object from the persist worker, found {obj!r}")
    cls = _KINDS.get(obj.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise CheckpointError(
            f"unknown message kind {obj.get('kind')!r} between the trainer and its persist "
            "worker (are both the same version of resumable?)"
        )
    names = _FIELDS[cls.kind]
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as exc:
        raise CheckpointError(f"malformed {cls.kind!r} message: {exc}") from exc


def with_id(job: Job, job_id: int) -> Job:
    return dataclasses.replace(job, id=job_id)
