"""Several processes: rank coordination and global (replicated or sharded) tensors.

Under ``torchrun`` (or any initialised ``torch.distributed`` process group) the same
`Checkpointer` code runs on every rank. This module holds what is specific to that:

- `Group`: rank, world size and a side gloo group with a bounded timeout, used only by
  checkpointing (so its collectives never interleave with training's), with the three
  collectives a coordinated commit and a coordinated restore need.
- *Global tensors*: the tensors of top-level modules and optimizers. A ``DTensor``
  (FSDP2, tensor parallel) is written as this rank's local shard; a plain tensor (DDP
  replicas, optimizer step counts) is written once in total, by the rank `balance`
  assigns it to. Each piece records its ``fqn`` (its path in the state, the same at any
  world size), the global shape and its offset in the global tensor.
- `GlobalLoader`: fills each live target (a DTensor's local shard, or a whole tensor)
  from whichever pieces overlap it, whatever world size wrote them. Which byte ranges
  of which pieces to copy is planned by ``torch.distributed.checkpoint``'s own planner
  helper (``create_read_items_for_chunk_list``), as ``dcp.load`` does. That the pieces
  tile each tensor exactly (DCP itself does not check) is part of reading the manifest
  (`check_pieces`, called by `resumable.format.decode_manifest`), in O(n log n).

Everything else in the state (RNG streams, data position, ...) is per-rank: every rank
saves its own. On a different world size such state cannot be resharded, and restore
says so by name unless asked to reset it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from resumable.errors import CorruptCheckpointError, PersistError, StateMismatchError

log = logging.getLogger("resumable")

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Piece:
    """Where a captured tensor sits in its global tensor."""

    fqn: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def is_dtensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def dtensor_piece(t: Any, fqn: str) -> tuple[torch.Tensor, Piece, bool]:
    """This rank's local shard of DTensor ``t`` (detached), where it lies, and whether
    it is fully replicated (every rank holds all of it). Runs at every snapshot, so the
    shard's place is computed once per shape, mesh and placements."""
    shape = tuple(t.shape)  # a torch.Size: ints already
    offset, replicated = _shard_place(shape, t.device_mesh, tuple(t.placements))
    # What to_local() returns with grad disabled, without its dispatch (about 45 us a
    # tensor, at every snapshot); to_local where the attribute is not there.
    local = getattr(t, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):
        with torch.no_grad():  # no autograd node for the view (to_local is differentiable)
            local = t.to_local()
    return (local.detach() if local.requires_grad else local), Piece(fqn, shape, offset), replicated


@functools.lru_cache(maxsize=4096)
def _shard_place(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], bool]:
    """Where this rank's shard lies, and whether every placement is ``Replicate`` (an
    ``isinstance`` on a placement costs microseconds: torch's placements check it in
    Python)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(x) for x in offset), all(isinstance(p, Replicate) for p in placements)


def pieces_to_json(pieces: Mapping[str, Piece]) -> dict[str, list[Any]]:
    return {n: [p.fqn, list(p.global_shape), list(p.global_offset)] for n, p in pieces.items()}


def pieces_from_json(data: Any) -> dict[str, Piece]:
    return {n: Piece(str(f), tuple(g), tuple(o)) for n, (f, g, o) in (data or {}).items()}


def piece_name(piece: Piece) -> str:
    """Index name of a shard: ``fqn@o1,o2`` (a whole tensor keeps its plain name)."""
    return f"{piece.fqn}@{','.join(str(o) for o in piece.global_offset)}"


def owned_tensors(
    tensors: Mapping[str, torch.Tensor], replicated: Any, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """The tensors ``rank`` writes: all but the replicated ones that `balance` gives
    another rank (each replicated tensor is written once in total)."""
    if world == 1:
        return dict(tensors)
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in replicated if n in tensors}
    owner = balance(sizes, world)
    return {n: t for n, t in tensors.items() if owner.get(n, rank) == rank}


def balance(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Assign each replicated tensor to one rank: biggest first, to the least loaded
    rank (ties to the lowest). Deterministic, so every rank computes the same map
    without communicating."""
    load = [0] * world
    owner: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    return owner


# --------------------------------------------------------------------------- the group


