"""Global tensors and their pieces: where each rank's part of a tensor lies.

The tensors of top-level modules and optimizers are *global*. A ``DTensor`` (FSDP2,
tensor parallel) is written as this rank's local shard; a plain tensor (DDP replicas,
optimizer step counts) is written once in total, by the rank `balance` assigns it to.
Each piece records its ``fqn`` (its path in the state, the same at any world size), the
global shape and its offset in the global tensor. `check_pieces` proves, when a manifest
is read, that the pieces tile each tensor exactly (DCP itself does not check).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resumable._lazy import numpy_module, torch_module
from resumable.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    np = numpy_module()
    torch = torch_module()


@dataclass(frozen=True)
class Piece:
    """Where a captured tensor sits in its global tensor."""

    fqn: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed`` DTensor, without importing that package.

    Args:
        t: any object.

    Returns:
        True for a DTensor.
    """
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def dtensor_piece(t: Any, fqn: str) -> tuple[torch.Tensor, Piece, bool]:
    """This rank's local shard of a DTensor, and where it lies. Runs at every snapshot,
    so the shard's place is computed once per shape, mesh and placements.

    Args:
        t: a DTensor.
        fqn: its path in the state.

    Returns:
        ``(local shard, detached; its Piece; whether it is fully replicated)``. Fully
        replicated means every rank holds all of it.
    """
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
    """Pieces as JSON values, the inverse of `pieces_from_json`.

    Args:
        pieces: each tensor's Piece, by tensor name.

    Returns:
        ``{name: [fqn, global_shape, global_offset]}``.
    """
    return {n: [p.fqn, list(p.global_shape), list(p.global_offset)] for n, p in pieces.items()}


def pieces_from_json(data: Any) -> dict[str, Piece]:
    """Pieces from what `pieces_to_json` wrote. Expects values of valid types.

    Args:
        data: ``{name: [fqn, global_shape, global_offset]}``, or None for none.

    Returns:
        Each tensor's Piece, by tensor name.
    """
    return {n: Piece(str(f), tuple(g), tuple(o)) for n, (f, g, o) in (data or {}).items()}


def piece_name(piece: Piece) -> str:
    """Index name of a shard: ``fqn@o1,o2`` (a whole tensor keeps its plain name).

    Args:
        piece: the shard's place.

    Returns:
        The name of its entry in the tensor index.
    """
    return f"{piece.fqn}@{','.join(str(o) for o in piece.global_offset)}"


def owned_tensors(
    tensors: Mapping[str, torch.Tensor], replicated: Any, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """The tensors ``rank`` writes: all but the replicated ones that `balance` gives
    another rank (each replicated tensor is written once in total).

    Args:
        tensors: this rank's captured tensors, by name.
        replicated: the names of the replicated ones.
        rank: this rank.
        world: the number of ranks.

    Returns:
        The tensors this rank writes, by name.
    """
    if world == 1:
        return dict(tensors)
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in replicated if n in tensors}
    owner = balance(sizes, world)
    return {n: t for n, t in tensors.items() if owner.get(n, rank) == rank}


def balance(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Assign each replicated tensor to one rank: biggest first, to the least loaded
    rank (ties to the lowest). Deterministic, so every rank computes the same map
    without communicating.

    Args:
        sizes: each replicated tensor's bytes, by name.
        world: the number of ranks.

    Returns:
        The rank that writes each tensor, by name.
    """
    load = [0] * world
    owner: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    return owner


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
    (`check_pieces`).

    Args:
        index: a manifest's tensor index.

    Returns:
        Each global tensor, by ``fqn``.
    """
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
    fqn: str,
    spec: GlobalTensor,
    index: Mapping[str, Mapping[str, Any]],
    where: str,
    *,
    complete: bool = True,
) -> None:
    """Check that the pieces of ``fqn`` agree on its shape and dtype and tile it exactly:
    inside it, no overlap, every element covered (DCP itself does not check).

    Cost O(n·d·log n + c) for n pieces of d dimensions: the distinct piece boundaries of
    each dimension cut the tensor into a grid of c cells, each piece covers whole cells,
    and a bitmap of the cells finds one covered twice. A DTensor's shards form a grid,
    so c = n; a tiling cut into more than max(n, `MAX_TILING_CELLS`) cells is refused.

    Args:
        fqn: the global tensor's name.
        spec: the global tensor, as `global_tensors` grouped it.
        index: the manifest's tensor index.
        where: the checkpoint, for error messages.
        complete: False where ``index`` holds some ranks' entries only (a split
            manifest read in part): the pieces need not cover the tensor.

    Raises:
        CorruptCheckpointError: the pieces disagree, lie outside the tensor, overlap,
            leave part of it uncovered, or cut it into too many cells.
    """
    what = f"{where}: pieces of {fqn[:100]!r}"
    for p in spec.pieces:
        info = index[p.name]
        if tuple(info.get("global_shape", info["shape"])) != spec.shape or (
            info["dtype"] != spec.dtype
        ):
            raise CorruptCheckpointError(f"{what} disagree on its shape or dtype")
    pieces = [p for p in spec.pieces if math.prod(p.shape)]
    for p in pieces:
        if any(o + s > g for o, s, g in zip(p.offset, p.shape, spec.shape)):
            raise CorruptCheckpointError(f"{what}: piece {p.name[:100]!r} lies outside it")
    covered, total = sum(math.prod(p.shape) for p in pieces), math.prod(spec.shape)
    if covered > total or (complete and covered != total):
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
    cells = math.prod(tuple(len(c) - 1 for c in cuts))
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
