"""Moving replicas between ranks: a TCP server per rank, and a client that pushes and fetches.

Each rank runs one `ReplicaServer` on its own threads; it receives its peers' replicas
into its `ReplicaStore` and serves them back to a rank that lost its own memory. Its
own connections, never a collective on the training groups.

Every message is a frame::

    [header length, u32 BE][payload length, u64 BE][header JSON][payload][HMAC-SHA256, 32 B]

No pickle: headers are JSON, payloads raw bytes. The tag is an HMAC-SHA256 under the
job's secret (the caller passes it; in a job it comes from the rendezvous store) over
a context string, the direction, the *receiver's* nonce, the frame's sequence number,
both lengths, the header and the payload. A connection opens with a challenge: the
server sends a fresh random nonce, the client answers ``hello`` with its run id, rank
and its own nonce, MACed under the server's nonce, and the server's replies are MACed
under the client's nonce. So a frame recorded on one connection fails on any other
(another nonce), a frame replayed or reordered on the same one fails (another sequence
number), and a reply cannot be reflected back as a request (another direction). A
hello from another job fails its tag; one from the same job but another run id, or a
frame whose rank differs from the hello's, is refused by name. A rank may push only
its own snapshot (``source_rank`` must be the sender's rank).

The HMAC covers the payload, so a byte flipped on the wire fails the tag. Each piece
also carries its XXH3-64 digest, computed where the snapshot was read: the receiver
checks it before it marks the piece received, which catches bytes that changed
between digest and send (a slot rewritten by the next snapshot while it was sent).
The cost is one SHA-256 pass over the bytes on each side (about 1-2 GB/s per core
with SHA extensions); replication runs in the background, under a rate limit.

A push is: ``put`` (the replica's header, answered ``ready`` or an error), one
``piece`` frame per piece, ``commit`` (answered ``ok`` once the replica is complete in
the peer's store, or an error). A fetch: ``fetch`` answered ``replica``, the pieces,
``end``. Every socket operation has a timeout; every failure of a client call raises
`ReplicaError` with a ``reason``; the server logs each failed connection and keeps it
in `ReplicaServer.failures` for its owner to report.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from resumable.errors import ReplicaError
from resumable.replicas.store import (
    CHUNK,
    PartialReplica,
    Piece,
    Replica,
    ReplicaInfo,
    ReplicaStore,
    check_pieces,
    info_from_header,
    plan_pieces,
)

log = logging.getLogger(__name__)

PROTOCOL = 1
CONTEXT = b"resumable-replica-v1\0"
_LENGTHS = struct.Struct(">IQ")
_TAG = 32
_NONCE = 16
MAX_HEADER = 16 << 20  # a put's header lists its pieces: 100,000 tensors fit
_SMALL = 64 << 10  # frames before authentication
IO_CHUNK = 256 << 10
TO_SERVER, TO_CLIENT = b"C", b"S"


# --------------------------------------------------------------------------- rate limit


# ``local(step, data_len)``: a context manager giving a view of this rank's own
# snapshot data of ``step`` if it holds one complete of that length, else None.
LocalBytes = Callable[[int, int], AbstractContextManager[Any]]


class TokenBucket:
    """A sender's share of the network: at most ``rate`` bytes a second on average,
    bursts up to ``burst`` bytes (a quarter second's worth by default). `take` blocks
    the sending thread until the bytes may go. Not thread-safe: one per connection."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive bytes/s, found {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 4, IO_CHUNK))
        self._tokens = self.burst
        self._last = time.monotonic()

    def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= min(n, self.burst):
                self._tokens -= n
                return
            time.sleep((min(n, self.burst) - self._tokens) / self.rate)


# --------------------------------------------------------------------------- framing


@dataclass
class Frame:
    header: dict[str, Any]
    payload: bytes


class Channel:
    """One authenticated end of a connection: frames out under the peer's nonce and
    our sequence numbers, frames in under our nonce and the peer's. One thread uses it."""

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        *,
        out_dir: bytes,
        in_dir: bytes,
        limiter: TokenBucket | None = None,
    ) -> None:
        self.sock = sock
        # A frame goes out in several writes and the peer answers it: without this,
        # Nagle's algorithm holds each frame's tail until the peer's delayed ACK (40 ms
        # on Linux), several times a push (measured: 195 ms a push of 18 MiB that the
        # peer held, 15 ms of which was work).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._secret = secret
        self._out_dir, self._in_dir = out_dir, in_dir
        self.my_nonce = secrets.token_bytes(_NONCE)
        self.peer_nonce = b""
        self._out_seq = 0
        self._in_seq = 0
        self._limiter = limiter

    def _mac(self, direction: bytes, nonce: bytes, seq: int, hlen: int, plen: int) -> Any:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        mac.update(CONTEXT + direction + nonce + struct.pack(">Q", seq) + _LENGTHS.pack(hlen, plen))
        return mac

    # ---------------------------------------------------------------- sending

    def send(
        self,
        header: dict[str, Any],
        payload: Any = b"",
        *,
        nonce: bytes | None = None,
        sequenced: bool = True,
    ) -> None:
        """Send one frame; ``payload`` is a buffer (sent without a copy)."""
        seq = self._out_seq if sequenced else 0
        head = json.dumps({**header, "seq": seq}, separators=(",", ":")).encode()
        body = memoryview(payload).cast("B")
        lengths = _LENGTHS.pack(len(head), len(body))
        mac = self._mac(
            self._out_dir, self.peer_nonce if nonce is None else nonce, seq, len(head), len(body)
        )
        mac.update(head)
        self._sendall(lengths + head)
        for at in range(0, len(body), IO_CHUNK):
            chunk = body[at : at + IO_CHUNK]
            mac.update(chunk)
            self._sendall(chunk)
        self._sendall(mac.digest())
        if sequenced:
            self._out_seq += 1

    def _sendall(self, data: Any) -> None:
        if self._limiter is not None:
            self._limiter.take(len(data))
        self.sock.sendall(data)

    # ---------------------------------------------------------------- receiving

    def _recv_exact(
        self, n: int, into: memoryview | None = None, *, first: bool = False
    ) -> memoryview:
        buf = into if into is not None else memoryview(bytearray(n))
        got = 0
        while got < n:
            k = self.sock.recv_into(buf[got:], n - got)
            if k == 0:
                if first and got == 0:
                    raise ReplicaError("the peer closed the connection", reason="closed")
                raise ReplicaError(
                    f"the peer closed the connection after {got} of {n} bytes of a frame",
                    reason="truncated",
                )
            got += k
        return buf

    def recv(
        self,
        *,
        nonce: bytes | None = None,
        sequenced: bool = True,
        max_payload: int = 64 << 20,
        sink: Callable[[dict[str, Any]], Callable[[memoryview], None] | None] | None = None,
        max_header: int = MAX_HEADER,
        idle: float | None = None,
    ) -> Frame:
        """Receive one frame and check its tag and sequence number; `ReplicaError`
        (``refused``) if either fails. With ``sink``, a payload is not kept: ``sink``
        is called with the (not yet authenticated) header and returns a function that
        takes the payload chunk by chunk, or None to keep it (up to ``max_payload``).
        The caller must discard what the sink took if this raises. ``idle``: the
        timeout for the frame's first byte (then the socket's own); a frame that does not
        start in time raises `ReplicaError` (``closed``)."""
        if idle is not None:
            io_timeout = self.sock.gettimeout()
            self.sock.settimeout(idle)
            try:
                first = self._recv_exact(1, first=True)
            except TimeoutError:
                raise ReplicaError("the connection was idle too long", reason="closed") from None
            finally:
                self.sock.settimeout(io_timeout)
            lengths = bytes(first) + bytes(self._recv_exact(_LENGTHS.size - 1))
        else:
            lengths = bytes(self._recv_exact(_LENGTHS.size, first=True))
        hlen, plen = _LENGTHS.unpack(lengths)
        if hlen > max_header:
            raise ReplicaError(
                f"a frame header of {hlen} bytes (at most {max_header}); not a replica peer?",
                reason="refused",
            )
        seq = self._in_seq if sequenced else 0
        mac = self._mac(self._in_dir, self.my_nonce if nonce is None else nonce, seq, hlen, plen)
        head = bytes(self._recv_exact(hlen))
        mac.update(head)
        try:
            header = json.loads(head)
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise ReplicaError("a frame header is not a JSON object", reason="refused")
        take = sink(header) if sink is not None and plen else None
        payload = b""
        if take is None:
            if plen > max_payload:
                raise ReplicaError(
                    f"a frame of {plen} payload bytes (at most {max_payload})", reason="refused"
                )
            payload = bytes(self._recv_exact(plen))
            mac.update(payload)
        else:
            scratch = memoryview(bytearray(min(plen, IO_CHUNK)))
            left = plen
            while left:
                n = min(left, len(scratch))
                chunk = self._recv_exact(n, scratch[:n])
                mac.update(chunk)
                take(chunk)
                left -= n
        tag = bytes(self._recv_exact(_TAG))
        if not hmac.compare_digest(tag, mac.digest()) or header.get("seq") != seq:
            raise ReplicaError(
                f"a {str(header.get('type'))[:20]!r} frame fails its authentication (HMAC-SHA256 "
                "under the job's secret, this connection's nonce and sequence number): "
                "another job, a damaged frame, or a replay; refused",
                reason="refused",
            )
        if sequenced:
            self._in_seq += 1
        return Frame(header, payload)


