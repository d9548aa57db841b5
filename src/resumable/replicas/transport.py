"""Moving replicas between ranks: a TCP server per rank, and a client that pushes and fetches.

Each rank runs one `ReplicaServer` (in `resumable.replicas._server`) on its own threads.
It receives its peers' replicas and serves them back to a rank that lost its memory.
A `ReplicaClient` pushes this rank's snapshot to a peer and fetches one back. Both speak
authenticated frames (`resumable.replicas._framing`): JSON headers, raw payloads and an
HMAC-SHA256 per frame under the job's secret, never pickle. Each piece also carries its
XXH3-64 digest, checked before it counts as received. The cost is one SHA-256 pass over
the bytes on each side; replication runs in the background, under a rate limit.

A push is ``put``, one ``piece`` frame per piece, then ``commit``. A fetch is ``fetch``
answered ``replica``, the pieces, then ``end``. Every socket operation has a timeout.
Every failed client call raises `ReplicaError` with a ``reason``. The full rationale is
in docs/decisions.md.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from resumable.errors import ReplicaError
from resumable.replicas._framing import (
    CONTEXT,
    IO_CHUNK,
    MAX_HEADER,
    PROTOCOL,
    SMALL_FRAME,
    TO_CLIENT,
    TO_SERVER,
    Channel,
    Frame,
    TokenBucket,
    raise_if_error,
)
from resumable.replicas._server import LocalBytes, ReplicaServer, ServerFailure
from resumable.replicas.store import (
    CHUNK,
    Piece,
    Replica,
    ReplicaInfo,
    check_pieces,
    info_from_header,
    plan_pieces,
)

log = logging.getLogger(__name__)

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
            challenge = ch.recv(nonce=b"", sequenced=False, max_payload=0, max_header=SMALL_FRAME)
            raise_if_error(challenge, "challenge", self.peer)
            ch.adopt_peer_nonce(challenge, "challenge")
            ch.send(self._header("hello", protocol=PROTOCOL, nonce=ch.my_nonce.hex()))
            welcome = ch.recv(max_payload=0)
            raise_if_error(welcome, "welcome", self.peer)
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
            raise_if_error(ready, "ready", self.peer)
            have = _have(ready.header.get("have"), len(pieces))
            for index, p in enumerate(pieces):
                if index in have:
                    self.skipped_bytes += p.length
                    continue
                ch.send(self._header("piece", index=index), _slice(m, d, p.offset, p.length))
                self.sent_bytes += p.length
            ch.send(self._header("commit"))
            done = ch.recv(max_payload=0)
            raise_if_error(done, "ok", self.peer)
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
            raise_if_error(frame, "error-reply", self.peer)
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
            raise_if_error(head, "replica", self.peer)
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
                raise_if_error(frame, "piece", self.peer)
                if frame.header.get("index") != index:
                    raise ReplicaError(f"expected piece {index}", reason="refused")
                if at[0] != p.offset + p.length or hasher.hexdigest() != p.digest:
                    raise ReplicaError(
                        f"piece {index} of rank {source_rank}'s replica fails its digest",
                        reason="corrupt",
                    )
            end = ch.recv(max_payload=0)
            raise_if_error(end, "end", self.peer)
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
            raise_if_error(frame, "listing", self.peer)
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
    "CONTEXT",
    "IO_CHUNK",
    "MAX_HEADER",
    "PROTOCOL",
    "TO_CLIENT",
    "TO_SERVER",
    "Channel",
    "Frame",
    "LocalBytes",
    "ReplicaClient",
    "ReplicaServer",
    "ServerFailure",
    "TokenBucket",
    "fetch_replica",
    "push_replica",
]
