"""Resharding on restore: each live tensor filled from the pieces that overlap it.

`GlobalLoader` fills each live target (a DTensor's local shard, or a whole tensor) from
whichever stored pieces overlap it, whatever world size wrote them. Which byte ranges of
which pieces to copy is planned by ``torch.distributed.checkpoint``'s own planner helper
(``create_read_items_for_chunk_list``), as ``dcp.load`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from resumable._dtypes import dtype_from_name
from resumable.errors import CorruptCheckpointError, StateMismatchError
from resumable.pieces import global_tensors, is_dtensor


class GlobalLoader:
    """Builds the value of each global tensor for this rank from the pieces of a
    checkpoint, shaped like the live target (see module doc).

    Where the reader holds a split manifest in part
    (`resumable.reader.CheckpointReader.only_rank`) and the pieces found do not fill a
    target, it reads every part and plans again.

    Call order: `prepare` for the tensors to restore (optional: `value` and `assemble`
    prepare what they need), then `value` or `assemble` per tensor.

    Args:
        reader: the checkpoint's reader (a `resumable.reader.CheckpointReader`).
        live: the live targets by global name; a DTensor's placement decides what this
            rank reads.
    """

    def __init__(self, reader: Any, live: Mapping[str, Any]) -> None:
        self.reader = reader
        self.live = live
        self.where = reader.where
        # Validated when the manifest was read: the pieces of each tensor tile it.
        self.globals = global_tensors(reader.manifest["tensors"])
        self._values: dict[str, torch.Tensor] = {}

    def prepare(self, fqns: list[str]) -> None:
        """Read (and checksum) every piece this rank needs for ``fqns``, once.

        Args:
            fqns: global tensor names.

        Raises:
            StateMismatchError: the checkpoint has no such tensor, or its shape differs
                from the live target's.
            CorruptCheckpointError: a piece fails its checksum.
        """
        plans = {f: self._plan(f) for f in fqns}
        names = sorted({item[0] for plan in plans.values() for item in plan[2]})
        read = self.reader.tensors(names, verify=True) if names else {}
        for fqn, (local_shape, dtype, items) in plans.items():
            whole = _whole_piece(items, read, local_shape, dtype)
            if whole is not None:  # saved as this rank holds it: no copy here
                self._values[fqn] = whole
                continue
            out = torch.empty(local_shape, dtype=dtype)
            for name, src_off, dst_off, lengths in items:
                src = read[name]
                dst = out
                for d, (so, do, n) in enumerate(zip(src_off, dst_off, lengths)):
                    src = src.narrow(d, so, n)
                    dst = dst.narrow(d, do, n)
                dst.copy_(src)
            self._values[fqn] = out

    def _plan(self, fqn: str) -> tuple[tuple[int, ...], torch.dtype, list[Any]]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.planner_helpers import (
            create_read_items_for_chunk_list,
        )

        if fqn not in self.globals:
            if self._widen():
                return self._plan(fqn)
            raise StateMismatchError(f"{self.where}: the checkpoint has no tensor {fqn!r}")
        spec = self.globals[fqn]
        gshape, dtype = spec.shape, dtype_from_name(spec.dtype)
        saved = [p for p in spec.pieces if math.prod(p.shape)]
        live = self.live.get(fqn)
        if live is not None and tuple(live.shape) != gshape:
            raise StateMismatchError(
                f"{fqn}: the checkpoint holds shape {list(gshape)}, the live tensor is "
                f"{list(live.shape)}; restore into the same model it was saved from"
            )
        if live is not None and is_dtensor(live):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(
                live.shape, live.device_mesh, live.placements
            )
            local_shape, offset = tuple(local_shape), tuple(offset)
        else:
            local_shape, offset = gshape, (0,) * len(gshape)
        by_offset = {p.offset: p for p in saved}
        md = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(gshape),
            chunks=[ChunkStorageMetadata(torch.Size(p.offset), torch.Size(p.shape)) for p in saved],
        )
        target = ChunkStorageMetadata(torch.Size(offset), torch.Size(local_shape))
        items = []
        if math.prod(local_shape):
            for it in create_read_items_for_chunk_list(fqn, md, [target]):
                src = by_offset[tuple(it.storage_index.offset or ())]
                items.append(
                    (src.name, tuple(it.storage_offsets), tuple(it.dest_offsets), tuple(it.lengths))
                )
        if sum(math.prod(it[3]) for it in items) != math.prod(local_shape):
            # the pieces read (disjoint, `check_pieces`) do not fill this rank's part
            if self._widen():
                return self._plan(fqn)
            raise CorruptCheckpointError(f"{self.where}: the pieces of {fqn!r} do not cover it")
        return local_shape, dtype, items

    def _widen(self) -> bool:
        """Where the reader holds some ranks' parts of a split manifest only, read them
        all (another layout at the same world size); whether it did."""
        if not getattr(self.reader, "partial", False):
            return False
        self.reader.widen()
        self.globals = global_tensors(self.reader.manifest["tensors"])
        return True

    def assemble(self, fqn: str) -> torch.Tensor:
        """The whole of ``fqn`` as one tensor, read from its pieces and not kept (export
        holds one tensor at a time). Needs no live target and no process group.

        Args:
            fqn: a global tensor name.

        Returns:
            The whole tensor.

        Raises:
            StateMismatchError: the checkpoint has no such tensor.
            CorruptCheckpointError: a piece fails its checksum.
        """
        self.prepare([fqn])
        return self._values.pop(fqn)

    def spec(self, fqn: str) -> tuple[tuple[int, ...], str]:
        """Global shape and dtype name of ``fqn``.

        Args:
            fqn: a global tensor name.

        Returns:
            ``(shape, dtype name)``.

        Raises:
            CorruptCheckpointError: the checkpoint holds no pieces of ``fqn``.
        """
        if fqn not in self.globals:
            raise CorruptCheckpointError(f"{self.where}: no pieces of {fqn!r}")
        return self.globals[fqn].shape, self.globals[fqn].dtype

    def value(self, fqn: str) -> torch.Tensor:
        """The restored value of ``fqn``, read now if `prepare` did not.

        Args:
            fqn: a global tensor name.

        Returns:
            A DTensor like the live one, or a tensor.

        Raises:
            StateMismatchError: the checkpoint has no such tensor, or its shape differs.
            CorruptCheckpointError: a piece fails its checksum.
        """
        if fqn not in self._values:
            self.prepare([fqn])
        return shaped_like(self._values[fqn], self.live.get(fqn))


def _whole_piece(
    items: list[Any], read: Mapping[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """The piece read, where one piece is all of this rank's part, as it is (a restore at
    the layout saved): the read tensor itself, not a copy of it. A mapped file's view is
    borrowed as any read tensor is (`resumable.capture.restore` copies what is kept).
    None where the part is assembled from several pieces or a part of one."""
    if len(items) != 1:
        return None
    name, src_off, dst_off, lengths = items[0]
    src = read[name]
    if any(src_off) or any(dst_off) or tuple(lengths) != tuple(shape):
        return None
    if tuple(src.shape) != tuple(shape) or src.dtype != dtype:
        return None
    return src


def shaped_like(local: torch.Tensor, live: Any) -> torch.Tensor:
    """``local`` as the live target holds it.

    Args:
        local: this rank's part of the tensor.
        live: the live target, or None.

    Returns:
        A DTensor with the live one's mesh and placements when ``live`` is a DTensor,
        else ``local`` itself.
    """
    if live is None or not is_dtensor(live):
        return local
    from torch.distributed.tensor import DTensor

    mine, spec = getattr(live, "_local_tensor", None), getattr(live, "_spec", None)
    if (
        mine is not None
        and spec is not None
        and local.dtype == mine.dtype
        and local.shape == mine.shape
        and local.stride() == mine.stride()
        and local.device == mine.device
    ):
        made = with_spec(local, spec)  # the live one's spec holds for ``local``
        if made is not None:
            return made
    return DTensor.from_local(
        local,
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )


def with_spec(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor of ``local`` with ``spec`` (a ``DTensorSpec`` made for a local tensor
    of the same dtype, shape, strides and device), or None where this torch's DTensor
    constructor differs. ``DTensor.from_local`` builds the spec anew at every call:
    about 19 µs against 2 µs here (torch 2.13, CPU), for every tensor of a Megatron
    model's state at each snapshot and restore."""
    from torch.distributed.tensor import DTensor

    try:
        return DTensor(local, spec, requires_grad=local.requires_grad)
    except TypeError:  # private constructor: another signature in this torch
        return None


class SpecCache:
    """DTensors made from local tensors with the spec of the first one made under the
    same key from a local tensor of the same dtype, shape, strides and device
    (`with_spec`): each `make` after the first skips ``DTensor.from_local``'s spec."""

    def __init__(self) -> None:
        self._specs: dict[tuple[Any, ...], Any] = {}

    def make(
        self,
        key: Any,
        local: torch.Tensor,
        mesh: Any,
        placements: Any,
        shape: torch.Size | None = None,
        stride: tuple[int, ...] | None = None,
    ) -> Any:
        """``DTensor.from_local(local, mesh, placements, run_check=False, shape=,
        stride=)``; ``key`` names the global tensor (and part) it is made for."""
        from torch.distributed.tensor import DTensor

        k = (key, local.dtype, local.shape, local.stride(), local.device)
        spec = self._specs.get(k)
        if spec is not None:
            made = with_spec(local, spec)
            if made is not None:
                return made
        made = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
        self._specs[k] = made._spec
        return made
