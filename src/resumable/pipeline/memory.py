"""The memory tier: snapshots of the state in this user's shared memory.

A snapshot captures the state (`resumable.capture`) and copies its tensors into one of
this rank's shared-memory slots (`resumable.snapshot.ShmArena`: two alternating, a third
while a persist holds one, so the two newest complete snapshots survive a kill during a
copy); the copy is the only part of a
checkpoint that blocks training. With ``overlap``, the tensors only ``optimizer.step()``
changes (parameters and optimizer state) are copied in the background during the next
forward/backward, and an optimizer step pre-hook waits for that copy first.

A snapshot outlives the process: the next launch *adopts* the slots of a dead one and
restores from them (`resumable.pipeline.restorer`), checking them complete and, where
the persist worker recorded them, against their checksums: before the copy into the
live state (`verified`), or during it where a failed check has something to fall back
to (`copy_verified`).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import marshal
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from resumable import capture as capture_mod
from resumable._capture_plan import CapturePlan
from resumable._encode import KnownJSON
from resumable._shm import (
    RawJSON,
    SlotContent,
    SlotMeta,
    remove_dead_segments,
    run_key_for,
    shm_free_bytes,
)
from resumable.audit import AuditLog
from resumable.errors import CorruptCheckpointError, StorageError
from resumable.format import json_metrics
from resumable.options import OVERLAP_MIN_BYTES, Overlap
from resumable.pieces import is_dtensor, owned_tensors
from resumable.replicas.peers import Replication
from resumable.runid import snapshot_belongs
from resumable.snapshot import CopyPlan, MemorySnapshot, ShmArena, Snapshot
from resumable.storage import Storage

log = logging.getLogger(__name__)

OTHERS_LAST_SHARE = 64
"""The replicated tensors another rank writes are laid out last while they hold at most
1/64 of a snapshot's bytes (`MemoryTier._others`)."""

STALE_SHM_S = 24 * 3600.0


