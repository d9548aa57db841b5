"""Cloud termination-notice watchers: opt-in background threads that poll a cloud's
instance metadata service and report a coming preemption before the signal arrives.

Each watcher polls one endpoint (AWS spot, GCP preemption, Azure Scheduled Events) from
one daemon thread, and calls ``on_notice(reason)`` at most once, then stops. The
trade-off is polling against long-polling: a GET every ``interval_s`` costs one local
round-trip and holds no connection open. The clouds warn 30 s to 2 minutes ahead, so a
5 s poll loses little.

Contract: a watcher never hurts the job it protects. One deadline, ``timeout_s``, covers
each poll. ``start`` and ``stop`` return at once. After ``max_failures`` failed polls in
a row it logs one WARNING and stops. Requests go to the endpoint only: no proxy, no
redirect. `watchers_from_env` is the one place where the environment selects watchers.

Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from resumable import settings

log = logging.getLogger(__name__)

WATCH_ENV = settings.WATCH.name
WATCH_ENDPOINT_ENV = settings.WATCH_ENDPOINT.name

_MAX_BODY = 1 << 16

PollError = (OSError, http.client.HTTPException, ValueError)
"""What one failed poll raises: transport failures (refused, DNS, reset), a poll past
its deadline (`TimeoutError`), malformed HTTP, and unexpected answers (`OSError` with
the status, redirects included; `ValueError` for a body that does not parse)."""


@dataclass(frozen=True)
class _Deadline:
    """The end of one poll, on the `time.monotonic` clock."""

    at: float
    seconds: float

    def left(self) -> float:
        """Seconds left; raises `TimeoutError` once there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out: no complete answer within {self.seconds:g} s")
        return left


