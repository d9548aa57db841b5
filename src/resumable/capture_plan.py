"""Capture the same state snapshot after snapshot, its structure planned once (issue 20).

`resumable.capture.capture` walks the whole state at every call: ``state_dict()`` of
every module (a Python call per submodule, a ``detach()`` per tensor), then a tree node
per tensor. At a memory snapshot every step, that walk cost a small model more than
copying its bytes. A `CapturePlan` keeps, per top-level entry, the tree node and the
live tensors of a walk, and reuses them while a check made of a few C-level passes
(``map`` over lists, no Python loop per item) says the entry still has the structure
they were made from:

- a module (an ``nn.Module`` whose classes keep torch's ``state_dict``, with no
  state-dict hooks and no extra state): the same submodules of the same classes, the
  same parameter, buffer and submodule dicts holding the same objects under the same
  names (each dict's length too), the same non-persistent buffer names, and still no
  hooks or per-object ``state_dict``; its ``state_dict()`` is then not called;
- an optimizer: the same per-parameter state dicts with the same keys and value objects
  (tensors updated in place). One keeping torch's ``state_dict`` with no hooks is
  checked on its own ``state`` and parameter order, without calling ``state_dict()``
  (others are called as always); its ``"param_groups"`` are packed as torch packs
  them, an item whose value is the very object of the last snapshot keeping its node
  (a learning rate changed at every step makes one new item);
- a plain dict or list of dicts, lists, tensors and immutable values: the same
  containers, lengths, keys and value objects.

Each tensor's dtype, shape and device can change without its object changing
(``p.data = ...``): the check does not look at them, the caller does. It compares them
with those its copy was planned for (`resumable.snapshot.CopyPlan.matches`) and, if
any differs, calls `forget` and captures again, so a reused node never names a stale
device. The tensors of a planned entry are the live objects (a parameter is not
detached): they are for copying under ``torch.no_grad()``.

An entry is planned when its tensors are named as a walk would name them. At several
ranks (and for DTensors at one) only modules and optimizers are planned, their tensors
global: a reuse also hands out what the walk noted of each (its shard's place, whether
it is replicated, the live object under its global name), once a check says each
DTensor still holds the same local tensor and placement objects; the tensor handed out
for a DTensor is its local tensor. A module's state-dict pre-hooks are allowed where
they are FSDP2's (``fully_shard`` registers one that makes sure the parameters are the
sharded ones): a reuse runs them, as ``state_dict()`` would, before its check. Per-rank
containers and the random streams are walked. An entry that fails its check again and
again (a module replacing a buffer at every step), or that cannot be planned, is walked
the ordinary way for `REST` captures before it is tried again.

Python's and NumPy's global streams are read anew only when they changed, compared
where they lie (`PythonState`, `NumpyState`).
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import operator
import random
import struct
import sys
from collections.abc import Callable, Iterable
from itertools import chain, compress, islice
from typing import Any

import numpy as np
import torch

from resumable.capture import PLAIN_TENSORS, Encoder, rng_state, unwrap
from resumable.pieces import Piece, is_dtensor
from resumable.tree import RNG_KEY

log = logging.getLogger(__name__)

REST = 100  # captures an entry is walked the ordinary way after it could not be reused
_MISSES = 3  # consecutive re-plans of an entry before it rests

_MODULE_ATTRS = operator.itemgetter(  # from a module's __dict__
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
)
_SAVE_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")
_TORCH_MODULE = torch.nn.Module
_TORCH_SAVE = tuple(getattr(_TORCH_MODULE, m) for m in _SAVE_METHODS)
_IMMUTABLE = (int, float, bool, str, type(None))


class CapturePlan:
    """The reusable part of this rank's captures (see the module docstring); used by one
    thread, one capture at a time."""

    def __init__(self) -> None:
        self._entries: dict[str, _ModuleEntry | _OptimizerEntry | _ContainerEntry] = {}
        self._rest: dict[str, int] = {}  # key -> captures left to walk it the usual way
        self._misses: dict[str, int] = {}
        self._reused = False
        self._numpy = NumpyState()
        self._pystate = PythonState()
        self._python: tuple[Any, Any] | None = None  # Python's last state and its node
        self._words: list[int] | None = None  # its words, as the node holds them
        self._numpy_node: tuple[Any, Any, dict[str, torch.Tensor]] | None = None

    def entry(self, key: str, obj: Any, enc: Encoder) -> Any | None:
        """The tree node of the top-level entry ``state[key] = obj``, its tensors and
        classes added to ``enc`` as `Encoder.value` would add them; None if this plan
        does not take it (the caller walks it)."""
        if (enc.world_size != 1 or enc.rank != 0) and not enc.in_global:
            return None  # a per-rank object: walked
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizer(key, obj, enc)
        if type(obj) is dict or type(obj) is list:
            return self._container(key, obj, enc)
        module = unwrap(obj)
        if isinstance(module, torch.nn.Module) and _torch_saves_modules():
            return self._module(key, obj, module, enc)
        return None

    def streams(self, enc: Encoder) -> Any:
        """The node of the random streams, as ``enc.streams(rng_state())`` makes it;
        Python's and NumPy's nodes (and NumPy's tensor) are the last ones while their
        states are the same."""
        streams = rng_state(self._numpy.get, self._pystate.get)
        if enc.world_size != 1 or enc.rank != 0:
            return enc.streams(streams)
        items = []
        for key, v in streams.items():
            if key == "python":
                node = self._python_node(enc, v)
            elif key == "numpy":
                kept = self._numpy_node
                if kept is not None and v is kept[0] and _free(enc, kept[2]):
                    enc.tensors.update(kept[2])
                    node = kept[1]
                else:
                    mark = len(enc.tensors)
                    node = enc.value(v, (RNG_KEY, key), 3)
                    made = dict(_added(enc, mark))
                    self._numpy_node = (v, node, made) if v is self._numpy.kept else None
            else:
                node = enc.value(v, (RNG_KEY, key), 3)
            items.append([key, node])
        return {"dict": items}

    def _python_node(self, enc: Encoder, v: Any) -> Any:
        """The node of Python's stream: the last one while the state is the last one;
        while only its position moved, the same int objects for its 624 words (so
        `TreeJSON` compares them by identity)."""
        last = self._python
        if last is not None and v is last[0]:
            return last[1]
        if last is not None and self._pystate.words_kept and self._words is not None:
            path = (RNG_KEY, "python")
            node = {
                "tuple": [
                    enc.value(v[0], (*path, 0), 4),
                    {"tuple": [*self._words, v[1][-1]]},
                    enc.value(v[2], (*path, 2), 4),
                ]
            }
        else:
            node = enc.streams({"python": v})["dict"][0][1]
            self._words = list(v[1][:-1]) if type(v) is tuple and len(v) == 3 else None
        self._python = (v, node)
        return node

    def reused(self) -> bool:
        reused, self._reused = self._reused, False
        return reused

    def forget(self) -> None:
        """Drop every planned entry: the next capture walks the whole state."""
        self._entries.clear()
        self._reused = False

    # ------------------------------------------------------------------ entries

    def _resting(self, key: str) -> bool:
        left = self._rest.get(key, 0)
        if left:
            self._rest[key] = left - 1
        return left > 0

    def _missed(self, key: str, why: str) -> None:
        """The entry of ``key`` was not reused; after `_MISSES` in a row it rests."""
        self._entries.pop(key, None)
        n = self._misses[key] = self._misses.get(key, 0) + 1
        if n >= _MISSES or why:
            self._rest[key] = REST
            self._misses[key] = 0
            log.debug("state[%r] is walked at every snapshot for a while: %s", key, why or n)

    def _container(self, key: str, obj: dict[Any, Any] | list[Any], enc: Encoder) -> Any | None:
        hit = self._entries.get(key)
        if isinstance(hit, _ContainerEntry):
            if hit.valid(obj) and _free_entry(enc, hit):
                return self._reuse(key, hit, enc)
            self._missed(key, "")
        return self._walk(
            key,
            obj,
            enc,
            lambda node, made, classes, glob: (
                _ContainerEntry.make(key, obj, node, made)
                if glob is None and not classes
                else (None, "it holds global tensors or parameters")
            ),
        )

    def _module(self, key: str, obj: Any, module: torch.nn.Module, enc: Encoder) -> Any | None:
        hit = self._entries.get(key)
        if isinstance(hit, _ModuleEntry):
            if hit.valid(obj, module) and _free_entry(enc, hit):
                return self._reuse(key, hit, enc)
            self._missed(key, "")
        return self._walk(
            key,
            obj,
            enc,
            lambda node, made, classes, glob: _ModuleEntry.make(
                key, obj, module, node, made, classes, glob
            ),
        )

    def _reuse(self, key: str, hit: _ModuleEntry | _ContainerEntry, enc: Encoder) -> Any:
        """``hit``'s node, its classes and live tensors added to ``enc``."""
        if hit.classes is not None:
            enc.classes.append(hit.classes)
        enc.tensors.update(hit.tensors)
        if hit.glob is not None:
            hit.glob.add(enc)
        self._reused = True
        self._misses[key] = 0
        return hit.node

    def _walk(
        self,
        key: str,
        obj: Any,
        enc: Encoder,
        make: Callable[
            [Any, list[tuple[str, torch.Tensor]], list[Any], _Globals | None], tuple[Any, str]
        ],
    ) -> Any | None:
        """Walk ``obj`` as `Encoder.value` does, and plan its entry (``make``: from its
        node, the tensors, the classes and the global tensors' notes the walk made) for
        the next capture; None while the entry rests."""
        if self._resting(key):
            return None
        mark, classes, marks = len(enc.tensors), len(enc.classes), _Globals.marks(enc)
        node = enc.value(obj, (key,), 2)
        entry, why = make(node, _added(enc, mark), enc.classes[classes:], _Globals.made(enc, marks))
        self._keep(key, entry, why, enc)
        return node

    def _keep(self, key: str, entry: Any, why: str, enc: Encoder) -> None:
        """Keep a new entry (its live tensors handed out now, as a reuse hands them), or
        count the miss."""
        if entry is None:
            self._missed(key, why)
        else:
            self._entries[key] = entry
            enc.tensors.update(entry.tensors)

    def _optimizer(self, key: str, obj: torch.optim.Optimizer, enc: Encoder) -> Any | None:
        if self._resting(key):
            return None
        path = (key,)
        hit = self._entries.get(key)
        if isinstance(hit, _OptimizerEntry) and hit.direct(obj) and _free_entry(enc, hit):
            # torch's state_dict(), no hooks: its "state" as before, without calling it
            enc.classes.append(hit.classes)
            enc.tensors.update(hit.tensors)
            if hit.glob is not None:
                hit.glob.add(enc)
            self._reused = True
            self._misses[key] = 0
            groups = hit.groups_node(obj, enc, key)
            return {"stateful": {"dict": [["state", hit.node], ["param_groups", groups]]}}
        classes = len(enc.classes)
        sd = enc.state_dict_of(obj, path)
        if type(sd) is not dict or list(sd) != ["state", "param_groups"]:
            self._missed(key, f"its state_dict() has keys {list(sd)[:4]}")
            return {"stateful": enc.value(sd, path, 3)}
        st = sd["state"]
        if isinstance(hit, _OptimizerEntry) and hit.valid(obj, st) and _free_entry(enc, hit):
            enc.tensors.update(hit.tensors)
            if hit.glob is not None:
                hit.glob.add(enc)
            state_node = hit.node
            self._reused = True
            self._misses[key] = 0
        else:
            if hit is not None:
                self._missed(key, "")
            mark, marks = len(enc.tensors), _Globals.marks(enc)
            state_node = enc.value(st, (key, "state"), 4)
            made, glob = _added(enc, mark), _Globals.made(enc, marks)
            entry, why = _OptimizerEntry.make(
                key, obj, sd, state_node, made, enc.classes[classes], glob
            )
            self._keep(key, entry, why, enc)
        groups = enc.value(sd["param_groups"], (key, "param_groups"), 4)
        return {"stateful": {"dict": [["state", state_node], ["param_groups", groups]]}}


def _added(enc: Encoder, mark: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``enc`` collected after its first ``mark``, in order."""
    n = len(enc.tensors) - mark
    return list(islice(reversed(enc.tensors.items()), n))[::-1] if n else []


def _free(enc: Encoder, names: dict[str, torch.Tensor]) -> bool:
    """Whether none of ``names`` is taken yet (else a walk would rename them)."""
    return not enc.tensors or enc.tensors.keys().isdisjoint(names)


def _free_entry(enc: Encoder, entry: _ModuleEntry | _OptimizerEntry | _ContainerEntry) -> bool:
    """Whether none of ``entry``'s names (its tensors' and global tensors') is taken yet."""
    if not _free(enc, entry.tensors):
        return False
    glob = entry.glob
    return glob is None or not enc.live or enc.live.keys().isdisjoint(glob.live)


_LOCAL = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")


class _Globals:
    """What a walk of a module or optimizer notes of its global tensors (at several ranks,
    or DTensors) beside the tensors it hands out: each tensor's piece (where its shard
    lies) and whether it is replicated, and the live objects under their global names.
    Of each DTensor it keeps the local tensor and the spec (mesh and placements) objects:
    a reuse needs them unchanged (FSDP2 keeps both from step to step; resharding or
    loading a state dict with ``assign`` makes new ones)."""

    def __init__(
        self,
        pieces: dict[str, Piece],
        replicated: set[str],
        live: dict[str, Any],
        world_size: int,
    ) -> None:
        self.pieces, self.replicated, self.live = pieces, replicated, live
        self.world_size = world_size
        self.dtensors = [t for t in live.values() if is_dtensor(t)]
        self._locals = list(map(_LOCAL, self.dtensors))  # held: the ids below stay theirs
        self._specs = list(map(_SPEC, self.dtensors))
        self.local_ids = list(map(id, self._locals))
        self.spec_ids = list(map(id, self._specs))

    @staticmethod
    def marks(enc: Encoder) -> tuple[int, int, frozenset[str]]:
        return len(enc.pieces), len(enc.live), frozenset(enc.replicated)

    @classmethod
    def made(cls, enc: Encoder, marks: tuple[int, int, frozenset[str]]) -> _Globals | None:
        """What a walk noted after ``marks``; None if it met no global tensor (a plain
        state of one process)."""
        pieces_at, live_at, replicated = marks
        live = dict(islice(enc.live.items(), live_at, None))
        if not live:
            return None
        if not all(
            hasattr(t, "_local_tensor") and hasattr(t, "_spec")
            for t in live.values()
            if is_dtensor(t)
        ):
            return None
        pieces = dict(islice(enc.pieces.items(), pieces_at, None))
        return cls(pieces, set(enc.replicated - replicated), live, enc.world_size)

    def valid(self) -> bool:
        """Whether each DTensor holds the local tensor and spec it held."""
        return (
            list(map(id, map(_LOCAL, self.dtensors))) == self.local_ids
            and list(map(id, map(_SPEC, self.dtensors))) == self.spec_ids
        )

    def add(self, enc: Encoder) -> None:
        enc.pieces.update(self.pieces)
        enc.replicated.update(self.replicated)
        enc.live.update(self.live)

    def handout(
        self, made: list[tuple[str, torch.Tensor]], fqns: list[str], values: list[Any]
    ) -> dict[str, torch.Tensor] | None:
        """The tensors a reuse hands out under the names the walk gave them (``made``):
        for a DTensor its local tensor, else the live tensor; None unless the walk took
        ``values`` under the names ``fqns`` (the global ones, all at several ranks and
        the DTensors at one, as live objects) and each tensor it took is the local
        tensor (or a detached alias) of its own live object."""
        if len(values) != len(fqns):
            return None
        glob = [self.world_size > 1 or is_dtensor(v) for v in values]
        if list(self.live) != [f for f, g in zip(fqns, glob) if g]:
            return None
        if not all(a is b for a, b in zip(self.live.values(), compress(values, glob))):
            return None
        plain = {f: v for f, v, g in zip(fqns, values, glob) if not g}
        out: dict[str, torch.Tensor] = {}
        for name, walked in made:
            piece = self.pieces.get(name)
            if piece is not None:
                v = self.live.get(piece.fqn)
                src = _LOCAL(v) if is_dtensor(v) else v
            else:
                src = plain.pop(name, None)
            if src is None or not _same_tensor(walked, src):
                return None
            out[name] = src
        return None if plain else out


def _own_tensors(
    key: str,
    made: list[tuple[str, torch.Tensor]],
    paths: list[tuple[Any, ...]],
    values: list[Any],
    glob: _Globals | None,
) -> dict[str, torch.Tensor] | None:
    """The tensors an entry hands out at a reuse, by name: the live ones where the walk
    took ``values`` (at ``paths`` under ``key``) under the names a walk gives them; None
    if it did not (names taken, or values that are not plain tensors of their own)."""
    names = _base_names(key, paths)
    if glob is not None:
        return glob.handout(made, names, values)
    if [n for n, _ in made] != names or len(made) != len(values):
        return None
    if not all(_same_tensor(t, v) for (_, t), v in zip(made, values)):
        return None
    return {n: v for (n, _), v in zip(made, values)}


def _same_tensor(walked: torch.Tensor, live: Any) -> bool:
    """Whether ``walked`` (a tensor the walk collected) is ``live`` or its detached
    alias, and ``live`` is a plain tensor."""
    if type(live) not in PLAIN_TENSORS:
        return False
    if walked is live:
        return True
    return (
        walked.data_ptr() == live.data_ptr()
        and walked.dtype == live.dtype
        and walked.shape == live.shape
        and walked.stride() == live.stride()
    )


def _base_names(key: str, paths: Iterable[tuple[Any, ...]]) -> list[str]:
    return ["/".join(map(str, (key, *p))) for p in paths]


def _torch_saves_modules() -> bool:
    """Whether ``nn.Module``'s own state-dict methods are torch's (not patched)."""
    return all(
        getattr(_TORCH_MODULE, m) is f and getattr(f, "__module__", "") == "torch.nn.modules.module"
        for m, f in zip(_SAVE_METHODS, _TORCH_SAVE)
    )


def _keeps_torch_state_dict(cls: type) -> bool:
    return all(getattr(cls, m, f) is f for m, f in zip(_SAVE_METHODS, _TORCH_SAVE))


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules in the order (and with the repeats) of
    ``state_dict()``'s recursion."""
    out: list[torch.nn.Module] = []
    todo = [module]
    while todo:
        m = todo.pop()
        out.append(m)
        todo.extend(reversed([s for s in m._modules.values() if s is not None]))
    return out


class _ModuleEntry:
    """A module's node and tensors, and what they were made from."""

    def __init__(
        self,
        obj: Any,
        module: torch.nn.Module,
        node: Any,
        tensors: dict[str, torch.Tensor],
        classes: tuple[tuple[Any, ...], str],
        glob: _Globals | None,
    ) -> None:
        self.obj, self.module, self.node, self.tensors = obj, module, node, tensors
        self.classes, self.glob = classes, glob
        self.mods = _submodules(module)
        self.own = [vars(m) for m in self.mods]  # a per-object override would land here
        attrs = list(map(_MODULE_ATTRS, self.own))
        self._attrs = attrs  # held: the ids below stay theirs
        self.attr_ids = list(map(id, chain.from_iterable(attrs)))
        self.types = list(map(type, self.mods))
        self.dicts = [d for a in attrs for d in a[0:3]]
        self.lens = list(map(len, self.dicts))  # a key moved to the next dict keeps the keys
        self.keys = list(chain.from_iterable(self.dicts))
        self._values = list(chain.from_iterable(map(dict.values, self.dicts)))
        self.value_ids = list(map(id, self._values))
        self.sets = [a[3] for a in attrs]
        self.set_copies = list(map(frozenset, self.sets))
        self.post_hooks = [a[4] for a in attrs]
        self.pre_hooks = [a[5] for a in attrs]
        # FSDP2's pre-hooks (`make` allows no other), run before each check
        self.pre_calls = [(m, h) for m, a in zip(self.mods, attrs) for h in a[5].values()]
        self.pre_ids = [id(h) for _, h in self.pre_calls]
        # (class, method name) for each class and state-dict method, and torch's methods
        kinds = list(dict.fromkeys(self.types))
        self.cls_rep = [c for c in kinds for _ in _SAVE_METHODS]
        self.names_rep = list(_SAVE_METHODS) * len(kinds)
        self.torch_rep = list(_TORCH_SAVE) * len(kinds)

    @classmethod
    def make(
        cls,
        key: str,
        obj: Any,
        module: torch.nn.Module,
        node: Any,
        made: list[tuple[str, torch.Tensor]],
        classes: list[tuple[tuple[Any, ...], str]],
        glob: _Globals | None,
    ) -> tuple[_ModuleEntry | None, str]:
        """The entry of a module just walked (``node``, the tensors ``made``, the notes
        on its global tensors ``glob``), or None and why it cannot be reused."""
        mods = _submodules(module)
        for m in mods:
            if not _keeps_torch_state_dict(type(m)):
                return None, f"{type(m).__name__} has its own state_dict methods"
            if m._state_dict_hooks:
                return None, f"{type(m).__name__} has state_dict hooks"
            if not all(map(_fsdp_pre_hook, m._state_dict_pre_hooks.values())):
                return None, f"{type(m).__name__} has state_dict pre-hooks"
            if any(name in vars(m) for name in _SAVE_METHODS):
                return None, f"a {type(m).__name__} object has its own state_dict"
        live = module.state_dict(keep_vars=True)
        tensors = _own_tensors(key, made, [(k,) for k in live], list(live.values()), glob)
        if tensors is None:
            return None, "its tensors' names are taken, or its state_dict() holds more"
        if len(classes) != 1:
            return None, "its state holds stateful objects"
        return cls(obj, module, node, tensors, classes[0], glob), ""

    def valid(self, obj: Any, module: torch.nn.Module) -> bool:
        """Whether the module has the structure this entry was made from (its FSDP2
        pre-hooks run first, as ``state_dict()`` runs them)."""
        if obj is not self.obj or module is not self.module:
            return False
        for m, hook in self.pre_calls:
            hook(m, "", True)
        return (
            list(map(type, self.mods)) == self.types
            and list(map(id, chain.from_iterable(map(_MODULE_ATTRS, self.own)))) == self.attr_ids
            and list(map(len, self.dicts)) == self.lens
            and list(chain.from_iterable(self.dicts)) == self.keys
            and list(map(id, chain.from_iterable(map(dict.values, self.dicts)))) == self.value_ids
            and not any(map(len, self.post_hooks))
            and list(map(id, chain.from_iterable(map(dict.values, self.pre_hooks)))) == self.pre_ids
            and list(map(frozenset, self.sets)) == self.set_copies
            and not any(map(_overrides, self.own))
            and list(map(getattr, self.cls_rep, self.names_rep)) == self.torch_rep
            and (self.glob is None or self.glob.valid())
        )


def _fsdp_pre_hook(hook: Any) -> bool:
    """Whether ``hook`` is the state-dict pre-hook FSDP2's ``fully_shard`` registers (it
    makes sure the module holds its sharded parameters, and does nothing else)."""
    return getattr(hook, "__module__", "").startswith("torch.distributed.fsdp") and getattr(
        hook, "__qualname__", ""
    ).endswith("._register_state_dict_hooks.<locals>.to_sharded_hook")


def _overrides(attrs: dict[str, Any]) -> bool:
    return "state_dict" in attrs or "_save_to_state_dict" in attrs or "get_extra_state" in attrs


class _ContainerEntry:
    """A top-level dict or list of plain dicts, lists, tensors and immutable values: its
    node and tensors, and the containers they were made from (the same objects, with
    the same keys, lengths and value objects)."""

    def __init__(
        self,
        obj: Any,
        node: Any,
        tensors: dict[str, torch.Tensor],
        dicts: list[dict[Any, Any]],
        lists: list[list[Any]],
    ) -> None:
        self.obj, self.node, self.tensors = obj, node, tensors
        self.classes = None  # plain containers record no class
        self.glob: _Globals | None = None  # of one process, plain tensors only
        self.dicts, self.lists = dicts, lists
        self.dict_lens = list(map(len, dicts))
        self.keys = list(chain.from_iterable(dicts))
        self._values = list(chain.from_iterable(map(dict.values, dicts)))  # held
        self.value_ids = list(map(id, self._values))
        self.list_lens = list(map(len, lists))
        self._items = list(chain.from_iterable(lists))  # held
        self.item_ids = list(map(id, self._items))

    @classmethod
    def make(
        cls, key: str, obj: Any, node: Any, made: list[tuple[str, torch.Tensor]]
    ) -> tuple[_ContainerEntry | None, str]:
        dicts: list[dict[Any, Any]] = []
        lists: list[list[Any]] = []
        paths: list[tuple[Any, ...]] = []
        live: list[Any] = []
        todo: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
        while todo:  # depth first, in the walk's order
            v, path = todo.pop()
            tv = type(v)
            if tv is dict:
                dicts.append(v)
                todo.extend(reversed([(x, (*path, k)) for k, x in v.items()]))
            elif tv is list:
                lists.append(v)
                todo.extend(reversed([(x, (*path, i)) for i, x in enumerate(v)]))
            elif tv in PLAIN_TENSORS:
                paths.append(path)
                live.append(v)
            elif tv is tuple:
                if not all(type(x) in _IMMUTABLE_TYPES for x in v):
                    return None, "it holds a tuple of containers"
            elif tv not in _IMMUTABLE_TYPES:
                return None, f"it holds a {tv.__name__}"
        if [n for n, _ in made] != _base_names(key, paths):
            return None, "its tensors' names are taken"
        if len(made) != len(live) or not all(_same_tensor(t, v) for (_, t), v in zip(made, live)):
            return None, "its tensors are not its own"
        tensors = {n: v for (n, _), v in zip(made, live)}
        return cls(obj, node, tensors, dicts, lists), ""

    def valid(self, obj: Any) -> bool:
        return (
            obj is self.obj
            and list(map(len, self.dicts)) == self.dict_lens
            and list(chain.from_iterable(self.dicts)) == self.keys
            and list(map(id, chain.from_iterable(map(dict.values, self.dicts)))) == self.value_ids
            and list(map(len, self.lists)) == self.list_lens
            and list(map(id, chain.from_iterable(self.lists))) == self.item_ids
        )


_IMMUTABLE_TYPES = (int, float, bool, str, type(None))


def _stable(v: Any) -> bool:
    """Whether ``v``'s node depends only on the object (an immutable value)."""
    tv = type(v)
    return tv in _IMMUTABLE_TYPES or (tv is tuple and all(type(x) in _IMMUTABLE_TYPES for x in v))


_OPTIMIZER_STATE_DICT = torch.optim.Optimizer.state_dict
_PARAMS = operator.itemgetter("params")


class _OptimizerEntry:
    """The node and tensors of an optimizer's ``state_dict()["state"]``, and the
    per-parameter dicts and values they were made from.

    Where the optimizer keeps torch's ``state_dict`` with no hooks, and this entry's
    packing of the parameter groups matched that ``state_dict()``'s when it was made
    (``can_pack``), `direct` checks the optimizer's own ``state`` and groups instead,
    and `pack_groups` packs the groups as torch does: ``state_dict()`` is not called."""

    def __init__(
        self,
        obj: torch.optim.Optimizer,
        sd: dict[str, Any],
        node: Any,
        tensors: dict[str, torch.Tensor],
        classes: tuple[tuple[Any, ...], str],
        glob: _Globals | None,
    ) -> None:
        st = sd["state"]
        self.obj, self.node, self.tensors, self.classes = obj, node, tensors, classes
        self.glob = glob
        self.cls = type(obj)
        self.keys = list(st)
        self._inner = list(st.values())  # held: the ids below stay theirs
        self.inner_ids = list(map(id, self._inner))
        self.inner_lens = list(map(len, self._inner))
        self.inner_keys = list(chain.from_iterable(self._inner))
        self._values = list(chain.from_iterable(map(dict.values, self._inner)))
        self.value_ids = list(map(id, self._values))
        # what `direct` compares: the optimizer's state keys (its parameters) and groups
        self._params = list(obj.state)
        self.param_ids = list(map(id, self._params))
        self._flat = list(chain.from_iterable(map(_PARAMS, obj.param_groups)))
        self.flat_ids = list(map(id, self._flat))
        self.group_lens = list(map(len, map(_PARAMS, obj.param_groups)))
        self.indices = [g["params"] for g in sd["param_groups"]]
        self._group_items: list[dict[Any, tuple[Any, list[Any]]]] = []  # groups_node's
        self.can_pack = (
            self.cls.state_dict is _OPTIMIZER_STATE_DICT
            and all(type(k) in PLAIN_TENSORS or is_dtensor(k) for k in self._params)
            and _same_groups(self.pack_groups(obj), sd["param_groups"])
        )

    @classmethod
    def make(
        cls,
        key: str,
        obj: torch.optim.Optimizer,
        sd: dict[str, Any],
        node: Any,
        made: list[tuple[str, torch.Tensor]],
        classes: tuple[tuple[Any, ...], str],
        glob: _Globals | None,
    ) -> tuple[_OptimizerEntry | None, str]:
        st, groups = sd["state"], sd["param_groups"]
        if type(st) is not dict:
            return None, f"its state is a {type(st).__name__}"
        if type(groups) is not list or not all(type(g) is dict for g in groups):
            return None, "its param_groups are not a list of dicts"
        paths: list[tuple[Any, ...]] = []
        live: list[Any] = []
        for idx, inner in st.items():
            if type(inner) is not dict or type(idx) not in (int, str):
                return None, "its state is not a dict of dicts"
            for name, v in inner.items():
                if type(v) in PLAIN_TENSORS or is_dtensor(v):
                    paths.append(("state", idx, name))
                    live.append(v)
                elif not isinstance(v, _IMMUTABLE) or type(name) not in (int, str):
                    return None, f"its state holds a {type(v).__name__}"
        tensors = _own_tensors(key, made, paths, live, glob)
        if tensors is None:
            return None, "its tensors' names are taken, or its state's tensors are not its own"
        return cls(obj, sd, node, tensors, classes, glob), ""

    def valid(self, obj: Any, st: Any) -> bool:
        """Whether ``st`` (of ``obj.state_dict()``) holds the per-parameter dicts and
        values this was made from."""
        return (
            obj is self.obj
            and type(st) is dict
            and list(st) == self.keys
            and list(map(id, st.values())) == self.inner_ids
            and self._same_inner()
            and (self.glob is None or self.glob.valid())
        )

    def direct(self, obj: Any) -> bool:
        """Whether ``obj.state_dict()`` would have the ``"state"`` this was made from,
        and groups `pack_groups` packs as it would; checked without calling it."""
        if not (
            self.can_pack
            and obj is self.obj
            and type(obj) is self.cls
            and self.cls.state_dict is _OPTIMIZER_STATE_DICT
            and not obj._optimizer_state_dict_pre_hooks
            and not obj._optimizer_state_dict_post_hooks
            and "state_dict" not in vars(obj)
        ):
            return False
        st = obj.state
        groups = obj.param_groups
        return (
            list(map(id, st)) == self.param_ids
            and list(map(id, st.values())) == self.inner_ids
            and self._same_inner()
            and list(map(id, chain.from_iterable(map(_PARAMS, groups)))) == self.flat_ids
            and list(map(len, map(_PARAMS, groups))) == self.group_lens
            and (self.glob is None or self.glob.valid())
        )

    def _same_inner(self) -> bool:
        return (
            list(map(len, self._inner)) == self.inner_lens
            and list(chain.from_iterable(self._inner)) == self.inner_keys
            and list(map(id, chain.from_iterable(map(dict.values, self._inner)))) == self.value_ids
        )

    def groups_node(self, obj: torch.optim.Optimizer, enc: Encoder, key: str) -> Any:
        """The node ``enc.value(self.pack_groups(obj), (key, "param_groups"), 4)``
        makes, built item by item: an item whose value is the very object of the last
        call (an unchanged hyperparameter, a tuple of them, the parameter indices) is the
        same ``[name, node]`` list as then, so `TreeJSON` reuses its text; a changed one
        (a learning rate) and every tensor are walked."""
        path = (key, "param_groups")
        nodes = []
        kept: list[dict[Any, tuple[Any, list[Any]]]] = []
        for i, packed in enumerate(self.pack_groups(obj)):
            last = self._group_items[i] if i < len(self._group_items) else {}
            mine: dict[Any, tuple[Any, list[Any]]] = {}
            if not all(type(k) is str for k in packed):  # keys the walk refuses: walk it
                nodes.append(enc.value(packed, (*path, i), 5))
                kept.append(mine)
                continue
            items = []
            for k, v in packed.items():
                hit = last.get(k)
                if hit is not None and hit[0] is v:
                    item = hit[1]
                else:
                    item = [k, enc.value(v, (*path, i, k), 6)]
                if _stable(v) or v is self.indices[i]:
                    mine[k] = (v, item)
                items.append(item)
            nodes.append({"dict": items})
            kept.append(mine)
        self._group_items = kept
        return {"list": nodes}

    def pack_groups(self, obj: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """``obj.state_dict()["param_groups"]`` while `direct` holds: each group but its
        parameters, then their indices."""
        out = []
        for group, indices in zip(obj.param_groups, self.indices):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = indices
            out.append(packed)
        return out


def _same_groups(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> bool:
    """Whether two packings of parameter groups hold the same keys, in order, the same
    value objects, and equal parameter indices."""
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs):
        if list(a) != list(b) or a["params"] != b["params"]:
            return False
        if any(a[k] is not b[k] for k in a if k != "params"):
            return False
    return True


class PythonState:
    """Python's global stream (``random.getstate()``), read anew only when it changed.

    ``random.getstate()`` builds a tuple of 625 new ints (~7 µs) that then has to be
    compared with the last one (~5 µs). The Mersenne Twister's position and 624 words
    lie in the ``_random.Random`` object's struct; where is found once on a private
    ``random.Random`` (its words and position searched for and checked after a draw and
    a reseed), then checked on ``random``'s own instance against ``getstate``; the
    kept Gaussian (``gauss_next``) is an attribute, compared by identity. Anything
    unexpected leaves this off: every call then reads ``getstate``. ``words_kept``
    says whether the last read found the words of the read before it (only the
    position moved)."""

    _BYTES = 4 + 624 * 4  # the position (an int), then the words

    def __init__(self) -> None:
        self._inst: Any = None
        self._read: Callable[[], bytes] | None = None
        self._raw = b""
        self._gauss: Any = None
        self._last: Any = None
        self.words_kept = False

    def get(self) -> Any:
        inst: Any = getattr(random, "_inst", None)
        if inst is not self._inst:
            self._attach(inst)
        read = self._read
        if read is None:
            self.words_kept = False
            return random.getstate()
        raw = read()
        gauss = inst.gauss_next
        last = self._last
        if last is not None and raw == self._raw and gauss is self._gauss:
            return last
        self.words_kept = last is not None and raw[4:] == self._raw[4:]
        last = random.getstate()
        self._raw, self._gauss, self._last = raw, gauss, last
        return last

    def _attach(self, inst: Any) -> None:
        self._inst, self._read, self._raw, self._gauss, self._last = inst, None, b"", None, None
        self.words_kept = False
        where = _python_offset()
        if where is None or not isinstance(inst, random.Random):
            return
        address, size = id(inst) + where, self._BYTES

        def read() -> bytes:
            return ctypes.string_at(address, size)

        if read() == _python_expected(random.getstate()):
            self._read = read


def _python_expected(state: Any) -> bytes:
    """What `PythonState` reads for ``random.getstate()``'s ``state``."""
    internal = state[1]
    return (
        int(internal[-1]).to_bytes(4, sys.byteorder, signed=True)
        + array.array("I", internal[:-1]).tobytes()
    )


@functools.lru_cache(maxsize=1)
def _python_offset() -> int | None:
    """Where a ``random.Random``'s position (then its words) lies in the object, found
    and checked on a private one; None if not found or not what ``getstate`` says."""
    if sys.implementation.name != "cpython" or array.array("I").itemsize != 4:
        return None
    try:
        import _random

        probe = random.Random(20261127)
        size = _random.Random.__basicsize__
        state = probe.getstate()
        raw = ctypes.string_at(id(probe), size)
        at = raw.find(_python_expected(state)[4:]) - 4
        if at < 0 or at + PythonState._BYTES > size:
            return None
        for change in (probe.random, lambda: probe.seed(7), lambda: probe.getrandbits(64)):
            change()
            got = ctypes.string_at(id(probe) + at, PythonState._BYTES)
            if got != _python_expected(probe.getstate()):
                return None
        return at
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


class NumpyState:
    """NumPy's global stream (``np.random.get_state(legacy=False)``), read anew only
    when it changed.

    Reading the state costs ~25 µs: NumPy copies the Mersenne Twister's 624 words one at
    a time into a new array. Comparing the state where it lies costs ~1 µs: the words
    and position at the bit generator's ``ctypes.state_address``, and the Gaussian the
    legacy generator keeps for its next ``normal()`` (``has_gauss``, ``gauss``: a
    normal drawn from it changes neither the words nor the position) in the generator
    object's own struct. That struct has no public address, so where it lies is found
    once on a private ``RandomState`` (the field that points at the generator's state,
    the field that points at that one, then the Gaussian beside it), checked there with
    a Gaussian pending and without, and checked again on NumPy's global generator
    against ``get_state``. Anything unexpected (another NumPy layout, another bit
    generator, another Python) leaves this off: every call then reads ``get_state``."""

    _STATE_BYTES = 624 * 4 + 4  # the words, then the position (an int)

    def __init__(self) -> None:
        self._gen: Any = None
        self._read: Callable[[], bytes] | None = None
        self._raw = b""
        self._last: dict[str, Any] | None = None
        self._keep: Any = None  # the object whose memory the read reads
        self._decode = False

    @property
    def kept(self) -> Any:
        """The state `get` returns while the stream does not change (or None)."""
        return self._last if self._read is not None else None

    def get(self) -> Any:
        rs = np.random.mtrand._rand
        gen = getattr(rs, "_bit_generator", None)
        if gen is not self._gen:
            self._attach(rs, gen)
        read = self._read
        if read is None:
            return np.random.get_state(legacy=False)
        raw = read()
        if raw == self._raw and self._last is not None:
            return self._last
        last = _decoded(raw) if self._decode else np.random.get_state(legacy=False)
        self._raw, self._last = raw, last
        return last

    def _attach(self, rs: Any, gen: Any) -> None:
        self._gen, self._read, self._raw, self._last = gen, None, b"", None
        where = _gaussian_offset()
        if where is None or type(gen).__name__ != "MT19937":
            return
        base = id(rs)
        try:
            address = int(gen.ctypes.state_address)
        except (AttributeError, TypeError, ValueError):
            return
        bit_off, gauss_off = where
        if _word(base + bit_off) != address or _word(base + gauss_off - 8) != base + bit_off:
            return
        size = self._STATE_BYTES

        def read() -> bytes:
            return ctypes.string_at(address, size) + ctypes.string_at(base + gauss_off, 16)

        state = np.random.get_state(legacy=False)
        raw = read()
        if raw == _expected(state):
            self._read, self._keep = read, rs
            # the state made from the bytes read, where it is exactly get_state's
            self._decode = _same_state(_decoded(raw), state)


def _decoded(raw: bytes) -> dict[str, Any]:
    """``np.random.get_state(legacy=False)`` made from what `NumpyState` read (words,
    position, has_gauss, padding, gauss), without NumPy's element-by-element copy."""
    order = sys.byteorder
    words = NumpyState._STATE_BYTES - 4
    return {
        "bit_generator": "MT19937",
        "state": {
            "key": np.frombuffer(raw, dtype=np.uint32, count=words // 4).copy(),
            "pos": int.from_bytes(raw[words : words + 4], order, signed=True),
        },
        "has_gauss": int.from_bytes(raw[words + 4 : words + 8], order, signed=True),
        "gauss": struct.unpack("=d", raw[words + 12 : words + 20])[0],
    }


def _same_state(a: Any, b: Any) -> bool:
    """Whether two NumPy states are the same, key for key, type for type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return bool(a == b)


def _word(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def _expected(state: dict[str, Any]) -> bytes:
    """What `NumpyState`'s read finds for ``state``: words, position, has_gauss, the
    4 bytes of padding after it (zero in a struct NumPy keeps zeroed), and gauss."""
    inner = state["state"]
    order = sys.byteorder
    return (
        np.asarray(inner["key"], dtype=np.uint32).tobytes()
        + int(inner["pos"]).to_bytes(4, order, signed=True)
        + int(state["has_gauss"]).to_bytes(4, order, signed=True)
        + bytes(4)
        + struct.pack("=d", float(state["gauss"]))
    )


@functools.lru_cache(maxsize=1)
def _gaussian_offset() -> tuple[int, int] | None:
    """(offset of the bit generator struct, offset of the Gaussian's ``has_gauss``) in a
    ``RandomState`` object of this NumPy, found and checked on a private one; None if
    they cannot be found or do not hold what ``get_state`` says."""
    if sys.implementation.name != "cpython" or struct.calcsize("P") != 8:
        return None
    try:
        probe = np.random.RandomState(20261127)
        base, size = id(probe), type(probe).__basicsize__
        address = int(probe._bit_generator.ctypes.state_address)
        words = [_word(base + off) for off in range(0, size - 7, 8)]
        bit_off = 8 * words.index(address)
        gauss_off = 8 * words.index(base + bit_off) + 8
        if gauss_off + 16 > size:
            return None
        for draw in (probe.standard_normal, probe.standard_normal, probe.random_sample):
            draw()  # a Gaussian pending, then used, then none after another draw
            state = probe.get_state(legacy=False)
            got = ctypes.string_at(address, NumpyState._STATE_BYTES) + ctypes.string_at(
                base + gauss_off, 16
            )
            if got != _expected(state):
                return None
        return bit_off, gauss_off
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
