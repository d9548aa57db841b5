"""A shared-memory slot's metadata JSON: what it records, how it is written and checked.

The metadata is ``{"layout": [...], ...}``: the tensors of the data region (`slot_layout`),
then `SlotMeta`. The writer encodes the layout once per structure and `SlotMeta` at every
snapshot (a `RawJSON` tree spliced in as it is); a reader checks it all in `decode_meta`.
Its checksum in the control block proves only that this user wrote it, so everything
is checked as if hostile: a slot that fails is not used, as one cut short is not. Keys
nobody knows are ignored, so a newer writer's slot stays readable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resumable._dtypes import check_dtype_name, itemsize
from resumable.errors import CheckpointError, CorruptCheckpointError
from resumable.format import LINE_BYTES, TensorSlot
from resumable.pieces import Piece, pieces_to_json

ROOT_KEY = "root"  # metadata key: the checkpoint root's URL


@dataclass(frozen=True)
class SlotMeta:
    """What a snapshot's metadata JSON records besides its ``layout`` (the slot's tensors,
    `slot_layout`). Made by `pipeline.memory.MemoryTier`, written by `encode`, read back
    by `decode_meta` only (one check for the worker, a restore and ``resumable shm``).

    ``tree``: the state's tree (`capture`'s JSON; a `RawJSON` of it when written).
    ``pieces``, ``world_size`` and ``replicated``: what a coordinated persist and a
    restore of several ranks need; empty, 1 and empty for one process without DTensors.
    ``run_id`` and ``root``: whose snapshot it is (absent from slots of older versions)."""

    tree: Any
    metrics: Mapping[str, int | float | str] = field(default_factory=dict)
    created: float | None = None
    run_id: str | None = None
    world_size: int = 1
    pieces: Mapping[str, Piece] = field(default_factory=dict)
    replicated: tuple[str, ...] = ()
    root: str | None = None

    def encode(self, step: int, root: str | None = None) -> bytes:
        """The JSON object (``step`` first: the control block's, repeated), byte for byte
        what earlier versions wrote; a `RawJSON` tree is spliced in as it is. ``root``:
        recorded instead of `root` (the arena's), if given.

        A snapshot of the memory tier (a `RawJSON` tree, an int step, a finite or no
        creation time) is written from its parts without building the object: one is
        written per step. A sharded snapshot's pieces, the same objects from step to
        step, keep their JSON (`_pieces_json`)."""
        if root is None:
            root = self.root
        if (
            type(self.tree) is RawJSON
            and type(step) is int
            and (self.created is None or type(self.created) is float)
        ):
            created = "" if self.created is None else _created_json(self.created)
            if created is not None:
                sharded = bool(self.pieces) or self.world_size != 1
                parts = [
                    '{"step":',
                    int.__repr__(step),
                    ',"metrics":',
                    _dumps(dict(self.metrics)) if self.metrics else "{}",
                    created,
                    _names_json(self.run_id, None),
                ]
                if sharded:
                    parts += [
                        ',"world_size":',
                        _dumps(self.world_size),
                        ',"pieces":',
                        _pieces_json(self.pieces),
                    ]
                if sharded or self.replicated:
                    parts += [',"replicated":', _dumps(list(self.replicated))]
                parts += [_names_json(None, root), ',"tree":', self.tree, "}"]
                return "".join(parts).encode()
        if root != self.root:
            return dataclasses.replace(self, root=root).encode(step)
        obj: dict[str, Any] = {"step": step, "tree": self.tree, "metrics": dict(self.metrics)}
        if self.created is not None:
            obj["created"] = self.created
        if self.run_id is not None:
            obj["run_id"] = self.run_id
        sharded = bool(self.pieces) or self.world_size != 1
        if sharded:
            obj["world_size"] = self.world_size
            obj["pieces"] = pieces_to_json(self.pieces)
        if sharded or self.replicated:
            obj["replicated"] = list(self.replicated)
        if self.root is not None:
            obj[ROOT_KEY] = self.root
        return encode_meta(obj)

    @classmethod
    def from_json(cls, obj: Any) -> SlotMeta:
        """The metadata of a decoded JSON object; keys it does not know are ignored (as
        they always were). Raises `CorruptCheckpointError` naming the key if ``tree`` is
        missing or a key holds what no writer writes."""
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(
                f"snapshot slot metadata must be a JSON object, found {_kind(obj)}"
            )
        if "tree" not in obj:
            raise CorruptCheckpointError("snapshot slot metadata has no 'tree'")
        tree = _field(obj, "tree", "an object", lambda v: isinstance(v, dict))
        metrics = _field(obj, "metrics", "an object of numbers and strings", _is_metrics, {})
        created = _field(obj, "created", "a number", _is_number)
        pieces = _field(obj, "pieces", "an object of [fqn, shape, offset]", _is_pieces, {})
        replicated = _field(obj, "replicated", "a list of strings", lambda v: _is_list(v, str), [])
        return cls(
            tree=tree,
            metrics=metrics,
            created=None if created is None else float(created),
            run_id=_field(obj, "run_id", "a string", lambda v: isinstance(v, str)),
            world_size=_field(obj, "world_size", "a positive integer", _is_world, 1),
            pieces={n: Piece(f, tuple(g), tuple(o)) for n, (f, g, o) in pieces.items()},
            replicated=tuple(replicated),
            root=_field(obj, ROOT_KEY, "a string", lambda v: isinstance(v, str)),
        )


def decode_meta(blob: bytes, data_cap: int) -> tuple[SlotMeta, list[TensorSlot]]:
    """A slot's metadata JSON (``blob``) and its tensors in a data region of ``data_cap``
    bytes. Raises `CorruptCheckpointError` saying what is wrong: not JSON (or nested too
    deeply), a ``layout`` `slot_layout` refuses, or what `SlotMeta.from_json` refuses."""
    try:
        obj = json.loads(blob)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        raise CorruptCheckpointError("snapshot slot metadata is not JSON") from None
    meta = SlotMeta.from_json(obj)
    slots = slot_layout(obj.get("layout"), data_cap)
    if slots is None:
        raise CorruptCheckpointError(
            f"snapshot slot metadata has no 'layout' of tensors that fit its {data_cap} bytes"
        )
    return meta, slots


def _field(
    obj: dict[str, Any], key: str, what: str, ok: Callable[[Any], bool], default: Any = None
) -> Any:
    """``obj[key]`` if ``ok`` accepts it, ``default`` if absent; else the error."""
    if key not in obj:
        return default
    value = obj[key]
    if not ok(value):
        raise CorruptCheckpointError(
            f"snapshot slot metadata: {key!r} must be {what}, found {_kind(value)} "
            "(no version of resumable writes that)"
        )
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_world(v: Any) -> bool:
    return type(v) is int and v >= 1


def _is_list(v: Any, kind: type) -> bool:
    return isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _is_metrics(v: Any) -> bool:
    return isinstance(v, dict) and all(_is_number(x) or isinstance(x, str) for x in v.values())


def _is_pieces(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(p, list)
        and len(p) == 3
        and isinstance(p[0], str)
        and isinstance(p[1], list)
        and isinstance(p[2], list)
        and len(p[1]) == len(p[2])
        and all(_is_count(d) for d in p[1] + p[2])
        for p in v.values()
    )


def slot_layout(layout: Any, data_cap: int) -> list[TensorSlot] | None:
    """The tensor slots of a snapshot's ``layout`` metadata if it is one `layout_meta`
    writes for a `plan_layout`: distinct names, known dtypes, shapes of non-negative
    integers, each tensor's bytes right after the previous one's (or at the next cache
    line: where the tensors another rank writes begin), aligned to its element
    size, as long as its shape needs, inside the data region; else None. (A slot whose
    metadata checksum holds was written by this user, but a restore must not crash on
    it either.)"""
    if not isinstance(layout, list):
        return None
    slots: list[TensorSlot] = []
    names: set[str] = set()
    offset = 0
    for t in layout:
        if not isinstance(t, dict):
            return None
        name, dtype, shape, begin, end = (
            t.get(k) for k in ("name", "dtype", "shape", "begin", "end")
        )
        if not isinstance(name, str) or name in names:
            return None
        try:
            dtype = check_dtype_name(dtype)
        except CheckpointError:
            return None
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            return None
        size = itemsize(dtype)
        if type(begin) is not int or type(end) is not int or begin % size:
            return None
        if begin != offset and begin != offset + -offset % LINE_BYTES:
            return None
        if end != begin + math.prod(shape) * size or end > data_cap:
            return None
        names.add(name)
        slots.append(TensorSlot(name, dtype, tuple(shape), begin, end))
        offset = end
    return slots


class RawJSON(str):
    """A value of a snapshot's metadata already encoded as JSON (by `encode_meta`'s caller,
    which caches the parts that do not change from one snapshot to the next)."""


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """The JSON object of ``meta``: `RawJSON` values as they are, the rest encoded."""
    plain = {k: v for k, v in meta.items() if not isinstance(v, RawJSON)}
    raw = [f"{_dumps(k)}:{v}" for k, v in meta.items() if isinstance(v, RawJSON)]
    text = _dumps(plain)
    if raw:
        text = text[:-1] + ("," if plain else "") + ",".join(raw) + "}"
    return text.encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _created_json(created: float) -> str | None:
    """``,"created":<created>`` as `encode_meta` writes it; None if not finite."""
    return ',"created":' + float.__repr__(created) if math.isfinite(created) else None


# The last pieces written: their names, their `Piece` objects and their JSON.
_last_pieces: tuple[list[str], list[Piece], str] = ([], [], "{}")


def _pieces_json(pieces: Mapping[str, Piece]) -> str:
    """``pieces``' JSON (`pieces_to_json`), kept while the pieces are the very objects
    of the last call under the same names (a capture hands the same `Piece` objects
    out at every step; they are frozen)."""
    global _last_pieces
    names, values, text = _last_pieces
    if (
        len(pieces) == len(values)
        and all(map(operator.is_, pieces.values(), values))
        and list(pieces) == names
    ):
        return text
    text = _dumps(pieces_to_json(pieces))
    _last_pieces = (list(pieces), list(pieces.values()), text)
    return text


@functools.lru_cache(maxsize=16)
def _names_json(run_id: str | None, root: str | None) -> str:
    """``,"run_id":...,"root":...`` (each where given) as `encode_meta` writes them."""
    out = ""
    if run_id is not None:
        out += ',"run_id":' + _dumps(run_id)
    if root is not None:
        out += "," + _dumps(ROOT_KEY) + ":" + _dumps(root)
    return out


def layout_meta(slots: list[TensorSlot]) -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "dtype": s.dtype,
            "shape": list(s.shape),
            "begin": s.begin,
            "end": s.end,
        }
        for s in slots
    ]
