"""Walk the user's training state into tensors plus a JSON tree, and back.

`capture` turns ``state={"model": model, "optim": optimizer, ...}`` into a `Captured`:
the tensors, in order, and a JSON-able tree that refers to them by name. `restore`
loads decoded values back into the live objects. The random streams are captured too,
under the reserved key ``"__rng__"``, and the class of each stateful object under
``"__classes__"``. Nothing below this module knows about models.

The tree is a closed vocabulary of tagged nodes (``docs/format.md``), so loading never
executes code from a checkpoint. This module is the entry point. Its parts are
``_encode`` (state to tree), ``_decode`` (tree to values), ``_restore`` (values into
live objects) and ``_rng`` (the random streams). The longer notes are in
``docs/decisions.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from resumable._decode import decode, global_refs, globalize, iter_refs, iter_tensor_refs, subtree
from resumable._encode import (
    CLASSES_KEY,
    PLAIN_TENSORS,
    RESERVED_KEYS,
    Encoder,
    JSONValue,
    Tree,
    class_name,
    classes_node,
    is_global_object,
    unwrap,
)
from resumable._restore import check_classes, recorded_classes, restore
from resumable._rng import check_rng_state, rng_state, set_rng_state
from resumable.errors import UnsupportedStateError
from resumable.pieces import Piece
from resumable.tree import RNG_KEY

__all__ = [
    "CLASSES_KEY",
    "PLAIN_TENSORS",
    "RESERVED_KEYS",
    "RNG_KEY",
    "Captured",
    "Encoder",
    "JSONValue",
    "Planner",
    "Stateful",
    "Tree",
    "capture",
    "check_classes",
    "check_rng_state",
    "class_name",
    "decode",
    "global_refs",
    "globalize",
    "is_global_object",
    "iter_refs",
    "iter_tensor_refs",
    "recorded_classes",
    "restore",
    "rng_state",
    "set_rng_state",
    "subtree",
    "unwrap",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything that can hand out its state and take it back.

    ``state_dict()`` returns plain containers of tensors and JSON values (and nested
    state dicts); ``load_state_dict(sd)`` receives an equal structure, with tensors on
    the CPU or on ``map_location``. The tensors it receives are its own to keep (a
    restore copies them out of shared memory or a read buffer first), unless its class
    sets ``resumable_copies_on_load = True``: it then gets them as read, and must copy
    what it keeps (as ``nn.Module.load_state_dict`` copies into its parameters), which
    saves the restore one copy of them.
    """

    def state_dict(self) -> dict[str, Any]:
        """The object's state.

        Returns:
            Plain containers of tensors and JSON values, and nested state dicts.
        """
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Take the state back.

        Args:
            state_dict: a structure equal to what `state_dict` returned, with tensors
                on the CPU or on ``map_location``.

        Returns:
            Anything. Only an ``nn.Module``'s result is read, by a partial restore
            (``strict=False``): its missing and unexpected keys.
        """
        ...


@dataclass
class Captured:
    """The result of `capture`: a JSON-able tree and the tensors it references, in order.

    With several ranks (or DTensors), the tensors of top-level modules and optimizers
    are *global*: ``pieces`` says where each captured one lies in its global tensor,
    ``replicated`` names those every rank holds whole (written by one rank only), and
    ``live`` maps each global tensor's fqn to the live tensor (a DTensor keeps its mesh
    and placements there, for restoring).
    """

    tree: Tree
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    pieces: dict[str, Piece] = field(default_factory=dict)
    replicated: set[str] = field(default_factory=set)
    live: dict[str, torch.Tensor] = field(default_factory=dict)
    reused: bool = False  # some entries came from a plan (`capture`'s ``plan``)


_ENGINE_WRAPPERS = {
    "DeepSpeedEngine": "resumable.integrations.deepspeed.DeepSpeedState(engine)",
    "DeepSpeedOptimizer": "resumable.integrations.deepspeed.DeepSpeedState(engine)",
}


def _refuse_framework_engine(key: str, obj: Any) -> None:
    """A framework engine whose ``state_dict`` is not its whole state (a DeepSpeed engine
    gives its module's, with ZeRO-3 placeholders; its ZeRO optimizer's ``load_state_dict``
    takes a list of ranks' dicts) needs its integration's wrapper."""
    if not type(obj).__module__.startswith("deepspeed."):
        return
    wrapper = next(
        (_ENGINE_WRAPPERS[c.__name__] for c in type(obj).__mro__ if c.__name__ in _ENGINE_WRAPPERS),
        None,
    )
    if wrapper is not None:
        raise UnsupportedStateError(
            f"state[{key!r}] is a {type(obj).__module__}.{type(obj).__name__}, whose "
            f"state_dict() is not its whole training state; pass {wrapper} instead of the "
            "engine and its optimizer (docs/deepspeed.md)"
        )


def _refuse_raw_megatron(key: Any, obj: Any) -> None:
    """A Megatron-Core module or optimizer given as it is: under tensor parallelism its
    parameters are plain tensors holding this rank's shard, which would be taken for
    replicas (written once, by one rank): a wrong checkpoint, silently."""
    cls = type(obj)
    if cls.__module__.startswith("megatron.") and callable(
        getattr(obj, "sharded_state_dict", None)
    ):
        raise UnsupportedStateError(
            f"state[{key!r}] is a {cls.__module__}.{cls.__name__}, whose tensors are this "
            "rank's tensor-parallel shards; pass resumable.integrations.megatron's "
            "MegatronModel(model) and MegatronOptimizer(optimizer, model) instead "
            "(docs/megatron.md)"
        )


# Classes of top-level objects from neither DeepSpeed nor Megatron: neither refusal
# applies to them, so a capture checks them no further (`_refuse_framework`). Bounded:
# cleared when it grows past `_PLAIN_MAX` (classes made on the fly).
_PLAIN_TYPES: set[type] = set()
_PLAIN_MAX = 256


def _refuse_framework(key: Any, obj: Any) -> None:
    """`_refuse_raw_megatron` and `_refuse_framework_engine`; a class from neither
    framework is noted in `_PLAIN_TYPES`."""
    _refuse_raw_megatron(key, obj)
    _refuse_framework_engine(key, obj)
    cls = type(obj)
    if not cls.__module__.startswith(("deepspeed.", "megatron.")):
        if len(_PLAIN_TYPES) >= _PLAIN_MAX:
            _PLAIN_TYPES.clear()
        _PLAIN_TYPES.add(cls)


def capture(
    state: Mapping[str, Any],
    *,
    include_rng: bool = True,
    rank: int = 0,
    world_size: int = 1,
    plan: Planner | None = None,
) -> Captured:
    """Encode ``state`` (and, by default, the global RNG streams) into a `Captured`.

    Called on the training thread at a step boundary. The returned tensors are the live
    tensors (detached, not copied): the caller must copy them before training goes on.
    Raises `UnsupportedStateError` naming the path of anything that cannot be captured.

    With a ``plan`` (`resumable._capture_plan.CapturePlan`), top-level entries it knows
    are taken from it instead of walked (``reused`` says whether any was), and the
    tensors of those entries are not detached: they are for copying under
    ``torch.no_grad()``.
    """
    if type(state) is not dict and not isinstance(state, Mapping):  # an ABC's check is slow
        raise UnsupportedStateError(
            f"state must be a dict of named objects, found {type(state).__name__}; "
            'pass state={"model": model, "optim": optimizer, ...}'
        )
    enc = Encoder(rank, world_size)
    top: list[list[Any]] = []
    for key, obj in state.items():
        if not isinstance(key, str) or key in RESERVED_KEYS:
            raise UnsupportedStateError(
                f"state keys must be strings other than {RNG_KEY!r} and {CLASSES_KEY!r}, "
                f"found {key!r}"
            )
        if type(obj) not in _PLAIN_TYPES:
            _refuse_framework(key, obj)
        enc.in_global = is_global_object(obj)
        node = plan.entry(key, obj, enc) if plan is not None else None
        top.append([key, enc.value(obj, (key,), 2) if node is None else node])
        enc.in_global = False
    if enc.classes:
        node = plan.classes(enc.classes) if plan is not None else None
        top.append([CLASSES_KEY, classes_node(enc.classes) if node is None else node])
    if include_rng:
        node = plan.streams(enc) if plan is not None else None
        top.append([RNG_KEY, enc.streams(rng_state()) if node is None else node])
    return Captured(
        tree={"dict": top},
        tensors=enc.tensors,
        pieces=enc.pieces,
        replicated=enc.replicated,
        live=enc.live,
        reused=plan is not None and plan.reused(),
    )


class Planner(Protocol):
    """What `capture` asks of a plan (`resumable._capture_plan.CapturePlan`), in this
    order: `entry` for each top-level entry, `classes` if any stateful object was met,
    `streams` for the random streams (if they are captured), then `reused`."""

    def entry(self, key: str, obj: Any, enc: Encoder) -> Any | None:
        """The node of ``obj`` (its tensors and classes added to ``enc``), or None."""

    def classes(self, classes: list[tuple[tuple[Any, ...], str]]) -> Any:
        """The `classes_node` of ``classes``, or None (the caller makes it)."""

    def streams(self, enc: Encoder) -> Any:
        """The node of `rng_state`'s streams, as `Encoder.streams` makes it."""

    def reused(self) -> bool:
        """Whether any entry of this capture was reused; starts the next capture."""
