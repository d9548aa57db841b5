"""Capture the same state snapshot after snapshot, its structure planned once.

`resumable.capture.capture` walks the whole state at every call. For a small model that
walk costs more than copying its bytes. A `CapturePlan` keeps, per top-level entry, the
tree node and the live tensors of one walk. It reuses them while a cheap check says the
entry keeps its structure (the entries and their checks: ``_plan_entries``).

The check does not look at a tensor's dtype, shape or device. The caller compares those
(`resumable.snapshot.CopyPlan.matches`) and calls `forget` if any changed. The tensors
handed out are the live objects, for copying under ``torch.no_grad()``. An entry that
fails its check again and again is walked the ordinary way for `REST` captures. The
random streams are read anew only when they changed (`PythonState`, `NumpyState`).
Longer notes: ``docs/decisions.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
from collections.abc import Callable
from itertools import islice
from typing import Any

import numpy as np
import torch

from resumable._encode import Encoder, KnownJSON, classes_node, scalar_json, unwrap
from resumable._plan_entries import (
    ContainerEntry,
    Globals,
    ModuleEntry,
    OptimizerEntry,
    torch_saves_modules,
)
from resumable._rng import NumpyState, PythonState, rng_state
from resumable.tree import RNG_KEY

__all__ = ["REST", "CapturePlan", "NumpyState", "PythonState"]

log = logging.getLogger(__name__)

REST = 100  # captures an entry is walked the ordinary way after it could not be reused
_MISSES = 3  # consecutive re-plans of an entry before it rests

_MakeEntry = Callable[
    [Any, list[tuple[str, torch.Tensor]], list[Any], Globals | None], tuple[Any, str]
]
"""Plans an entry from a walk's node, tensors, classes and global tensors' notes: the
entry, or None and why it cannot be reused."""


class CapturePlan:
    """The reusable part of this rank's captures (see the module docstring); used by one
    thread, one capture at a time."""

    def __init__(self) -> None:
        self._entries: dict[str, ModuleEntry | OptimizerEntry | ContainerEntry] = {}
        self._rest: dict[str, int] = {}  # key -> captures left to walk it the usual way
        self._misses: dict[str, int] = {}
        self._reused = False
        self._numpy = NumpyState()
        self._pystate = PythonState()
        # Python's last state, its node and JSON; its words, as the node holds them
        self._python: tuple[Any, Any, str | None] | None = None
        self._words: list[int] | None = None
        self._words_text: str | None = None
        # NumPy's last state, its node, tensors and JSON
        self._numpy_node: tuple[Any, Any, dict[str, torch.Tensor], str | None] | None = None
        self._texts: dict[str, tuple[Any, str]] = {}  # a tensor stream's node and JSON
        # the classes of the last capture (the entries' own tuples) and their node
        self._classes: tuple[list[tuple[tuple[Any, ...], str]], Any] | None = None

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
        if isinstance(module, torch.nn.Module) and torch_saves_modules():
            return self._module(key, obj, module, enc)
        return None

    def classes(self, classes: list[tuple[tuple[Any, ...], str]]) -> Any:
        """The ``"__classes__"`` node (`resumable._encode.classes_node`): the last one
        while ``classes`` are the very tuples of the last capture (reused entries hand
        out their own), so the memory tier finds the node it encoded
        (`resumable.pipeline.memory.TreeJSON`) instead of comparing a new one's bytes."""
        last = self._classes
        if (
            last is not None
            and len(last[0]) == len(classes)
            and all(map(operator.is_, classes, last[0]))
        ):
            return last[1]
        node = classes_node(classes)
        self._classes = (list(classes), node)
        return node

    def streams(self, enc: Encoder) -> Any:
        """The node of the random streams, as ``enc.streams(rng_state())`` makes it;
        Python's and NumPy's nodes (and NumPy's tensor) are the last ones while their
        states are the same. Where each stream has its usual shape (CPython's Mersenne
        Twister, NumPy's MT19937, torch's CPU state), the node is a `KnownJSON`: its
        text made from the few numbers that change, not encoded again."""
        streams = rng_state(self._numpy.get, self._pystate.get)
        if enc.world_size == 1 and enc.rank != 0:
            return enc.streams(streams)
        items = []
        texts: list[str | None] = []
        for key, v in streams.items():
            if key == "python":
                node, text = self._python_node(enc, v)
            elif key == "numpy":
                node, text = self._numpy_stream(enc, v)
            else:
                node = enc.value(v, (RNG_KEY, key), 3)
                text = self._plain_text(key, node)
            items.append([key, node])
            texts.append(text)
        if None in texts:
            return {"dict": items}
        return KnownJSON({"dict": items}, '{"dict":[' + ",".join(texts) + "]}")  # type: ignore[arg-type]

    def _plain_text(self, key: str, node: Any) -> str | None:
        """``[key, node]``'s JSON for a stream of a tensor node (torch's CPU state: the
        same name at every step), or None (encoded by the caller's `TreeJSON`)."""
        if type(node) is not dict or list(node) != ["tensor", "device"]:
            return None
        got = self._texts.get(key)
        if got is None or got[0] != node:
            got = self._texts[key] = (node, _dumps([key, node]))
        return got[1]

    def _numpy_stream(self, enc: Encoder, v: Any) -> tuple[Any, str | None]:
        """NumPy's node (the last one while its state is the same object) and its
        ``["numpy", node]`` JSON, made from the position and Gaussian where the state
        is MT19937's usual dict; else walked (text None)."""
        name, head = _numpy_names(enc.rank if enc.world_size > 1 else None)
        kept = self._numpy_node
        if kept is not None and v is kept[0] and name in kept[2] and _free(enc, kept[2]):
            enc.tensors.update(kept[2])
            return kept[1], kept[3]
        usual = _numpy_usual(v)
        if usual is not None and name not in enc.tensors:
            key, pos, has_gauss, gauss = usual
            made = {name: torch.from_numpy(key)}
            enc.tensors.update(made)
            state = {"dict": [["key", {"ndarray": name}], ["pos", pos]]}
            node: Any = {
                "dict": [
                    ["bit_generator", "MT19937"],
                    ["state", state],
                    ["has_gauss", has_gauss],
                    ["gauss", gauss],
                ]
            }
            text: str | None = (
                head
                + int.__repr__(pos)
                + ']]}],["has_gauss",'
                + int.__repr__(has_gauss)
                + '],["gauss",'
                + float.__repr__(gauss)
                + "]]}]"
            )
        else:  # another generator, or names taken: walked, encoded by `TreeJSON`
            mark = len(enc.tensors)
            node = enc.value(v, (RNG_KEY, "numpy"), 3)
            made = dict(_added(enc, mark))
            text = None
        self._numpy_node = (v, node, made, text) if v is self._numpy.kept else None
        return node, text

    def _python_node(self, enc: Encoder, v: Any) -> tuple[Any, str | None]:
        """The node of Python's stream and its ``["python", node]`` JSON (None: not the
        usual shape): the last ones while the state is the last one; while only its
        position moved, the same int objects for its 624 words, whose text is kept."""
        last = self._python
        if last is not None and v is last[0]:
            return last[1], last[2]
        if last is not None and self._pystate.words_kept and self._words is not None:
            path = (RNG_KEY, "python")
            position = v[1][-1]
            node = {
                "tuple": [
                    enc.value(v[0], (*path, 0), 4),
                    {"tuple": [*self._words, position]},
                    enc.value(v[2], (*path, 2), 4),
                ]
            }
        else:
            node = enc.streams({"python": v})["dict"][0][1]
            words = list(v[1][:-1]) if type(v) is tuple and len(v) == 3 else None
            self._words = words
            ints = words is not None and all(type(w) is int for w in words)
            self._words_text = ",".join(map(str, words)) if words is not None and ints else None
        text = _python_text(node, self._words_text)
        self._python = (v, node, text)
        return node, text

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
        return self._reuse_or_walk(
            key,
            obj,
            enc,
            ContainerEntry,
            lambda hit: hit.valid(obj),
            lambda node, made, classes, glob: (
                ContainerEntry.make(key, obj, node, made)
                if glob is None and not classes
                else (None, "it holds global tensors or parameters")
            ),
        )

    def _module(self, key: str, obj: Any, module: torch.nn.Module, enc: Encoder) -> Any | None:
        return self._reuse_or_walk(
            key,
            obj,
            enc,
            ModuleEntry,
            lambda hit: hit.valid(obj, module),
            lambda node, made, classes, glob: ModuleEntry.make(
                key, obj, module, node, made, classes, glob
            ),
        )

    def _reuse_or_walk(
        self,
        key: str,
        obj: Any,
        enc: Encoder,
        kind: type[ModuleEntry] | type[ContainerEntry],
        valid: Callable[[Any], bool],
        make: _MakeEntry,
    ) -> Any | None:
        """The node of ``key``'s entry, reused when it is a ``kind`` that is still ``valid``
        and free; else a miss (for a stale entry of that kind) and a fresh `_walk`."""
        hit = self._entries.get(key)
        if isinstance(hit, kind):
            if valid(hit) and _free_entry(enc, hit):
                return self._reuse(key, hit, enc)
            self._missed(key, "")
        return self._walk(key, obj, enc, make)

    def _reuse(
        self, key: str, hit: ModuleEntry | ContainerEntry | OptimizerEntry, enc: Encoder
    ) -> Any:
        """``hit``'s node, its classes and live tensors added to ``enc``."""
        if hit.classes is not None:
            enc.classes.append(hit.classes)
        return self._take(key, hit, enc)

    def _take(
        self, key: str, hit: ModuleEntry | ContainerEntry | OptimizerEntry, enc: Encoder
    ) -> Any:
        """``hit``'s node, its live tensors (and global tensors' notes) added to ``enc``;
        the entry counts as reused."""
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
        make: _MakeEntry,
    ) -> Any | None:
        """Walk ``obj`` as `Encoder.value` does, and plan its entry (``make``: from its
        node, the tensors, the classes and the global tensors' notes the walk made) for
        the next capture; None while the entry rests."""
        if self._resting(key):
            return None
        mark, classes, marks = len(enc.tensors), len(enc.classes), Globals.marks(enc)
        node = enc.value(obj, (key,), 2)
        entry, why = make(node, _added(enc, mark), enc.classes[classes:], Globals.made(enc, marks))
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
        if isinstance(hit, OptimizerEntry) and hit.direct(obj) and _free_entry(enc, hit):
            # torch's state_dict(), no hooks: its "state" as before, without calling it
            node = self._reuse(key, hit, enc)
            groups = hit.groups_node(obj, enc, key)
            return {"stateful": {"dict": [["state", node], ["param_groups", groups]]}}
        classes = len(enc.classes)
        sd = enc.state_dict_of(obj, path)
        if type(sd) is not dict or list(sd) != ["state", "param_groups"]:
            self._missed(key, f"its state_dict() has keys {list(sd)[:4]}")
            return {"stateful": enc.value(sd, path, 3)}
        st = sd["state"]
        if isinstance(hit, OptimizerEntry) and hit.valid(obj, st) and _free_entry(enc, hit):
            state_node = self._take(key, hit, enc)  # its classes came with state_dict_of
        else:
            if hit is not None:
                self._missed(key, "")
            mark, marks = len(enc.tensors), Globals.marks(enc)
            state_node = enc.value(st, (key, "state"), 4)
            made, glob = _added(enc, mark), Globals.made(enc, marks)
            entry, why = OptimizerEntry.make(
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


def _free_entry(enc: Encoder, entry: ModuleEntry | OptimizerEntry | ContainerEntry) -> bool:
    """Whether none of ``entry``'s names (its tensors' and global tensors') is taken yet."""
    if not _free(enc, entry.tensors):
        return False
    glob = entry.glob
    return glob is None or not enc.live or enc.live.keys().isdisjoint(glob.live)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _python_text(node: Any, words_text: str | None) -> str | None:
    """``["python", node]``'s JSON for ``{"tuple": [version, {"tuple": [words...,
    position]}, gauss]}`` whose words' text is ``words_text``; None for another shape."""
    if words_text is None:
        return None
    t = node["tuple"] if type(node) is dict and list(node) == ["tuple"] else None
    if type(t) is not list or len(t) != 3 or type(t[1]) is not dict:
        return None
    key = t[1].get("tuple")
    if type(key) is not list or not key or type(key[-1]) is not int:
        return None
    version, position, gauss = scalar_json(t[0]), int.__repr__(key[-1]), scalar_json(t[2])
    if version is None or gauss is None:
        return None
    sep = "," if words_text else ""
    return (
        '["python",{"tuple":['
        + version
        + ',{"tuple":['
        + words_text
        + sep
        + position
        + "]},"
        + gauss
        + "]}]"
    )


_NUMPY_KEY = f"{RNG_KEY}/numpy/state/key"  # the name a walk gives NumPy's words


@functools.lru_cache(maxsize=8)
def _numpy_names(rank: int | None) -> tuple[str, str]:
    """The name a walk gives NumPy's words (at several ranks, under this ``rank``'s
    prefix, as every per-rank tensor: `Encoder.tensor`) and the start of the stream's
    JSON up to its position."""
    name = _NUMPY_KEY if rank is None else f"rank{rank}/{_NUMPY_KEY}"
    head = (
        '["numpy",{"dict":[["bit_generator","MT19937"],["state",{"dict":[["key",'
        + _dumps({"ndarray": name})
        + '],["pos",'
    )
    return name, head


def _numpy_usual(v: Any) -> tuple[np.ndarray, int, int, float] | None:
    """The words, position, has_gauss and Gaussian of NumPy's usual state (MT19937's
    dict, as ``get_state(legacy=False)`` makes it: a C-ordered uint32 key, plain ints
    and a finite float), whose node `CapturePlan` makes without a walk; else None."""
    if type(v) is not dict or list(v) != ["bit_generator", "state", "has_gauss", "gauss"]:
        return None
    inner, has_gauss, gauss = v["state"], v["has_gauss"], v["gauss"]
    if v["bit_generator"] != "MT19937" or type(inner) is not dict:
        return None
    if list(inner) != ["key", "pos"] or type(inner["pos"]) is not int:
        return None
    key = inner["key"]
    if type(key) is not np.ndarray or key.dtype != np.uint32 or not key.flags.c_contiguous:
        return None
    if type(has_gauss) is not int or type(gauss) is not float or not math.isfinite(gauss):
        return None
    return key, inner["pos"], has_gauss, gauss
