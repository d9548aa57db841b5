"""Walk the user's training state into tensors plus a JSON tree, and back.

`capture` turns ``state={"model": model, "optim": optimizer, ...}`` into a flat,
ordered mapping of tensor names to tensors and a JSON-able *tree* that records the
structure and every non-tensor value, with tensors replaced by references to their
names. `restore` does the reverse into the *live* objects: ``load_state_dict`` for
stateful objects, in-place updates for plain containers and tensors, ``set_state`` for
random generators. Nothing below this module knows about models.

The tree is a closed vocabulary of tagged nodes (see ``docs/format.md``): decoding it
can build only dicts, lists, tuples, strings, numbers, booleans, ``None``, bytes,
dtypes, devices and tensors. Nothing in a checkpoint can name a class or a function, so
loading never executes code from it.

Random streams are captured without being asked: Python's `random`, NumPy's global
generator, torch's CPU generator and every initialised CUDA device's generator, under
the reserved key ``"__rng__"``.

The class of every stateful object is recorded too, under the reserved key
``"__classes__"`` (a list of ``[path, "module:qualname"]``): names only, never resolved
to code. `restore` compares them with the live objects before touching any, so an AdamW
checkpoint is refused by an SGD optimizer instead of crashing at its first step. It is
an ordinary tree entry, so format version 1 readers (and checkpoints without it: the
golden ones) keep working; only the qualified name is compared, not the module, so
``__main__.Net`` (a script) matches ``train.Net`` (imported by a launcher).
"""

from __future__ import annotations

import base64
import math
import random
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from resumable.errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError
from resumable.pieces import Piece, dtensor_piece, is_dtensor, piece_name
from resumable.tree import MAX_TREE_DEPTH, RNG_KEY

CLASSES_KEY = "__classes__"
RESERVED_KEYS = (RNG_KEY, CLASSES_KEY)

JSONValue = Any
Tree = Any


