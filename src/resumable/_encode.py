"""Encode the user's training state as tensors plus a JSON tree (the walk of `capture`).

`Encoder` walks a state. Each tensor is collected under a name, and the tree refers to
it by that name. Every other value becomes a tagged node of a closed vocabulary
(``docs/format.md``). A value outside it is refused here, at save, with
`UnsupportedStateError` naming its path, so a reader never meets a node it cannot build.

The trade-off: `Encoder.tensor` runs once per tensor at every snapshot. Its common case
reads as few attributes as it can, at the cost of a longer function.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from resumable.errors import UnsupportedStateError
from resumable.pieces import Piece, dtensor_piece, is_dtensor, piece_name
from resumable.tree import MAX_TREE_DEPTH, RNG_KEY

CLASSES_KEY = "__classes__"
RESERVED_KEYS = (RNG_KEY, CLASSES_KEY)

JSONValue = Any
Tree = Any


class KnownJSON(dict):
    """A tree node whose JSON text is known already: ``json`` is exactly what
    ``json.dumps(node, separators=(",", ":"), allow_nan=False)`` gives. A capture plan
    hands such nodes out for the parts that change at every step (the random streams),
    so the memory tier does not encode them again. Anything else reads it as a dict."""

    __slots__ = ("json",)

    def __init__(self, node: dict[str, Any], text: str) -> None:
        super().__init__(node)
        self.json = text


def scalar_json(v: Any) -> str | None:
    """The JSON of an int, a finite float, a bool or None, exactly as ``json.dumps``
    writes it; None for anything else."""
    tv = type(v)
    if tv is int:
        return int.__repr__(v)
    if tv is float:
        return float.__repr__(v) if math.isfinite(v) else None
    if tv is bool:
        return "true" if v else "false"
    return "null" if v is None else None


@functools.lru_cache(maxsize=1024)
def key_json(key: str | int) -> str:
    """A key's JSON (the same few keys at every snapshot)."""
    return json.dumps(key)


def path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


_BASE_NAMES: dict[tuple[Any, ...], str] = {}  # memo: the same paths come at every snapshot


def _tensor_name(path: tuple[Any, ...], taken: Mapping[str, Any]) -> str:
    base = _BASE_NAMES.get(path)
    if base is None:
        if len(_BASE_NAMES) >= 1 << 16:
            _BASE_NAMES.clear()
        base = _BASE_NAMES[path] = "/".join(map(str, path)) or "tensor"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}#{n}"
    return name


