"""`SlotMeta`, a shared-memory slot's metadata: written as earlier versions wrote it, read
back whole, and refused with an error naming the key when a key is missing or holds
what no writer writes. Keys it does not know are ignored, as they always were."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from resumable._shm import RawJSON, SlotMeta, decode_meta, encode_meta, layout_meta, slot_layout
from resumable.errors import CorruptCheckpointError
from resumable.format import TensorSlot
from resumable.pieces import Piece

# What the code before `SlotMeta` wrote for these snapshots (its `encode_meta` of the
# dict `MemoryTier.take` built, ``root`` added by the arena), byte for byte.
OLD_SHARDED = (
    b'{"step":7,"metrics":{"loss":0.5,"tag":"a"},"created":1700000000.25,"run_id":"r1",'
    b'"world_size":2,"pieces":{"w":["model.w",[4,2],[2,0]]},"replicated":["b"],'
    b'"root":"file:///ck","tree":{"dict":[]}}'
)
OLD_PLAIN = b'{"step":3,"metrics":{},"created":1.5,"tree":{"dict":[]}}'

SHARDED = SlotMeta(
    tree=RawJSON('{"dict":[]}'),
    metrics={"loss": 0.5, "tag": "a"},
    created=1700000000.25,
    run_id="r1",
    world_size=2,
    pieces={"w": Piece("model.w", (4, 2), (2, 0))},
    replicated=("b",),
    root="file:///ck",
)

LAYOUT = [TensorSlot("w", "F32", (4,), 0, 16)]


def _blob(meta: dict[str, Any]) -> bytes:
    """A slot's whole metadata JSON: ``meta`` and a layout of one tensor of 16 bytes."""
    return json.dumps({"layout": layout_meta(LAYOUT), **meta}).encode()


def test_the_bytes_are_those_earlier_versions_wrote() -> None:
    assert SHARDED.encode(7) == OLD_SHARDED
    plain = SlotMeta(tree=RawJSON('{"dict":[]}'), created=1.5)
    assert plain.encode(3) == OLD_PLAIN


@pytest.mark.parametrize("old", [OLD_SHARDED, OLD_PLAIN])
def test_metadata_earlier_versions_wrote_reads_back(old: bytes) -> None:
    blob = b'{"layout":' + json.dumps(layout_meta(LAYOUT)).encode() + b"," + old[1:]
    meta, slots = decode_meta(blob, 16)
    assert slots == LAYOUT
    assert meta.tree == {"dict": []}
    step = json.loads(old)["step"]
    assert json.loads(meta.encode(step)) == json.loads(old)  # the tree read back: a dict


def test_round_trip_keeps_every_field() -> None:
    back = SlotMeta.from_json(json.loads(SHARDED.encode(7)))
    assert back == SlotMeta(**{**SHARDED.__dict__, "tree": {"dict": []}})
    assert back.pieces["w"] == Piece("model.w", (4, 2), (2, 0))
    assert back.replicated == ("b",) and back.world_size == 2 and back.root == "file:///ck"


def test_absent_keys_take_what_one_process_without_them_means() -> None:
    """Only ``tree`` is required: slots of older versions lack ``run_id`` and ``root``, a
    snapshot of one process without DTensors lacks the pieces."""
    meta = SlotMeta.from_json({"tree": {}})
    assert meta == SlotMeta(tree={})
    assert meta.world_size == 1 and meta.pieces == {} and meta.replicated == ()
    assert meta.metrics == {} and meta.created is None and meta.run_id is None
    assert SlotMeta.from_json(json.loads(meta.encode(1))) == meta


def test_unknown_keys_are_ignored() -> None:
    meta = SlotMeta.from_json({"tree": {}, "step": 1, "future": [1, {"x": None}]})
    assert meta == SlotMeta(tree={})


@pytest.mark.parametrize(
    ("meta", "key"),
    [
        ({}, "tree"),
        ({"tree": []}, "tree"),
        ({"tree": {}, "metrics": [1]}, "metrics"),
        ({"tree": {}, "metrics": {"loss": [1]}}, "metrics"),
        ({"tree": {}, "metrics": {"ok": True}}, "metrics"),
        ({"tree": {}, "created": "yesterday"}, "created"),
        ({"tree": {}, "created": None}, "created"),
        ({"tree": {}, "run_id": 5}, "run_id"),
        ({"tree": {}, "world_size": 0}, "world_size"),
        ({"tree": {}, "world_size": 2.0}, "world_size"),
        ({"tree": {}, "world_size": True}, "world_size"),
        ({"tree": {}, "pieces": []}, "pieces"),
        ({"tree": {}, "pieces": {"w": ["w", [4]]}}, "pieces"),
        ({"tree": {}, "pieces": {"w": [1, [4], [0]]}}, "pieces"),
        ({"tree": {}, "pieces": {"w": ["w", [4], [0, 0]]}}, "pieces"),
        ({"tree": {}, "pieces": {"w": ["w", [4], [-1]]}}, "pieces"),
        ({"tree": {}, "pieces": {"w": ["w", [4.0], [0]]}}, "pieces"),
        ({"tree": {}, "replicated": "w"}, "replicated"),
        ({"tree": {}, "replicated": [1]}, "replicated"),
        ({"tree": {}, "root": {"url": "x"}}, "root"),
    ],
)
def test_a_missing_or_wrong_typed_key_is_refused_by_name(meta: dict[str, Any], key: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"'{key}'"):
        SlotMeta.from_json(meta)
    with pytest.raises(CorruptCheckpointError, match=f"'{key}'"):
        decode_meta(_blob(meta), 16)


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        (b"not json", "not JSON"),
        (b"[" * 100_000, "not JSON"),
        (b"\xff", "not JSON"),
        (b"[1, 2]", "JSON object, found list"),
        (json.dumps({"tree": {}}).encode(), "'layout'"),
        (json.dumps({"tree": {}, "layout": layout_meta(LAYOUT)}).encode()[:-1], "not JSON"),
    ],
)
def test_a_blob_that_is_no_slot_metadata_is_refused(blob: bytes, says: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=says):
        decode_meta(blob, 16)


