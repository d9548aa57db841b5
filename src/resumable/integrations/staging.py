"""`StagedState`: restored state held back until a framework's own load point.

A `Checkpointer` restores everything at once, but a trainer builds some of what it
restores later (the optimizer after the model is wrapped) or consumes random numbers
between the restore and the first training step (setup hooks, sanity checks). A slot
keeps what was restored and hands it over when the integration calls `StagedState.apply`
from the framework's hook, so the live objects see it exactly where the framework would
have loaded its own checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StagedState"]


class StagedState:
    """A `resumable.Stateful` whose state is read from a live object at save time, and
    whose restored state is kept until the framework's own load point calls `apply`.

    ``read`` is called on the training thread at every capture (also when nothing
    exists yet, before a restore: it then returns ``{}``); ``write`` gets the restored
    state once, from `apply`. `discard` drops a restored state that must not be applied
    (the optimizer of the best step, when only its model is wanted).
    """

    def __init__(
        self, read: Callable[[], dict[str, Any]], write: Callable[[dict[str, Any]], None]
    ) -> None:
        self._read = read
        self._write = write
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self._read()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = dict(state_dict)

    def apply(self) -> bool:
        """Hand the restored state to ``write``; False when nothing was restored."""
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        self._write(pending)
        return True

    def discard(self) -> None:
        self.pending = None