class Encoder:
    """One capture's walk: the tree node of each value (`value`), with the tensors met
    on the way collected in ``tensors`` under their names, in order, and the classes of
    the stateful objects met in ``classes`` (`resumable._capture_plan` reuses the nodes
    and tensors of a walk while the state keeps its structure)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.rank = rank
        self.world_size = world_size
        self.pieces: dict[str, Piece] = {}
        self.replicated: set[str] = set()
        self.live: dict[str, torch.Tensor] = {}
        self.in_global = False  # encoding a top-level module or optimizer
        # Paths below a stateful object that it says every rank holds alike
        # (``resumable_replicated``): their tensors are global, as a module's are.
        self.global_paths: set[tuple[Any, ...]] = set()
        self.classes: list[tuple[tuple[Any, ...], str]] = []  # stateful objects met
        self.in_stateful = 0  # how many stateful objects' state dicts enclose the walk
        # Each tensor met so far, by its address: its kind of node, the tensor (kept
        # alive, so no other takes its address) and its node. A tensor met again (a tied
        # weight: the same `alias_key`) is stored once and referenced from each place
        # (format version 5). The whole key is made only where an address repeats.
        self._seen: dict[int, list[tuple[str, torch.Tensor, dict[str, Any]]]] = {}

    def _again(self, t: torch.Tensor, kind: str, ptr: int) -> dict[str, Any] | None:
        """The node (copied) of a tensor met before that is the same as ``t`` (at address
        ``ptr``; `alias_key`), or None."""
        hits = self._seen.get(ptr)
        if hits is None:
            return None
        key = alias_key(t, kind)
        if key is not None:
            for k, seen, node in hits:
                if k == kind and alias_key(seen, kind) == key:
                    return dict(node)
        return None

    def _global(self, t: torch.Tensor, path: tuple[Any, ...], alias: bool) -> dict[str, Any]:
        """A tensor of a module or optimizer, with several ranks or as a DTensor."""
        ptr = (t._local_tensor if is_dtensor(t) else t).data_ptr() if alias else 0  # type: ignore[attr-defined]
        node = self._again(t, "global", ptr) if alias else None
        if node is not None:
            return node
        fqn = _tensor_name(path, self.live)
        if is_dtensor(t):
            local, piece, whole = dtensor_piece(t, fqn)
            self._check(local, path)
            name = fqn if whole else piece_name(piece)
            if whole:
                self.replicated.add(name)
        else:
            self._check(t, path)
            local = t.detach()
            piece = Piece(fqn, tuple(int(x) for x in t.shape), (0,) * t.dim())
            name = fqn
            self.replicated.add(name)
        self.live[fqn] = t
        if local.numel():  # an empty shard (uneven sharding) holds no bytes
            self.tensors[name] = local
            self.pieces[name] = piece
        node = {"global": fqn, "device": str(local.device)}
        if alias:
            self._seen.setdefault(ptr, []).append(("global", t, node))
        return node

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...], alias: bool = True) -> dict[str, Any]:
        """The node of tensor ``t`` at ``path``, ``t`` collected (or a ``global`` node).
        A tensor viewing the same memory as one met before (``alias``: `alias_key`) is
        referenced under that one's name, not stored again."""
        # Runs once per tensor at every walk: the common case (a plain CPU or CUDA
        # tensor of one process) takes as few attribute reads as it can (docs/performance.md).
        if (self.in_global and self.world_size > 1) or (
            type(t) not in PLAIN_TENSORS and is_dtensor(t)
        ):
            return self._global(t, path, alias)
        if not (
            type(t) in PLAIN_TENSORS
            and t.layout is torch.strided
            and _plain_dtype(t.dtype)
            and not t.is_meta
            and not t.is_nested
        ):
            self._refuse(t, path)
        ptr = t.data_ptr() if alias else 0
        node = self._again(t, "tensor", ptr) if alias else None
        if node is None:
            name = _tensor_name(path, self.tensors)
            if self.world_size > 1:  # per-rank state: every rank saves its own
                name = _tensor_name((f"rank{self.rank}", *path), self.tensors)
            self.tensors[name] = t.detach() if t.requires_grad else t
            node = {"tensor": name, "device": "cpu" if t.is_cpu else str(t.device)}
            if alias:
                self._seen.setdefault(ptr, []).append(("tensor", t, node))
        if not (self.in_global or self.in_stateful) and (
            t.requires_grad or type(t) is not torch.Tensor
        ):
            self.classes.append((path, KIND_NAMES[type(t), t.requires_grad]))
        return node

    def _check(self, t: torch.Tensor, path: tuple[Any, ...]) -> None:
        if type(t) in PLAIN_TENSORS and t.layout is torch.strided and _plain_dtype(t.dtype):
            if not t.is_meta and not t.is_nested:
                return
        self._refuse(t, path)

    def _refuse(self, t: torch.Tensor, path: tuple[Any, ...]) -> None:
        """Raise for a tensor `_check` found unusual, if it cannot be checkpointed."""
        if t.is_nested:
            raise UnsupportedStateError(
                f"{path_str(path)}: cannot checkpoint a nested tensor (torch.nested, "
                f"{t.layout} layout); a checkpoint holds dense tensors. Store its "
                "components instead, in a list (list(t.unbind())) or padded "
                "(t.to_padded_tensor(0.0)) with their lengths, and rebuild it after restore()"
            )
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedStateError(
                f"{path_str(path)}: cannot checkpoint a {t.layout} tensor; "
                "convert it to a dense tensor in state_dict()"
            )
        if t.is_quantized or t.is_complex() or t.device.type == "meta":
            raise UnsupportedStateError(
                f"{path_str(path)}: cannot checkpoint a {t.dtype} tensor on {t.device}; "
                "store a real-valued dense copy instead"
            )
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{path_str(path)}: cannot checkpoint tensor subclass {type(t).__name__}; "
                "pass a plain tensor (DTensors are supported in modules and optimizers)"
            )

    def value(self, v: Any, path: tuple[Any, ...], depth: int) -> Any:
        """The tree node of ``v``, a node ``depth`` levels below the root (its entries are
        at depth 2). Readers refuse tagged nodes deeper than `MAX_TREE_DEPTH`, so such
        a state is refused here, at save."""
        if type(v) in PLAIN_TENSORS and depth <= MAX_TREE_DEPTH:  # the most common node
            return self.tensor(v, path)
        if depth > MAX_TREE_DEPTH and not _plain_scalar(v):
            raise UnsupportedStateError(
                f"{path_str(path)}: the state nests containers more than "
                f"{MAX_TREE_DEPTH} levels deep, more than a checkpoint holds; flatten it "
                "(e.g. store it as a JSON string)"
            )
        # Exact built-in types first (most of a tree), without the isinstance chain below.
        tp = type(v)
        if tp is str or tp is bool or tp is int or v is None:
            return v
        if tp is float and math.isfinite(v):
            return v
        if tp is dict:
            return self._mapping(v, path, depth)
        if tp is list:
            return {"list": self._sequence(v, path, depth + 1)}
        if tp is tuple:
            return {"tuple": self._sequence(v, path, depth + 1)}
        # np.generic first: np.float64 is a float subclass. bool before int: bool is an int.
        if isinstance(v, np.generic):
            return {"npscalar": v.dtype.str, "v": self.value(v.item(), path, depth + 1)}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return float(v)
            return {"float": repr(v)}
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise UnsupportedStateError(
                    f"{path_str(path)}: cannot checkpoint a NumPy array of Python objects"
                )
            try:  # not ascontiguousarray: it turns a 0-d array into shape (1,)
                as_tensor = torch.from_numpy(v if v.flags.c_contiguous else v.copy(order="C"))
            except (TypeError, ValueError) as exc:
                raise UnsupportedStateError(
                    f"{path_str(path)}: cannot checkpoint a NumPy array of dtype {v.dtype} "
                    f"({exc}); convert it to a native-endian numeric or bool array"
                ) from exc
            node = self.tensor(as_tensor, path, alias=False)
            return {"ndarray": node["tensor"]}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, torch.Generator):
            node = self.tensor(v.get_state(), path, alias=False)
            return {"torch_generator": node["tensor"]}
        if isinstance(v, np.random.Generator):
            return {"np_generator": self.value(v.bit_generator.state, path, depth + 1)}
        if isinstance(v, Mapping) and not is_stateful(v):
            return self._mapping(v, path, depth)
        if isinstance(v, torch.Size):
            return {"size": list(v)}
        if isinstance(v, list):
            return {"list": self._sequence(v, path, depth + 1)}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"tuple": self._sequence(v, path, depth + 1)}
        if is_stateful(v):
            self.in_stateful += 1
            try:
                sd = self.state_dict_of(v, path)
                if self.world_size > 1:
                    for sub in getattr(v, "resumable_replicated", None) or ():
                        self.global_paths.add((*path, *_key_path(sub, path)))
                return {"stateful": self.value(sd, path, depth + 1)}
            finally:
                self.in_stateful -= 1
        raise UnsupportedStateError(
            f"{path_str(path)}: cannot checkpoint {type(v)!r}; "
            "give it state_dict()/load_state_dict() or store plain tensors and JSON values"
        )

    def state_dict_of(self, v: Any, path: tuple[Any, ...]) -> Any:
        """``v.state_dict()`` of the stateful object ``v`` at ``path``, its class recorded."""
        v = unwrap(v)
        self.classes.append((path, class_name(v)))
        try:
            if _keeps_vars(v):  # its tensors detached here, once, not by state_dict()
                return v.state_dict(keep_vars=True)
            return v.state_dict()
        except Exception as exc:  # the user's object failed; say where
            raise UnsupportedStateError(
                f"{path_str(path)}: {type(v).__name__}.state_dict() raised {exc!r}"
            ) from exc

    def streams(self, streams: Mapping[str, Any]) -> Any:
        """The node of `rng_state`'s streams: what `value` makes of them, but Python's
        state (made by CPython's ``random.getstate``: 625 ints) is not checked element
        by element."""
        items = []
        for key, v in streams.items():
            path = (RNG_KEY, key)
            if key == "python" and type(v) is tuple and len(v) == 3 and type(v[1]) is tuple:
                node = {
                    "tuple": [
                        self.value(v[0], (*path, 0), 4),
                        {"tuple": list(v[1])},
                        self.value(v[2], (*path, 2), 4),
                    ]
                }
            else:
                node = self.value(v, path, 3)
            items.append([key, node])
        return {"dict": items}

    def _mapping(self, v: Mapping[Any, Any], path: tuple[Any, ...], depth: int) -> Any:
        items = []
        for k, item in v.items():
            tk = type(k)
            if (tk is not str and tk is not int) and (
                not isinstance(k, (str, int)) or isinstance(k, bool)
            ):
                raise UnsupportedStateError(
                    f"{path_str(path)}: cannot checkpoint a dict key of type "
                    f"{type(k).__name__} ({k!r}); use str or int keys"
                )
            if self.global_paths and (*path, k) in self.global_paths and not self.in_global:
                self.in_global = True
                try:
                    items.append([k, self.value(item, (*path, k), depth + 1)])
                finally:
                    self.in_global = False
                continue
            items.append([k, self.value(item, (*path, k), depth + 1)])
        return {"dict": items}

    def _sequence(
        self, v: list[Any] | tuple[Any, ...], path: tuple[Any, ...], depth: int
    ) -> list[Any]:
        # Fast path (same output): long runs of plain ints, such as Python's RNG state,
        # are their own encoding.
        if set(map(type, v)) <= _INT_OR_STR:
            return list(v)
        return [self.value(x, (*path, i), depth) for i, x in enumerate(v)]