class MemoryTier:
    """This rank's shared-memory slots for the run in ``storage``."""

    def __init__(
        self,
        storage: Storage,
        *,
        rank: int,
        world_size: int,
        shm_dir: Path | None,
        overlap: Overlap,
        audit: AuditLog,
        run_id: str | None = None,
    ) -> None:
        self.rank = rank
        self.run_id = run_id
        self.audit = audit
        self.discarded: str | None = None  # why an adopted snapshot was not trusted
        self.world_size = world_size
        self.arena = ShmArena(
            run_key_for(storage.location), rank=rank, shm_dir=shm_dir, root=storage.url
        )
        for path in remove_dead_segments(self.arena.shm_dir, older_than_s=STALE_SHM_S):
            log.info("removed shared-memory snapshot %s left by a dead run", path)
            audit.record("stale_removed", name=str(path))
        self.overlap = overlap
        self._exec = (
            ThreadPoolExecutor(1, thread_name_prefix="resumable-overlap") if overlap else None
        )
        self._pending: Future[MemorySnapshot] | None = None
        self._copied_now: CopyPlan | None = None  # overlap="auto": too small to overlap
        self._hooks: list[tuple[torch.optim.Optimizer, Any]] = []
        self._adopted = False
        self._tree_json = TreeJSON()
        self._plan = CapturePlan()  # what the captures of one snapshot after another share
        # Set by the facade with replicas > 1: each snapshot is pushed to the peers, and
        # the next one waits for that push (`resumable.replicas.peers`).
        self.replication: Replication | None = None

    @property
    def newest(self) -> MemorySnapshot | None:
        return self.arena.newest

    def take(
        self, state: Mapping[str, Any], step: int, metrics: Mapping[str, Any] | None, *, rng: bool
    ) -> tuple[float, int]:
        """Snapshot ``state`` as of ``step``; returns the blocking seconds and the bytes
        left to an overlapped copy."""
        self.adopt()
        t0 = time.perf_counter()
        if self.replication is not None:
            self.replication.wait()  # counted as this snapshot's stall: it blocks
        captured = self._capture(state, rng)
        copy_plan, new = self.arena.plan(captured.tensors, lambda: self._others(captured))
        if new and captured.reused:  # a tensor changed dtype, shape or device in place
            self._plan.forget()
            captured = self._capture(state, rng)
            copy_plan = self.arena.plan(captured.tensors, lambda: self._others(captured))[0]
        # Several ranks (or DTensors): what a coordinated persist and a restore need. A
        # state of per-rank objects only (a DeepSpeed engine's) has no pieces, yet its
        # snapshot is of this world size all the same.
        sharded = bool(captured.pieces) or self.world_size > 1
        meta = SlotMeta(
            tree=self._tree_json.encode(captured.tree),
            metrics=json_metrics(metrics or {}),
            created=time.time(),
            run_id=self.run_id,
            world_size=self.world_size,
            pieces=captured.pieces,
            replicated=tuple(sorted(captured.replicated)) if sharded else (),
        )
        deferred = self._deferred(state, captured.tensors, copy_plan) if self.overlap else set()
        done = self.arena.snapshot(
            step, captured.tensors, meta, deferred=deferred, executor=self._exec, plan=copy_plan
        )
        if isinstance(done, Future):
            self._pending = done  # resolved by the next optimizer.step() or `settle`
        if self.replication is not None:
            self.replication.push(self.arena, done)
        seconds = time.perf_counter() - t0
        overlapped = sum(
            captured.tensors[n].numel() * captured.tensors[n].element_size() for n in deferred
        )
        return seconds, overlapped

    def _others(self, captured: capture_mod.Captured) -> set[str]:
        """The replicated tensors another rank writes in a coordinated persist, to be laid
        out last (`plan_layout`), where they are a small part of the snapshot (a sharded
        state's optimizer step counters): this rank's persist worker then writes its
        share from shared memory. Not where they are a large part (data parallelism):
        every rank's layout then stays the same, and a replica to a peer sends only the
        bytes the peer's own snapshot does not hold at the same place
        (`resumable.replicas`)."""
        if self.world_size <= 1 or not captured.replicated:
            return set()
        tensors = captured.tensors
        mine = owned_tensors(tensors, captured.replicated, self.rank, self.world_size)
        others = set(tensors) - set(mine)
        size = sum(tensors[n].numel() * tensors[n].element_size() for n in others)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return others if size * OTHERS_LAST_SHARE <= total else set()

    def _deferred(
        self, state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], plan: CopyPlan
    ) -> set[str]:
        """The tensors an overlapped copy takes: those only ``optimizer.step()`` changes.
        With ``overlap="auto"``, none while they hold under `OVERLAP_MIN_BYTES` (decided
        once per copy plan): handing a small copy to a second thread costs the step
        more than copying it at once (``docs/decisions.md``, "Overlap by size")."""
        if plan is self._copied_now:
            return set()
        owned = self._optimizer_owned(state)
        deferred = {n for n, t in tensors.items() if t.data_ptr() in owned}
        if self.overlap == "auto":
            size = sum(tensors[n].numel() * tensors[n].element_size() for n in deferred)
            if size < OVERLAP_MIN_BYTES:
                self._copied_now = plan
                return set()
        self._copied_now = None
        return deferred

    def _capture(self, state: Mapping[str, Any], rng: bool) -> capture_mod.Captured:
        return capture_mod.capture(
            state, include_rng=rng, rank=self.rank, world_size=self.world_size, plan=self._plan
        )

    def settle(self) -> None:
        """Wait for an overlapped copy; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def copying(self) -> bool:
        """Whether an overlapped copy is still owed (until `settle` or the optimizer step)."""
        return self._pending is not None

    def current(self, step: int) -> MemorySnapshot | None:
        """The newest snapshot if it is of ``step`` and its slot may be reused for a
        persist (not locked by one already running); else None."""
        newest = self.arena.newest
        if newest is None or newest.step != step or newest.index in self.arena.locked:
            return None
        return newest

    def _optimizer_owned(self, state: Mapping[str, Any]) -> set[int]:
        """Data pointers of tensors only ``optimizer.step()`` changes (parameters and
        optimizer state); installs the pre-hooks that wait for an overlapped copy."""
        ptrs: set[int] = set()
        for obj in state.values():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            if not any(h[0] is obj for h in self._hooks):
                ref = weakref.ref(self)

                def wait_for_copy(*_: Any, ref: Callable[[], MemoryTier | None] = ref) -> None:
                    tier = ref()
                    if tier is not None:
                        tier.settle()

                self._hooks.append((obj, obj.register_step_pre_hook(wait_for_copy)))
            for group in obj.param_groups:
                ptrs.update(storage_ptr(p) for p in group["params"])
            for st in obj.state.values():
                ptrs.update(storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def adopt(self) -> None:
        """Once: take over the slots left by a dead launch of this run."""
        if self._adopted:
            return
        self._adopted = True
        found = self.arena.adopt()
        if not found:
            return
        step, meta = found[0][1].step, found[0][1].meta
        if self.run_id is not None and not snapshot_belongs(meta.run_id, self.run_id):
            # Taken for another run of this directory: it was deleted or replaced since.
            self.arena.newest = None
            self.discarded = (
                f"taken for another run of {meta.root or 'this directory'} (run id "
                f"{meta.run_id or 'not recorded'}, the directory's is {self.run_id}): "
                "the directory was deleted or replaced since; the slot is reused"
            )
            log.warning(
                "discarding the shared-memory snapshot of step %d: %s", step, self.discarded
            )
            self.audit.record("skip", step=step, tier="memory", reason=self.discarded[:500])
            return
        log.info("found a shared-memory snapshot of step %d from an earlier launch", step)

    def complete(self) -> list[tuple[MemorySnapshot, SlotContent]]:
        """This run's complete snapshots in this rank's slots (with their content),
        newest first: what a restore may offer (`Restorer`). Snapshots another run of
        the directory took are left out (`adopt` said so for the newest)."""
        self.adopt()
        return [
            (snap, content)
            for snap, content in self.arena.complete()
            if self.run_id is None or snapshot_belongs(content.meta.run_id, self.run_id)
        ]

    def restored(self, step: int, snap: MemorySnapshot | None = None) -> None:
        """A restore loaded ``step`` (from ``snap``, a snapshot of this tier, which is
        the newest one from now on): snapshots of later steps are dropped
        (`ShmArena.forget_after`)."""
        self.adopt()
        self.arena.forget_after(step, snap)

    def preflight(
        self, state: Mapping[str, Any], *, rng: bool, live: capture_mod.Captured | None = None
    ) -> None:
        """Fail before training starts if shared memory cannot hold two snapshots (three
        with replicas; one more, made while a persist holds one of them, is used only
        where it fits) and, with replicas, the peers' snapshots this rank keeps
        (`Replication.check_room`). ``live``: a capture of ``state`` without the random
        streams, made just before (`Restorer.hold_live`), instead of walking it here."""
        if live is None:
            captured = capture_mod.capture(state, include_rng=rng)
            tensors = list(captured.tensors.values())
        else:
            tensors = list(live.tensors.values())
            if rng:
                tensors += capture_mod.capture({}, include_rng=True).tensors.values()
        size = sum(t.numel() * t.element_size() for t in tensors)
        count = self.arena.keep + 1  # those kept, and the one being copied
        need = count * size
        have = shm_free_bytes(self.arena.directory) + self.arena.existing_bytes()
        if self.replication is not None:  # collective: every rank, every restore
            self.replication.check_room(size, have, need)
        if need > have:
            raise StorageError(
                errno.ENOSPC,
                f"shared memory {self.arena.directory} has {have / 2**20:.0f} MiB available, "
                f"{count} snapshots of this state need {need / 2**20:.0f} MiB (and one more, "
                "while a persist runs, keeps the previous snapshot during a copy where it "
                "fits); enlarge /dev/shm "
                "(docker run --shm-size, or a larger tmpfs mount) or checkpoint without "
                "shared memory: persist='sync' with memory_every=None",
            )

    def readable(self, snap: MemorySnapshot) -> SlotContent | None:
        """The content of ``snap``'s slot if it still holds that snapshot, complete."""
        content = self.arena.content(snap.index)
        if content is None or content.seq != snap.seq:
            return None
        return content

    def verified(
        self, snap: MemorySnapshot, content: SlotContent | None = None
    ) -> tuple[SlotContent, dict[str, torch.Tensor]]:
        """The content and tensor views of ``snap``, checked complete and (where the
        persist worker recorded them) against its checksums. ``content``: the slot's,
        read just before (the caller checked it is ``snap``'s), else read here."""
        content = content or self.readable(snap)
        if content is None:
            raise CorruptCheckpointError("the snapshot is incomplete or was overwritten")
        views = self.arena.tensors(snap.index, content)
        if content.checksums is not None:
            got = self.arena.checksums(self.data(snap).memory(), content.slots)
            for sl, have, want in zip(content.slots, got, content.checksums):
                if have != want:
                    raise CorruptCheckpointError(f"checksum mismatch in tensor {sl.name!r}")
        return content, views

    def copy_verified(
        self, snap: MemorySnapshot, content: SlotContent, dests: Mapping[str, torch.Tensor]
    ) -> None:
        """Copy each tensor of ``snap`` that has a destination in ``dests`` there while
        checking every tensor against its recorded checksums (`ShmArena.copy_checked`).
        A mismatch raises `CorruptCheckpointError` once every copy ended: by then
        destinations hold bytes of a snapshot that is not what was saved."""
        assert content.checksums is not None
        slot = self.arena.slots[snap.index]
        if slot is None or not slot.still(content.seq):
            raise CorruptCheckpointError("the snapshot is incomplete or was overwritten")
        got = self.arena.copy_checked(
            slot.data_tensor(), content.slots, [dests.get(s.name) for s in content.slots]
        )
        for sl, have, want in zip(content.slots, got, content.checksums):
            if have != want:
                raise CorruptCheckpointError(f"checksum mismatch in tensor {sl.name!r}")

    def data(self, snap: MemorySnapshot) -> Snapshot:
        """``snap`` as a `Snapshot` over its slot (for a persist on this thread)."""
        content = self.readable(snap)
        slot = self.arena.slots[snap.index]
        if content is None or slot is None:
            raise CorruptCheckpointError(f"memory snapshot of step {snap.step} is gone")
        return Snapshot(content.slots, slot.data_tensor())

    def path(self, snap: MemorySnapshot) -> str:
        return str(self.arena.paths[snap.index])

    def lock(self, snap: MemorySnapshot) -> None:
        """Keep ``snap``'s slot from being rewritten until `unlock` (a persist reads it)."""
        self.arena.locked.add(snap.index)

    def room_to_queue(self, snap: MemorySnapshot) -> bool:
        """Whether ``snap`` may go to a persist queued behind the running one: a slot is
        left (or made now) for the snapshots taken meanwhile (`ShmArena.reserve_spare`)."""
        return self.arena.reserve_spare(snap.index)

    def full(self) -> bool:
        """Whether every slot a snapshot may use is held by a persist (`ShmArena.full`)."""
        return self.arena.full()

    def unlock(self, index: int | None = None) -> None:
        """Release one slot (``index``), or all of them."""
        if index is None:
            self.arena.locked.clear()
        else:
            self.arena.locked.discard(index)

    def close(self, *, unlink: bool) -> None:
        if self.replication is not None:
            self.replication.close(unlink=unlink)
            self.replication = None
        for _, handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        self.arena.close(unlink=unlink)


