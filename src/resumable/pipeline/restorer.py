"""Restoring: find the newest valid state across the tiers and load it.

The candidates, newest first: this rank's shared-memory snapshot (left by a dead launch
of this run; used if it is newer than every committed checkpoint, or asked for), then
each committed step, from the local root or else the mirror. Corrupt candidates are
skipped with a WARNING and an audit entry; if checkpoints exist and none is valid,
`CorruptCheckpointError` (never a silent start from scratch). A candidate's values are
decoded without touching a live object (`RestoreValues`), and applied only if every
rank could decode its own.

Every decision is the same on every rank: each rank offers what it found and the
coordination (`resumable.group.Group`) gathers the offers, and each rank's verdict on a
candidate reaches every rank (`resumable.coordination.StoreVerdicts` through the store
where several ranks persist in the background, else over the side group), so all
ranks restore the same step from the same tier or fall back together. Per-rank state
(random streams, data positions) cannot reshard to another world size, and needs an
explicit opt-in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from resumable import capture as capture_mod
from resumable._shm import SlotContent
from resumable.audit import AuditLog
from resumable.commit import list_committed, step_dir
from resumable.coordination import GroupVerdicts, StoreVerdicts
from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StateMismatchError,
)
from resumable.group import Group
from resumable.pieces import Piece, is_dtensor
from resumable.pipeline._restore_values import Fused, RestoreValues
from resumable.pipeline.memory import MemoryTier
from resumable.reader import CheckpointReader
from resumable.snapshot import MemorySnapshot
from resumable.storage import Storage

log = logging.getLogger(__name__)

TIERS = ("auto", "memory", "storage")
_LOOK_BACK = 20  # older checkpoints whose manifests a refused restore reads for a way back


@dataclass
class Restored:
    """What `Restorer.restore` did: the step (0: nothing to restore), where it came from
    (``"memory"``, ``"local"``, ``"mirror"`` or ``"none"``), the memory snapshot it came
    from, and the candidates skipped on the way, with why."""

    step: int
    tier: str
    snapshot: MemorySnapshot | None = None
    skipped: list[str] = field(default_factory=list)
    newest_committed: int | None = None
    partial: list[str] = field(default_factory=list)  # what a partial restore left
    from_peers: list[int] = field(default_factory=list)  # ranks restored from a replica

    def summary(self, url: str, seconds: float) -> str:
        """The one line a resumed run prints: the step, where from and how long."""
        where = {"memory": "shared memory", "local": url, "mirror": "the mirror"}[self.tier]
        tier = "storage" if self.tier == "local" else self.tier
        if self.from_peers:
            where += f" (rank(s) {_ranks(self.from_peers)} from peers' replicas)"
        return f"resumable: restored step {self.step} from {where} ({tier}, {seconds:.2f} s)"

    def describe(self, url: str) -> str:
        if self.tier == "none":
            head = f"nothing to restore in {url}: starting from step 0"
        else:
            where = {"memory": "shared memory", "local": url, "mirror": "the mirror"}[self.tier]
            if self.from_peers:
                where += f" (rank(s) {_ranks(self.from_peers)} from peers' replicas)"
            head = f"restored step {self.step} from {where}"
        if self.skipped:
            head += "; skipped: " + "; ".join(self.skipped)
        return head


class Restorer(RestoreValues):
    """Loads the newest valid state into ``state``.

    Call order (the facade's, on every rank, on the training thread): `roots_by_step`
    at any time (a listing). `restore` before training, and again for an explicit
    step; every rank calls it together. It raises before touching a live object,
    except when a memory snapshot asked for alone fails its check while copied.

    ``verdicts`` carries each rank's verdict on a candidate to every rank: through the
    coordination store where there is one (`StoreVerdicts`), by default over
    ``coordination`` (`GroupVerdicts`)."""

    def __init__(
        self,
        state: Mapping[str, Any],
        storage: Storage,
        *,
        mirror: Storage | None,
        memory: MemoryTier | None,
        coordination: Group,
        audit: AuditLog,
        verdicts: GroupVerdicts | StoreVerdicts | None = None,
    ) -> None:
        self.state = state
        self.storage = storage
        self.mirror = mirror
        self.memory = memory
        self.group = coordination
        self.verdicts = verdicts if verdicts is not None else GroupVerdicts(coordination)
        self.rank = coordination.rank
        self.world_size = coordination.world_size
        self.audit = audit
        self.reset_per_rank = False
        self.strict = True
        self.partial: list[str] = []
        self._held: capture_mod.Captured | None = None  # `hold_live`'s, used once

    def hold_live(self) -> capture_mod.Captured | None:
        """One process: a capture of the live state (without the random streams) for
        the caller's own use (the memory tier's room check), which the next `restore`
        takes instead of walking the state again (a large state's walk costs
        milliseconds); else None. Taken once: after a restore wrote into the state, a
        capture made before it may name tensors an object has since replaced."""
        if self.world_size != 1:
            return None
        live = capture_mod.capture(self.state, include_rng=False)
        if any(is_dtensor(t) for t in live.live.values()):
            return None  # `_live` prepares an optimizer of DTensors first
        self._held = live
        return live

    def roots_by_step(self) -> dict[int, list[Storage]]:
        """For each committed step, the roots holding it (the local one first)."""
        out: dict[int, list[Storage]] = {}
        for root in (self.storage, self.mirror):
            if root is not None:
                for s in list_committed(root):
                    out.setdefault(s, []).append(root)
        return out

    def restore(
        self,
        step: int | None,
        *,
        map_location: Any,
        tier: str,
        reset_per_rank: bool,
        strict: bool = True,
    ) -> Restored:
        self.strict, self.partial = strict, []
        try:
            done = self._restore(
                step, map_location=map_location, tier=tier, reset_per_rank=reset_per_rank
            )
        finally:
            self._held = None
        done.partial = self.partial
        return done

    def _restore(
        self, step: int | None, *, map_location: Any, tier: str, reset_per_rank: bool
    ) -> Restored:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.reset_per_rank = reset_per_rank
        roots = self.roots_by_step() if tier != "memory" else {}
        steps = sorted(roots)
        skipped: list[str] = []
        newest = steps[-1] if steps else None
        if tier != "storage" and self.memory is not None:
            restored = self._from_memory(steps, step, map_location, tier, skipped)
            if restored is not None:
                restored.newest_committed = newest
                return restored
            if tier == "memory":
                if step is not None:
                    where = "on every rank" if self.world_size > 1 else f"for {self.storage.url}"
                    raise NoCheckpointError(f"no memory snapshot of step {step} {where}")
                return Restored(0, "none", skipped=skipped, newest_committed=newest)
        restored = self._from_storage(roots, step, map_location, skipped)
        if self.memory is not None:
            self.memory.restored(restored.step)  # later snapshots: a timeline left
        restored.newest_committed = newest
        return restored

    # ------------------------------------------------------------ memory

    def _from_memory(
        self, steps: list[int], step: int | None, loc: Any, tier: str, skipped: list[str]
    ) -> Restored | None:
        """Every rank from its own shared-memory snapshot of the newest step that every
        rank holds complete (newer than the newest checkpoint, unless asked for);
        otherwise None, and every rank falls back to storage together.

        A rank keeps its newest complete snapshot and the one before it
        (`resumable.snapshot.ShmArena`) and offers each it could restore: ranks killed
        while some of them copied step s+1 all still hold step s, and resume from it."""
        memory = self.memory
        assert memory is not None
        held = memory.complete()
        if memory.discarded is not None:
            skipped.append(f"a memory snapshot ({memory.discarded})")
            memory.discarded = None
        mine: list[int] = []  # the steps this rank can restore, newest first
        why, warned = "it has none", False  # why this rank offers none; said already?
        same: dict[frozenset[tuple[str, Piece]], bool] = {}  # `_same_pieces`: one capture each

        def same_pieces(pieces: Mapping[str, Piece]) -> bool:
            key = frozenset(pieces.items())
            if key not in same:
                same[key] = self._same_pieces(pieces)
            return same[key]

        for snap, found in held:
            saved_world = found.meta.world_size
            if saved_world != self.world_size:
                why = (
                    f"it was taken by a job of {saved_world} rank(s), this one has "
                    f"{self.world_size} (snapshots do not reshard; checkpoints do)"
                )
            elif not same_pieces(found.meta.pieces):
                why, warned = "it holds another sharding of the state", True
                self._skip_memory(
                    snap.step,
                    "it holds another sharding of the state than this launch's (a changed "
                    "parallel layout at the same world size); the checkpoints reshard",
                    skipped,
                )
            else:
                mine.append(snap.step)
        had = held[0][0].step if held else None
        replication = memory.replication
        replicas = replication.held() if replication is not None else []
        gathered = self.group.all_gather((mine, had, why, warned, replicas))
        answers = [(_offered(a[0]), *a[1:4]) for a in gathered]
        # Where each rank's snapshot of a step is: its own memory, or a peer's replica.
        holders: dict[tuple[int, int], list[int]] = {}
        for holder, a in enumerate(gathered):
            for source, at in a[4] if len(a) > 4 else ():
                holders.setdefault((int(source), int(at)), []).append(holder)
        reachable = [
            set(a[0]) | {at for (source, at) in holders if source == r}
            for r, a in enumerate(answers)
        ]
        common = reachable[0].intersection(*reachable[1:])
        if step is not None:
            common &= {step}
        if not common:
            if step is None:
                self._discarded(
                    answers,
                    steps[-1] if steps else None,
                    skipped,
                    holders if replication is not None else None,
                )
            return None
        s = max(common)
        wanted = step is not None or tier == "memory" or not steps or s >= steps[-1]
        if not wanted:
            return None
        t0 = time.perf_counter()
        problem = None
        values: dict[str, Any] = {}
        fetched = s not in mine
        if fetched:
            try:
                assert replication is not None
                newest, content = self._fetch(s, holders.get((self.rank, s), []))
            except CheckpointError as exc:
                problem = f"rank {self.rank}: {exc}"
        else:
            newest, content = next((sn, c) for sn, c in held if sn.step == s)
        if step is None:
            self._went_back(
                answers, s, skipped, fetched=[r for r, a in enumerate(answers) if s not in a[0]]
            )
        # Checked while copied where something else can be restored if the check fails
        # (or, asked for memory only, the failure is raised): `_decode_memory`. One
        # process only: a coordinated persist of several ranks records no checksums in
        # their snapshots, so theirs are copied as they are.
        fallback = tier != "memory" and bool(steps) and (step is None or step in steps)
        fuse = self.world_size == 1 and (tier == "memory" or fallback)
        fused: Fused | None = None
        if problem is None:
            try:
                values, fused = self._decode_memory(newest, content, loc, fuse=fuse)
            except CorruptCheckpointError as exc:
                problem = f"rank {self.rank}: {exc}" if self.world_size > 1 else str(exc)
        problems = [m for _, m in self.verdicts.collect(("corrupt", problem) if problem else None)]
        if problems:
            self._skip_memory(s, "; ".join(problems), skipped)
            if replication is not None:
                self._replica_fallback(s, "; ".join(problems), steps)
            return None
        # Borrowed: the slot is rewritten by later snapshots, so whatever the live state
        # would keep a reference to is copied out (but what `fused` copied already).
        try:
            self.partial += capture_mod.restore(
                self.state,
                values,
                borrowed=True,
                strict=self.strict,
                prepare=fused,
                owned=fused.owned if fused is not None else (),
            )
        except CorruptCheckpointError as exc:
            if fused is None or not fused.started:
                raise  # nothing live was touched: as any malformed value
            if not fallback:
                raise CorruptCheckpointError(
                    f"the shared-memory snapshot of step {s} failed its check while it was "
                    f"copied into the live state ({exc}), which now holds part of it; "
                    "restore(tier='auto') loads the newest committed checkpoint over it, or "
                    "rebuild the state to start afresh"
                ) from None
            why = f"{exc} (found while copying; the checkpoint restored next overwrites it)"
            self._skip_memory(s, why, skipped)
            return None
        memory.restored(s, newest)
        from_peers = [r for r, a in enumerate(answers) if s not in a[0]]
        if replication is not None:
            replication.restored(s)
        self.audit.record(
            "restore",
            step=s,
            tier="memory",
            bytes=newest.nbytes,
            ranks=self.world_size,
            duration_s=round(time.perf_counter() - t0, 6),
            **({"from_peers": from_peers} if from_peers else {}),
        )
        return Restored(int(s), "memory", snapshot=newest, skipped=skipped, from_peers=from_peers)

    def _fetch(self, step: int, holders: list[int]) -> tuple[MemorySnapshot, SlotContent]:
        """This rank's snapshot of ``step`` from a peer's replica (its own memory lost
        it: a replaced node), written into one of its slots and checked as one of its
        own snapshots would be (same world size, same sharding)."""
        memory = self.memory
        assert memory is not None and memory.replication is not None
        replica = memory.replication.fetch(step, holders)
        snap = memory.arena.install(step, replica.meta, replica.data)
        del replica
        content = memory.readable(snap)
        if content is None:
            raise CorruptCheckpointError(f"the replica of step {step} did not read back")
        saved_world = content.meta.world_size
        if saved_world != self.world_size:
            raise CorruptCheckpointError(
                f"the replica of step {step} was taken by a job of {saved_world} rank(s), "
                f"this one has {self.world_size} (snapshots do not reshard; checkpoints do)"
            )
        if not self._same_pieces(content.meta.pieces):
            raise CorruptCheckpointError(
                f"the replica of step {step} holds another sharding of the state"
            )
        log.info("rank %d: fetched its snapshot of step %d from a peer's replica", self.rank, step)
        return snap, content

    def _replica_fallback(self, s: int, reason: str, steps: list[int]) -> None:
        """Say (rank 0, WARNING) that the snapshot of step ``s``, reachable only through
        peers' replicas for some ranks, could not be restored, and what that costs."""
        committed = steps[-1] if steps else 0
        if self.rank == 0:
            log.warning(
                "could not restore step %d from memory and peers' replicas (%s): this "
                "launch falls back to storage (step %d) and trains %d step(s) again",
                s,
                reason,
                committed,
                max(0, s - committed),
            )
        self.audit.record(
            "replica_fallback",
            step=s,
            committed=committed,
            lost=max(0, s - committed),
            reason=reason[:500],
        )

    def _same_pieces(self, saved: Mapping[str, Piece]) -> bool:
        """Whether each global tensor of this rank's live state that a snapshot's pieces
        (``saved``) also hold has the same pieces there: global shape and offsets. A
        snapshot is restored without resharding, so one taken under another layout
        (tensor parallelism 2 -> 1 on the same ranks, another mesh) must not be. Tensors
        the live state does not hold yet (a fresh optimizer's moments) are not compared."""

        def by_fqn(pieces: Mapping[str, Piece]) -> dict[str, set[tuple[Any, ...]]]:
            out: dict[str, set[tuple[Any, ...]]] = {}
            for p in pieces.values():
                out.setdefault(p.fqn, set()).add((tuple(p.global_shape), tuple(p.global_offset)))
            return out

        snap = by_fqn(saved)  # checked when the slot was read (`SlotMeta.from_json`)
        if not snap:
            return True  # nothing to compare (one process): no capture of the state
        # Not self._live(): that gives a fresh optimizer its state (a zero-lr step), which
        # must not happen before it is known that something is restored. A run that then
        # starts afresh would train with step counts of 1 (found by the two-rank
        # random-SIGKILL test: a relaunch that found nothing diverged from the reference).
        current = capture_mod.capture(
            self.state, include_rng=False, rank=self.rank, world_size=self.world_size
        )
        live = by_fqn(current.pieces)
        return all(snap[f] == pieces for f, pieces in live.items() if f in snap)

    def _went_back(
        self,
        answers: list[tuple[list[int], int | None, str, bool]],
        s: int,
        skipped: list[str],
        *,
        fetched: Sequence[int] = (),
    ) -> None:
        """Say at WARNING (rank 0) which newer memory snapshot some ranks hold but not
        every rank does (a copy cut short by a kill, or a push to a peer cut short with
        the node that sent it), when the ranks resume from the snapshot before it: one
        snapshot's steps are trained again, not a persist's. ``fetched``: the ranks that
        restore from a peer's replica."""
        lost = max((a[1] for a in answers if a[1] is not None), default=s)
        if lost <= s:
            return
        whys = []
        for r, (offer, had, why, _) in enumerate(answers):
            if lost in offer:
                continue
            if r in fetched:
                whys.append(f"rank {r}: its memory is gone, its peers' newest replica is step {s}")
            elif had == lost or had is None:
                whys.append(f"rank {r}: {why}")
            else:
                whys.append(f"rank {r}: its newest complete snapshot is of step {had}")
        reason = "; ".join(whys) + f"; every rank holds step {s}"
        if self.rank == 0:
            log.warning(
                "discarding the shared-memory snapshot of step %d: %s, which this launch "
                "resumes from",
                lost,
                reason,
            )
        self.audit.record("skip", step=lost, tier="memory", reason=reason[:500])
        skipped.append(f"memory snapshot of step {lost} ({reason})")

    def _discarded(
        self,
        answers: list[tuple[list[int], int | None, str, bool]],
        committed: int | None,
        skipped: list[str],
        holders: Mapping[tuple[int, int], list[int]] | None = None,
    ) -> None:
        """Say at WARNING (rank 0) which memory snapshot newer than every committed
        checkpoint is thrown away because not every rank can restore it, and why each
        rank that cannot does not: the steps since the checkpoint are trained again.
        ``holders``: with replicas, which ranks hold which rank's replica of which step."""
        held = [a[1] for a in answers if a[1] is not None]
        lost = max(held, default=None)
        if lost is None or (committed is not None and lost <= committed):
            return  # nothing newer than storage is lost
        if len(answers) == 1 and answers[0][3]:
            return  # said by `_skip_memory` already
        whys = []
        for rank, (offer, had, why, _) in enumerate(answers):
            if lost in offer:
                continue
            if holders is not None and (rank, lost) in holders:
                continue  # a peer holds it
            if had is None and holders is not None:
                have = sorted(at for (src, at) in holders if src == rank)
                whys.append(
                    f"rank {rank}: its memory holds no snapshot (a replaced node) and "
                    + (
                        f"its peers' replicas are of step(s) {have}"
                        if have
                        else "no peer holds a replica of it (its replica holders were lost too)"
                    )
                )
            elif had is None or had == lost:
                whys.append(f"rank {rank}: {why}" if len(answers) > 1 else why)
            else:
                whys.append(f"rank {rank}: its snapshot is of step {had}")
        reason = "; ".join(whys) or "the ranks' snapshots are of different steps"
        after = f"step {committed}" if committed is not None else "step 0"
        cost = lost - (committed or 0)
        if self.rank == 0:
            log.warning(
                "discarding the shared-memory snapshot of step %d, newer than every "
                "committed checkpoint, because not every rank can restore it (%s): this "
                "launch resumes from %s and trains the %d step(s) after it again",
                lost,
                reason,
                after,
                cost,
            )
        self.audit.record("skip", step=lost, tier="memory", reason=reason[:500], lost=cost)
        skipped.append(f"memory snapshot of step {lost} ({reason})")

    def _skip_memory(self, step: int, reason: str, skipped: list[str]) -> None:
        log.warning("skipping the shared-memory snapshot of step %d: %s", step, reason)
        self.audit.record("skip", step=step, tier="memory", reason=reason[:500])
        skipped.append(f"memory snapshot of step {step} ({reason})")

    def _from_storage(
        self, roots: dict[int, list[Storage]], step: int | None, loc: Any, skipped: list[str]
    ) -> Restored:
        """The newest committed step every rank can read (each from the local root, or
        else the mirror), trying older ones in turn."""
        steps = sorted(roots)
        if step is not None and step not in steps:
            raise NoCheckpointError(
                f"no committed checkpoint for step {step} in {self.storage.url}; "
                f"committed steps: {steps[-10:] or 'none'}"
            )
        candidates = [step] if step is not None else list(reversed(steps))
        if not candidates:
            self.audit.record("restore", step=0, fresh=True)
            return Restored(0, "none", skipped=skipped)
        problems: list[str] = []
        last: CorruptCheckpointError | None = None
        # A step whose check failed while it was copied into the live state (`fuse`)
        touched: int | None = None
        for i, s in enumerate(candidates):
            # Checked while copied where an older checkpoint is left to restore over
            # what a failed check leaves (as from shared memory): one process, strict,
            # no step asked for (`_decode`'s ``fuse``, `docs/decisions.md`).
            fuse = self.world_size == 1 and self.strict and i + 1 < len(candidates)
            t0 = time.perf_counter()
            pending = list(roots[s])  # the local root, then the mirror
            while True:
                root: Storage | None = None
                reader: CheckpointReader | None = None
                values: dict[str, Any] = {}
                skip: set[str] = set()
                problem: tuple[str, str] | None = None
                seen: list[str] = []
                while pending:
                    candidate = pending.pop(0)
                    try:
                        reader = CheckpointReader(candidate, s)
                        values, skip = self._decode(reader, loc, fuse=fuse)
                        root = candidate
                        break
                    except CorruptCheckpointError as exc:
                        last = exc
                        seen.append(f"{candidate.url}/{step_dir(s)}: {exc}")
                        self._skip(s, candidate, exc, skipped)
                    except StateMismatchError as exc:
                        if self.world_size == 1:
                            raise _noting(exc, touched) from None
                        problem = ("mismatch", f"rank {self.rank}: {exc}")
                        break
                if root is None and problem is None:
                    problem = ("corrupt", f"rank {self.rank}: " + "; ".join(seen))
                verdicts = self.verdicts.collect(problem)
                if any(kind == "mismatch" for kind, _ in verdicts):
                    raise StateMismatchError("; ".join(msg for _, msg in verdicts))
                if verdicts:
                    problems += seen if self.world_size == 1 else [m for _, m in verdicts]
                    break
                assert root is not None and reader is not None
                applied: tuple[str, str] | None = None
                try:
                    # Raises CorruptCheckpointError or StateMismatchError only before
                    # touching a live object, but where a tensor is checked while it
                    # is copied (``fuse``: `CheckpointReader.fused_started` says so).
                    self._apply(
                        values,
                        skip,
                        borrowed=reader.mapped,
                        prepare=reader.fill,
                        owned=reader.owned,
                    )
                except CorruptCheckpointError as exc:
                    last = exc
                    if reader.fused_started:
                        touched = s
                        exc = CorruptCheckpointError(
                            f"{exc} (found while copying into the live state; the checkpoint "
                            "restored next overwrites it)"
                        )
                    self._skip(s, root, exc, skipped)
                    applied = ("corrupt", f"rank {self.rank}: {root.url}/{step_dir(s)}: {exc}")
                except StateMismatchError as exc:
                    exc = self._way_back(exc, values, s)
                    if self.world_size == 1:
                        raise _noting(exc, touched) from None
                    applied = ("mismatch", f"rank {self.rank}: {exc}")
                failures = self.verdicts.collect(applied)
                if any(kind == "mismatch" for kind, _ in failures):
                    raise StateMismatchError("; ".join(msg for _, msg in failures))
                if failures:
                    problems += [m for _, m in failures]
                    if self.world_size == 1 and pending:
                        # The same step from the mirror before an older one: a damaged
                        # byte found while copying from the local root (several ranks
                        # agree on one step and its root before any copy, and do not
                        # copy while they check)
                        continue
                    break
                tier = "local" if root is self.storage else "mirror"
                self.audit.record(
                    "restore",
                    step=s,
                    tier="storage" if tier == "local" else "mirror",
                    url=root.url,
                    bytes=sum(f["size"] for f in reader.manifest["files"].values()),
                    ranks=self.world_size,
                    saved_ranks=reader.manifest.get("world_size", 1),
                    duration_s=round(time.perf_counter() - t0, 6),
                )
                return Restored(s, tier, skipped=skipped)
        if step is not None and last is not None and self.world_size == 1:
            raise last
        roots_named = " and ".join(r.url for r in (self.storage, self.mirror) if r is not None)
        raise _noting(
            CorruptCheckpointError(
                f"{len(candidates)} checkpoint(s) in {roots_named} "
                "and none is valid (readable by every rank); refusing to start over "
                "silently. Inspect them with `resumable verify`, or move the directory "
                "away to start fresh. Problems: " + "; ".join(problems)
            ),
            touched,
        )

    def _way_back(
        self, exc: StateMismatchError, values: Mapping[str, Any], step: int
    ) -> StateMismatchError:
        """``exc`` naming the newest checkpoint older than ``step`` that holds every state
        key ``values`` (step ``step``'s) lacks, if there is one among the last few: a
        relaunch that puts back an entry an earlier launch left out can go back to it."""
        missing = [k for k in self.state if k not in values]
        if not values or not missing:
            return exc
        roots = self.roots_by_step()
        for older in sorted((s for s in roots if s < step), reverse=True)[:_LOOK_BACK]:
            for root in roots[older]:
                try:
                    tree = CheckpointReader(root, older).tree
                except CorruptCheckpointError:
                    continue
                keys = {p[0] for p in tree["dict"]}
                if all(k in keys for k in missing):
                    return StateMismatchError(
                        f"{exc}. Step {older} is the newest checkpoint that holds "
                        f"{missing}: restore(step={older}) loads it (the steps after it "
                        "are trained again)"
                    )
                break
        return exc

    def _skip(self, step: int, root: Storage, exc: Exception, skipped: list[str]) -> None:
        log.warning("skipping corrupt checkpoint %s in %s: %s", step_dir(step), root.url, exc)
        self.audit.record("skip", step=step, url=root.url, reason=str(exc)[:500])
        skipped.append(f"{step_dir(step)} in {root.url} ({exc})")


E = TypeVar("E", bound=Exception)


def _noting(exc: E, touched: int | None) -> E:
    """``exc`` saying that the live state holds part of step ``touched`` (whose check
    failed while it was copied there), if any: a caller that goes on must rebuild it."""
    if touched is None:
        return exc
    return type(exc)(
        f"{exc}. The live state holds part of {step_dir(touched)}, whose check failed "
        "while it was copied into it: rebuild the state before training from it"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (
        f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    )


def _offered(offer: Any) -> list[int]:
    """The steps a rank's memory offer names: a list of them, or one step, or None (the
    single step an offer named before a rank offered each snapshot it holds)."""
    if offer is None:
        return []
    return [offer] if isinstance(offer, int) else list(offer)