@runtime_checkable
class Stateful(Protocol):
    """Anything that can hand out its state and take it back.

    ``state_dict()`` returns plain containers of tensors and JSON values (and nested
    state dicts); ``load_state_dict(sd)`` receives an equal structure, with tensors on
    the CPU or on ``map_location``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


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


def _path_str(path: tuple[Any, ...]) -> str:
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
    the stateful objects met in ``classes`` (`resumable.capture_plan` reuses the nodes
    and tensors of a walk while the state keeps its structure)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.rank = rank
        self.world_size = world_size
        self.pieces: dict[str, Piece] = {}
        self.replicated: set[str] = set()
        self.live: dict[str, torch.Tensor] = {}
        self.in_global = False  # encoding a top-level module or optimizer
        self.classes: list[tuple[tuple[Any, ...], str]] = []  # stateful objects met
        self.in_stateful = 0  # how many stateful objects' state dicts enclose the walk

    def _global(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        """A tensor of a module or optimizer, with several ranks or as a DTensor."""
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
        return {"global": fqn, "device": str(local.device)}

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        # Runs once per tensor at every snapshot: the common case (a plain CPU or CUDA
        # tensor of one process) takes as few attribute reads as it can (docs/performance.md).
        if (self.in_global and self.world_size > 1) or (
            type(t) not in PLAIN_TENSORS and is_dtensor(t)
        ):
            return self._global(t, path)
        if not (
            type(t) in PLAIN_TENSORS
            and t.layout is torch.strided
            and _plain_dtype(t.dtype)
            and not t.is_meta
            and not t.is_nested
        ):
            self._refuse(t, path)
        name = _tensor_name(path, self.tensors)
        if self.world_size > 1:  # per-rank state: every rank saves its own
            name = _tensor_name((f"rank{self.rank}", *path), self.tensors)
        if t.requires_grad:
            self.tensors[name] = t.detach()
            if not (self.in_global or self.in_stateful):
                self.classes.append((path, _KIND_NAMES[type(t), True]))
        else:
            self.tensors[name] = t
            if type(t) is not torch.Tensor and not (self.in_global or self.in_stateful):
                self.classes.append((path, _KIND_NAMES[type(t), False]))
        return {"tensor": name, "device": "cpu" if t.is_cpu else str(t.device)}

    def _check(self, t: torch.Tensor, path: tuple[Any, ...]) -> None:
        if type(t) in PLAIN_TENSORS and t.layout is torch.strided and _plain_dtype(t.dtype):
            if not t.is_meta and not t.is_nested:
                return
        self._refuse(t, path)

    def _refuse(self, t: torch.Tensor, path: tuple[Any, ...]) -> None:
        """Raise for a tensor `_check` found unusual, if it cannot be checkpointed."""
        if t.is_nested:
            raise UnsupportedStateError(
                f"{_path_str(path)}: cannot checkpoint a nested tensor (torch.nested, "
                f"{t.layout} layout); a checkpoint holds dense tensors. Store its "
                "components instead, in a list (list(t.unbind())) or padded "
                "(t.to_padded_tensor(0.0)) with their lengths, and rebuild it after restore()"
            )
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedStateError(
                f"{_path_str(path)}: cannot checkpoint a {t.layout} tensor; "
                "convert it to a dense tensor in state_dict()"
            )
        if t.is_quantized or t.is_complex() or t.device.type == "meta":
            raise UnsupportedStateError(
                f"{_path_str(path)}: cannot checkpoint a {t.dtype} tensor on {t.device}; "
                "store a real-valued dense copy instead"
            )
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{_path_str(path)}: cannot checkpoint tensor subclass {type(t).__name__}; "
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
                f"{_path_str(path)}: the state nests containers more than "
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
                    f"{_path_str(path)}: cannot checkpoint a NumPy array of Python objects"
                )
            try:  # not ascontiguousarray: it turns a 0-d array into shape (1,)
                as_tensor = torch.from_numpy(v if v.flags.c_contiguous else v.copy(order="C"))
            except (TypeError, ValueError) as exc:
                raise UnsupportedStateError(
                    f"{_path_str(path)}: cannot checkpoint a NumPy array of dtype {v.dtype} "
                    f"({exc}); convert it to a native-endian numeric or bool array"
                ) from exc
            node = self.tensor(as_tensor, path)
            return {"ndarray": node["tensor"]}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, torch.Generator):
            node = self.tensor(v.get_state(), path)
            return {"torch_generator": node["tensor"]}
        if isinstance(v, np.random.Generator):
            return {"np_generator": self.value(v.bit_generator.state, path, depth + 1)}
        if isinstance(v, Mapping) and not _is_stateful(v):
            return self._mapping(v, path, depth)
        if isinstance(v, torch.Size):
            return {"size": list(v)}
        if isinstance(v, list):
            return {"list": self._sequence(v, path, depth + 1)}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"tuple": self._sequence(v, path, depth + 1)}
        if _is_stateful(v):
            self.in_stateful += 1
            try:
                return {"stateful": self.value(self.state_dict_of(v, path), path, depth + 1)}
            finally:
                self.in_stateful -= 1
        raise UnsupportedStateError(
            f"{_path_str(path)}: cannot checkpoint {type(v)!r}; "
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
                f"{_path_str(path)}: {type(v).__name__}.state_dict() raised {exc!r}"
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
                    f"{_path_str(path)}: cannot checkpoint a dict key of type "
                    f"{type(k).__name__} ({k!r}); use str or int keys"
                )
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


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# What ``__classes__`` records of a tensor in a plain container that is not a plain tensor
# without gradient (by its type and requires_grad), so that a restore into an empty slot
# makes it again: a name no stateful object has, so older readers pass it by.
_KIND_NAMES: dict[tuple[type, bool], str] = {
    (torch.nn.Parameter, True): "torch.nn.parameter:Parameter",
    (torch.nn.Parameter, False): "torch.nn.parameter:Parameter(requires_grad=False)",
    (torch.Tensor, True): "torch:Tensor(requires_grad=True)",
}
_KINDS = {name: kind for kind, name in _KIND_NAMES.items()}
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


def _qualname(recorded: str) -> str:
    return recorded.rsplit(":", 1)[-1]


def is_global_object(v: Any) -> bool:
    """Top-level objects whose tensors are global: modules and optimizers."""
    return isinstance(v, (torch.nn.Module, torch.optim.Optimizer))


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


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(
        getattr(v, "load_state_dict", None)
    )


def rng_state(
    numpy_state: Callable[[], Any] | None = None, python_state: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """The process-wide random streams, as plain values and tensors; ``numpy_state`` and
    ``python_state`` stand in for ``np.random.get_state(legacy=False)`` and
    ``random.getstate()`` (`resumable.capture_plan`)."""
    out: dict[str, Any] = {
        "python": random.getstate() if python_state is None else python_state(),
        "numpy": np.random.get_state(legacy=False) if numpy_state is None else numpy_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state_all()
    return out


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

    With a ``plan`` (`resumable.capture_plan.CapturePlan`), top-level entries it knows
    are taken from it instead of walked (``reused`` says whether any was), and the
    tensors of those entries are not detached: they are for copying under
    ``torch.no_grad()``.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"state must be a dict of named objects, found {type(state).__name__}; "
            'pass state={"model": model, "optim": optimizer, ...}'
        )
    enc = Encoder(rank, world_size)
    top: list[list[Any]] = []
    for key, obj in state.items():
        _refuse_raw_megatron(key, obj)
        if not isinstance(key, str) or key in RESERVED_KEYS:
            raise UnsupportedStateError(
                f"state keys must be strings other than {RNG_KEY!r} and {CLASSES_KEY!r}, "
                f"found {key!r}"
            )
        _refuse_framework_engine(key, obj)
        enc.in_global = is_global_object(obj)
        node = plan.entry(key, obj, enc) if plan is not None else None
        top.append([key, enc.value(obj, (key,), 2) if node is None else node])
        enc.in_global = False
    if enc.classes:
        entries = [{"list": [{"list": list(p)}, name]} for p, name in enc.classes]
        top.append([CLASSES_KEY, {"list": entries}])
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
    """What `capture` asks of a plan (`resumable.capture_plan.CapturePlan`), in this
    order: `entry` for each top-level entry, `streams` for the random streams (if they
    are captured), then `reused`."""

    def entry(self, key: str, obj: Any, enc: Encoder) -> Any | None:
        """The node of ``obj`` (its tensors and classes added to ``enc``), or None."""

    def streams(self, enc: Encoder) -> Any:
        """The node of `rng_state`'s streams, as `Encoder.streams` makes it."""

    def reused(self) -> bool:
        """Whether any entry of this capture was reused; starts the next capture."""


