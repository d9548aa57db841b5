"""How a snapshot is cut into the pieces a replica push sends (`tensor_ranges`): along
its tensors, read from the slot's metadata through the one check every reader uses."""

from __future__ import annotations

import torch

from resumable._shm_meta import SlotMeta
from resumable.replicas.peers import MERGE, tensor_ranges
from resumable.snapshot import CopyPlan


def _meta(tensors: dict[str, torch.Tensor], replicated: tuple[str, ...] = ()) -> bytes:
    plan = CopyPlan(tensors)
    return plan.meta_head + SlotMeta(tree={}, replicated=replicated).encode(3)[1:]


def _data_len(tensors: dict[str, torch.Tensor]) -> int:
    return CopyPlan(tensors).nbytes


def test_pieces_follow_the_tensors_and_cover_the_data() -> None:
    tensors = {"a": torch.zeros(100_000), "b": torch.zeros(10), "c": torch.zeros(20)}
    n = _data_len(tensors)
    ranges = tensor_ranges(_meta(tensors), n, chunk=150_000)
    assert ranges is not None
    assert sum(length for _, length in ranges) == n
    assert [b for b, _ in ranges] == sorted(b for b, _ in ranges)
    # "a" (400,000 bytes) in chunks of at most 150,000; "b" and "c" merged into one piece.
    assert [length for _, length in ranges[:3]] == [150_000, 150_000, 100_000]
    assert len(ranges) == 4 and ranges[3][1] <= MERGE


def test_replicated_and_per_rank_bytes_never_share_a_piece() -> None:
    tensors = {"w": torch.zeros(10), "shard": torch.zeros(10), "v": torch.zeros(10)}
    n = _data_len(tensors)
    mixed = tensor_ranges(_meta(tensors, replicated=("w", "v")), n)
    alone = tensor_ranges(_meta(tensors), n)
    assert alone is not None and len(alone) == 1  # all small, one kind: one piece
    assert mixed is not None and len(mixed) == 3  # w | shard | v


def test_metadata_the_check_refuses_gives_fixed_chunks() -> None:
    tensors = {"a": torch.zeros(10)}
    n = _data_len(tensors)
    good = _meta(tensors)
    assert tensor_ranges(good, n) is not None
    assert tensor_ranges(b"not json", n) is None
    assert tensor_ranges(good.replace(b'"tree":{}', b'"tree":{},"pieces":[]'), n) is None
    assert tensor_ranges(good, n - 8) is None  # the layout does not fit the data
