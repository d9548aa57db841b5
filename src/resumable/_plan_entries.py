"""The entries of a `resumable._capture_plan.CapturePlan`, and the checks that guard them.

An entry keeps the tree node and the live tensors that a walk made of one top-level
object: a module (`ModuleEntry`), an optimizer (`OptimizerEntry`) or a plain container
(`ContainerEntry`). Its ``valid`` check says whether the object still has the structure
they were made from. `Globals` notes what the walk met of global tensors (several
ranks, or DTensors).

The trade-off: each check is a few C-level passes (``map`` over lists, no Python loop
per item), so an entry holds every object it compares by identity, and no other object
can take its address. A check does not see a tensor's dtype, shape or device change:
the caller compares those.

Where CPython keeps a version tag in each dict (3.11 to 3.13: a number taken from a
process-wide counter at every change; read through torch's ``dict_version``), an entry
notes the tags of the dicts its check reads once that check passed. While every tag is
the same, no dict changed since: the check compares the tags, one number per dict, and
skips the per-item passes over those dicts. Any changed tag runs the whole check.
"""

from __future__ import annotations

import json
import operator
from collections import defaultdict
from collections.abc import Iterable
from itertools import chain, compress, islice
from typing import Any

import torch

from resumable._encode import (
    PLAIN_TENSORS,
    Encoder,
    KnownJSON,
    alias_key,
    key_json,
    scalar_json,
)
from resumable.pieces import Piece, is_dtensor

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


def _version_reader() -> Any:
    """torch's reader of a dict's version tag, if this Python and torch have one that
    changes at every change of a dict (checked here); else None (every check is whole)."""
    try:
        from torch._C._dynamo.guards import dict_version
    except (ImportError, AttributeError):
        return None
    try:
        d: dict[int, int] = {}
        tags = [dict_version(d)]
        for v in (0, 1):
            d[0] = v
            tags.append(dict_version(d))
        del d[0]
        tags.append(dict_version(d))
    except Exception:  # a private API: any failure means no tags
        return None
    if not all(type(t) is int for t in tags) or len(set(tags)) != len(tags):
        return None
    return dict_version


_DICT_VERSION = _version_reader()


def dict_tags(dicts: list[Any]) -> list[int] | None:
    """The version tags of ``dicts`` (all dicts or dict subclasses), or None where this
    Python has none to read."""
    if _DICT_VERSION is None:
        return None
    return list(map(_DICT_VERSION, dicts))


def _orders_in_place(dicts: Iterable[Any]) -> bool:
    """Whether any of ``dicts`` can change its order without a change its tag sees (an
    ``OrderedDict``'s ``move_to_end``): such dicts are checked whole every time."""
    return not all(type(d) is dict or type(d) is defaultdict for d in dicts)


_LOCAL = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")


