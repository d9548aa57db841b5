"""Fault injection between an S3 client and a real S3 server: a loopback HTTP/1.1 proxy.

Faults are injected per request, so the proxy parses HTTP rather than copying bytes: each
request head, its body (``Content-Length``, or ``Transfer-Encoding: chunked`` with trailers,
which also carries ``aws-chunked`` payloads untouched), each response head and body
(length, chunked, read-to-close, or none for HEAD / 1xx / 204 / 304). Bodies are streamed,
never buffered whole, and are relayed byte for byte, so signatures and checksums still
verify upstream. The proxy answers ``Expect: 100-continue`` itself and drops that header
upstream (SigV4 never signs it).

One thread serves each client connection and owns one keep-alive connection upstream.
Requests get global indices 0, 1, 2, ... in the order their heads arrive; the fault for a
request comes from an explicit `FaultProxy.schedule` entry for its index, else from the
rates of `FaultProxy.set_faults` drawn from one seeded ``random.Random`` (deterministic for
a client that sends one request at a time). The fault kinds:

- ``error``: answer a well-formed S3 XML error (500 InternalError, 503 SlowDown, ...)
  without forwarding; the connection stays usable.
- ``reset``: read the request, then reset the client connection (RST) without forwarding.
- ``lost_response``: forward the request, read the server's whole response (so the request
  took effect), then reset the client connection instead of relaying it.
- ``delay``: wait ``delay_s`` before forwarding.

`FaultProxy.drop_request_headers` strips headers from every forwarded request, which
makes the server behave as one that ignores them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Protocol, cast
from urllib.parse import urlsplit

MAX_LINE = 64 * 1024
CHUNK = 256 * 1024
UPSTREAM_TIMEOUT_S = 60.0
ACTIONS = ("pass", "error", "reset", "lost_response", "delay")
S3_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "Bad gateway."),
    503: ("SlowDown", "Please reduce your request rate."),
    504: ("GatewayTimeout", "The gateway timed out."),
}

Sink = Callable[[bytes], None]
RequestCallback = Callable[[int, str, str], None]
Match = Callable[[str, str], bool]


class Reader(Protocol):
    """A buffered binary stream (``socket.makefile("rb")``, ``io.BufferedReader``)."""

    def readline(self, size: int = -1, /) -> bytes: ...

    def read1(self, size: int = -1, /) -> bytes: ...


class ProtocolError(Exception):
    """A message the proxy cannot frame (a proxy bug or a broken peer)."""


class Truncated(ProtocolError):
    """The peer closed the connection in the middle of a message."""


class UpstreamError(Exception):
    """The upstream server could not be reached or broke the connection mid-exchange."""


@dataclass(frozen=True)
class ProxiedRequest:
    """One request seen by the proxy.

    ``path`` is the request target (path and query). ``action`` is one of `ACTIONS`.
    ``status`` is the status sent to the client (set just before its head goes out), ``None``
    until then and for resets.
    """

    index: int
    method: str
    path: str
    action: str
    status: int | None = None


@dataclass(frozen=True)
class Faults:
    """Per-request fault probabilities; they must sum to at most 1."""

    error_rate: float = 0.0
    error_codes: tuple[int, ...] = (500, 503)
    reset_rate: float = 0.0
    delay_rate: float = 0.0
    delay_s: float = 0.0
    lost_response_rate: float = 0.0
    match: Match | None = None

    def __post_init__(self) -> None:
        rates = (self.error_rate, self.reset_rate, self.lost_response_rate, self.delay_rate)
        if any(r < 0 for r in rates) or sum(rates) > 1.0 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1, got {rates}")
        if not self.error_codes or any(c not in S3_ERRORS for c in self.error_codes):
            raise ValueError(f"error_codes must be a non-empty subset of {sorted(S3_ERRORS)}")


@dataclass(frozen=True)
class Head:
    """A message head: the start line and the header lines, kept as received."""

    start: str
    lines: tuple[str, ...]

    def values(self, name: str) -> list[str]:
        prefix = name.lower() + ":"
        return [ln.split(":", 1)[1].strip() for ln in self.lines if ln.lower().startswith(prefix)]

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for v in self.values(name) for t in v.split(",") if t.strip()}

    def content_length(self) -> int | None:
        values = {v.strip() for v in self.values("content-length")}
        if not values:
            return None
        if len(values) > 1 or not values.pop().isdigit():
            raise ProtocolError(f"bad Content-Length in {self.start!r}")
        return int(self.values("content-length")[0])

    def encode(self, drop: Iterable[str] = ()) -> bytes:
        dropped = {d.lower() + ":" for d in drop}
        kept = [ln for ln in self.lines if not any(ln.lower().startswith(d) for d in dropped)]
        return "\r\n".join([self.start, *kept, "", ""]).encode("latin-1")


def read_head(reader: Reader) -> Head | None:
    """The next message head, or ``None`` on a clean end of stream between messages."""
    lines: list[str] = []
    while True:
        line = reader.readline(MAX_LINE)
        if not line:
            if lines:
                raise Truncated("connection closed inside a message head")
            return None
        if not line.endswith(b"\n"):
            raise ProtocolError("message head line too long")
        text = line.rstrip(b"\r\n").decode("latin-1")
        if not text:
            if lines:
                return Head(lines[0], tuple(lines[1:]))
            continue  # a stray CRLF between messages
        lines.append(text)


def copy_exact(reader: Reader, size: int, sink: Sink) -> None:
    while size > 0:
        data = reader.read1(min(size, CHUNK))
        if not data:
            raise Truncated(f"connection closed with {size} body bytes missing")
        sink(data)
        size -= len(data)


def copy_chunked(reader: Reader, sink: Sink) -> None:
    """Relay a chunked body verbatim: chunk-size lines (extensions too), data, trailers."""
    while True:
        line = reader.readline(MAX_LINE)
        if not line:
            raise Truncated("connection closed before a chunk-size line")
        if not line.endswith(b"\n"):
            raise ProtocolError("chunk-size line too long")
        sink(line)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProtocolError(f"bad chunk-size line {line[:80]!r}") from None
        if size == 0:
            break
        copy_exact(reader, size + 2, sink)
    while True:
        line = reader.readline(MAX_LINE)
        if not line:
            raise Truncated("connection closed inside chunked trailers")
        if not line.endswith(b"\n"):
            raise ProtocolError("chunked trailer line too long")
        sink(line)
        if line in (b"\r\n", b"\n"):
            return


def copy_to_close(reader: Reader, sink: Sink) -> None:
    while data := reader.read1(CHUNK):
        sink(data)


def copy_body(reader: Reader, framing: str, length: int, sink: Sink) -> None:
    if framing == "chunked":
        copy_chunked(reader, sink)
    elif framing == "length":
        copy_exact(reader, length, sink)
    elif framing == "close":
        copy_to_close(reader, sink)


def request_framing(head: Head) -> tuple[str, int]:
    if "chunked" in head.tokens("transfer-encoding"):
        return "chunked", 0
    length = head.content_length()
    return ("length", length) if length else ("none", 0)


def response_framing(method: str, status: int, head: Head) -> tuple[str, int]:
    if method == "HEAD" or status < 200 or status in (204, 304):
        return "none", 0
    if "chunked" in head.tokens("transfer-encoding"):
        return "chunked", 0
    length = head.content_length()
    return ("close", 0) if length is None else ("length", length)


def discard(data: bytes) -> None:
    del data


def s3_error(code: int, method: str, path: str, index: int, close: bool) -> bytes:
    name, message = S3_ERRORS[code]
    request_id = f"faultproxy-{index}"
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{name}</Code><Message>{message}</Message>"
        f"<Resource>{path.split('?', 1)[0]}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    lines = [
        f"HTTP/1.1 {code} {HTTPStatus(code).phrase}",
        "Content-Type: application/xml",
        f"Content-Length: {0 if method == 'HEAD' else len(body)}",
        f"x-amz-request-id: {request_id}",
    ]
    if close:
        lines.append("Connection: close")
    return "\r\n".join([*lines, "", ""]).encode() + (b"" if method == "HEAD" else body)


class Peer:
    """A socket with a buffered reader; `close` can reset (RST) instead of closing cleanly."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = cast(io.BufferedReader, sock.makefile("rb", buffering=CHUNK))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def idle_but_readable(self) -> bool:
        """Readable while no response is due: the peer closed (or misbehaves); don't reuse."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def close(self, reset: bool = False) -> None:
        with contextlib.suppress(OSError):
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            self.reader.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class FaultProxy:
    """A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream``.

    Thread safety: the configuration methods may be called from any thread at any time;
    a change applies to requests whose heads arrive afterwards. The `on_request` callback
    runs on the connection's thread before the request is acted on; an exception in it
    is recorded in `errors` and resets that client connection.
    """

    def __init__(self, upstream: str, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._faults = Faults()
        self._schedule: dict[int, str] = {}
        self._callback: RequestCallback | None = None
        self._dropped: tuple[str, ...] = ()
        self._records: list[ProxiedRequest] = []
        self._errors: list[BaseException] = []
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._connections: set[Connection] = set()
        self._threads: list[threading.Thread] = []
        self.endpoint = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        if self._listener is not None:
            raise RuntimeError("FaultProxy already started")
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.1)
        self._listener = listener
        self.endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._accepter = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._accepter.start()
        return self

    def stop(self) -> None:
        """Stop accepting, cut every open connection, join the threads. Idempotent."""
        self._stopping.set()
        if self._accepter is not None:
            self._accepter.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            connections = list(self._connections)
            threads = list(self._threads)
        for connection in connections:
            connection.shutdown()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ configuration

    def set_faults(
        self,
        error_rate: float = 0.0,
        error_codes: tuple[int, ...] = (500, 503),
        reset_rate: float = 0.0,
        delay_rate: float = 0.0,
        delay_s: float = 0.0,
        lost_response_rate: float = 0.0,
        match: Match | None = None,
    ) -> None:
        """Replace the random faults; ``match(method, path)`` limits them to some requests."""
        faults = Faults(
            error_rate=error_rate,
            error_codes=tuple(error_codes),
            reset_rate=reset_rate,
            delay_rate=delay_rate,
            delay_s=delay_s,
            lost_response_rate=lost_response_rate,
            match=match,
        )
        with self._lock:
            self._faults = faults

    def schedule(self, actions: Mapping[int, str | int]) -> None:
        """Force the action of given request indices (added to earlier entries).

        Values: an action name from `ACTIONS`, or an error status (``500``, ``"503"``).
        Scheduled actions ignore ``match``; ``"delay"`` uses the current ``delay_s``.
        """
        checked: dict[int, str] = {}
        for index, action in actions.items():
            name = str(action)
            if name not in ACTIONS and not (name.isdigit() and int(name) in S3_ERRORS):
                raise ValueError(f"unknown action {action!r} for request {index}")
            checked[index] = name
        with self._lock:
            self._schedule.update(checked)

    def clear_faults(self) -> None:
        """No random faults and no scheduled actions; the callback and records stay."""
        with self._lock:
            self._faults = Faults()
            self._schedule.clear()

    def drop_request_headers(self, *names: str) -> None:
        """Remove these headers from every request forwarded upstream (replacing the
        earlier list; none: forward all). Simulates a server that ignores a header, e.g.
        ``If-None-Match``; the request's signature then no longer matches, which only a
        server that checks signatures notices."""
        with self._lock:
            self._dropped = tuple(names)

    def on_request(self, callback: RequestCallback | None) -> None:
        """Call ``callback(index, method, path)`` before acting on each request (None: off)."""
        with self._lock:
            self._callback = callback

    # ------------------------------------------------------------------ observation

    @property
    def requests(self) -> list[ProxiedRequest]:
        """A snapshot of every request seen so far, by index."""
        with self._lock:
            return list(self._records)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._records)

    @property
    def errors(self) -> list[BaseException]:
        """Callback exceptions, unframeable messages and upstream failures, in order."""
        with self._lock:
            return list(self._errors)

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = Connection(self, Peer(sock))
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            with self._lock:
                self._connections.add(connection)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _decide(self, method: str, path: str) -> tuple[int, str, int, RequestCallback | None]:
        """Index the request and pick its action (and error status) under the lock."""
        with self._lock:
            index = len(self._records)
            faults = self._faults
            scheduled = self._schedule.pop(index, None)
            code = 0
            if scheduled is not None:
                action = scheduled
                if action.isdigit():
                    action, code = "error", int(action)
            elif faults.match is None or faults.match(method, path):
                draw = self._rng.random()
                action = "pass"
                for name, rate in (
                    ("error", faults.error_rate),
                    ("reset", faults.reset_rate),
                    ("lost_response", faults.lost_response_rate),
                    ("delay", faults.delay_rate),
                ):
                    if draw < rate:
                        action = name
                        break
                    draw -= rate
            else:
                action = "pass"
            if action == "error" and not code:
                code = self._rng.choice(faults.error_codes)
            self._records.append(ProxiedRequest(index, method, path, action))
            return index, action, code, self._callback

    def _dropped_headers(self) -> tuple[str, ...]:
        with self._lock:
            return self._dropped

    def _delay_s(self) -> float:
        with self._lock:
            return self._faults.delay_s

    def _finish(self, index: int, status: int) -> None:
        with self._lock:
            self._records[index] = dataclasses.replace(self._records[index], status=status)

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)

    def _serve(self, connection: Connection) -> None:
        try:
            connection.serve()
        finally:
            with self._lock:
                self._connections.discard(connection)


class Connection:
    """One client connection and its keep-alive upstream connection; owned by one thread."""

    def __init__(self, proxy: FaultProxy, client: Peer) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: Peer | None = None

    def serve(self) -> None:
        """Serve requests until either side closes; never raises."""
        reset = False
        try:
            while not self.proxy._stopping.is_set():
                head = read_head(self.client.reader)
                if head is None:
                    return
                keep_open, reset = self.exchange(head)
                if not keep_open:
                    return
        except UpstreamError as exc:
            self.proxy._record_error(exc)
            reset = True
        except (Truncated, OSError):
            pass  # the client went away (killed writers do that mid-request)
        except ProtocolError as exc:
            self.proxy._record_error(exc)
        finally:
            self.client.close(reset=reset)
            self.drop_upstream()

    def shutdown(self) -> None:
        """Unblock the serving thread (called by `FaultProxy.stop` from another thread)."""
        self.client.shutdown()
        upstream = self.upstream
        if upstream is not None:
            upstream.shutdown()

    def drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    def open_upstream(self, index: int) -> Peer:
        """The kept-alive upstream connection, or a new one if it was closed meanwhile."""
        if self.upstream is not None and self.upstream.idle_but_readable():
            self.drop_upstream()
        if self.upstream is None:
            try:
                sock = socket.create_connection(self.proxy.upstream, UPSTREAM_TIMEOUT_S)
            except OSError as exc:
                raise UpstreamError(f"request {index}: cannot connect upstream: {exc}") from exc
            self.upstream = Peer(sock)
        return self.upstream

    def exchange(self, head: Head) -> tuple[bool, bool]:
        """Serve one request; returns (keep the client connection, reset it on close)."""
        client = self.client
        try:
            method, path, _version = head.start.split(" ", 2)
        except ValueError:
            raise ProtocolError(f"bad request line {head.start!r}") from None
        framing, length = request_framing(head)
        index, action, code, callback = self.proxy._decide(method, path)
        if callback is not None:
            try:
                callback(index, method, path)
            except Exception as exc:
                self.proxy._record_error(exc)
                return False, True
        if framing != "none" and "100-continue" in head.tokens("expect"):
            client.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        client_close = "close" in head.tokens("connection")

        if action in ("error", "reset"):
            copy_body(client.reader, framing, length, discard)
            if action == "reset":
                return False, True
            self.proxy._finish(index, code)
            client.send(s3_error(code, method, path, index, client_close))
            return not client_close, False
        if action == "delay":
            self.proxy._stopping.wait(self.proxy._delay_s())

        upstream = self.open_upstream(index)

        def to_upstream(data: bytes) -> None:
            try:
                upstream.send(data)
            except OSError as exc:
                raise UpstreamError(f"request {index}: upstream broke mid-request: {exc}") from exc

        to_upstream(head.encode(drop=("expect", *self.proxy._dropped_headers())))
        copy_body(client.reader, framing, length, to_upstream)

        try:
            status, response = self.read_response(upstream)
            resp_framing, resp_length = response_framing(method, status, response)
            upstream_close = (
                resp_framing == "close"
                or "close" in response.tokens("connection")
                or response.start.startswith("HTTP/1.0")
            )
            if action == "lost_response":
                copy_body(upstream.reader, resp_framing, resp_length, discard)
                if upstream_close:
                    self.drop_upstream()
                return False, True
        except (OSError, ProtocolError) as exc:
            raise UpstreamError(f"request {index}: bad or no response: {exc}") from exc

        self.proxy._finish(index, status)
        client.send(response.encode())
        try:
            copy_body(upstream.reader, resp_framing, resp_length, client.send)
        except ProtocolError as exc:
            raise UpstreamError(f"request {index}: truncated response: {exc}") from exc
        if upstream_close:
            self.drop_upstream()
        return not (client_close or upstream_close), False

    @staticmethod
    def read_response(upstream: Peer) -> tuple[int, Head]:
        """The final response head; interim (1xx) ones are dropped, the proxy sent its own."""
        while True:
            response = read_head(upstream.reader)
            if response is None:
                raise ProtocolError("upstream closed without a response")
            try:
                status = int(response.start.split(" ", 2)[1])
            except (IndexError, ValueError):
                raise ProtocolError(f"bad status line {response.start!r}") from None
            if status >= 200:
                return status, response