class TreeJSON:
    """The JSON of capture trees, one snapshot after another: a top-level entry (a model,
    an optimizer, the random streams, ...) that is the same as at the previous snapshot
    keeps its encoding, so a step re-encodes only what changed (an optimizer's learning
    rate, a loader's position), not the reference to every tensor.

    "The same" is the very node of the previous snapshot (a node `CapturePlan` reused:
    nodes are never changed once made, and the last ones are held, so their ids are not
    reused), or a node with the same `marshal` bytes, which tell 1, 1.0 and True apart
    (``==`` does not, and their JSON differs); they are compared in memory only and
    never loaded."""

    def __init__(self) -> None:
        self._last: dict[str, _Encoded] = {}
        self._kids: dict[str, dict[Any, _Encoded]] = {}
        # (entry, part, group, key) -> the item, its marshal bytes, its JSON
        self._items: dict[Any, tuple[Any, bytes, str]] = {}
        self._streams = _StreamsJSON()

    def encode(self, tree: Any) -> RawJSON:
        entries = tree["dict"]
        parts: list[str] = []
        seen: dict[Any, _Encoded] = {}
        kids: dict[str, dict[Any, _Encoded]] = {}
        items_seen: dict[Any, tuple[Any, bytes, str]] = {}
        for key, node in entries:
            if key == capture_mod.RNG_KEY:  # changes at every step: encoded per stream
                if type(node) is KnownJSON:  # made by the capture plan with its text
                    parts.append("[" + _key_json(key) + "," + node.json + "]")
                else:
                    parts.append(self._streams.encode(node))
                continue
            split = _few_entries(node)
            if split is None:
                parts.append(self._entry(self._last, seen, key, node))
                continue
            # An entry of a few parts (an optimizer: "state" and "param_groups") is
            # cached per part: a scheduler changing the learning rate at every step
            # re-encodes the groups, not the reference to every moment.
            head, items, tail = split
            last, mine = self._kids.get(key, {}), kids.setdefault(key, {})
            texts = [
                "[" + _key_json(k) + "," + n.json + "]"
                if type(n) is KnownJSON  # made by the capture plan with its text
                else self._entry(last, mine, k, n)
                if (groups := _dict_list(n)) is None
                else self._groups((key, k), groups, items_seen)
                for k, n in items
            ]
            parts.append("[" + _key_json(key) + "," + head + ",".join(texts) + tail + "]")
        self._last, self._kids, self._items = seen, kids, items_seen
        return RawJSON('{"dict":[' + ",".join(parts) + "]}")

    def _groups(
        self,
        where: tuple[str, Any],
        groups: list[list[list[Any]]],
        seen: dict[Any, tuple[Any, bytes, str]],
    ) -> str:
        """``[name, {"list": [{"dict": items}, ...]}]``'s JSON (an optimizer's parameter
        groups), item by item: an item that is the very ``[key, node]`` list of the last
        snapshot (`CapturePlan` keeps those of unchanged values) keeps its text, and so
        does one with the same `marshal` bytes."""
        last = self._items
        texts = []
        for i, items in enumerate(groups):
            inner = []
            for item in items:
                ck = (where, i, item[0])
                hit = last.get(ck)
                if hit is not None and hit[0] is item:
                    seen[ck] = hit
                    inner.append(hit[2])
                    continue
                try:  # a walked item: the same bytes, the same text (as `_entry`)
                    fingerprint = marshal.dumps(item)
                except ValueError:
                    fingerprint = b""
                if fingerprint and hit is not None and hit[1] == fingerprint:
                    text = hit[2]
                else:
                    text = _dumps(item)
                seen[ck] = (item, fingerprint, text)
                inner.append(text)
            texts.append('{"dict":[' + ",".join(inner) + "]}")
        return "[" + _dumps(where[1]) + ',{"list":[' + ",".join(texts) + "]}]"

    @staticmethod
    def _entry(last: Mapping[Any, _Encoded], seen: dict[Any, _Encoded], key: Any, node: Any) -> str:
        """``[key, node]``'s JSON, reused from ``last`` if ``node`` is the same."""
        hit = last.get(key)
        if hit is not None and hit[2] is node:
            seen[key] = hit
            return hit[1]
        try:
            fingerprint = marshal.dumps(node)
        except ValueError:  # not a plain JSON value: never cached
            fingerprint = b""
        if fingerprint and hit is not None and hit[0] == fingerprint:
            text = hit[1]
        else:
            text = _dumps([key, node])
        seen[key] = (fingerprint, text, node)
        return text