def _error_frame(exc: BaseException) -> dict[str, Any]:
    reason = exc.reason if isinstance(exc, ReplicaError) else "io"
    return {"type": "error", "reason": reason, "message": str(exc)[:2000]}


def _raise_if_error(frame: Frame, expected: str, peer: str) -> None:
    kind = frame.header.get("type")
    if kind == "error":
        raise ReplicaError(
            f"replica peer {peer} refused: {frame.header.get('message')}",
            reason=str(frame.header.get("reason", "refused")),
        )
    if kind != expected:
        raise ReplicaError(
            f"replica peer {peer}: expected a {expected!r} frame, received {kind!r}",
            reason="refused",
        )


def _int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ReplicaError(
            f"field {name!r} should be a non-negative integer, found {value!r}", reason="refused"
        )
    return value


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
            hello = ch.recv(max_payload=0, max_header=_SMALL)
            nonce = hello.header.get("nonce")
            if not isinstance(nonce, str) or len(nonce) != 2 * _NONCE:
                raise ReplicaError("a hello without a nonce", reason="refused")
            ch.peer_nonce = bytes.fromhex(nonce)  # authenticated: errors are sent under it
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
                    ch.send(_error_frame(error))
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
        sender = _int_field(header, "rank")
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
        source = _int_field(header, "source_rank")
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
        source = _int_field(header, "source_rank")
        step = header.get("step")
        if step is not None:
            step = _int_field(header, "step")
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
            ch.send(_error_frame(exc))


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