# --------------------------------------------------------------------------- decoding


class _Decoder:
    """Builds plain values from a tree; every malformed node is a `CorruptCheckpointError`."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        map_location: Any,
        resolve: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        self.tensors = tensors
        self.map_location = map_location
        self.resolve = resolve

    def _get_tensor(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise CorruptCheckpointError(
                f"manifest tree references tensor {name!r}, which is not in the tensor index"
            )
        return self.tensors[name]

    def _device(self, recorded: Any) -> torch.device:
        if self.map_location is not None:
            if callable(self.map_location):
                return torch.device(self.map_location(recorded))
            return torch.device(self.map_location)
        try:
            dev = torch.device(recorded)
            if dev.type != "cpu":
                torch.empty(0, device=dev)  # usable in this process? (backend, ordinal)
        except Exception:  # e.g. saved on a GPU, restored on a CPU-only machine
            return torch.device("cpu")
        return torch.device("cpu") if dev.type == "meta" else dev

    def value(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict) or len(node) not in (1, 2, 3):
            raise CorruptCheckpointError(f"malformed tree node: {str(node)[:80]}")
        if "tensor" in node:
            t = self._get_tensor(node["tensor"])
            dev = self._device(node.get("device", "cpu"))
            return t if dev.type == "cpu" else t.to(dev)
        if "global" in node:
            if self.resolve is None or not isinstance(node["global"], str):
                raise CorruptCheckpointError(f"malformed global tensor node: {str(node)[:80]}")
            t = self.resolve(node["global"])
            dev = self._device(node.get("device", "cpu"))
            return t if dev.type == "cpu" else t.to(dev)
        if "dict" in node:
            out: dict[Any, Any] = {}
            for pair in _as_list(node["dict"]):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise CorruptCheckpointError("malformed dict entry in manifest tree")
                k, v = pair
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise CorruptCheckpointError(f"malformed dict key in tree: {k!r}")
                out[k] = self.value(v)
            return out
        if "list" in node:
            return [self.value(x) for x in _as_list(node["list"])]
        if "tuple" in node:
            return tuple(self.value(x) for x in _as_list(node["tuple"]))
        if "stateful" in node:
            return self.value(node["stateful"])
        if "float" in node:
            if node["float"] not in ("nan", "inf", "-inf"):
                raise CorruptCheckpointError(f"malformed float node: {node!r}")
            return float(node["float"])
        if "ndarray" in node:
            try:
                return self._get_tensor(node["ndarray"]).numpy()
            except (TypeError, ValueError) as exc:  # e.g. bfloat16: NumPy has no such dtype
                raise CorruptCheckpointError(f"malformed ndarray node {node!r}: {exc}") from None
        if "npscalar" in node:
            try:
                npdt, v = np.dtype(str(node["npscalar"])), self.value(node.get("v"))
                kind = npdt.kind
                if kind not in "biufSU" or (kind in "SU" and not isinstance(v, (str, bytes))):
                    raise TypeError(f"NumPy scalars of kind {kind!r} are not stored")
                return npdt.type(v)
            except (TypeError, ValueError, OverflowError) as exc:
                raise CorruptCheckpointError(f"malformed NumPy scalar node: {node!r}") from exc
        if "dtype" in node:
            dt = _TORCH_DTYPES.get(str(node["dtype"]))  # never getattr: torch imports lazily
            if not isinstance(dt, torch.dtype):
                raise CorruptCheckpointError(f"unknown dtype in tree: {node['dtype']!r}")
            return dt
        if "device" in node:
            try:
                return torch.device(str(node["device"]))
            except (RuntimeError, TypeError, ValueError) as exc:
                raise CorruptCheckpointError(f"malformed device node: {node!r}") from exc
        if "bytes" in node:
            try:
                return base64.b64decode(str(node["bytes"]), validate=True)
            except ValueError as exc:
                raise CorruptCheckpointError("malformed bytes node in tree") from exc
        if "size" in node:
            dims = _as_list(node["size"])
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in dims):
                raise CorruptCheckpointError(f"malformed torch.Size node: {str(node)[:80]}")
            try:
                return torch.Size(dims)
            except (TypeError, ValueError, OverflowError) as exc:
                raise CorruptCheckpointError(f"malformed torch.Size node: {exc}") from None
        if "torch_generator" in node:
            return {"__torch_generator_state__": self._get_tensor(node["torch_generator"])}
        if "np_generator" in node:
            return {"__np_generator_state__": self.value(node["np_generator"])}
        raise CorruptCheckpointError(f"unknown tree node {sorted(node)!r}")


_TORCH_DTYPES = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _as_list(x: Any) -> list[Any]:
    if not isinstance(x, list):
        raise CorruptCheckpointError(f"expected a list in the manifest tree, found {type(x)}")
    return x


def decode(
    tree: Tree,
    tensors: Mapping[str, torch.Tensor],
    map_location: Any = None,
    resolve: Callable[[str], torch.Tensor] | None = None,
) -> Any:
    """Turn a tree back into plain values; tensors go to their recorded device or
    ``map_location`` (never the RNG states: generators take CPU tensors). ``resolve``
    builds global tensors (several ranks) from their fqn. Raises
    `CorruptCheckpointError` for any malformed node.

    Recursive: trees from `capture`, and from manifests `resumable.format.decode_manifest`
    accepted, are at most `resumable.tree.MAX_TREE_DEPTH` deep; a deeper one given
    directly fails as corrupt too."""
    try:
        values = _Decoder(tensors, map_location, resolve).value(_without_rng(tree))
        rng = _rng_node(tree)
        if rng is not None and isinstance(values, dict):
            values[RNG_KEY] = _Decoder(tensors, None).value(rng)
        return values
    except RecursionError as exc:
        raise CorruptCheckpointError("manifest tree is nested too deeply") from exc


def _rng_node(tree: Tree) -> Any:
    if isinstance(tree, dict) and isinstance(tree.get("dict"), list):
        for pair in tree["dict"]:
            if isinstance(pair, list) and len(pair) == 2 and pair[0] == RNG_KEY:
                return pair[1]
    return None


def _without_rng(tree: Tree) -> Tree:
    if isinstance(tree, dict) and isinstance(tree.get("dict"), list) and len(tree) == 1:
        return {
            "dict": [p for p in tree["dict"] if not (isinstance(p, list) and p[:1] == [RNG_KEY])]
        }
    return tree


def iter_tensor_refs(
    tree: Tree, path: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Yield ``(path, tensor_name)`` for every tensor reference in a tree, in order
    (global tensors excluded: they have pieces, see `iter_refs`)."""
    for p, tag, name in iter_refs(tree, path):
        if tag != "global":
            yield p, name