_Encoded = tuple[bytes, str, Any]  # an entry's marshal bytes, its JSON, and its node


_FEW = 8  # at most this many parts: more (a model's tensors) are cached as one
_GROUP_ITEMS = 64  # at most this many groups, and items per group, encoded item by item


def _dict_list(node: Any) -> list[list[list[Any]]] | None:
    """The items of each dict of a ``{"list": [{"dict": items}, ...]}`` node of at most
    `_GROUP_ITEMS` dicts of at most as many items, all ``[str or int key, node]`` pairs
    (an optimizer's parameter groups), else None."""
    if type(node) is not dict or len(node) != 1:
        return None
    groups = node.get("list")
    if type(groups) is not list or not groups or len(groups) > _GROUP_ITEMS:
        return None  # a long list (a user's history, say) stays one fingerprint
    out = []
    for g in groups:
        items = g.get("dict") if type(g) is dict and len(g) == 1 else None
        if type(items) is not list or len(items) > _GROUP_ITEMS:
            return None
        for item in items:
            if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
                return None
        out.append(items)
    return out


def _few_entries(node: Any) -> tuple[str, list[list[Any]], str] | None:
    """``(head, entries, tail)`` of a ``{"stateful": {"dict": entries}}`` or ``{"dict":
    entries}`` node of 2 to `_FEW` ``[key, node]`` entries, whose JSON is ``head``, the
    entries' JSON joined by commas, and ``tail``; None for any other node."""
    if type(node) is not dict or len(node) != 1:
        return None
    head, tail = '{"dict":[', "]}"
    inner = node.get("stateful")
    if inner is not None:
        if type(inner) is not dict or len(inner) != 1:
            return None
        node, head, tail = inner, '{"stateful":{"dict":[', "]}}"
    items = node.get("dict")
    if type(items) is not list or not 2 <= len(items) <= _FEW:
        return None
    for item in items:
        if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
            return None
    return head, items, tail


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


