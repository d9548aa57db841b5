"""The one error hierarchy of `resumable`.

Every error the library raises on purpose is a `CheckpointError`; each subclass also
inherits the builtin a caller would naturally catch (`ValueError`, `OSError`, ...), so
``except OSError`` around a save still sees a storage failure. Messages say what was
expected, what was found, and what to do.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by `resumable`."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint exists but cannot be trusted: bad checksum, truncated or missing file,
    malformed or hostile manifest. Restore skips such checkpoints; it raises this error
    only when checkpoints exist and none of them is valid."""


class NewerFormatError(CheckpointError, ValueError):
    """A checkpoint was written in a newer format version than this `resumable` reads.
    Restore raises it instead of skipping the checkpoint: falling back to an older one
    would silently lose progress."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """A specific checkpoint was asked for (``restore(step=N)``, ``show --step N``) and
    is not there."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed (I/O error, full disk, permission, unreachable server)."""


class UnsupportedStateError(CheckpointError, TypeError):
    """An object in the user's ``state`` cannot be checkpointed safely."""


class StateMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the ``state`` it is restored into (missing keys,
    different shapes or structure)."""


class PersistError(CheckpointError, RuntimeError):
    """A save that was started earlier failed; raised at the next ``save``/``wait``/``close``."""


class RootInUseError(CheckpointError, RuntimeError):
    """Another process holds the checkpoint root (`resumable.lock`): two jobs writing one
    root would replace each other's checkpoints. Raised when the root is taken, and by a
    holder that lost its lease on object storage. ``holder`` describes the other process
    (host, pid, since when) where it is known."""

    def __init__(self, message: str, *, url: str = "", holder: object = None) -> None:
        super().__init__(message)
        self.url = url
        self.holder = holder


class StepOrderError(CheckpointError, ValueError):
    """A step passed to ``save``, ``maybe_save`` or ``snapshot`` is older than the newest
    step restored or saved: its checkpoint would never be the one restored (the newer
    one is), so the work since would be lost at the next launch. Raised instead of
    dropping the step in silence."""


class ReplicaError(CheckpointError, OSError):
    """A memory snapshot's replica on a peer node could not be sent, received or read:
    the peer refused it (another job or run, a bad signature, a replayed message), its
    bytes did not match their digest, the connection failed or timed out, or the replica
    asked for is not held. ``reason`` names which (`resumable.replicas.transport`)."""

    def __init__(self, message: str, *, reason: str = "io") -> None:
        super().__init__(message)
        self.reason = reason


class ReplicaPlacementError(CheckpointError, ValueError):
    """Replicas of memory snapshots cannot be placed as asked: more copies than there
    are nodes (failure domains), or a rank layout that names no node."""


class OptionError(CheckpointError, ValueError):
    """An option of a `Checkpointer` (or of an integration built on it) has a value of
    the wrong type or range, or options that cannot work together were combined
    (`resumable.options`). Raised when the options are built, before anything is opened."""
