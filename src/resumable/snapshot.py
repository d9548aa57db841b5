"""Consistent host copies of the captured tensors, at a step boundary.

`Arena` owns one preallocated byte buffer laid out exactly like the data region of a
safetensors file (see `resumable.format.plan_layout`), so a snapshot is one copy in
and the persist writes it out with no further copy. The buffer is allocated on the
first snapshot and reused while the state's layout stays the same; it is reallocated
only when tensors appear, disappear or change shape (e.g. optimizer moments created by
the first ``optimizer.step()``). Pinned when any source tensor lives on CUDA.

This is the only part of a save that blocks training: once `Arena.snapshot` returns,
the trainer may mutate every tensor and the snapshot stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from resumable.format import TensorSlot, byte_view, plan_layout


@dataclass
class Snapshot:
    """Bytes of every tensor, packed per `slots`, in ``buffer`` (a uint8 CPU tensor)."""

    slots: list[TensorSlot]
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.slots[-1].end if self.slots else 0

    def memory(self) -> memoryview:
        """The packed bytes, without a copy."""
        if self.nbytes == 0:
            return memoryview(b"")
        return byte_view(self.buffer[: self.nbytes])

    def tensor(self, slot: TensorSlot) -> torch.Tensor:
        """A view of one tensor inside the arena (valid until the next snapshot)."""
        return _view(self.buffer, slot)


def _view(buf: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return buf[slot.begin : slot.end].view(slot.dtype).view(slot.shape)


class Arena:
    """A reusable host buffer for snapshots. Used from the training thread only."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] | None = None
        self._slots: list[TensorSlot] = []
        self.allocations = 0

    def snapshot(self, tensors: Mapping[str, torch.Tensor]) -> Snapshot:
        """Copy ``tensors`` into the arena; returns when the copy is complete."""
        slots = plan_layout(tensors)
        key = tuple((s.name, s.dtype, s.shape) for s in slots)
        on_cuda = any(t.is_cuda for t in tensors.values())
        if key != self._key or self._buffer is None:
            total = slots[-1].end if slots else 0
            pin = on_cuda and torch.cuda.is_available()
            self._buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
            self._key, self._slots = key, slots
            self.allocations += 1
        buf = self._buffer
        with torch.no_grad():
            for slot in self._slots:
                _view(buf, slot).copy_(tensors[slot.name], non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        return Snapshot(self._slots, buf)