@functools.lru_cache(maxsize=1024)
def _key_json(key: str | int) -> str:
    """A top-level key's (or a part's) JSON: the same few keys at every snapshot."""
    return _dumps(key)


class _StreamsJSON:
    """The JSON of the random streams' entry, the same text ``json.dumps`` makes.

    Each stream is cached on its own (a step that draws from torch's generator only
    leaves Python's and NumPy's encodings as they were), and Python's state, 624 words
    of Mersenne Twister and a position, is compared as integers rather than marshalled
    (25 µs): its words change once in 624 draws, so the text of the words is usually
    reused and only the position is new. Python's words are ints by construction
    (`capture.rng_state` takes them from ``random.getstate()``), for which ``==`` and
    JSON agree."""

    def __init__(self) -> None:
        self._last: dict[Any, _Encoded] = {}
        self._words: list[int] | None = None
        self._words_text = ""

    def encode(self, node: Any) -> str:
        items = node.get("dict") if type(node) is dict and len(node) == 1 else None
        if type(items) is not list:
            return _dumps([capture_mod.RNG_KEY, node])
        parts: list[str] = []
        seen: dict[Any, _Encoded] = {}
        for item in items:
            stream, sub = item
            hit = self._last.get(stream)
            if hit is not None and hit[2] is sub:  # a node the plan kept: the same state
                seen[stream] = hit
                parts.append(hit[1])
                continue
            text = self._python(sub) if stream == "python" else None
            if text is None:
                text = TreeJSON._entry(self._last, seen, stream, sub)
            else:
                text = '["python",' + text + "]"
                seen[stream] = (b"", text, sub)
            parts.append(text)
        self._last = seen
        return "[" + _key_json(capture_mod.RNG_KEY) + ',{"dict":[' + ",".join(parts) + "]}]"

    def _python(self, sub: Any) -> str | None:
        """``{"tuple": [version, {"tuple": [words..., position]}, gauss]}``'s JSON, or
        None for any other shape (encoded the general way)."""
        if type(sub) is not dict or len(sub) != 1:
            return None
        t = sub.get("tuple")
        if type(t) is not list or len(t) != 3 or type(t[1]) is not dict or len(t[1]) != 1:
            return None
        key = t[1].get("tuple")
        if type(key) is not list or not key or type(t[0]) is not int:
            return None
        if self._words is None or len(key) != len(self._words) + 1 or key[:-1] != self._words:
            words = key[:-1]
            if not all(type(w) is int for w in words):
                return None
            self._words, self._words_text = words, ",".join(map(str, words))
        sep = "," if self._words else ""
        return (
            '{"tuple":['
            + str(t[0])
            + ',{"tuple":['
            + self._words_text
            + sep
            + _dumps(key[-1])
            + "]},"
            + _dumps(t[2])
            + "]}"
        )


def storage_ptr(t: torch.Tensor) -> int:
    """Where ``t``'s bytes are: a DTensor's are its local shard's (the wrapper has none)."""
    if is_dtensor(t):
        with torch.no_grad():
            return int(t.to_local().data_ptr())  # type: ignore[attr-defined]
    return int(t.data_ptr())
