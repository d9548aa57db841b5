"""Put decoded values back into the live objects of a state (`restore`).

Stateful objects get ``load_state_dict``, plain containers and tensors are updated in
place, and random generators get ``set_state``. Every check that can refuse a
checkpoint runs before the first live object is touched.

The class of each stateful object is checked first (`check_classes`). Only the
qualified name is compared, not the module: ``__main__.Net`` (a script) matches
``train.Net`` (imported by a launcher).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch

from resumable._encode import (
    CLASSES_KEY,
    KINDS,
    RESERVED_KEYS,
    class_name,
    is_stateful,
    path_str,
    unwrap,
)
from resumable._rng import check_rng_state, set_rng_state
from resumable.errors import CorruptCheckpointError, StateMismatchError
from resumable.tree import RNG_KEY


def restore(
    state: Mapping[str, Any],
    values: Mapping[Any, Any],
    *,
    borrowed: bool = False,
    strict: bool = True,
    prepare: Callable[[], None] | None = None,
    owned: Collection[int] = (),
) -> list[str]:
    """Load decoded ``values`` into the live objects of ``state``, and the RNG streams.

    Called on the training thread after every tensor was verified. Stateful objects get
    ``load_state_dict``; dicts and lists are updated in place; tensors are copied in
    place when shape and dtype agree. Raises `StateMismatchError` when the checkpoint
    does not fit ``state`` (missing key, different structure or shapes).

    ``borrowed``: the tensors in ``values`` are views of memory that will be reused (a
    shared-memory slot, a mapped file). They are then copied wherever the live state
    would keep a reference (optimizers and other non-module state dicts, new container
    entries), and handed as they are where the live object copies them anyway
    (``nn.Module.load_state_dict``, in-place tensor copies, and a stateful object whose
    class sets ``resumable_copies_on_load = True``: its ``load_state_dict`` keeps no
    tensor it is given, as the Megatron wrappers'): one copy either way.

    ``strict=False`` (a partial restore): state keys the checkpoint lacks, and a module's
    parameters and buffers it lacks, are left as constructed; a module's entries that
    the state lacks are ignored. Returns what was left or ignored, one line each (also
    the checkpoint's top-level keys the state lacks, which are ignored in either mode),
    for the caller to report. Shapes, classes and structure must still fit.

    ``prepare``: called once the checks that come before any live object is touched
    have passed, before the first is (a reader's `fill` of live tensors it verified).

    ``owned``: ids of tensors in ``values`` that are already the restore's own (live
    tensors that ``prepare`` fills, new ones made for the restore): kept as they are
    where ``borrowed`` values are copied.
    """
    if not isinstance(values, Mapping):
        raise CorruptCheckpointError(
            f"the checkpoint's state tree holds a {type(values).__name__}, not a dict of entries"
        )
    if RNG_KEY in values:
        check_rng_state(values[RNG_KEY])  # before any live object is touched
    notes: list[str] = []
    extra = sorted(str(k) for k in values if k not in RESERVED_KEYS and k not in state)
    if extra and not strict:
        notes.append(f"checkpoint entries {extra} have no key in the state: not restored")
    elif extra:
        notes.append(
            f"checkpoint entries {extra} have no key in the state: not restored, so the "
            "objects they were saved from keep their fresh values in this launch (an "
            "optimizer left out starts with fresh moments), and the checkpoints this run "
            "writes will not hold them. Put them back in state= to restore them; if they "
            "were left out on purpose, pass restore(strict=False) (this line then only "
            "lists them)"
        )
    missing = [k for k in state if k not in values]
    if missing and not strict:
        notes.append(f"state keys {missing} are not in the checkpoint: left as constructed")
    elif missing:
        raise StateMismatchError(
            f"checkpoint has no entry for state key(s) {missing}; it holds "
            f"{sorted(str(k) for k in values if k not in RESERVED_KEYS)}. Restore into "
            "the same state keys it was saved with; or pass restore(strict=False) to "
            f"leave {missing} as constructed; or start a new checkpoint directory"
        )
    check_classes(state, values.get(CLASSES_KEY))
    values = _with_kinds(state, values)
    if prepare is not None:
        prepare()
    own = _Own(frozenset(owned)) if borrowed else None
    for key, obj in state.items():
        if key not in values:
            continue
        new = _restore_into(obj, values[key], (key,), own, None if strict else notes)
        if new is not obj and isinstance(state, dict):
            state[key] = new
    if RNG_KEY in values:
        set_rng_state(values[RNG_KEY], checked=True)
    return notes


def recorded_classes(value: Any) -> list[tuple[tuple[Any, ...], str]]:
    """The decoded ``__classes__`` entry as ``(path, "module:qualname")`` pairs; ``[]``
    for a checkpoint written before classes were recorded. Malformed:
    `CorruptCheckpointError`."""
    if value is None:
        return []
    out = []
    for entry in value if isinstance(value, list) else [None]:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], list)
            and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in entry[0])
            and isinstance(entry[1], str)
        ):
            raise CorruptCheckpointError(
                f"malformed {CLASSES_KEY} entry in the state tree: {str(entry)[:80]}"
            )
        out.append((tuple(entry[0]), entry[1]))
    return out


def _with_kinds(state: Mapping[str, Any], values: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """``values`` with each tensor ``__classes__`` records as a parameter, or as
    requiring gradients (`KIND_NAMES`), made so again (sharing its memory), so that one
    restored into an empty slot (None, a missing key) is what was saved."""
    marked = [
        (path, KINDS[name])
        for path, name in recorded_classes(values.get(CLASSES_KEY))
        if name in KINDS and path and path[0] in state and path[0] in values
    ]
    if not marked:
        return values
    out = dict(values)
    for path, kind in marked:
        out[path[0]] = _rewrap(out[path[0]], path[1:], kind)
    return out


def _rewrap(node: Any, path: tuple[Any, ...], kind: tuple[type, bool]) -> Any:
    """``node`` with the tensor at ``path`` (through dicts, lists and tuples) made of
    ``kind``; ``node`` as it is where there is no tensor there."""
    if not path:
        return _of_kind(node, *kind) if isinstance(node, torch.Tensor) else node
    key, rest = path[0], path[1:]
    if isinstance(node, dict) and key in node:
        node[key] = _rewrap(node[key], rest, kind)
    elif isinstance(node, (list, tuple)) and type(key) is int and 0 <= key < len(node):
        item = _rewrap(node[key], rest, kind)
        if isinstance(node, list):
            node[key] = item
        else:
            node = (*node[:key], item, *node[key + 1 :])
    return node


def _of_kind(t: torch.Tensor, cls: type, grad: bool) -> torch.Tensor:
    """A tensor of class ``cls`` (a parameter or a plain tensor) sharing ``t``'s memory,
    requiring gradients if ``grad`` (a leaf; ``t`` itself is not changed)."""
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t.detach(), requires_grad=grad and _grad_dtype(t))
    return t.detach().requires_grad_(grad and _grad_dtype(t))


def _grad_dtype(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _live_at(state: Mapping[str, Any], path: tuple[Any, ...]) -> Any:
    """The live object at ``path`` (dict keys and list indices), or None if absent."""
    obj: Any = state
    for k in path:
        in_dict = isinstance(obj, Mapping) and not is_stateful(obj) and k in obj
        in_list = isinstance(obj, (list, tuple)) and isinstance(k, int) and 0 <= k < len(obj)
        if not (in_dict or in_list):
            return None
        obj = obj[k]
    return obj


def _qualname(recorded: str) -> str:
    return recorded.rsplit(":", 1)[-1]


def check_classes(state: Mapping[str, Any], recorded: Any) -> None:
    """Refuse, with `StateMismatchError` naming both classes, to restore a stateful object
    saved from one class into an object of another (an AdamW state into SGD). Compares
    qualified names only (see the module docstring); entries whose path is not in
    ``state``, or holds no stateful object now, are left to the structural checks."""
    wrong = []
    for path, saved in recorded_classes(recorded):
        if not path or path[0] not in state:
            continue
        obj = _live_at(state, path)
        if obj is None or not is_stateful(obj):
            continue
        live = class_name(obj)
        if _qualname(live) != _qualname(saved):
            wrong.append(
                f"{path_str(path)} was saved from a {saved.replace(':', '.')} and would be "
                f"restored into a {live.replace(':', '.')}"
            )
    if wrong:
        raise StateMismatchError(
            "the checkpoint does not fit the state: "
            + "; ".join(wrong)
            + ". Their states differ (an optimizer's moments, a scheduler's position), so "
            "loading one into the other would fail later or train with the wrong state. "
            "Create the same classes as the run that wrote the checkpoint, or start a new "
            "checkpoint directory for the new setup"
        )


class _Own:
    """Makes a borrowed value the restore's own: a copy that shares no tensor or array
    memory with it, but for the tensors whose ids are in ``owned``, kept as they are."""

    def __init__(self, owned: frozenset[int]) -> None:
        self.owned = owned
        # one copy of a tensor decoded at several places (a tied weight, format
        # version 5), so the places still share it; each value is kept with its copy,
        # so that no other tensor made meanwhile can take its id
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in self.owned:
                return value
            hit = self._copies.get(id(value))
            if hit is not None and hit[0] is value:
                return hit[1]
            if type(value) is torch.Tensor and not value.requires_grad:
                copy = value.clone()
            else:
                copy = _of_kind(value.detach().clone(), type(value), value.requires_grad)
            self._copies[id(value)] = (value, copy)
            return copy
        if isinstance(value, np.ndarray):
            return value.copy()
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            return tuple(self(v) for v in value)
        return value

    def tensor(self, value: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
        """``moved`` (``value`` on its device) as the restore's own."""
        return self(value) if moved is value else moved


def _restore_into(
    obj: Any, value: Any, path: tuple[Any, ...], own: _Own | None, partial: list[str] | None
) -> Any:
    """Restore ``value`` into ``obj`` in place where possible; returns the object to keep.
    ``own``: the values are borrowed, and this copies what is kept. ``partial``: not
    strict; what modules left or ignored is appended to it."""
    try:
        if value is obj:
            return obj  # a tensor filled in place already (a fused restore's ``prepare``)
        if isinstance(obj, torch.Generator):
            # A fresh tensor: set_state crashes on views with a storage offset.
            payload = _generator_payload(value, "__torch_generator_state__", path)
            obj.set_state(payload.detach().to("cpu", torch.uint8).clone())
            return obj
        if isinstance(obj, np.random.Generator):
            obj.bit_generator.state = _generator_payload(value, "__np_generator_state__", path)
            return obj
        if isinstance(obj, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise StateMismatchError(f"{path_str(path)}: expected a tensor in the checkpoint")
            if obj.shape == value.shape and obj.dtype == value.dtype:
                with torch.no_grad():
                    obj.copy_(value)
                return obj
            moved = value.to(obj.device)
            if moved is not value and (value.requires_grad or type(value) is not torch.Tensor):
                moved = _of_kind(moved, type(value), value.requires_grad)  # a leaf again
            return own.tensor(value, moved) if own is not None else moved
        if isinstance(obj, Mapping) and not is_stateful(obj):
            if not isinstance(value, dict):
                raise StateMismatchError(
                    f"{path_str(path)}: expected a dict, checkpoint has {type(value).__name__}"
                )
            if isinstance(obj, dict):
                for k in list(obj):
                    if k not in value:
                        del obj[k]
                for k, v in value.items():
                    if k in obj:
                        obj[k] = _restore_into(obj[k], v, (*path, k), own, partial)
                    else:
                        obj[k] = own(v) if own is not None else v
                return obj
            return own(value) if own is not None else value
        if isinstance(obj, list):
            if not isinstance(value, list):
                raise StateMismatchError(
                    f"{path_str(path)}: expected a list, checkpoint has {type(value).__name__}"
                )
            if len(obj) == len(value):
                obj[:] = [
                    _restore_into(o, v, (*path, i), own, partial)
                    for i, (o, v) in enumerate(zip(obj, value))
                ]
            else:
                obj[:] = own(value) if own is not None else value
            return obj
        if is_stateful(obj):
            obj = unwrap(obj)
            if not isinstance(value, dict):
                raise StateMismatchError(
                    f"{path_str(path)}: expected a state dict, checkpoint has "
                    f"{type(value).__name__}"
                )
            module = isinstance(obj, torch.nn.Module)  # it copies into its parameters
            copies = module or getattr(type(obj), "resumable_copies_on_load", False) is True
            if module and partial is not None:
                result = obj.load_state_dict(value, strict=False)
                where = path_str(path)
                if result.missing_keys:
                    partial.append(
                        f"{where}: {sorted(result.missing_keys)} are not in the checkpoint: "
                        "left as constructed"
                    )
                if result.unexpected_keys:
                    partial.append(
                        f"{where}: checkpoint entries {sorted(result.unexpected_keys)} have "
                        "no place in the module: not restored"
                    )
                return obj
            obj.load_state_dict(own(value) if own is not None and not copies else value)
            return obj
    except (StateMismatchError, CorruptCheckpointError):
        raise  # a corrupt value (a DeepSpeedState tree) is skipped like a bad checksum
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise StateMismatchError(
            f"{path_str(path)}: the checkpoint does not fit this object ({exc}). "
            "Restore into the same kind of model/optimizer it was saved from"
        ) from exc
    return own(value) if own is not None else value


def _generator_payload(value: Any, tag: str, path: tuple[Any, ...]) -> Any:
    if not isinstance(value, dict) or tag not in value:
        raise StateMismatchError(f"{path_str(path)}: expected a generator state in the checkpoint")
    return value[tag]