# --------------------------------------------------------------------------- client


class ReplicaClient:
    """A connection to one peer's `ReplicaServer`, as rank ``rank`` of run ``run_id``.

    Used by one thread (the rank's replication thread); every call raises
    `ReplicaError` on failure and leaves the connection closed after one. ``rate``
    (bytes/s) caps what this connection sends."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        secret: bytes,
        run_id: str,
        rank: int,
        connect_timeout: float = 10.0,
        io_timeout: float = 30.0,
        rate: float | None = None,
    ) -> None:
        self.address = (address[0], int(address[1]))
        self.peer = f"{self.address[0]}:{self.address[1]}"
        self._secret = bytes(secret)
        self.run_id = run_id
        self.rank = rank
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._limiter = TokenBucket(rate) if rate else None
        self._ch: Channel | None = None
        self.peer_rank: int | None = None
        self.sent_bytes = 0  # pushed pieces' bytes sent
        self.skipped_bytes = 0  # and those the peer held already (`ReplicaServer` local)

    def _fail(self, exc: BaseException, doing: str) -> ReplicaError:
        self.close()
        if isinstance(exc, ReplicaError):
            reason = "io" if exc.reason == "closed" else exc.reason
            return ReplicaError(f"{doing} (peer {self.peer}): {exc}", reason=reason)
        reason = "timeout" if isinstance(exc, TimeoutError) else "io"
        return ReplicaError(
            f"{doing} (peer {self.peer}) failed: {type(exc).__name__}: {exc}", reason=reason
        )

    def connect(self) -> None:
        if self._ch is not None:
            return
        try:
            sock = socket.create_connection(self.address, timeout=self._connect_timeout)
        except OSError as exc:
            raise self._fail(exc, "connecting to a replica peer") from exc
        sock.settimeout(self._io_timeout)
        ch = Channel(sock, self._secret, out_dir=TO_SERVER, in_dir=TO_CLIENT, limiter=self._limiter)
        self._ch = ch
        try:
            challenge = ch.recv(nonce=b"", sequenced=False, max_payload=0, max_header=_SMALL)
            _raise_if_error(challenge, "challenge", self.peer)
            nonce = challenge.header.get("nonce")
            if not isinstance(nonce, str) or len(nonce) != 2 * _NONCE:
                raise ReplicaError("a challenge without a nonce", reason="refused")
            ch.peer_nonce = bytes.fromhex(nonce)
            ch.send(self._header("hello", protocol=PROTOCOL, nonce=ch.my_nonce.hex()))
            welcome = ch.recv(max_payload=0)
            _raise_if_error(welcome, "welcome", self.peer)
            self.peer_rank = welcome.header.get("rank")
        except (ReplicaError, OSError, ValueError) as exc:
            raise self._fail(exc, "authenticating to a replica peer") from exc

    def _header(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "run_id": self.run_id, "rank": self.rank, **fields}

    def close(self) -> None:
        if self._ch is not None:
            try:
                self._ch.sock.close()
            finally:
                self._ch = None

    def __enter__(self) -> ReplicaClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ch is not None:
            try:
                self._ch.send(self._header("bye"))
            except OSError:
                pass
        self.close()

    def push(
        self,
        step: int,
        meta: Any,
        data: Any,
        *,
        pieces: Sequence[Piece] | None = None,
        chunk: int = CHUNK,
    ) -> ReplicaInfo:
        """Send this rank's snapshot at ``step`` (``meta``: its metadata JSON bytes,
        ``data``: its data region) and return once the peer holds it complete. The
        digests are those in ``pieces`` (computed by `plan_pieces` when None): pass
        digests taken when the snapshot was consistent, and bytes changed since are
        refused by the peer. Raises `ReplicaError`; the peer then holds no new replica
        and keeps its previous one."""
        m, d = memoryview(meta).cast("B"), memoryview(data).cast("B")
        if pieces is None:
            pieces = plan_pieces(m, d, chunk=chunk)
        check_pieces(pieces, len(m) + len(d))
        self.connect()
        ch = self._ch
        assert ch is not None
        header = self._header(
            "put",
            source_rank=self.rank,
            step=step,
            meta_len=len(m),
            data_len=len(d),
            pieces=[[p.offset, p.length, p.digest] for p in pieces],
        )
        try:
            ch.send(header)
            ready = ch.recv(max_payload=0)
            _raise_if_error(ready, "ready", self.peer)
            have = _have(ready.header.get("have"), len(pieces))
            for index, p in enumerate(pieces):
                if index in have:
                    self.skipped_bytes += p.length
                    continue
                ch.send(self._header("piece", index=index), _slice(m, d, p.offset, p.length))
                self.sent_bytes += p.length
            ch.send(self._header("commit"))
            done = ch.recv(max_payload=0)
            _raise_if_error(done, "ok", self.peer)
            return info_from_header(done.header.get("replica"), Path(f"tcp:{self.peer}"))
        except (ReplicaError, OSError, ValueError) as exc:
            reply = self._late_error(ch) if not isinstance(exc, ReplicaError) else None
            raise self._fail(reply or exc, f"pushing rank {self.rank}'s step {step}") from exc

    def _late_error(self, ch: Channel) -> ReplicaError | None:
        """The error frame a server sent before it closed, if one can still be read."""
        try:
            ch.sock.settimeout(2.0)
            frame = ch.recv(max_payload=0)
        except (ReplicaError, OSError):
            return None
        if frame.header.get("type") != "error":
            return None
        try:
            _raise_if_error(frame, "error-reply", self.peer)
        except ReplicaError as exc:
            return exc
        return None

    def fetch(self, source_rank: int, step: int | None = None) -> Replica:
        """The peer's complete replica of ``source_rank`` at ``step`` (its newest if
        None), every piece checked against its digest. Raises `ReplicaError`
        (``absent`` when the peer holds none)."""
        self.connect()
        ch = self._ch
        assert ch is not None
        try:
            ch.send(self._header("fetch", source_rank=source_rank, step=step))
            head = ch.recv(max_payload=0)
            _raise_if_error(head, "replica", self.peer)
            raw = head.header.get("replica")
            info = info_from_header(raw, Path(f"tcp:{self.peer}"))
            if (
                info.run_id != self.run_id
                or info.source_rank != source_rank
                or (step is not None and info.step != step)
            ):
                raise ReplicaError(
                    f"asked for rank {source_rank}'s replica at step {step} of run {self.run_id}, "
                    f"received rank {info.source_rank}'s at step {info.step} of run {info.run_id}",
                    reason="refused",
                )
            buf = bytearray(info.nbytes)
            view = memoryview(buf)
            for index, p in enumerate(info.pieces):
                hasher = xxhash.xxh3_64()
                at = [p.offset]

                def sink(
                    h: dict[str, Any],
                    hasher: Any = hasher,
                    at: list[int] = at,
                    end: int = p.offset + p.length,
                ) -> Any:
                    def take(chunk: memoryview) -> None:
                        n = len(chunk)
                        if at[0] + n > end:
                            raise ReplicaError("a piece longer than announced", reason="corrupt")
                        view[at[0] : at[0] + n] = chunk
                        hasher.update(chunk)
                        at[0] += n

                    return take

                frame = ch.recv(max_payload=0, sink=sink)
                _raise_if_error(frame, "piece", self.peer)
                if frame.header.get("index") != index:
                    raise ReplicaError(f"expected piece {index}", reason="refused")
                if at[0] != p.offset + p.length or hasher.hexdigest() != p.digest:
                    raise ReplicaError(
                        f"piece {index} of rank {source_rank}'s replica fails its digest",
                        reason="corrupt",
                    )
            end = ch.recv(max_payload=0)
            _raise_if_error(end, "end", self.peer)
        except (ReplicaError, OSError, ValueError) as exc:
            raise self._fail(exc, f"fetching rank {source_rank}'s replica") from exc
        return Replica(info, buf)

    def held(self) -> list[ReplicaInfo]:
        """The complete replicas the peer holds for this run."""
        self.connect()
        ch = self._ch
        assert ch is not None
        try:
            ch.send(self._header("list"))
            frame = ch.recv(max_payload=0)
            _raise_if_error(frame, "listing", self.peer)
            raw = frame.header.get("replicas")
            if not isinstance(raw, list):
                raise ReplicaError("a listing without replicas", reason="refused")
            return [info_from_header(r, Path(f"tcp:{self.peer}")) for r in raw]
        except (ReplicaError, OSError, ValueError) as exc:
            raise self._fail(exc, "listing a peer's replicas") from exc


def _have(raw: Any, n: int) -> set[int]:
    """The piece indices a server's ``ready`` says it holds already (none if absent)."""
    if raw is None:
        return set()
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in raw
    ):
        raise ReplicaError(f"a ready frame names pieces {str(raw)[:80]}", reason="refused")
    return set(raw)


