"""The last step the training loop reported: what `resumable.Checkpointer.close`
checkpoints as the final state.

The state is that step's only while no optimizer of the state has stepped since the
report; otherwise it is ahead of the step, and close takes no capture (a WARNING says
to pass ``close(step=...)``). A post-step hook on each optimizer tells the two apart.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

Final = tuple[int, Mapping[str, Any] | None]


def check_step(step: Any) -> None:
    """Refuse a step that is not a non-negative int (a bool included)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


class LastStep:
    """The last step reported, and whether an optimizer of the state stepped since.

    Call order (the facade's, on the training thread): `saw` at each ``save``,
    ``maybe_save`` and ``snapshot``; `forget` when that save failed; `final` at close;
    `close` once, which removes the optimizer hooks.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.step: int | None = None
        self.metrics: Mapping[str, Any] | None = None
        self.stepped = False
        ref = weakref.ref(self)

        def mark(*_: Any) -> None:
            seen = ref()
            if seen is not None:
                seen.stepped = True

        self._handles: list[Any] = []
        for obj in state.values():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            inner = getattr(obj, "optimizer", None)  # wrappers (accelerate, Lightning)
            target = inner if isinstance(inner, torch.optim.Optimizer) else obj
            try:
                self._handles.append(target.register_step_post_hook(mark))
            except AttributeError:  # a subclass that skipped Optimizer.__init__: not watched
                pass

    def saw(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        self.step, self.metrics, self.stepped = step, metrics, False

    def forget(self) -> None:
        """The save or snapshot of the step seen failed: nothing to checkpoint at close."""
        self.step, self.metrics = None, None

    def final(self, step: int | None, metrics: Mapping[str, Any] | None, url: str) -> Final | None:
        """The step (and metrics) whose state close checkpoints, or None: ``step`` if
        given, else the last step seen unless an optimizer stepped after it."""
        if step is not None:
            return step, metrics
        if self.step is None:
            return None
        if self.stepped:
            log.warning(
                "closing %s: an optimizer stepped after the last maybe_save()/save() "
                "(step %d), so the state is ahead of that step and is not checkpointed "
                "at close; the newest checkpoint is the last one taken. Call "
                "maybe_save(step) after each optimizer step, or close(step=...) with the "
                "step the state is at",
                url,
                self.step,
            )
            return None
        return self.step, self.metrics

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