def iter_refs(tree: Tree, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str, str]]:
    """Yield ``(path, tag, name)`` for every tensor reference in a tree, in order; the
    name of a ``global`` reference is its fqn."""
    if isinstance(tree, dict):
        for tag in ("tensor", "ndarray", "torch_generator", "global"):
            if tag in tree and isinstance(tree[tag], str):
                yield path, tag, tree[tag]
                return
        if "dict" in tree and isinstance(tree["dict"], list):
            for pair in tree["dict"]:
                if isinstance(pair, list) and len(pair) == 2:
                    yield from iter_refs(pair[1], (*path, pair[0]))
        for tag in ("list", "tuple"):
            if tag in tree and isinstance(tree[tag], list):
                for i, x in enumerate(tree[tag]):
                    yield from iter_refs(x, (*path, i))
        for tag in ("stateful", "np_generator"):
            if tag in tree:
                yield from iter_refs(tree[tag], path)


def subtree(tree: Tree, key: str) -> Tree:
    """The node stored under top-level ``key``; `KeyError` if absent."""
    for k, node in tree.get("dict", []):
        if k == key:
            return node
    raise KeyError(key)


# --------------------------------------------------------------------------- restoring


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
    (``nn.Module.load_state_dict``, in-place tensor copies): one copy either way.

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
        set_rng_state(values[RNG_KEY])
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
    requiring gradients (`_KIND_NAMES`), made so again (sharing its memory), so that one
    restored into an empty slot (None, a missing key) is what was saved."""
    marked = [
        (path, _KINDS[name])
        for path, name in recorded_classes(values.get(CLASSES_KEY))
        if name in _KINDS and path and path[0] in state and path[0] in values
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
        in_dict = isinstance(obj, Mapping) and not _is_stateful(obj) and k in obj
        in_list = isinstance(obj, (list, tuple)) and isinstance(k, int) and 0 <= k < len(obj)
        if not (in_dict or in_list):
            return None
        obj = obj[k]
    return obj


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
        if obj is None or not _is_stateful(obj):
            continue
        live = class_name(obj)
        if _qualname(live) != _qualname(saved):
            wrong.append(
                f"{_path_str(path)} was saved from a {saved.replace(':', '.')} and would be "
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

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in self.owned:
                return value
            if type(value) is torch.Tensor and not value.requires_grad:
                return value.clone()
            return _of_kind(value.detach().clone(), type(value), value.requires_grad)
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
                raise StateMismatchError(f"{_path_str(path)}: expected a tensor in the checkpoint")
            if obj.shape == value.shape and obj.dtype == value.dtype:
                with torch.no_grad():
                    obj.copy_(value)
                return obj
            moved = value.to(obj.device)
            if moved is not value and (value.requires_grad or type(value) is not torch.Tensor):
                moved = _of_kind(moved, type(value), value.requires_grad)  # a leaf again
            return own.tensor(value, moved) if own is not None else moved
        if isinstance(obj, Mapping) and not _is_stateful(obj):
            if not isinstance(value, dict):
                raise StateMismatchError(
                    f"{_path_str(path)}: expected a dict, checkpoint has {type(value).__name__}"
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
                    f"{_path_str(path)}: expected a list, checkpoint has {type(value).__name__}"
                )
            if len(obj) == len(value):
                obj[:] = [
                    _restore_into(o, v, (*path, i), own, partial)
                    for i, (o, v) in enumerate(zip(obj, value))
                ]
            else:
                obj[:] = own(value) if own is not None else value
            return obj
        if _is_stateful(obj):
            obj = unwrap(obj)
            if not isinstance(value, dict):
                raise StateMismatchError(
                    f"{_path_str(path)}: expected a state dict, checkpoint has "
                    f"{type(value).__name__}"
                )
            copies = isinstance(obj, torch.nn.Module)  # it copies into its parameters
            if copies and partial is not None:
                result = obj.load_state_dict(value, strict=False)
                where = _path_str(path)
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
            f"{_path_str(path)}: the checkpoint does not fit this object ({exc}). "
            "Restore into the same kind of model/optimizer it was saved from"
        ) from exc
    return own(value) if own is not None else value


def _generator_payload(value: Any, tag: str, path: tuple[Any, ...]) -> Any:
    if not isinstance(value, dict) or tag not in value:
        raise StateMismatchError(f"{_path_str(path)}: expected a generator state in the checkpoint")
    return value[tag]


# What a malformed state makes the generators' own setters raise.
_SETTER_ERRORS = (TypeError, ValueError, RuntimeError, KeyError, IndexError, OverflowError)


def check_rng_state(rng: Any) -> None:
    """Raise `CorruptCheckpointError` unless `set_rng_state` can put back ``rng``.

    Each stream is tried on a throwaway generator (``random.Random``, NumPy's
    ``RandomState``, ``torch.Generator``), so no process-wide stream is touched: restore
    calls this before loading any live object, and verify calls it too, so both judge
    a checkpoint alike. CUDA states are checked for type only (trying one would need a
    CUDA context).
    """
    if not isinstance(rng, dict):
        raise CorruptCheckpointError(
            f"malformed RNG entry in checkpoint: a {type(rng).__name__}, not a dict"
        )
    try:
        if "python" in rng:
            random.Random().setstate(_python_state(rng["python"]))
        if "numpy" in rng:
            np.random.RandomState().set_state(rng["numpy"])
        if "torch_cpu" in rng:
            torch.Generator().set_state(_state_bytes(rng["torch_cpu"]))
        _cuda_states(rng)
    except _SETTER_ERRORS as exc:
        raise CorruptCheckpointError(f"malformed RNG state in checkpoint: {exc}") from exc


def set_rng_state(rng: Any) -> None:
    """Put back the process-wide random streams recorded by `rng_state` (checked by
    `check_rng_state` first, as `restore` does)."""
    check_rng_state(rng)
    if "python" in rng:
        random.setstate(_python_state(rng["python"]))
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "torch_cpu" in rng:
        torch.set_rng_state(_state_bytes(rng["torch_cpu"]))
    states = _cuda_states(rng)
    if states and torch.cuda.is_available():
        if len(states) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint holds RNG states for {len(states)} CUDA devices, this process "
                f"sees {torch.cuda.device_count()}; restoring the first ones only",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            for i, s in enumerate(states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        except RuntimeError as exc:
            raise CorruptCheckpointError(f"malformed CUDA RNG state in checkpoint: {exc}") from exc


def _python_state(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"Python's random state is a 3-tuple, found {str(value)[:80]}")
    version, internal, gauss = value
    if not isinstance(internal, (tuple, list)):
        raise TypeError("Python's random state holds a tuple of integers")
    return (version, tuple(internal), gauss)


def _state_bytes(value: Any) -> torch.Tensor:
    """A generator state as the fresh uint8 CPU tensor ``set_state`` needs (it crashes
    on views with a storage offset)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError(f"a generator state is a 1-D uint8 tensor, found {str(value)[:80]}")
    return value.detach().to("cpu").clone()