def _key_path(sub: Any, path: tuple[Any, ...]) -> tuple[Any, ...]:
    """One entry of a stateful object's ``resumable_replicated``: a tuple of str or int
    keys into its ``state_dict()``."""
    if type(sub) is tuple and sub and all(type(k) in (str, int) for k in sub):
        return sub
    raise UnsupportedStateError(
        f"{path_str(path)}: resumable_replicated should hold tuples of str or int keys "
        f"into its state_dict(), found {sub!r}; e.g. (('model_states', 'module'),)"
    )


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def alias_key(t: torch.Tensor, kind: str) -> tuple[Any, ...] | None:
    """What two tensors viewing the same memory alike have in common (a tied weight
    under two names, or one tensor given twice): their kind of node, device, address,
    dtype, shape and strides (a DTensor's: its local tensor's, and its global shape and
    placements). None for a tensor of no bytes (those share address 0)."""
    if type(t) in PLAIN_TENSORS or not is_dtensor(t):
        if not t.numel():
            return None
        return (kind, t.device, t.data_ptr(), t.dtype, t.shape, t.stride())
    local = t._local_tensor  # type: ignore[attr-defined]
    if not local.numel():
        return None
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    where = (local.device, local.data_ptr(), local.dtype, local.shape, local.stride())
    return (kind, *where, t.shape, placements)


