"""Replicas in a job: this rank's server and store, its peers, and the push of each
memory snapshot to them (``Checkpointer(..., replicas=R)``; docs/replicas.md).

Call order (the facade's and the memory tier's): the constructor once, on every rank
together (it broadcasts the job's secret and gathers every rank's place and address
through the checkpoint group, before training); `check_room` in the first `restore`,
on every rank; then, on the training thread, `wait` before each snapshot and `push`
after it; in a restore `held` (collectively gathered by the restorer) and `fetch`, then
`restored`; `close` last.

A snapshot is pushed to the peers in the background, and the next snapshot waits for
that push to end: so a peer's newest replica of this rank is never more than one
snapshot behind this rank's newest, and every rank still holds it (a rank keeps its
two newest complete snapshots), which is what a restore needs.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumable import settings
from resumable._shm import COMPLETE
from resumable._shm_meta import decode_meta
from resumable.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ReplicaError,
    ReplicaPlacementError,
)
from resumable.replicas.domains import (
    Topology,
    check_replicas,
    peer_ranks,
    place_from_env,
    source_ranks,
)
from resumable.replicas.store import (
    CHUNK,
    Replica,
    ReplicaStore,
    plan_pieces,
    remove_dead_stores,
)
from resumable.replicas.transport import ReplicaClient, ReplicaServer

if TYPE_CHECKING:
    from resumable.audit import AuditLog
    from resumable.group import Group
    from resumable.monitor import Monitor
    from resumable.snapshot import MemorySnapshot, ShmArena

log = logging.getLogger(__name__)

ALERT_REPLICA = "replica_failed"


STALE_S = 24 * 3600.0  # replicas of a run nobody holds, unchanged this long, are removed
LOCAL_WAIT_S = 1.0  # how long a receiver waits for its own snapshot of a pushed step
MERGE = 64 << 10  # tensors smaller than this travel together, in pieces of up to this


def tensor_ranges(meta: bytes, data_len: int, chunk: int = CHUNK) -> list[tuple[int, int]] | None:
    """Piece ranges of a snapshot's data along its tensors (the slot metadata's
    ``layout``): each tensor its own pieces of at most ``chunk`` bytes, small
    neighbours merged up to `MERGE` only with tensors of their kind (``replicated``,
    every rank holds them whole, or not), so per-rank bytes never spoil a piece of
    replicated ones. None (fixed chunks) if `decode_meta` refuses the metadata."""
    try:
        parsed, layout = decode_meta(meta, data_len)
    except CorruptCheckpointError:
        return None
    replicated = set(parsed.replicated)
    starts = sorted((t.begin, t.name in replicated) for t in layout)
    starts = [(b, r) for b, r in starts if b < data_len]
    if not starts or starts[0][0] != 0:
        starts.insert(0, (0, False))
    ends = [b for b, _ in starts[1:]] + [data_len]
    ranges: list[tuple[int, int]] = []
    kinds: list[bool] = []
    for (begin, kind), end in zip(starts, ends):
        for at in range(begin, end, chunk):
            length = min(chunk, end - at)
            if ranges and kinds[-1] == kind and ranges[-1][1] + length <= MERGE:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
            else:
                ranges.append((at, length))
                kinds.append(kind)
    return ranges


@contextlib.contextmanager
def own_snapshot(
    arena: ShmArena | None, step: int, data_len: int, wait_s: float = LOCAL_WAIT_S
) -> Iterator[memoryview | None]:
    """A view of this rank's own complete snapshot of ``step`` (data region of
    ``data_len`` bytes), for its server to fill an incoming replica's pieces that are
    the same bytes (`ReplicaServer._fill_locally`, which checks each digest). Runs on a
    server thread while the trainer may write the slots: it only reads, and a slot
    rewritten meanwhile fails the digests. Waits up to ``wait_s`` for the snapshot (the
    ranks snapshot together; a peer may push before this rank finished its copy)."""
    view = None
    deadline = time.monotonic() + wait_s
    while arena is not None and view is None:
        found = False
        for slot in list(arena.slots):
            try:
                if slot is None:
                    continue
                c = slot.control()
                if c.state == COMPLETE and c.seq % 2 == 0 and c.step == step:
                    found = True
                    if c.data_len == data_len:
                        view = slot.data_view(data_len)
                    break
            except (CheckpointError, ValueError):  # closed meanwhile
                continue
        if found or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    try:
        yield view
    finally:
        if view is not None:
            view.release()


def rate_from_env() -> float | None:
    """``RESUMABLE_REPLICA_RATE`` in bytes per second, None for no limit."""
    raw = settings.REPLICA_RATE.read()
    if raw is None or raw.strip() in ("", "0"):
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib >= 0 or mib == float("inf"):
        raise ValueError(
            f"RESUMABLE_REPLICA_RATE should be MiB per second, a number >= 0 (0: no limit), "
            f"found {raw!r}"
        )
    return mib * 2**20 if mib > 0 else None


class Replication:
    """This rank's part of keeping each node's newest snapshot on ``replicas - 1`` other
    nodes: its `ReplicaServer` over a `ReplicaStore` in ``directory`` (the rank's
    shared-memory directory), the peers it pushes to, and the push thread."""

    def __init__(
        self,
        replicas: int,
        *,
        group: Group,
        run_id: str,
        directory: Path,
        key: str,
        audit: AuditLog,
        monitor: Monitor,
        arena: ShmArena | None = None,
        rate: float | None = None,
        io_timeout: float = 30.0,
    ) -> None:
        self.replicas = replicas
        self.group = group
        self.rank = group.rank
        self.run_id = run_id
        self.audit = audit
        self.monitor = monitor
        self._rate = rate
        self._io_timeout = io_timeout
        self._arena = arena  # this rank's own slots: pieces a peer sends that it holds
        # The job's secret: rank 0's random bytes, over the checkpoint group (the
        # ranks' own connections, set up by the rendezvous), before training starts.
        secret = group.broadcast(secrets.token_bytes(32) if self.rank == 0 else None)
        self._secret = bytes(secret)
        hosts = group.all_gather(socket.gethostname())
        self.host = settings.REPLICA_HOST.read() or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn()
        )
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        problem, place, address = None, None, None
        try:  # what can fail on one rank only: said on every rank below
            place = place_from_env()
            if self._rate is None:
                self._rate = rate_from_env()
            for path in remove_dead_stores(directory, "replicas-", STALE_S):
                log.info("removed the replicas %s of a run that ended without closing", path)
            self.store = ReplicaStore(directory / f"replicas-{key}-r{self.rank}", run_id)
            self.store.drop_other_runs()
            bind = "127.0.0.1" if self.host == "127.0.0.1" else ""
            self.server = ReplicaServer(
                self.store,
                secret=self._secret,
                rank=self.rank,
                host=bind,
                io_timeout=io_timeout,
                rate=self._rate,
                local=self._local if arena is not None else None,
            )
            address = (self.host, self.server.start()[1])
        except (OSError, CheckpointError, ValueError) as exc:
            problem = f"rank {self.rank}: {exc}"
        answers = group.all_gather((problem, place, address))
        problems = [a[0] for a in answers if a[0]]
        if problems:
            self.close()
            raise ReplicaError("replicas could not start: " + "; ".join(problems), reason="io")
        try:
            self.topology = Topology.from_places([a[1] for a in answers])
            check_replicas(replicas, self.topology.n_nodes)
        except ReplicaPlacementError:
            self.close()
            raise
        self.addresses: list[tuple[str, int]] = [(a[2][0], int(a[2][1])) for a in answers]
        self.peers = peer_ranks(self.rank, self.topology, replicas)
        self.sources = source_ranks(self.rank, self.topology, replicas)
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="resumable-replicate")
        self._pending: Future[list[str]] | None = None
        self._pending_step: int | None = None
        self._clients: dict[int, ReplicaClient] = {}
        self.stats = {
            "pushes": 0,
            "bytes_sent": 0,  # pushed bytes sent over the network
            "bytes_held": 0,  # pushed bytes the peer held already (not sent)
            "push_s": 0.0,
            "failures": 0,
            "fetches": 0,
        }
        self.newest_pushed: int | None = None  # the newest step every peer holds

    # ------------------------------------------------------------ start-up

    def check_room(self, snapshot_bytes: int, available: int, own_bytes: int) -> None:
        """Refuse (`ReplicaError`, reason ``space``, on every rank) before training when
        some rank's shared memory (``available`` bytes, counting what its own slots and
        replicas already take) cannot hold its own snapshots (``own_bytes``) and, at
        their peak, the replicas it keeps for its peers: while a newer replica is
        received, the previous one is kept, so two per source rank. Collective."""
        assert self.store is not None
        available += sum(i.path.stat().st_size for i in self.store.held() if i.path.exists())
        where = str(self.store.directory.parent)
        sizes = self.group.all_gather((snapshot_bytes, available, own_bytes, self.sources, where))
        problems = []
        for rank, (_, have, own, sources, at) in enumerate(sizes):
            incoming = sum(2 * int(sizes[s][0]) for s in sources)
            if own + incoming > have:
                steady = sum(int(sizes[s][0]) for s in sources)
                problems.append(
                    f"rank {rank}: shared memory {at} has {have / 2**20:.0f} MiB available; "
                    f"its own snapshots need {own / 2**20:.0f} MiB and replicas="
                    f"{self.replicas} keeps {incoming / 2**20:.0f} MiB of its peers' "
                    f"snapshots at the peak ({steady / 2**20:.0f} MiB in steady state)"
                )
        if problems:
            raise ReplicaError(
                "; ".join(problems[:8])
                + ". Enlarge /dev/shm (docker --shm-size, a larger tmpfs), or lower replicas",
                reason="space",
            )

    # ------------------------------------------------------------ pushing

    def wait(self) -> None:
        """Wait for the push of the previous snapshot; a failed one is reported (WARNING,
        audit entry, alert), never raised: the snapshot is still in this rank's memory,
        only a lost node would go back further."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step = self._pending_step
        try:
            errors = pending.result()
        except Exception as exc:  # a bug, not a peer's failure: said, not swallowed
            errors = [f"{type(exc).__name__}: {exc}"]
        if not errors:
            self.newest_pushed = step
            return
        self.stats["failures"] += 1
        message = (
            f"rank {self.rank} could not replicate its snapshot of step {step}: "
            + "; ".join(errors)
            + " (a node lost now goes back to an older step, or to storage)"
        )
        self.audit.record("replica_failed", step=step, rank=self.rank, reason=message[:500])
        self.monitor.alert(ALERT_REPLICA, message, step=step)

    def push(self, arena: ShmArena, snap: MemorySnapshot | Future[MemorySnapshot]) -> None:
        """Send ``snap`` (or the snapshot an overlapped copy publishes) to every peer, in
        the background; the next `wait` ends it."""
        self.wait()
        self._pending_step = snap.step if not isinstance(snap, Future) else None
        self._pending = self._exec.submit(self._push, arena, snap)

    def _push(self, arena: ShmArena, snap: MemorySnapshot | Future[MemorySnapshot]) -> list[str]:
        """Push one snapshot to every peer; returns what failed, as text (no exception
        or traceback keeps a view of the slot alive past this call)."""
        if isinstance(snap, Future):
            snap = snap.result()
            self._pending_step = snap.step
        slot = arena.slots[snap.index]
        got = slot.replica_bytes(snap.seq) if slot is not None else None
        if got is None:
            return [f"its slot no longer holds step {snap.step}"]
        meta, data = got
        errors: list[str] = []
        try:
            pieces = plan_pieces(meta, data, ranges=tensor_ranges(meta, len(data)))
            if slot is None or not slot.still(snap.seq):
                return [f"its slot was rewritten while step {snap.step} was read"]
            t0 = time.perf_counter()
            for peer in self.peers:
                client = self._clients.get(peer)
                if client is None:
                    client = self._clients[peer] = ReplicaClient(
                        self.addresses[peer],
                        secret=self._secret,
                        run_id=self.run_id,
                        rank=self.rank,
                        io_timeout=self._io_timeout,
                        rate=self._rate,
                    )
                sent, held = client.sent_bytes, client.skipped_bytes
                try:
                    client.push(snap.step, meta, data, pieces=pieces)
                except ReplicaError as exc:
                    errors.append(f"rank {peer} ({exc.reason}): {exc}")
                self.stats["bytes_sent"] += client.sent_bytes - sent
                self.stats["bytes_held"] += client.skipped_bytes - held
            self.stats["pushes"] += 1
            self.stats["push_s"] += time.perf_counter() - t0
        finally:
            del data, got
        return errors

    def _local(self, step: int, data_len: int) -> contextlib.AbstractContextManager[Any]:
        return own_snapshot(self._arena, step, data_len)

    # ------------------------------------------------------------ restoring

    def held(self) -> list[tuple[int, int]]:
        """``(source rank, step)`` of every complete replica this rank holds."""
        if self.store is None:
            return []
        return [(i.source_rank, i.step) for i in self.store.held()]

    def fetch(self, step: int, holders: list[int]) -> Replica:
        """This rank's snapshot of ``step`` from the first of ``holders`` (ranks) that
        serves it complete, every piece checked; `ReplicaError` naming each failure."""
        errors = []
        for holder in holders:
            if holder == self.rank:
                try:
                    assert self.store is not None
                    return self.store.read(self.rank, step)
                except ReplicaError as exc:
                    errors.append(f"its own store ({exc.reason}): {exc}")
                    continue
            client = ReplicaClient(
                self.addresses[holder],
                secret=self._secret,
                run_id=self.run_id,
                rank=self.rank,
                io_timeout=self._io_timeout,
            )
            try:
                with client:
                    replica = client.fetch(self.rank, step)
                self.stats["fetches"] += 1
                return replica
            except ReplicaError as exc:
                errors.append(f"rank {holder} ({exc.reason}): {exc}")
        raise ReplicaError(
            f"no peer served rank {self.rank}'s replica of step {step}: " + "; ".join(errors),
            reason="absent" if not errors else "corrupt",
        )

    def restored(self, step: int) -> None:
        """A restore went back to ``step``: replicas of later steps (a timeline left)
        are dropped, so the next pushes are not refused as older."""
        if self.store is None:
            return
        for info in self.store.held():
            if info.step > step:
                with contextlib.suppress(FileNotFoundError):
                    info.path.unlink()
        self.newest_pushed = None

    def close(self, *, unlink: bool = False) -> None:
        """Stop pushing and serving; with ``unlink`` (a run that finished cleanly) the
        replicas this rank holds for its peers are deleted too."""
        exec_ = getattr(self, "_exec", None)
        if exec_ is not None:
            with contextlib.suppress(Exception):
                self.wait()
            exec_.shutdown(wait=True)
        for client in getattr(self, "_clients", {}).values():
            client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.store is not None:
            self.store.close(remove=unlink)
            self.store = None