class Globals:
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
        self._locals = list(map(_LOCAL, self.dtensors))
        self._specs = list(map(_SPEC, self.dtensors))

    @staticmethod
    def marks(enc: Encoder) -> tuple[int, int, frozenset[str]]:
        return len(enc.pieces), len(enc.live), frozenset(enc.replicated)

    @classmethod
    def made(cls, enc: Encoder, marks: tuple[int, int, frozenset[str]]) -> Globals | None:
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
        return _same_objects(map(_LOCAL, self.dtensors), self._locals) and _same_objects(
            map(_SPEC, self.dtensors), self._specs
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


def _same_objects(objs: Iterable[Any], held: list[Any]) -> bool:
    """Whether ``objs`` are the very objects ``held``, in order. Compared by identity
    (``==`` would call a tensor's ``__eq__``), not by ``id`` lists: those hold an int
    object per item, which a check right after a training step reads from memory."""
    got = list(objs)
    return len(got) == len(held) and all(map(operator.is_, got, held))


def _own_tensors(
    key: str,
    made: list[tuple[str, torch.Tensor]],
    paths: list[tuple[Any, ...]],
    values: list[Any],
    glob: Globals | None,
) -> dict[str, torch.Tensor] | None:
    """The tensors an entry hands out at a reuse, by name: the live ones where the walk
    took ``values`` (at ``paths`` under ``key``) under the names a walk gives them; None
    if it did not (names taken, or values that are not plain tensors of their own)."""
    firsts = _first_places(_base_names(key, paths), values)
    if firsts is None:
        return None
    names, values = firsts
    if glob is not None:
        return glob.handout(made, names, values)
    if [n for n, _ in made] != names or len(made) != len(values):
        return None
    if not all(_same_tensor(t, v) for (_, t), v in zip(made, values)):
        return None
    return {n: v for (n, _), v in zip(made, values)}


def _first_places(names: list[str], values: list[Any]) -> tuple[list[str], list[Any]] | None:
    """``names`` and ``values`` without the places where a value is met again (a tied
    weight: the walk referenced it under its first name, `Encoder.tensor`); None where
    two different tensor objects view the same memory, a tie that a reuse's identity
    checks would not see break (such an entry is walked at every capture)."""
    if len(names) != len(values):
        return None
    if len(set(map(id, values))) == len(values):  # no object twice (the usual case)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        keys = [alias_key(v, "") for v in tensors]
        ok = len({k for k in keys if k is not None}) == sum(k is not None for k in keys)
        return (names, values) if ok else None
    first: dict[int, Any] = {}
    keyed: dict[Any, Any] = {}
    out_names, out_values = [], []
    for n, v in zip(names, values):
        if id(v) in first:
            continue
        first[id(v)] = v
        k = alias_key(v, "") if isinstance(v, torch.Tensor) else None
        if k is not None:
            if k in keyed:
                return None
            keyed[k] = v
        out_names.append(n)
        out_values.append(v)
    return out_names, out_values


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


# Whether the methods found at import are torch's own (none patched before this import)
_TORCH_SAVE_IS_TORCHS = all(
    getattr(f, "__module__", "") == "torch.nn.modules.module" for f in _TORCH_SAVE
)
_MODULE_REP = (_TORCH_MODULE,) * len(_SAVE_METHODS)


def torch_saves_modules() -> bool:
    """Whether ``nn.Module``'s own state-dict methods are torch's (not patched): the
    ones found at import, if those were torch's (one C-level pass at each capture)."""
    return _TORCH_SAVE_IS_TORCHS and tuple(map(getattr, _MODULE_REP, _SAVE_METHODS)) == _TORCH_SAVE


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


class ModuleEntry:
    """A module's node and tensors, and what they were made from."""

    def __init__(
        self,
        obj: Any,
        module: torch.nn.Module,
        node: Any,
        tensors: dict[str, torch.Tensor],
        classes: tuple[tuple[Any, ...], str],
        glob: Globals | None,
    ) -> None:
        self.obj, self.module, self.node, self.tensors = obj, module, node, tensors
        self.classes, self.glob = classes, glob
        self.mods = _submodules(module)
        self.own = [vars(m) for m in self.mods]  # a per-object override would land here
        attrs = list(map(_MODULE_ATTRS, self.own))
        self._attrs = list(chain.from_iterable(attrs))
        self.types = list(map(type, self.mods))
        self.dicts = [d for a in attrs for d in a[0:3]]
        self.lens = list(map(len, self.dicts))  # a key moved to the next dict keeps the keys
        self.keys = list(chain.from_iterable(self.dicts))
        self._values = list(chain.from_iterable(map(dict.values, self.dicts)))
        self.sets = [a[3] for a in attrs]
        self.set_copies = list(map(frozenset, self.sets))
        self.post_hooks = [a[4] for a in attrs]
        self.pre_hooks = [a[5] for a in attrs]
        # FSDP2's pre-hooks (`make` allows no other), run before each check
        self.pre_calls = [(m, h) for m, a in zip(self.mods, attrs) for h in a[5].values()]
        self._pre = [h for _, h in self.pre_calls]
        # (class, method name) for each class and state-dict method, and torch's methods
        kinds = list(dict.fromkeys(self.types))
        self.cls_rep = [c for c in kinds for _ in _SAVE_METHODS]
        self.names_rep = list(_SAVE_METHODS) * len(kinds)
        self.torch_rep = list(_TORCH_SAVE) * len(kinds)
        # every dict the whole check reads, and their tags as the walk left them
        # (the hooks' OrderedDicts: none after, FSDP2's run first, their order moot)
        self._tagged = [*self.own, *self.dicts, *self.post_hooks, *self.pre_hooks]
        in_place = _orders_in_place(chain(self.own, self.dicts))
        self._tags = None if in_place else dict_tags(self._tagged)

    @classmethod
    def make(
        cls,
        key: str,
        obj: Any,
        module: torch.nn.Module,
        node: Any,
        made: list[tuple[str, torch.Tensor]],
        classes: list[tuple[tuple[Any, ...], str]],
        glob: Globals | None,
    ) -> tuple[ModuleEntry | None, str]:
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
        if not (
            list(map(type, self.mods)) == self.types
            and self.sets == self.set_copies  # each set against its frozen copy, by content
            and list(map(getattr, self.cls_rep, self.names_rep)) == self.torch_rep
            and (self.glob is None or self.glob.valid())
        ):
            return False
        if self._tags is not None and dict_tags(self._tagged) == self._tags:
            return True  # none of the dicts changed: what follows holds as it did
        same = self._same_dicts()
        if same and self._tags is not None:
            self._tags = dict_tags(self._tagged)
        return same

    def _same_dicts(self) -> bool:
        """Whether the modules' dicts hold the objects this entry was made from."""
        return (
            _same_objects(chain.from_iterable(map(_MODULE_ATTRS, self.own)), self._attrs)
            and list(map(len, self.dicts)) == self.lens
            and list(chain.from_iterable(self.dicts)) == self.keys
            and _same_objects(chain.from_iterable(map(dict.values, self.dicts)), self._values)
            and not any(map(len, self.post_hooks))
            and _same_objects(chain.from_iterable(map(dict.values, self.pre_hooks)), self._pre)
            and not any(map(_overrides, self.own))
        )


def _fsdp_pre_hook(hook: Any) -> bool:
    """Whether ``hook`` is the state-dict pre-hook FSDP2's ``fully_shard`` registers (it
    makes sure the module holds its sharded parameters, and does nothing else)."""
    return getattr(hook, "__module__", "").startswith("torch.distributed.fsdp") and getattr(
        hook, "__qualname__", ""
    ).endswith("._register_state_dict_hooks.<locals>.to_sharded_hook")


def _overrides(attrs: dict[str, Any]) -> bool:
    return "state_dict" in attrs or "_save_to_state_dict" in attrs or "get_extra_state" in attrs


class ContainerEntry:
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
        self.glob: Globals | None = None  # of one process, plain tensors only
        self.dicts, self.lists = dicts, lists
        self.dict_lens = list(map(len, dicts))
        self.keys = list(chain.from_iterable(dicts))
        self._values = list(chain.from_iterable(map(dict.values, dicts)))
        self.list_lens = list(map(len, lists))
        self._items = list(chain.from_iterable(lists))

    @classmethod
    def make(
        cls, key: str, obj: Any, node: Any, made: list[tuple[str, torch.Tensor]]
    ) -> tuple[ContainerEntry | None, str]:
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
        firsts = _first_places(_base_names(key, paths), live)
        if firsts is None:
            return None, "two of its tensors view the same memory"
        names, live = firsts
        if [n for n, _ in made] != names:
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
            and _same_objects(chain.from_iterable(map(dict.values, self.dicts)), self._values)
            and list(map(len, self.lists)) == self.list_lens
            and _same_objects(chain.from_iterable(self.lists), self._items)
        )


