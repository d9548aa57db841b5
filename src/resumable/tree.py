"""The state tree's vocabulary, and the check that a tree from a checkpoint keeps to it.

A manifest holds one *state tree* per rank (``docs/format.md`` section 6): scalars and
tagged nodes that describe dicts, lists, tensors and the rest, written by
`resumable.capture` and decoded there. A tree from storage is untrusted, so before it
is decoded `check_tree` walks it once, iteratively (no recursion, whatever the depth),
in time linear in its size: after that, decoding and restoring recurse at most
`MAX_TREE_DEPTH` levels and touch each stored tensor at most once. The checks a value
needs to be built (base64, NumPy dtype strings, generator states) stay with the
decoder, which raises the same `CorruptCheckpointError`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from resumable.errors import CorruptCheckpointError

RNG_KEY = "__rng__"
MAX_TREE_DEPTH = 64  # tagged nodes from the root; real states use fewer than 12
_INT64_LIMIT = 2**63

# Node tags in the order a reader identifies a node by.
TREE_TAGS = (
    "tensor",
    "global",
    "dict",
    "list",
    "tuple",
    "stateful",
    "float",
    "ndarray",
    "npscalar",
    "dtype",
    "device",
    "bytes",
    "size",
    "torch_generator",
    "np_generator",
)
_NODE_KEYS = {  # tag: (keys a node must have, keys it may have); other tags: the tag alone
    "tensor": ({"tensor"}, {"tensor", "device"}),
    "global": ({"global"}, {"global", "device"}),
    "npscalar": ({"npscalar", "v"}, {"npscalar", "v"}),
}
_REFS = ("tensor", "ndarray", "torch_generator", "global")


def check_tree(
    tree: Any,
    tensors: Mapping[str, Mapping[str, Any]],
    fqns: Collection[str],
    where: str,
    *,
    repeats: bool = False,
) -> None:
    """Validate a state tree against its checkpoint's tensor index.

    The root is a ``dict`` node; every node is a JSON scalar or a tagged node with
    exactly the keys of its tag and a payload of the right type; tagged nodes nest at
    most `MAX_TREE_DEPTH` deep; ``tensor``, ``ndarray`` and ``torch_generator`` nodes
    name an entry of ``tensors``, ``global`` nodes one of ``fqns``, and no name is
    referenced twice (so a restore materialises each stored tensor at most once: a
    tensor referenced 10,000 times would otherwise be copied 10,000 times), except with
    ``repeats`` (format version 5: one tensor in several places, as a tied weight is; a
    decoder builds it once and hands out the same tensor at each place); generator
    states are 1-D ``U8`` tensors; the ``__rng__`` entry holds what `capture.rng_state`
    writes. Raises `CorruptCheckpointError` naming ``where``.
    """
    if not (isinstance(tree, dict) and set(tree) == {"dict"} and isinstance(tree["dict"], list)):
        raise CorruptCheckpointError(f"{where} is not a dict node of state entries")
    referenced: set[str] = set()
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if node is None or isinstance(node, (bool, int, float, str)):
            continue
        if not isinstance(node, dict):
            raise CorruptCheckpointError(f"{where}: malformed node {str(node)[:80]}")
        if depth > MAX_TREE_DEPTH:
            raise CorruptCheckpointError(
                f"{where} is nested more than {MAX_TREE_DEPTH} levels deep"
            )
        tag = next((t for t in TREE_TAGS if t in node), "")
        must, may = _NODE_KEYS.get(tag, ({tag}, {tag}))
        if not tag or not must <= set(node) <= may:
            raise CorruptCheckpointError(f"{where}: unknown or malformed node {str(node)[:80]}")
        x = node[tag]
        if tag in _REFS:
            _check_ref(tag, x, tensors, fqns, None if repeats else referenced, where)
            if not isinstance(node.get("device", ""), str):
                raise CorruptCheckpointError(f"{where}: malformed device in {str(node)[:80]}")
        elif tag == "dict":
            for pair in _payload(x, tag, where):
                if (
                    not isinstance(pair, list)
                    or len(pair) != 2
                    or isinstance(pair[0], bool)
                    or not isinstance(pair[0], (str, int))
                ):
                    raise CorruptCheckpointError(f"{where}: malformed dict entry {str(pair)[:80]}")
                stack.append((pair[1], depth + 1))
        elif tag in ("list", "tuple"):
            stack.extend((child, depth + 1) for child in _payload(x, tag, where))
        elif tag in ("stateful", "np_generator"):
            stack.append((x, depth + 1))
        elif tag == "npscalar":
            if not isinstance(x, str):
                raise CorruptCheckpointError(f"{where}: malformed NumPy scalar {str(node)[:80]}")
            stack.append((node["v"], depth + 1))
        elif tag == "float":
            if x not in ("nan", "inf", "-inf"):
                raise CorruptCheckpointError(f"{where}: malformed float node {str(node)[:80]}")
        elif tag == "size":
            if not all(_dimension(d) for d in _payload(x, tag, where)):
                raise CorruptCheckpointError(f"{where}: malformed torch.Size {str(node)[:80]}")
        elif not isinstance(x, str):  # dtype, device, bytes
            raise CorruptCheckpointError(f"{where}: malformed {tag} node {str(node)[:80]}")
    for key, node in tree["dict"]:
        if key == RNG_KEY:
            _check_rng_node(node, tensors, where)


def has_repeats(tree: Any) -> bool:
    """Whether a tree (as a writer made it) references one stored tensor from more than
    one place (a tied weight: format version 5), walked iteratively."""
    seen: set[tuple[str, str]] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is list:
            stack.extend(node)
        elif isinstance(node, dict):
            for tag in _REFS:
                name = node.get(tag)
                if type(name) is str:
                    ref = ("global" if tag == "global" else "tensor", name)
                    if ref in seen:
                        return True
                    seen.add(ref)
                    break
            else:
                stack.extend(node.values())
    return False


def _dimension(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _INT64_LIMIT


def _payload(x: Any, tag: str, where: str) -> list[Any]:
    if not isinstance(x, list):
        raise CorruptCheckpointError(f"{where}: the payload of a {tag} node is not a list")
    return x


def _check_ref(
    tag: str,
    name: Any,
    tensors: Mapping[str, Mapping[str, Any]],
    fqns: Collection[str],
    referenced: set[str] | None,
    where: str,
) -> None:
    if tag == "global":
        if not isinstance(name, str) or name not in fqns:
            raise CorruptCheckpointError(
                f"{where} references global tensor {str(name)[:100]!r}, which has no "
                "pieces in the tensor index"
            )
    elif not isinstance(name, str) or name not in tensors:
        raise CorruptCheckpointError(
            f"{where} references tensor {str(name)[:100]!r}, which is not in the tensor index"
        )
    if referenced is not None:
        if name in referenced:
            raise CorruptCheckpointError(
                f"{where} references tensor {name[:100]!r} more than once; a tree of "
                "format version 4 or below references each stored tensor at most once"
            )
        referenced.add(name)
    if tag == "torch_generator" and not _state_bytes(tensors[name]):
        raise CorruptCheckpointError(f"{where}: generator state {name[:100]!r} is not 1-D U8")


def _state_bytes(info: Mapping[str, Any]) -> bool:
    return info["dtype"] == "U8" and len(info["shape"]) == 1


def _check_rng_node(node: Any, tensors: Mapping[str, Mapping[str, Any]], where: str) -> None:
    """The ``__rng__`` entry: a dict node whose known keys hold the node types that
    `capture.rng_state` writes. Their values are tried on throwaway generators once
    decoded (`capture.check_rng_state`); unknown keys are decoded and ignored."""
    bad = f"{where}: malformed RNG entry ({RNG_KEY})"
    if not (isinstance(node, dict) and set(node) == {"dict"}):
        raise CorruptCheckpointError(f"{bad}: not a dict node")
    for key, value in node["dict"]:
        if key == "python":
            items = value.get("tuple") if isinstance(value, dict) and len(value) == 1 else None
            ok = (
                isinstance(items, list)
                and len(items) == 3
                and _dimension(items[0])
                and isinstance(items[1], dict)
                and set(items[1]) == {"tuple"}
                and all(_dimension(w) for w in items[1]["tuple"])
                and (items[2] is None or isinstance(items[2], float))
            )
        elif key == "numpy":
            ok = isinstance(value, dict) and set(value) == {"dict"}
        elif key == "torch_cpu":
            ok = _state_ref(value, tensors)
        elif key == "torch_cuda":
            ok = (
                isinstance(value, dict)
                and set(value) == {"list"}
                and all(_state_ref(v, tensors) for v in value["list"])
            )
        else:
            continue
        if not ok:
            raise CorruptCheckpointError(f"{bad}: {key!r} holds {str(value)[:80]}")


def _state_ref(node: Any, tensors: Mapping[str, Mapping[str, Any]]) -> bool:
    return (
        isinstance(node, dict)
        and isinstance(node.get("tensor"), str)
        and _state_bytes(tensors[node["tensor"]])
    )