class _DeadlineReader(io.RawIOBase):
    """The socket of one request as `http.client.HTTPResponse` reads it: each read may
    wait only for the time left before the poll's deadline, so an answer that arrives
    a byte at a time still ends the poll on time."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class Watcher:
    """Base class: the polling thread, failure counting and shutdown.

    Subclasses set `name` and `default_endpoint` and implement `poll`.

    Args:
        endpoint: base URL of the metadata service (``http://host[:port]``); the
            provider's address when None.
        interval_s: seconds between polls.
        timeout_s: the time one poll may take, all of its requests together (connect,
            send, and every read of each answer).
        max_failures: consecutive failed polls after which the watcher logs one
            WARNING and stops.

    Threading contract: `start` and `stop` are called by the owner (the training
    thread); `poll` runs on the watcher's thread (or on the caller's, in tests);
    ``on_notice`` is called on the watcher's thread, at most once per `start`, and not
    after `stop` returned. Nothing raised on the watcher's thread reaches the owner: a
    failing ``on_notice`` is logged.
    """

    name = "watcher"
    default_endpoint = ""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        max_failures: int = 3,
    ) -> None:
        self.endpoint = _check_endpoint(endpoint if endpoint is not None else self.default_endpoint)
        self._url = urllib.parse.urlsplit(self.endpoint)
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not (isinstance(max_failures, int) and max_failures >= 1):
            raise ValueError(f"max_failures must be an integer >= 1, got {max_failures!r}")
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.max_failures = max_failures
        self.notice: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint={self.endpoint!r}, interval_s={self.interval_s})"

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive and not asked to stop."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stop.is_set()

    def start(self, on_notice: Callable[[str], None]) -> None:
        """Start polling on a new daemon thread; returns at once.

        Raises `RuntimeError` if this watcher is already running. A stopped watcher
        may be started again.
        """
        if self.running:
            raise RuntimeError(f"{self.name} watcher is already running")
        self.notice = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(on_notice, self._stop),
            name=f"resumable-watch-{self.name}",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop and wait for it about ``timeout_s`` at most.

        Idempotent. A thread still inside a request when this returns ends when that
        request does, without calling ``on_notice``.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout_s + 0.25)

    def poll(self) -> str | None:
        """One check of the endpoint: the notice's reason, or None while there is none.

        Raises one of `PollError` when the endpoint cannot be reached, answers
        something unexpected, or does not answer within ``timeout_s``. Implementations
        take one `_deadline` and pass it to each of their `_request` calls.
        """
        raise NotImplementedError

    def _run(self, on_notice: Callable[[str], None], stop: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                reason = self.poll()
            except PollError as exc:
                failures += 1
                log.debug("%s watcher: poll of %s failed: %r", self.name, self.endpoint, exc)
                if failures >= self.max_failures:
                    if not stop.is_set():
                        log.warning(
                            "%s watcher stopped: %s failed %d times in a row (last: %s); "
                            "termination notices from it will not be seen",
                            self.name,
                            self.endpoint,
                            failures,
                            _describe(exc),
                        )
                    return
            except Exception:
                log.exception(
                    "%s watcher stopped: unexpected error polling %s", self.name, self.endpoint
                )
                return
            else:
                failures = 0
                if reason is not None:
                    if stop.is_set():
                        return
                    self.notice = reason
                    log.info("termination notice: %s", reason)
                    try:
                        on_notice(reason)
                    except Exception:
                        log.exception("%s watcher: the on_notice callback failed", self.name)
                    return
            stop.wait(self.interval_s)

    def _timeout(self) -> float:
        return self.timeout_s

    def _deadline(self) -> _Deadline:
        """The deadline of a poll that starts now."""
        seconds = self._timeout()
        return _Deadline(time.monotonic() + seconds, seconds)

    def _request(
        self, method: str, path: str, headers: Mapping[str, str], deadline: _Deadline
    ) -> tuple[int, bytes]:
        """``method`` ``endpoint + path``, finished before ``deadline``: (status, body)
        for any HTTP answer but a redirect.

        Raises `TimeoutError` past the deadline, `OSError` for a redirect (3xx: not
        followed, not a notice) and for transport failures, `http.client.HTTPException`
        for malformed HTTP.
        """
        url = self._url
        connection = (
            http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        )
        conn = connection(url.hostname or "", url.port, timeout=deadline.left())
        try:
            conn.connect()
            conn.sock.settimeout(deadline.left())
            conn.request(method, url.path + path, headers={**headers, "Connection": "close"})
            response = http.client.HTTPResponse(
                _DeadlineReader(conn.sock, deadline),  # type: ignore[arg-type]
                method=method,
            )
            try:
                response.begin()
                if 300 <= response.status < 400:
                    location = (response.getheader("Location") or "")[:200]
                    raise OSError(
                        f"{self.name}: {path.split('?')[0]} answered HTTP {response.status}, "
                        f"a redirect to {location!r}: a metadata service does not redirect, "
                        "and the watcher does not follow redirects"
                    )
                return response.status, response.read(_MAX_BODY)
            finally:
                response.close()
        finally:
            conn.close()


def _check_endpoint(endpoint: str) -> str:
    parsed = urllib.parse.urlsplit(endpoint)
    try:
        valid = parsed.port is None or parsed.port > 0  # .port raises for a malformed port
    except ValueError:
        valid = False
    if not valid or parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query:
        raise ValueError(
            "watcher endpoint must be an http:// or https:// URL with a host (and a port, "
            f"optionally), got {endpoint!r}"
        )
    return endpoint.rstrip("/")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unexpected(name: str, what: str, status: int, body: bytes) -> OSError:
    snippet = body[:200].decode("utf-8", "replace")
    return OSError(f"{name}: {what} answered HTTP {status}, expected 200 ({snippet!r})")


class AWSSpotWatcher(Watcher):
    """EC2 spot interruption notices, through IMDSv2.

    A session token from ``PUT /latest/api/token`` authorizes each
    ``GET /latest/meta-data/spot/instance-action``; the token is renewed when the
    service answers 401 or its TTL is nearly over. The GET answers 404 while no action
    is scheduled and 200 with ``{"action": "terminate"|"stop"|"hibernate", "time": ...}``
    about two minutes before it.
    """

    name = "aws-spot"
    default_endpoint = "http://169.254.169.254"
    token_path = "/latest/api/token"
    notice_path = "/latest/meta-data/spot/instance-action"
    token_ttl_s = 21600

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._token: str | None = None
        self._token_expires = 0.0

    def poll(self) -> str | None:
        deadline = self._deadline()
        if self._token is None or time.monotonic() >= self._token_expires:
            self._refresh_token(deadline)
        status, body = self._get_notice(deadline)
        if status == 401:
            self._refresh_token(deadline)
            status, body = self._get_notice(deadline)
        if status == 404:
            return None
        if status != 200:
            raise _unexpected(self.name, self.notice_path, status, body)
        try:
            doc = json.loads(body)
            return f"{self.name}: {doc['action']} at {doc['time']}"
        except (ValueError, KeyError, TypeError):
            # A 200 is a scheduled action whatever its body says: report it anyway.
            return f"{self.name}: instance-action {body[:200].decode('utf-8', 'replace')!r}"

    def _refresh_token(self, deadline: _Deadline) -> None:
        self._token = None
        started = time.monotonic()
        status, body = self._request(
            "PUT",
            self.token_path,
            {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
            deadline,
        )
        if status != 200 or not body.strip():
            raise _unexpected(self.name, self.token_path, status, body)
        self._token = body.decode("ascii", "replace").strip()
        self._token_expires = started + self.token_ttl_s - 60

    def _get_notice(self, deadline: _Deadline) -> tuple[int, bytes]:
        return self._request(
            "GET", self.notice_path, {"X-aws-ec2-metadata-token": self._token or ""}, deadline
        )


class GCPPreemptionWatcher(Watcher):
    """Compute Engine preemption (spot and preemptible VMs).

    ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``
    answers ``FALSE`` until the VM is being preempted, then ``TRUE`` (30 s before the
    stop).
    """

    name = "gcp-preemption"
    default_endpoint = "http://metadata.google.internal"
    notice_path = "/computeMetadata/v1/instance/preempted"

    def poll(self) -> str | None:
        status, body = self._request(
            "GET", self.notice_path, {"Metadata-Flavor": "Google"}, self._deadline()
        )
        if status != 200:
            raise _unexpected(self.name, self.notice_path, status, body)
        value = body.strip().upper()
        if value == b"FALSE":
            return None
        if value == b"TRUE":
            return f"{self.name}: instance preempted"
        raise ValueError(f"{self.name}: expected TRUE or FALSE, found {body[:200]!r}")


class AzureScheduledEventsWatcher(Watcher):
    """Azure Scheduled Events (Spot eviction, scale-set termination).

    ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``
    answers ``{"DocumentIncarnation": n, "Events": [...]}``; an event whose
    ``EventType`` is one of ``event_types`` and whose ``Resources`` name this VM is a
    notice. Azure delivers the events of every VM in an availability set or scale-set
    placement group to all of them, so the VM's own name is read once from
    ``/metadata/instance/compute/name`` (or given as ``vm_name``); if it cannot be
    read, every event counts. Events are not acknowledged: that would shorten the
    warning.

    Args:
        event_types: the event types that end this VM's process and count as notices.
            ``Reboot`` and ``Redeploy`` also end it but are scheduled minutes ahead;
            add them to checkpoint and stop for those too.
        vm_name: this VM's name as it appears in ``Resources``; looked up when None.
        first_timeout_s: the time a poll may take until the service first answered:
            Azure enables Scheduled Events on the first request and may take up to two
            minutes to answer it. The thread waits; the owner does not.
    """

    name = "azure-scheduled-events"
    default_endpoint = "http://169.254.169.254"
    api_version = "2020-07-01"
    events_path = "/metadata/scheduledevents"
    vm_name_path = "/metadata/instance/compute/name"
    vm_name_api_version = "2020-09-01"

    def __init__(
        self,
        *,
        event_types: Iterable[str] = ("Preempt", "Terminate"),
        vm_name: str | None = None,
        first_timeout_s: float = 120.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not first_timeout_s > 0:
            raise ValueError(f"first_timeout_s must be positive, got {first_timeout_s!r}")
        self.event_types = frozenset(event_types)
        self.vm_name = vm_name
        self.first_timeout_s = float(first_timeout_s)
        self._answered = False
        self._looked_up = vm_name is not None

    def _timeout(self) -> float:
        return self.timeout_s if self._answered else max(self.timeout_s, self.first_timeout_s)

    def poll(self) -> str | None:
        deadline = self._deadline()
        headers = {"Metadata": "true"}
        status, body = self._request(
            "GET", f"{self.events_path}?api-version={self.api_version}", headers, deadline
        )
        self._answered = True
        if status != 200:
            raise _unexpected(self.name, self.events_path, status, body)
        doc = json.loads(body)
        events = doc.get("Events") if isinstance(doc, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"{self.name}: expected an Events list, found {body[:200]!r}")
        wanted = [
            e for e in events if isinstance(e, dict) and e.get("EventType") in self.event_types
        ]
        if not wanted:
            return None
        if not self._looked_up:
            self._look_up_vm_name(deadline)
        for event in wanted:
            resources = event.get("Resources")
            if self.vm_name is None or not resources or self.vm_name in resources:
                not_before = event.get("NotBefore") or "now"
                return (
                    f"{self.name}: {event.get('EventType')} not before {not_before} "
                    f"(event {event.get('EventId')})"
                )
        return None

    def _look_up_vm_name(self, deadline: _Deadline) -> None:
        path = f"{self.vm_name_path}?api-version={self.vm_name_api_version}&format=text"
        try:
            status, body = self._request("GET", path, {"Metadata": "true"}, deadline)
        except PollError as exc:
            log.debug("%s watcher: cannot read the VM name: %r", self.name, exc)
            return
        self._looked_up = True
        name = body.decode("utf-8", "replace").strip()
        if status == 200 and name:
            self.vm_name = name
        else:
            log.debug("%s watcher: no VM name (HTTP %d); every event counts", self.name, status)


WATCHERS: dict[str, type[Watcher]] = {
    "aws": AWSSpotWatcher,
    "gcp": GCPPreemptionWatcher,
    "azure": AzureScheduledEventsWatcher,
}
"""The names `watchers_from_env` accepts."""


def watchers_from_env(environ: Mapping[str, str] | None = None) -> list[Watcher]:
    """Watchers named by ``RESUMABLE_WATCH`` (a comma list of `WATCHERS` keys, e.g.
    ``aws,gcp``; unset or empty: none), each at ``RESUMABLE_WATCH_ENDPOINT`` when set.

    Raises `ValueError` for an unknown name or a malformed endpoint.
    """
    names: list[str] = []
    for item in (settings.WATCH.read(environ) or "").split(","):
        key = item.strip().lower()
        if not key or key in names:
            continue
        if key not in WATCHERS:
            raise ValueError(
                f"{WATCH_ENV} names an unknown watcher {item.strip()!r}; "
                f"expected a comma list of {', '.join(sorted(WATCHERS))}"
            )
        names.append(key)
    endpoint = settings.WATCH_ENDPOINT.read(environ) or None
    try:
        return [WATCHERS[key](endpoint=endpoint) for key in names]
    except ValueError as exc:
        raise ValueError(f"{WATCH_ENDPOINT_ENV}: {exc}") from None