def _slice(meta: memoryview, data: memoryview, offset: int, length: int) -> Any:
    """Bytes ``[offset, offset+length)`` of ``meta || data`` (a copy only when a piece
    straddles the two)."""
    m = len(meta)
    if offset + length <= m:
        return meta[offset : offset + length]
    if offset >= m:
        return data[offset - m : offset - m + length]
    return bytes(meta[offset:]) + bytes(data[: offset + length - m])


def push_replica(
    address: tuple[str, int],
    *,
    secret: bytes,
    run_id: str,
    rank: int,
    step: int,
    meta: Any,
    data: Any,
    rate: float | None = None,
    io_timeout: float = 30.0,
) -> ReplicaInfo:
    """One push on a fresh connection (`ReplicaClient.push`)."""
    with ReplicaClient(
        address, secret=secret, run_id=run_id, rank=rank, rate=rate, io_timeout=io_timeout
    ) as c:
        return c.push(step, meta, data)


def fetch_replica(
    address: tuple[str, int],
    *,
    secret: bytes,
    run_id: str,
    rank: int,
    source_rank: int,
    step: int | None = None,
    io_timeout: float = 30.0,
) -> Replica:
    """One fetch on a fresh connection (`ReplicaClient.fetch`)."""
    with ReplicaClient(
        address, secret=secret, run_id=run_id, rank=rank, io_timeout=io_timeout
    ) as c:
        return c.fetch(source_rank, step)


__all__ = [
    "ReplicaClient",
    "ReplicaServer",
    "ServerFailure",
    "TokenBucket",
    "fetch_replica",
    "push_replica",
]