def test_a_layout_past_the_data_region_is_refused() -> None:
    assert slot_layout(layout_meta(LAYOUT), 16) == LAYOUT
    with pytest.raises(CorruptCheckpointError, match="fit its 8 bytes"):
        decode_meta(_blob({"tree": {}}), 8)


@pytest.mark.parametrize("created", [None, 1.5, 1764745200.123456])
@pytest.mark.parametrize("run_id", [None, "r1", 'ü"\\'])
@pytest.mark.parametrize("root", [None, "file:///ck", 'file:///ç k/"x"'])
@pytest.mark.parametrize("arena_root", [None, "s3://b/p"])
def test_a_one_process_snapshot_is_written_as_the_general_encoder_writes_it(
    created: float | None, run_id: str | None, root: str | None, arena_root: str | None
) -> None:
    """`SlotMeta.encode` writes the memory tier's common snapshot from its parts: the
    same bytes as `encode_meta` of the whole object, with the arena's root in place
    of the meta's where it has one."""
    tree = RawJSON('{"dict":[["w",{"tensor":"w","device":"cpu"}]]}')
    meta = SlotMeta(tree=tree, created=created, run_id=run_id, root=root)
    obj: dict[str, Any] = {"step": 12, "tree": tree, "metrics": {}}
    if created is not None:
        obj["created"] = created
    if run_id is not None:
        obj["run_id"] = run_id
    if (arena_root or root) is not None:
        obj["root"] = arena_root or root
    assert meta.encode(12, root=arena_root) == encode_meta(obj)
    assert json.loads(meta.encode(12, root=arena_root)) == {**obj, "tree": json.loads(tree)}


@pytest.mark.parametrize("metrics", [{}, {"loss": 0.25, "tag": "ü"}])
@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("pieces", [{}, {"w": Piece("m.w", (8, 2), (2, 0))}])
@pytest.mark.parametrize("replicated", [(), ("opt/step", "b")])
@pytest.mark.parametrize("arena_root", [None, "s3://b/p"])
def test_every_memory_tier_snapshot_is_written_as_the_general_encoder_writes_it(
    metrics: dict[str, Any],
    world_size: int,
    pieces: dict[str, Piece],
    replicated: tuple[str, ...],
    arena_root: str | None,
) -> None:
    """With metrics, several ranks, pieces and replicated names, `SlotMeta.encode` still
    writes from its parts exactly what `encode_meta` writes for the whole object."""
    from resumable.pieces import pieces_to_json

    tree = RawJSON('{"dict":[["w",{"global":"w"}]]}')
    meta = SlotMeta(
        tree=tree,
        metrics=metrics,
        created=1764745200.5,
        run_id="r1",
        world_size=world_size,
        pieces=pieces,
        replicated=replicated,
        root="file:///ck",
    )
    obj: dict[str, Any] = {"step": 5, "tree": tree, "metrics": dict(metrics)}
    obj["created"], obj["run_id"] = 1764745200.5, "r1"
    sharded = bool(pieces) or world_size != 1
    if sharded:
        obj["world_size"], obj["pieces"] = world_size, pieces_to_json(pieces)
    if sharded or replicated:
        obj["replicated"] = list(replicated)
    obj["root"] = arena_root or "file:///ck"
    for _ in range(2):  # the second time with the pieces' JSON kept
        assert meta.encode(5, root=arena_root) == encode_meta(obj)


def test_the_pieces_json_is_kept_only_for_the_very_same_pieces() -> None:
    """A piece that is another object (a reshard: other offsets) or under another name
    is written anew, never from the JSON kept for the last pieces."""
    a = {"w": Piece("m.w", (8, 2), (0, 0)), "v": Piece("m.v", (4,), (0,))}
    meta = dataclasses.replace(SHARDED, pieces=a, metrics={})
    first = json.loads(meta.encode(1))["pieces"]
    assert first == {"w": ["m.w", [8, 2], [0, 0]], "v": ["m.v", [4], [0]]}
    renamed = {"x": a["w"], "v": a["v"]}  # the same objects under another name
    got = json.loads(dataclasses.replace(meta, pieces=renamed).encode(2))["pieces"]
    assert list(got) == ["x", "v"]
    moved = {"x": Piece("m.w", (8, 2), (4, 0)), "v": a["v"]}
    got = json.loads(dataclasses.replace(meta, pieces=moved).encode(3))["pieces"]
    assert got["x"] == ["m.w", [8, 2], [4, 0]]
    fewer = {"w": a["w"]}
    got = json.loads(dataclasses.replace(meta, pieces=fewer).encode(4))["pieces"]
    assert list(got) == ["w"]
    assert json.loads(meta.encode(5))["pieces"] == first