_IMMUTABLE_TYPES = (int, float, bool, str, type(None))
_SCALARS = frozenset((int, float, bool, type(None)))  # exact types: their node is the value
_STR = frozenset((str,))


def _stable(v: Any) -> bool:
    """Whether ``v``'s node depends only on the object (an immutable value)."""
    tv = type(v)
    return tv in _IMMUTABLE_TYPES or (tv is tuple and all(type(x) in _IMMUTABLE_TYPES for x in v))


_OPTIMIZER_STATE_DICT = torch.optim.Optimizer.state_dict


def _item_json(item: list[Any]) -> str:
    """``[key, node]``'s JSON, as ``json.dumps`` writes it (a number's without it)."""
    value = scalar_json(item[1])
    if value is None:
        return json.dumps(item, separators=(",", ":"), allow_nan=False)
    return "[" + key_json(item[0]) + "," + value + "]"


_PARAMS = operator.itemgetter("params")


class OptimizerEntry:
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
        glob: Globals | None,
    ) -> None:
        st = sd["state"]
        self.obj, self.node, self.tensors, self.classes = obj, node, tensors, classes
        self.glob = glob
        self.cls = type(obj)
        self.keys = list(st)
        self._inner = list(st.values())
        self.inner_lens = list(map(len, self._inner))
        self.inner_keys = list(chain.from_iterable(self._inner))
        self._values = list(chain.from_iterable(map(dict.values, self._inner)))
        # what `direct` compares: the optimizer's state keys (its parameters) and groups
        self._params = list(obj.state)
        self._flat = list(chain.from_iterable(map(_PARAMS, obj.param_groups)))
        self.group_lens = list(map(len, map(_PARAMS, obj.param_groups)))
        self.indices = [g["params"] for g in sd["param_groups"]]
        self._group_items: list[_GroupItems | None] = []  # groups_node's, per group
        # what `direct` reads of the optimizer's state: its dict and the per-parameter ones
        self._tagged = [obj.state, *self._inner]
        self._taggable = not _orders_in_place(self._tagged)
        self._tags = None
        if self._taggable and self._same_state(obj.state):
            self._tags = dict_tags(self._tagged)
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
        glob: Globals | None,
    ) -> tuple[OptimizerEntry | None, str]:
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
            and _same_objects(st.values(), self._inner)
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
        groups = obj.param_groups
        if not (
            _same_objects(chain.from_iterable(map(_PARAMS, groups)), self._flat)
            and list(map(len, map(_PARAMS, groups))) == self.group_lens
            and (self.glob is None or self.glob.valid())
        ):
            return False
        st = obj.state
        if self._tags is not None and st is self._tagged[0]:
            if dict_tags(self._tagged) == self._tags:
                return True  # neither the state nor a parameter's dict changed
        same = self._same_state(st)
        if same and self._taggable and not _orders_in_place((st,)):
            self._tagged[0] = st
            self._tags = dict_tags(self._tagged)
        return same

    def _same_state(self, st: Any) -> bool:
        """Whether the optimizer's ``state`` holds the parameters, dicts and values this
        entry was made from."""
        return (
            _same_objects(st, self._params)
            and _same_objects(st.values(), self._inner)
            and self._same_inner()
        )

    def _same_inner(self) -> bool:
        return (
            list(map(len, self._inner)) == self.inner_lens
            and list(chain.from_iterable(self._inner)) == self.inner_keys
            and _same_objects(chain.from_iterable(map(dict.values, self._inner)), self._values)
        )

    def groups_node(self, obj: torch.optim.Optimizer, enc: Encoder, key: str) -> Any:
        """The node ``enc.value(self.pack_groups(obj), (key, "param_groups"), 4)``
        makes, built item by item, as a `KnownJSON` (its text built alongside). Of a
        group with the keys of the last call, an item whose value is the very object it
        was then (an unchanged hyperparameter, a tuple of them, the parameter indices)
        keeps its ``[name, node]`` list and text, found in one pass over the values; a
        changed one (a learning rate) and every tensor or container are walked and
        encoded."""
        path = (key, "param_groups")
        nodes: list[Any] = []
        texts: list[str | None] = []
        kept: list[_GroupItems | None] = []
        last_groups = self._group_items
        for i, (group, indices) in enumerate(zip(obj.param_groups, self.indices)):
            last = last_groups[i] if i < len(last_groups) else None
            if not _STR.issuperset(map(type, group)):  # keys the walk refuses: walk it
                packed = {k: v for k, v in group.items() if k != "params"}
                packed["params"] = indices
                nodes.append(enc.value(packed, (*path, i), 5))
                texts.append(None)
                kept.append(None)
                continue
            values = list(group.values())
            if last is None or last.indices is not indices or list(group) != last.keys:
                last = _GroupItems(list(group), indices)
            last.update(values, enc, (*path, i))
            nodes.append({"dict": list(last.items)})  # the last node keeps its own list
            texts.append(last.text())
            kept.append(last)
        self._group_items = kept
        if None in texts:
            return {"list": nodes}
        return KnownJSON({"list": nodes}, '{"list":[' + ",".join(texts) + "]}")  # type: ignore[arg-type]

    def pack_groups(self, obj: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """``obj.state_dict()["param_groups"]`` while `direct` holds: each group but its
        parameters, then their indices."""
        out = []
        for group, indices in zip(obj.param_groups, self.indices):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = indices
            out.append(packed)
        return out


class _GroupItems:
    """One parameter group's items as `OptimizerEntry.groups_node` packs them (its keys
    in order, "params" last as the indices), with the values they were made from."""

    def __init__(self, keys: list[str], indices: list[int]) -> None:
        self.keys, self.indices = keys, indices
        # where each packed item's value lies among the group's values; the last item,
        # "params", is the indices (-1: they are this object's, whatever the group holds)
        self.order = [j for j, k in enumerate(keys) if k != "params"] + [-1]
        self.names = [keys[j] for j in self.order[:-1]] + ["params"]
        self.values: list[Any] = []  # the group's values at the last update, in its order
        self.items: list[list[Any]] = []
        self.texts: list[str] = []
        self.kept: list[bool] = []  # per packed item: reusable while its value is the same

    def update(self, values: list[Any], enc: Encoder, path: tuple[Any, ...]) -> None:
        """Make the items for the group's ``values`` (its keys are this one's)."""
        if self.values:
            same = list(map(operator.is_, values, self.values))
            redo = [
                k for k, j in enumerate(self.order) if not (self.kept[k] and (j < 0 or same[j]))
            ]
        else:
            redo = list(range(len(self.order)))
            self.items = [[]] * len(self.order)
            self.texts = [""] * len(self.order)
            self.kept = [False] * len(self.order)
        for k in redo:
            name, j = self.names[k], self.order[k]
            v = self.indices if j < 0 else values[j]
            # a number, bool or None (a learning rate): its own node, its text made here
            number = scalar_json(v) if type(v) in _SCALARS else None
            if number is not None:
                self.items[k] = [name, v]
                self.texts[k] = "[" + key_json(name) + "," + number + "]"
                self.kept[k] = True
                continue
            item = [name, enc.value(v, (*path, name), 6)]
            self.items[k] = item
            self.texts[k] = _item_json(item)
            self.kept[k] = v is self.indices or _stable(v)
        self.values = values

    def text(self) -> str:
        return '{"dict":[' + ",".join(self.texts) + "]}"


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