def _cuda_states(rng: dict[str, Any]) -> list[torch.Tensor]:
    states = rng.get("torch_cuda", [])
    if not isinstance(states, list):
        raise TypeError(f"CUDA RNG states are a list, found {type(states).__name__}")
    return [_state_bytes(t) for t in states]


def global_refs(tree: Tree) -> Iterator[str]:
    """The fqn of every global tensor node in a tree."""
    for _, tag, name in iter_refs(tree):
        if tag == "global":
            yield name


def globalize(tree: Tree, keys: set[str]) -> Tree:
    """``tree`` with the tensor nodes under top-level ``keys`` turned into global nodes
    (a checkpoint of one process, loaded by several ranks or into DTensors: its tensor
    names are the fqns)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if isinstance(node.get("tensor"), str):
                return {"global": node["tensor"], "device": node.get("device", "cpu")}
            out = {}
            for tag, child in node.items():
                if tag == "dict" and isinstance(child, list):
                    out[tag] = [
                        [p[0], walk(p[1])] if isinstance(p, list) and len(p) == 2 else p
                        for p in child
                    ]
                elif tag in ("list", "tuple") and isinstance(child, list):
                    out[tag] = [walk(x) for x in child]
                elif tag == "stateful":
                    out[tag] = walk(child)
                else:
                    out[tag] = child
            return out
        return node

    if not (isinstance(tree, dict) and isinstance(tree.get("dict"), list)):
        return tree
    return {
        "dict": [
            [p[0], walk(p[1])] if isinstance(p, list) and len(p) == 2 and p[0] in keys else p
            for p in tree["dict"]
        ]
    }