class Group:
    """This process's place in the job, and the collectives checkpointing uses."""

    def __init__(self, rank: int, world_size: int, pg: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pg = pg

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any, name: str = "") -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (``name`` is for
        `resumable.coordination`'s interface)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as exc:  # a rank died, hung past the timeout, or the group broke
            raise PersistError(
                f"rank {self.rank}: checkpoint coordination with the other ranks failed "
                f"({str(exc).splitlines()[0][:300]}); nothing was committed by this step"
            ) from exc
        return out

    def broadcast(self, obj: Any, name: str = "") -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.pg)
        except RuntimeError as exc:
            raise PersistError(
                f"rank {self.rank}: checkpoint coordination with rank 0 failed "
                f"({str(exc).splitlines()[0][:300]})"
            ) from exc
        return box[0]

    def abandon(self, reason: str) -> None:
        """Nothing to tell: when a collective fails, it fails on every rank."""

    def close(self) -> None:
        """Destroy the side group while the interpreter is fully alive: gloo's worker
        threads otherwise outlive it and can abort the process at exit (SIGABRT,
        "terminate called without an active exception")."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group(pg)
            except Exception as exc:  # already destroyed with the default group
                log.debug("destroying the checkpoint process group: %s", exc)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a one-integer all-reduce)."""
        if self.world_size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        return bool(t.item())

    def _failed(self, exc: BaseException) -> PersistError:
        return PersistError(
            f"rank {self.rank}: checkpoint coordination with the other ranks failed "
            f"({str(exc).splitlines()[0][:300]})"
        )


