"""The values side of a restore: decode a candidate, then apply it to the live state.

`RestoreValues` is the part of `Restorer` that makes values. It reads, verifies and
decodes a committed checkpoint or a shared-memory snapshot without touching a live
object, resharding model and optimizer state to another world size (`GlobalLoader`).
Only then `RestoreValues._apply` writes the values into the live state. Where a memory
snapshot is checked while it is copied (`Fused`), a failed check can come after live
tensors were written: the caller says whether it can handle that.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from resumable import capture as capture_mod
from resumable._dtypes import dtype_from_name
from resumable._shm import SlotContent
from resumable.errors import (
    CorruptCheckpointError,
    StateMismatchError,
)
from resumable.pieces import is_dtensor
from resumable.pipeline.memory import MemoryTier
from resumable.reader import CheckpointReader
from resumable.reshard import GlobalLoader, shaped_like
from resumable.snapshot import MemorySnapshot

log = logging.getLogger(__name__)


class RestoreValues:
    """Decodes and applies a restore candidate's values; `Restorer` inherits it.

    Called on the training thread, by the `Restorer` that owns the attributes below."""

    state: Mapping[str, Any]
    memory: MemoryTier | None
    rank: int
    world_size: int
    reset_per_rank: bool
    strict: bool
    partial: list[str]
    _held: capture_mod.Captured | None

    def _decode_memory(
        self, snap: MemorySnapshot, content: SlotContent | None, loc: Any, *, fuse: bool
    ) -> tuple[dict[str, Any], Fused | None]:
        """This rank's values from its shared-memory snapshot (same world size), and,
        where the snapshot is checked while it is copied, what does that (`Fused`: the
        restore's ``prepare``). Otherwise the snapshot is checked here, before any
        value is made. ``content``: the slot's, read just before. ``fuse``: whether
        the caller can handle a check failing once live tensors were written."""
        assert self.memory is not None
        if content is None or not self.memory.arena.still(snap.index, content.seq):
            raise CorruptCheckpointError("the snapshot is incomplete or was overwritten")
        if fuse and content.checksums is not None and not content.meta.pieces and loc is None:
            done = self._fused(snap, content)
            if done is not None:
                return done
        content, views = self.memory.verified(snap, content)
        live = self._live()
        by_fqn = {p.fqn: n for n, p in content.meta.pieces.items()}

        def resolve(fqn: str) -> torch.Tensor:
            target: Any = live.live.get(fqn)
            if fqn in by_fqn:
                local = views[by_fqn[fqn]]
            elif target is not None and is_dtensor(target):
                local = torch.empty_like(target.to_local())  # an empty shard
            else:
                raise CorruptCheckpointError(f"the snapshot has no tensor {fqn!r}")
            if target is not None and is_dtensor(target):
                return shaped_like(local.clone(), target)  # the slot is reused later
            return local

        return capture_mod.decode(content.meta.tree, views, loc, resolve=resolve), None

    def _fused(
        self, snap: MemorySnapshot, content: SlotContent
    ) -> tuple[dict[str, Any], Fused] | None:
        """Values whose tensors the restore's ``prepare`` fills while it checks the
        snapshot: the live tensor where the restore would copy into it anyway, else a
        new one (kept by the object: an optimizer's moments), each referred to once,
        outside the random streams (checked before ``prepare``). None where a value
        would not be the tensor given (moved to another device): checked first."""
        assert self.memory is not None
        tree = content.meta.tree
        if not on_cpu(tree):
            return None  # tensors restored to a GPU are checked first, then moved there
        slots = {sl.name: sl for sl in content.slots}
        refs = list(capture_mod.iter_refs(tree))
        uses = Counter(name for _, _, name in refs)
        live = destinations(self.state, self._live(), tree, containers=True, refs=refs)
        dests: dict[str, torch.Tensor] = {}
        for path, tag, name in refs:
            sl = slots.get(name)
            if (
                tag != "tensor"
                or uses[name] != 1
                or not path
                or path[0] in capture_mod.RESERVED_KEYS
                or sl is None
            ):
                continue
            dtype, shape = dtype_from_name(sl.dtype), tuple(sl.shape)
            dest = live.get(name)
            dests[name] = (
                dest
                if dest is not None and _fits(dest, dtype, shape)
                else torch.empty(shape, dtype=dtype)
            )
        # views only of what is decoded from the slot itself (the random streams, a
        # tensor named twice): the others are filled by ``prepare``
        views = self.memory.arena.tensors(snap.index, content, skip=dests)
        values = capture_mod.decode(tree, {**views, **dests}, None)
        for path, _, name in refs:
            if name in dests and _at(values, path) is not dests[name]:
                return None  # a value moved off the CPU: the snapshot is checked first
        return values, Fused(self.memory, snap, content, dests, frozenset(map(id, dests.values())))

    # ------------------------------------------------------------ storage

    def _live(self) -> capture_mod.Captured:
        """The live state's tensors; a fresh optimizer of DTensors gets its state first,
        so that a restore has targets to shard into. The capture `Restorer.hold_live`
        made for this restore is taken instead, once."""
        held, self._held = self._held, None
        if held is not None:
            return held
        live = capture_mod.capture(
            self.state, include_rng=False, rank=self.rank, world_size=self.world_size
        )
        if any(is_dtensor(t) for t in live.live.values()):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            for obj in self.state.values():
                if isinstance(obj, torch.optim.Optimizer):
                    _init_optim_state(obj)
            live = capture_mod.capture(
                self.state, include_rng=False, rank=self.rank, world_size=self.world_size
            )
        return live

    def _decode(
        self, reader: CheckpointReader, loc: Any, *, fuse: bool = False
    ) -> tuple[dict[str, Any], set[str]]:
        """Read, verify and decode this rank's values from ``reader`` without touching a
        live object; returns them and the state keys to leave as they are. Only the
        files it reads are checked (`CheckpointReader.tensors`), not every rank's.

        ``fuse``: the caller can handle a check failing once live tensors were written.
        Then a tensor the restore would copy into a live one of its dtype and shape (as
        the memory tier's `_fused` chooses them) is left to the reader's `fill` (the
        restore's ``prepare``), which copies it there and checks it in one pass."""
        if self.world_size > 1 and reader.top["world_size"] == self.world_size:
            reader.only_rank(self.rank)  # a split manifest: the parts this rank needs
        m = reader.manifest  # validated: one tree per rank of world_size
        saved_world = m["world_size"]
        trees = [r["tree"] for r in m["ranks"]]
        plain = saved_world == 1 and self.world_size == 1
        if plain and not any(True for _ in capture_mod.global_refs(trees[0])):
            live = capture_mod.capture(self.state, include_rng=False)
            if not live.pieces:
                fuse = fuse and loc is None and on_cpu(trees[0])
                into = destinations(self.state, live, trees[0], containers=fuse)
                if fuse:
                    refs = list(capture_mod.iter_refs(trees[0]))
                    uses = Counter(name for _, _, name in refs)
                    into = {
                        name: into[name]
                        for path, _, name in refs
                        if name in into
                        and uses[name] == 1
                        and path[0] not in capture_mod.RESERVED_KEYS
                    }
                tensors = reader.tensors(verify=True, into=into, fuse=fuse)
                return capture_mod.decode(trees[0], tensors, loc), set()
        global_keys = {k for k, v in self.state.items() if capture_mod.is_global_object(v)}
        skip: set[str] = set()
        if saved_world == self.world_size:
            tree = trees[self.rank]
        else:
            tree = trees[0]
            per_rank = self._per_rank_keys(reader, trees, global_keys)
            # An object whose per-rank state is all of it (a DeepSpeed engine's ZeRO
            # partitions) says why it cannot be reset: that would start it afresh.
            fixed = {
                k: hint
                for k in sorted(per_rank)
                if isinstance(
                    hint := getattr(self.state.get(k), "resumable_world_size_hint", None), str
                )
            }
            if fixed:
                raise StateMismatchError(
                    f"{reader.where} was saved by {saved_world} rank(s); this job has "
                    f"{self.world_size}. "
                    + "; ".join(f"{k!r}: {hint}" for k, hint in fixed.items())
                )
            if per_rank and not self.reset_per_rank:
                raise StateMismatchError(
                    f"{reader.where} was saved by {saved_world} rank(s); this job has "
                    f"{self.world_size}. Per-rank state {sorted(per_rank)} cannot be "
                    "resharded (each rank had its own). Model and optimizer state reshard; "
                    "pass restore(reset_per_rank_state=True) to keep this launch's fresh "
                    "values for the per-rank state"
                )
            skip = per_rank
            tree = {"dict": [p for p in tree["dict"] if p[0] not in skip]}
        tree = capture_mod.globalize(tree, global_keys)
        fqns = list(dict.fromkeys(capture_mod.global_refs(tree)))
        resolve = None
        if fqns:  # the live targets decide what each rank reads of a global tensor
            loader = GlobalLoader(reader, self._live().live)
            loader.prepare(fqns)
            resolve = loader.value
        names = list(dict.fromkeys(name for _, name in capture_mod.iter_tensor_refs(tree)))
        tensors = reader.tensors(names, verify=True) if names else {}
        return capture_mod.decode(tree, tensors, loc, resolve=resolve), skip

    def _per_rank_keys(
        self, reader: CheckpointReader, trees: list[Any], global_keys: set[str]
    ) -> set[str]:
        """Top-level keys that are each rank's own: the random streams, data loaders,
        and anything the saved ranks disagree on."""
        index = reader.manifest["tensors"]

        def by_content(node: Any) -> Any:  # tensor names replaced by their checksums
            if isinstance(node, dict):
                for tag in ("tensor", "ndarray", "torch_generator"):
                    if isinstance(node.get(tag), str):
                        return {**node, tag: index[node[tag]]["xxh3_64"]}
                return {k: by_content(v) for k, v in node.items()}
            if isinstance(node, list):
                return [by_content(v) for v in node]
            return node

        def norm(node: Any) -> str:
            return json.dumps(by_content(node), sort_keys=True)

        keys: set[str] = set()
        by_key = [dict((p[0], p[1]) for p in t.get("dict", [])) for t in trees]
        for key in by_key[0]:
            if key in global_keys:
                continue
            obj = self.state.get(key)
            if (
                key == capture_mod.RNG_KEY
                or getattr(obj, "resumable_per_rank", False)
                or len({norm(t.get(key)) for t in by_key}) > 1
            ):
                keys.add(key)
        return keys

    def _apply(
        self,
        values: dict[str, Any],
        skip: set[str],
        *,
        borrowed: bool,
        prepare: Callable[[], None] | None = None,
        owned: frozenset[int] = frozenset(),
    ) -> None:
        """Restore decoded ``values`` into the live state, leaving the ``skip`` keys.
        ``prepare``, ``owned``: see `capture.restore`."""
        if not skip:
            self.partial += capture_mod.restore(
                self.state,
                values,
                borrowed=borrowed,
                strict=self.strict,
                prepare=prepare,
                owned=owned,
            )
            return
        log.warning("restore leaves per-rank state %s as this launch made it", sorted(skip))
        part = {k: v for k, v in self.state.items() if k not in skip}
        values = {k: v for k, v in values.items() if k not in skip}
        self.partial += capture_mod.restore(
            part, values, borrowed=borrowed, strict=self.strict, prepare=prepare, owned=owned
        )
        if isinstance(self.state, dict):
            self.state.update(part)


def destinations(
    state: Mapping[str, Any],
    live: capture_mod.Captured,
    saved: Any,
    *,
    containers: bool = False,
    refs: list[tuple[tuple[Any, ...], str, str]] | None = None,
) -> dict[str, torch.Tensor]:
    """The live tensors a restore copies the checkpoint's tensors into, by the
    checkpoint's names: where the saved tree and the live one hold a tensor at the same
    path, under a module, an optimizer or a tensor at the top level (objects whose
    loading copies each value into the tensor it came from, or keeps a copy of it), and
    with ``containers``, under plain dicts and lists all the way down (restored in place,
    a tensor of the same shape and dtype copied into). `CheckpointReader.tensors`
    assembles a tensor stored in chunks straight into its destination instead of a
    buffer of its own. ``refs``: ``saved``'s references (`capture.iter_refs`), where the
    caller listed them already."""
    at = {path: name for path, tag, name in capture_mod.iter_refs(live.tree) if tag == "tensor"}
    out: dict[str, torch.Tensor] = {}
    for path, tag, name in capture_mod.iter_refs(saved) if refs is None else refs:
        mine = at.get(path)
        if tag != "tensor" or mine is None or not path:
            continue
        top = state.get(path[0])
        if isinstance(top, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)) or (
            containers and _plain_path(top, path[1:], live.tensors[mine])
        ):
            out[name] = live.tensors[mine]
    return out


def _plain_path(obj: Any, path: tuple[Any, ...], tensor: torch.Tensor) -> bool:
    """Whether ``path`` leads from ``obj`` to ``tensor`` through dicts and lists only."""
    for key in path:
        inside = (type(obj) is dict and key in obj) or (
            type(obj) is list and type(key) is int and 0 <= key < len(obj)
        )
        if not inside:
            return False
        obj = obj[key]
    return obj is tensor


def on_cpu(tree: Any) -> bool:
    """Whether every tensor of ``tree`` was recorded on the CPU (iterative)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if ("tensor" in node or "global" in node) and node.get("device", "cpu") != "cpu":
                return False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return True


def _at(values: Any, path: tuple[Any, ...]) -> Any:
    """The decoded value at ``path`` (None where there is none)."""
    for key in path:
        try:
            values = values[key]
        except (KeyError, IndexError, TypeError):
            return None
    return values


def _fits(dest: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether ``dest`` is a plain contiguous CPU tensor of ``dtype`` and ``shape`` whose
    memory holds its values as they are (no lazy conjugate or negation bit): its bytes
    can be written straight from a snapshot's."""
    return (
        type(dest) in (torch.Tensor, torch.nn.Parameter)
        and dest.is_cpu
        and dest.is_contiguous()
        and dest.dtype == dtype
        and dest.shape == shape
        and not dest.is_conj()
        and not dest.is_neg()
    )


class Fused:
    """A restore's ``prepare`` for a shared-memory snapshot: its tensors copied into the
    values' tensors (``dests``, contiguous CPU tensors by name) while all are checked against the
    checksums (`MemoryTier.copy_verified`). ``owned``: the ids of those tensors."""

    def __init__(
        self,
        memory: MemoryTier,
        snap: MemorySnapshot,
        content: SlotContent,
        dests: dict[str, torch.Tensor],
        owned: frozenset[int],
    ) -> None:
        self.memory, self.snap, self.content = memory, snap, content
        self.dests, self.owned = dests, owned
        self.started = False

    def __call__(self) -> None:
        self.started = True
        self.memory.copy_verified(self.snap, self.content, self.dests)
