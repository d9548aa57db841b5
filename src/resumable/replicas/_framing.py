"""The replica transport's frames: authenticated, sequenced, rate-limited.

Every message is a frame::

    [header length, u32 BE][payload length, u64 BE][header JSON][payload][HMAC-SHA256, 32 B]

No pickle: headers are JSON, payloads raw bytes. The tag is an HMAC-SHA256 under the
job's secret over a context string, the direction, the *receiver's* nonce, the frame's
sequence number, both lengths, the header and the payload. So a frame recorded on one
connection, replayed, reordered or reflected fails its tag. `Channel` is one end of a
connection; `TokenBucket` caps what it sends.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resumable.errors import ReplicaError

log = logging.getLogger(__name__)

PROTOCOL = 1
CONTEXT = b"resumable-replica-v1\0"
_LENGTHS = struct.Struct(">IQ")
_TAG = 32
NONCE = 16
MAX_HEADER = 16 << 20  # a put's header lists its pieces: 100,000 tensors fit
SMALL_FRAME = 64 << 10  # frames before authentication
IO_CHUNK = 256 << 10
TO_SERVER, TO_CLIENT = b"C", b"S"

# --------------------------------------------------------------------------- rate limit


# ``local(step, data_len)``: a context manager giving a view of this rank's own


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
        self.my_nonce = secrets.token_bytes(NONCE)
        self.peer_nonce = b""
        self._out_seq = 0
        self._in_seq = 0
        self._limiter = limiter

    def adopt_peer_nonce(self, frame: Frame, what: str) -> None:
        """Take the nonce in ``frame``, the peer's ``what`` (its challenge or hello), as the
        peer's: every frame sent from now on is under it. Raises `ReplicaError` ("refused")
        when the frame carries no nonce of `NONCE` bytes, `ValueError` when it is not hex."""
        nonce = frame.header.get("nonce")
        if not isinstance(nonce, str) or len(nonce) != 2 * NONCE:
            raise ReplicaError(f"a {what} without a nonce", reason="refused")
        self.peer_nonce = bytes.fromhex(nonce)

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


def error_frame(exc: BaseException) -> dict[str, Any]:
    reason = exc.reason if isinstance(exc, ReplicaError) else "io"
    return {"type": "error", "reason": reason, "message": str(exc)[:2000]}


def raise_if_error(frame: Frame, expected: str, peer: str) -> None:
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


def int_field(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ReplicaError(
            f"field {name!r} should be a non-negative integer, found {value!r}", reason="refused"
        )
    return value
