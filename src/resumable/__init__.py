"""resumable: cheap, atomic, exactly-resumable checkpoints for PyTorch training.

ckpt = resumable.Checkpointer("runs/exp1", state={"model": model, "optim": opt})
start = ckpt.restore()
for step in range(start, total_steps):
    ...
    ckpt.maybe_save(step + 1, metrics={"loss": loss.item()})
ckpt.close()
"""

from __future__ import annotations

from resumable._version import __version__
from resumable.capture import Stateful
from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NewerFormatError,
    NoCheckpointError,
    OptionError,
    PersistError,
    StateMismatchError,
    StepOrderError,
    StorageError,
    UnsupportedStateError,
)
from resumable.incremental import Incremental
from resumable.manager import Checkpointer
from resumable.options import CheckpointOptions
from resumable.policy import Every, Keep
from resumable.preemption import REQUEUE_EXIT_CODE, Preemption

__all__ = [
    "REQUEUE_EXIT_CODE",
    "CheckpointError",
    "CheckpointOptions",
    "Checkpointer",
    "CorruptCheckpointError",
    "Every",
    "Incremental",
    "Keep",
    "NewerFormatError",
    "NoCheckpointError",
    "OptionError",
    "PersistError",
    "Preemption",
    "StateMismatchError",
    "Stateful",
    "StepOrderError",
    "StorageError",
    "UnsupportedStateError",
    "__version__",
]