def current_group(timeout_s: float | None = None) -> Group | None:
    """The job's `Group` if ``torch.distributed`` is initialised with more than one
    rank, else None (a single process keeps the single-process path)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    # A side group: checkpoint collectives never interleave with training's. Gloo, so
    # small host-side messages need no GPU; created collectively, once, at construction.
    pg = dist.new_group(backend="gloo", timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size(), pg)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


# --------------------------------------------------------------------------- stored pieces


@dataclass(frozen=True)
class StoredPiece:
    """One tensor index entry, seen as a piece of its global tensor."""

    name: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True)
class GlobalTensor:
    """A global tensor of a checkpoint: its shape, dtype name and stored pieces."""

    shape: tuple[int, ...]
    dtype: str
    pieces: list[StoredPiece]


def global_tensors(index: Mapping[str, Mapping[str, Any]]) -> dict[str, GlobalTensor]:
    """A tensor index grouped by ``fqn`` (an entry without one is a global tensor of its
    own, whole), shape and dtype from each group's first entry. Expects entries of
    valid types; `format.decode_manifest` checks that each group agrees and tiles
    (`check_pieces`)."""
    out: dict[str, GlobalTensor] = {}
    for name, info in index.items():
        shape = tuple(info["shape"])
        fqn = info.get("fqn", name)
        if fqn not in out:
            out[fqn] = GlobalTensor(tuple(info.get("global_shape", shape)), info["dtype"], [])
        offset = tuple(info.get("global_offset", (0,) * len(shape)))
        out[fqn].pieces.append(StoredPiece(name, shape, offset))
    return out


MAX_TILING_CELLS = 1 << 22


def check_pieces(
    fqn: str, spec: GlobalTensor, index: Mapping[str, Mapping[str, Any]], where: str
) -> None:
    """Raise `CorruptCheckpointError` unless the pieces of ``fqn`` agree on its shape and
    dtype and tile it exactly: inside it, no overlap, every element covered (DCP itself
    does not check).

    Cost O(n·d·log n + c) for n pieces of d dimensions: the distinct piece boundaries of
    each dimension cut the tensor into a grid of c cells, each piece covers whole cells,
    and a bitmap of the cells finds one covered twice. A DTensor's shards form a grid,
    so c = n; a tiling cut into more than max(n, `MAX_TILING_CELLS`) cells is refused.
    """
    what = f"{where}: pieces of {fqn[:100]!r}"
    for p in spec.pieces:
        info = index[p.name]
        if tuple(info.get("global_shape", info["shape"])) != spec.shape or (
            info["dtype"] != spec.dtype
        ):
            raise CorruptCheckpointError(f"{what} disagree on its shape or dtype")
    pieces = [p for p in spec.pieces if _numel(p.shape)]
    for p in pieces:
        if any(o + s > g for o, s, g in zip(p.offset, p.shape, spec.shape)):
            raise CorruptCheckpointError(f"{what}: piece {p.name[:100]!r} lies outside it")
    covered, total = sum(_numel(p.shape) for p in pieces), _numel(spec.shape)
    if covered != total:
        raise CorruptCheckpointError(
            f"{what} cover {covered} of its {total} elements (a rank's file is missing "
            "from the manifest, or pieces overlap)"
        )
    if len(pieces) < 2:
        return
    cuts = [
        sorted({0, g} | {p.offset[d] for p in pieces} | {p.offset[d] + p.shape[d] for p in pieces})
        for d, g in enumerate(spec.shape)
    ]
    cells = _numel(tuple(len(c) - 1 for c in cuts))
    if cells > max(len(pieces), MAX_TILING_CELLS):
        raise CorruptCheckpointError(
            f"{what} cut it into {cells} cells, more than {MAX_TILING_CELLS}; no sharding "
            "resumable writes is that fragmented"
        )
    at = [{c: i for i, c in enumerate(dim)} for dim in cuts]
    seen = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for p in pieces:
        box = tuple(
            slice(at[d][o], at[d][o + s]) for d, (o, s) in enumerate(zip(p.offset, p.shape))
        )
        if seen[box].any():
            raise CorruptCheckpointError(f"{what} overlap (at piece {p.name[:100]!r})")
        seen[box] = True


# --------------------------------------------------------------------------- loading


class GlobalLoader:
    """Builds the value of each global tensor for this rank from the pieces of a
    checkpoint, shaped like the live target (see module doc)."""

    def __init__(self, reader: Any, live: Mapping[str, Any]) -> None:
        self.reader = reader
        self.live = live
        self.where = reader.where
        # Validated when the manifest was read: the pieces of each tensor tile it.
        self.globals = global_tensors(reader.manifest["tensors"])
        self._values: dict[str, torch.Tensor] = {}

    def prepare(self, fqns: list[str]) -> None:
        """Read (and checksum) every piece this rank needs for ``fqns``, once."""
        plans = {f: self._plan(f) for f in fqns}
        names = sorted({item[0] for plan in plans.values() for item in plan[2]})
        read = self.reader.tensors(names, verify=True) if names else {}
        for fqn, (local_shape, dtype, items) in plans.items():
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

        from resumable.format import dtype_from_name

        if fqn not in self.globals:
            raise StateMismatchError(f"{self.where}: the checkpoint has no tensor {fqn!r}")
        spec = self.globals[fqn]
        gshape, dtype = spec.shape, dtype_from_name(spec.dtype)
        saved = [p for p in spec.pieces if _numel(p.shape)]
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
        if _numel(local_shape):
            for it in create_read_items_for_chunk_list(fqn, md, [target]):
                src = by_offset[tuple(it.storage_index.offset or ())]
                items.append(
                    (src.name, tuple(it.storage_offsets), tuple(it.dest_offsets), tuple(it.lengths))
                )
        return local_shape, dtype, items

    def assemble(self, fqn: str) -> torch.Tensor:
        """The whole of ``fqn`` as one tensor, read from its pieces and not kept (export
        holds one tensor at a time). Needs no live target and no process group."""
        self.prepare([fqn])
        return self._values.pop(fqn)

    def spec(self, fqn: str) -> tuple[tuple[int, ...], str]:
        """Global shape and dtype name of ``fqn``."""
        if fqn not in self.globals:
            raise CorruptCheckpointError(f"{self.where}: no pieces of {fqn!r}")
        return self.globals[fqn].shape, self.globals[fqn].dtype

    def value(self, fqn: str) -> torch.Tensor:
        """The restored value of ``fqn``: a DTensor like the live one, or a tensor."""
        if fqn not in self._values:
            self.prepare([fqn])
        return shaped_like(self._values[fqn], self.live.get(fqn))


def shaped_like(local: torch.Tensor, live: Any) -> torch.Tensor:
    """``local`` as the live target holds it: a DTensor with the live one's mesh and
    placements when ``live`` is a DTensor, else ``local`` itself."""
    if live is None or not is_dtensor(live):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