# What ``__classes__`` records of a tensor in a plain container that is not a plain tensor
# without gradient (by its type and requires_grad), so that a restore into an empty slot
# makes it again: a name no stateful object has, so older readers pass it by.
KIND_NAMES: dict[tuple[type, bool], str] = {
    (torch.nn.Parameter, True): "torch.nn.parameter:Parameter",
    (torch.nn.Parameter, False): "torch.nn.parameter:Parameter(requires_grad=False)",
    (torch.Tensor, True): "torch:Tensor(requires_grad=True)",
}
KINDS = {name: kind for kind, name in KIND_NAMES.items()}
_INT_OR_STR = frozenset((int, str))
_PLAIN_DTYPES: dict[torch.dtype, bool] = {}


def _plain_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are real-valued and not quantized (memoised)."""
    known = _PLAIN_DTYPES.get(dtype)
    if known is None:
        quantized = str(dtype).startswith("torch.q")  # qint8, quint8, qint32, quint4x2, ...
        known = _PLAIN_DTYPES[dtype] = not (dtype.is_complex or quantized)
    return known


def _plain_scalar(v: Any) -> bool:
    """Whether ``v`` is encoded as a bare JSON scalar (no tagged node, no nesting)."""
    if isinstance(v, np.generic):
        return False
    if isinstance(v, float):
        return math.isfinite(v)
    return v is None or isinstance(v, (bool, int, str))


_MODULE_STATE_DICT = torch.nn.Module.state_dict


def _keeps_vars(v: Any) -> bool:
    """Whether ``v`` is a module whose ``state_dict(keep_vars=True)`` holds what its
    ``state_dict()`` holds but for the ``detach()``: torch's ``state_dict``, and no
    state-dict post-hook anywhere in it (a hook sees the values). The walk detaches
    each tensor it keeps anyway, and a DTensor's ``detach()`` runs torch's dispatch in
    Python (about 15 us each, at every snapshot of an FSDP2 model)."""
    if not isinstance(v, torch.nn.Module) or type(v).state_dict is not _MODULE_STATE_DICT:
        return False
    return not any(m._state_dict_hooks for m in v.modules())


def unwrap(v: Any) -> Any:
    """The module inside a DistributedDataParallel wrapper: its state is the module's,
    so a DDP checkpoint loads into the bare module (and the reverse)."""
    cls = type(v)
    if cls.__name__ == "DistributedDataParallel" and cls.__module__.startswith("torch.nn"):
        return v.module
    return v


def class_name(obj: Any) -> str:
    """``"module:qualname"`` of ``obj``'s class as a checkpoint records it: wrappers that
    do not change the state (DDP, ``torch.compile``) are seen through, and the classes
    FSDP2's ``fully_shard`` makes (``FSDPNet`` from ``Net``) count as the class they wrap,
    so a state saved with FSDP restores without it and the other way round."""
    if type(obj).__name__ == "OptimizedModule":
        inner = getattr(obj, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            obj = inner
    mro = type(unwrap(obj)).__mro__
    cls = next(
        (c for c in mro[:-1] if not c.__module__.startswith("torch.distributed.fsdp")), mro[0]
    )
    return f"{cls.__module__}:{cls.__qualname__}"


def classes_node(classes: list[tuple[tuple[Any, ...], str]]) -> Any:
    """The ``"__classes__"`` node of the stateful objects a capture met (each one's path
    and class name)."""
    return {"list": [{"list": [{"list": list(p)}, name]} for p, name in classes]}


def is_global_object(v: Any) -> bool:
    """Top-level objects whose tensors are global: modules and optimizers."""
    return isinstance(v, (torch.nn.Module, torch.optim.Optimizer))


def is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(
        getattr(v, "load_state_dict", None)
    )
