"""Decode a state tree back into plain values, and find the tensors it references.

A tree comes from storage, so it is untrusted. Decoding builds only dicts, lists,
tuples, strings, numbers, booleans, ``None``, bytes, dtypes, devices and tensors.
Nothing in a tree can name a class or a function, so loading never executes code from
it. Every malformed node raises `CorruptCheckpointError`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from resumable._encode import Tree
from resumable.errors import CorruptCheckpointError
from resumable.tree import RNG_KEY

_CPU = torch.device("cpu")


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
        # Each stored tensor built (resolved, moved) once, however many places name it
        # (format version 5: a tied weight); the same tensor at each place, as saved.
        self._built: dict[tuple[str, Any, torch.device], torch.Tensor] = {}

    def _once(
        self, tag: str, name: Any, dev: torch.device, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        key = (tag, name, dev)
        t = self._built.get(key)
        if t is None:
            t = self._built[key] = build()
        return t

    def _get_tensor(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise CorruptCheckpointError(
                f"manifest tree references tensor {name!r}, which is not in the tensor index"
            )
        return self.tensors[name]

    def _device(self, recorded: Any) -> torch.device:
        if recorded == "cpu" and self.map_location is None:
            return _CPU  # the common case, once per tensor
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
            return (
                t
                if dev.type == "cpu"
                else self._once("tensor", node["tensor"], dev, lambda: t.to(dev))
            )
        if "global" in node:
            fqn = node["global"]
            if self.resolve is None or not isinstance(fqn, str):
                raise CorruptCheckpointError(f"malformed global tensor node: {str(node)[:80]}")
            resolve = self.resolve
            t = self._once("global", fqn, torch.device("cpu"), lambda: resolve(fqn))
            dev = self._device(node.get("device", "cpu"))
            return t if dev.type == "cpu" else self._once("global", fqn, dev, lambda: t.to(dev))
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
    name of a ``global`` reference is its fqn. Iterative (a walk at every restore: nested
    generators cost a frame per level for every reference)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(tree, path)]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        for tag in _REF_TAGS:
            name = node.get(tag)
            if isinstance(name, str):
                yield at, tag, name
                break
        else:
            children: list[tuple[Any, tuple[Any, ...]]] = []
            pairs = node.get("dict")
            if isinstance(pairs, list):
                for pair in pairs:
                    if isinstance(pair, list) and len(pair) == 2:
                        children.append((pair[1], (*at, pair[0])))
            for tag in ("list", "tuple"):
                items = node.get(tag)
                if isinstance(items, list):
                    children.extend((x, (*at, i)) for i, x in enumerate(items))
            for tag in ("stateful", "np_generator"):
                if tag in node:
                    children.append((node[tag], at))
            stack.extend(reversed(children))


_REF_TAGS = ("tensor", "ndarray", "torch_generator", "global")


def subtree(tree: Tree, key: str) -> Tree:
    """The node stored under top-level ``key``; `KeyError` if absent."""
    for k, node in tree.get("dict", []):
        if k == key:
            return node
    raise KeyError(key)


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
