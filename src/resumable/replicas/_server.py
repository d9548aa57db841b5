"""The replica server: one per rank, on its own threads.

`ReplicaServer` receives its peers' replicas into the rank's `ReplicaStore` and serves
them back to a rank that lost its own memory. It opens each connection with a fresh
nonce (the challenge), checks the client's ``hello`` (job secret, run id, rank) and
refuses a frame whose rank differs from the hello's. A rank may push only its own
snapshot. Each failed connection is logged and kept in `ReplicaServer.failures` for the
server's owner to report.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import xxhash

from resumable.errors import ReplicaError
from resumable.replicas._framing import (
    PROTOCOL,
    SMALL_FRAME,
    TO_CLIENT,
    TO_SERVER,
    Channel,
    TokenBucket,
    error_frame,
    int_field,
)
from resumable.replicas.store import (
    PartialReplica,
    ReplicaInfo,
    ReplicaStore,
    info_from_header,
)

log = logging.getLogger(__name__)

# snapshot data of ``step`` if it holds one complete of that length, else None.
LocalBytes = Callable[[int, int], AbstractContextManager[Any]]


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerFailure:
    """A connection the server gave up on, kept for its owner to report."""

    peer: str
    error: ReplicaError
    at: float = field(default_factory=time.time)


class ReplicaServer:
    """One rank's replica server: receives its peers' replicas into ``store`` and
    serves them back. `start` binds and returns the address; `stop` closes the
    listener and every connection and joins the threads.

    ``peers``: the ranks allowed to connect (None: any rank of the job). Every
    connection has ``io_timeout`` seconds for each socket operation, and is closed
    quietly after ``idle_timeout`` seconds without a request (a client reconnects)."""

    def __init__(
        self,
        store: ReplicaStore,
        *,
        secret: bytes,
        rank: int,
        host: str = "127.0.0.1",
        port: int = 0,
        peers: Collection[int] | None = None,
        io_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        max_connections: int = 32,
        rate: float | None = None,
        local: LocalBytes | None = None,
    ) -> None:
        if not secret:
            raise ReplicaError("the replica secret is empty; pass the job's secret", reason="io")
        self.store = store
        self._secret = bytes(secret)
        self.rank = rank
        self._bind = (host, port)
        self._peers = None if peers is None else frozenset(peers)
        self._io_timeout = io_timeout
        self._idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._rate = rate
        self._local = local
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._mutex = threading.Lock()
        self._stopping = threading.Event()
        self.failures: list[ServerFailure] = []
        self.address: tuple[str, int] | None = None

    def start(self) -> tuple[str, int]:
        listener = socket.create_server(self._bind, backlog=64)
        listener.settimeout(0.5)
        self._listener = listener
        self.address = listener.getsockname()[:2]
        thread = threading.Thread(
            target=self._accept_loop, name=f"resumable-replica-server-{self.rank}", daemon=True
        )
        thread.start()
        self._threads.add(thread)
        return self.address

    def __enter__(self) -> ReplicaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._mutex:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def take_failures(self) -> list[ServerFailure]:
        """The failures since the last call (the owner reports them)."""
        with self._mutex:
            found, self.failures = self.failures, []
        return found

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            if not self._slots.acquire(blocking=False):
                log.warning(
                    "replica server of rank %d: too many connections; closing one from %s",
                    self.rank,
                    addr,
                )
                conn.close()
                continue
            conn.settimeout(self._io_timeout)
            peer = f"{addr[0]}:{addr[1]}"
            thread = threading.Thread(
                target=self._serve,
                args=(conn, peer),
                name=f"resumable-replica-conn-{peer}",
                daemon=True,
            )
            with self._mutex:
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        limiter = TokenBucket(self._rate) if self._rate else None
        ch = Channel(conn, self._secret, out_dir=TO_CLIENT, in_dir=TO_SERVER, limiter=limiter)
        try:
            ch.send(
                {"type": "challenge", "protocol": PROTOCOL, "nonce": ch.my_nonce.hex()},
                nonce=b"",
                sequenced=False,
            )
            hello = ch.recv(max_payload=0, max_header=SMALL_FRAME)
            ch.adopt_peer_nonce(hello, "hello")  # authenticated: errors are sent under it
            sender = self._check_hello(hello.header)
            ch.send({"type": "welcome", "rank": self.rank})
            while True:
                try:
                    frame = ch.recv(max_payload=0, idle=self._idle_timeout)
                except ReplicaError as exc:
                    if exc.reason == "closed":
                        return  # the client closed, or went idle, between requests
                    raise
                self._check_rank(frame.header, sender)
                kind = frame.header.get("type")
                if kind == "put":
                    self._receive(ch, frame.header, sender)
                elif kind == "fetch":
                    self._send_replica(ch, frame.header)
                elif kind == "list":
                    held = [i.header() for i in self.store.held()]
                    ch.send({"type": "listing", "rank": self.rank, "replicas": held})
                elif kind == "bye":
                    return
                else:
                    raise ReplicaError(f"unknown request {str(kind)[:40]!r}", reason="refused")
        except (ReplicaError, OSError, ValueError, KeyError) as exc:
            if isinstance(exc, ReplicaError):
                error = exc
            else:
                reason = "timeout" if isinstance(exc, TimeoutError) else "io"
                error = ReplicaError(f"{type(exc).__name__}: {exc}", reason=reason)
            if not self._stopping.is_set():
                log.warning(
                    "replica server of rank %d: connection from %s failed: %s",
                    self.rank,
                    peer,
                    error,
                )
                with self._mutex:
                    self.failures.append(ServerFailure(peer, error))
            try:
                if ch.peer_nonce:
                    ch.send(error_frame(error))
                    _drain(conn)
            except OSError:
                pass
        finally:
            try:
                conn.close()
            finally:
                with self._mutex:
                    self._conns.discard(conn)
                    self._threads.discard(threading.current_thread())
                self._slots.release()

    def _check_hello(self, header: dict[str, Any]) -> int:
        if header.get("type") != "hello" or header.get("protocol") != PROTOCOL:
            raise ReplicaError(
                f"expected a hello of protocol {PROTOCOL}, received "
                f"{str(header.get('type'))[:20]!r} of protocol {header.get('protocol')!r}",
                reason="refused",
            )
        if header.get("run_id") != self.store.run_id:
            raise ReplicaError(
                f"a hello from run {str(header.get('run_id'))[:64]!r}; this server holds run "
                f"{self.store.run_id!r}: refused",
                reason="refused",
            )
        sender = int_field(header, "rank")
        if self._peers is not None and sender not in self._peers:
            raise ReplicaError(
                f"rank {sender} is not a peer of rank {self.rank} (peers {sorted(self._peers)})",
                reason="refused",
            )
        return sender

    def _check_rank(self, header: dict[str, Any], sender: int) -> None:
        if header.get("rank") != sender or header.get("run_id") != self.store.run_id:
            raise ReplicaError(
                f"a frame from rank {header.get('rank')!r} of run "
                f"{str(header.get('run_id'))[:64]!r} on the connection of rank {sender} of "
                f"run {self.store.run_id!r}: refused",
                reason="refused",
            )

    def _receive(self, ch: Channel, header: dict[str, Any], sender: int) -> None:
        source = int_field(header, "source_rank")
        if source != sender:
            raise ReplicaError(
                f"rank {sender} pushed a replica of rank {source}; a rank pushes only its own",
                reason="refused",
            )
        raw = {**header, "run_id": self.store.run_id, "version": 1}
        info = info_from_header(raw, self.store.directory)
        partial = self.store.begin(source, info.step, info.meta_len, info.data_len, info.pieces)
        try:
            have = self._fill_locally(partial, info)
            ch.send({"type": "ready", "rank": self.rank, "have": sorted(have)})
            for index in range(len(info.pieces)):
                if index in have:
                    continue
                writer = partial.piece_writer(index)

                def sink(h: dict[str, Any], w: Any = writer, i: int = index) -> Any:
                    if h.get("type") != "piece" or h.get("index") != i:
                        raise ReplicaError(
                            f"expected piece {i}, received {str(h)[:80]}", reason="refused"
                        )
                    return w.write

                frame = ch.recv(max_payload=0, sink=sink)
                self._check_rank(frame.header, sender)
                if frame.header.get("type") != "piece" or frame.header.get("index") != index:
                    raise ReplicaError(f"expected piece {index}", reason="refused")
                writer.finish()
            done = ch.recv(max_payload=0)
            self._check_rank(done.header, sender)
            if done.header.get("type") != "commit":
                raise ReplicaError(
                    f"expected commit, received {str(done.header.get('type'))[:20]!r}",
                    reason="refused",
                )
            stored = partial.commit()
        except ReplicaError as exc:
            partial.abort()
            if exc.reason == "closed":
                raise ReplicaError(
                    f"rank {sender} closed the connection in the middle of its replica at step "
                    f"{info.step}; the replica is discarded",
                    reason="truncated",
                ) from None
            raise
        except BaseException:
            partial.abort()
            raise
        log.debug(
            "replica server of rank %d: stored rank %d's step %d", self.rank, source, stored.step
        )
        ch.send({"type": "ok", "rank": self.rank, "replica": stored.header()})

    def _fill_locally(self, partial: PartialReplica, info: ReplicaInfo) -> set[int]:
        """The data pieces of an incoming replica this rank already holds, byte for
        byte, in its own snapshot of the same step (``local``: what data parallelism
        replicates, DDP parameters and moments), copied from there into the replica;
        a piece counts only once its digest matched, so a piece whose bytes differ
        (per-rank state, a shard) or changed while copied is asked of the sender."""
        if self._local is None or info.data_len == 0:
            return set()
        have: set[int] = set()
        with self._local(info.step, info.data_len) as view:
            if view is None:
                return have
            for index, p in enumerate(info.pieces):
                start = p.offset - info.meta_len
                if start < 0 or p.length == 0:
                    continue  # the metadata (per rank) always travels
                writer = partial.piece_writer(index)
                try:
                    writer.write(view[start : start + p.length])
                    writer.finish()
                except (ReplicaError, ValueError):
                    continue
                have.add(index)
        return have

    def _send_replica(self, ch: Channel, header: dict[str, Any]) -> None:
        source = int_field(header, "source_rank")
        step = header.get("step")
        if step is not None:
            step = int_field(header, "step")
        try:
            with self.store.mapped(source, step) as (info, payload):
                ch.send({"type": "replica", "rank": self.rank, "replica": info.header()})
                for index, p in enumerate(info.pieces):
                    piece = payload[p.offset : p.offset + p.length]
                    if xxhash.xxh3_64_hexdigest(piece) != p.digest:
                        raise ReplicaError(
                            f"replica {info.path}: piece {index} fails its digest; it was "
                            "damaged at rest and is not served",
                            reason="corrupt",
                        )
                    ch.send({"type": "piece", "rank": self.rank, "index": index}, piece)
                ch.send({"type": "end", "rank": self.rank})
        except ReplicaError as exc:
            if exc.reason != "absent":
                raise
            ch.send(error_frame(exc))


def _drain(conn: socket.socket, *, limit_s: float = 3.0) -> None:
    """After an error frame: stop sending and read what the client still sends for a
    moment, so that closing does not reset the connection before it reads the error."""
    conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + limit_s
    conn.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            if not conn.recv(1 << 16):
                return
        except TimeoutError:
            continue
        except OSError:
            return
