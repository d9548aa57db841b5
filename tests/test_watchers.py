"""Cloud termination-notice watchers against local HTTP servers that speak each
provider's metadata protocol: AWS IMDSv2 (session tokens, 401 on a missing or expired
one, 404 until a spot action is scheduled), GCP ``instance/preempted`` (403 without
``Metadata-Flavor: Google``) and Azure Scheduled Events (400 without ``Metadata: true``
or ``api-version``; events of other VMs in the same scale set are delivered too).
A fake can also misbehave: answer slowly, trickle its answer a byte at a time, or
redirect to another server.

No timed assertions but upper bounds: waits have generous deadlines that only a broken
watcher reaches.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from resumable.watchers import (
    AWSSpotWatcher,
    AzureScheduledEventsWatcher,
    GCPPreemptionWatcher,
    Watcher,
    watchers_from_env,
)

FAST: dict[str, Any] = {"interval_s": 0.05, "timeout_s": 2.0}
DEADLINE_S = 10.0
TRICKLE_S = 0.2  # a trickling fake sends one byte this often
NOTICE_TIME = "2026-05-01T12:00:00Z"
SELF_VM = "train-vm_3"


def wait_until(predicate: Callable[[], bool], deadline_s: float = DEADLINE_S) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class Recorder:
    """An ``on_notice`` callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.called = threading.Event()

    def __call__(self, reason: str) -> None:
        self.calls.append(reason)
        self.called.set()


# --------------------------------------------------------------------------- fake clouds


class FakeCloud:
    """The state of one fake metadata service; the handler reads and updates it.

    Args:
        provider: "aws", "gcp" or "azure".
        notice_after: the number of notice polls answered "no notice" before the notice
            appears; None: it never does.
        delay_s: every answer is held this long (a slow or hung service).
        trickle: every answer is sent one byte every `TRICKLE_S` seconds: from its
            status line ("head") or, after the status line and headers, its body
            ("body", padded with 50 spaces).
        redirect_to: notice requests that pass the protocol's checks are answered
            ``redirect_status`` with ``Location: redirect_to + path``.
        token_uses: AWS: the number of GETs a session token authorizes before it
            expires (401).
        notice_body: AWS: the body of the notice (a JSON instance-action when None).
        events: Azure: the events listed once ``notice_after`` polls were answered.
        vm_name: Azure: this VM's name from ``compute/name``; None: 404.
    """

    def __init__(
        self,
        provider: str,
        *,
        notice_after: int | None = None,
        delay_s: float = 0.0,
        trickle: str | None = None,
        redirect_to: str | None = None,
        redirect_status: int = 302,
        token_uses: int = 1_000_000,
        notice_body: bytes | None = None,
        events: list[dict[str, Any]] | None = None,
        vm_name: str | None = SELF_VM,
    ) -> None:
        self.provider = provider
        self.notice_after = notice_after
        self.delay_s = delay_s
        self.trickle = trickle
        self.redirect_to = redirect_to
        self.redirect_status = redirect_status
        self.token_uses = token_uses
        self.notice_body = notice_body
        self.events = events if events is not None else [azure_event("Preempt")]
        self.vm_name = vm_name
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.polls = 0  # notice requests that passed the protocol's checks
        self.token_puts = 0
        self.tokens: dict[str, int] = {}  # token -> GETs it may still authorize
        self.refused: list[tuple[str, int]] = []  # (path, status) of rejected requests
        self.name_lookups = 0
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)
        self.url = ""

    def notice_due(self) -> bool:
        return self.notice_after is not None and self.polls > self.notice_after


def azure_event(event_type: str, resources: list[str] | None = None) -> dict[str, Any]:
    return {
        "EventId": f"{event_type.upper()}-{secrets.token_hex(4)}",
        "EventStatus": "Scheduled",
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": [SELF_VM] if resources is None else resources,
        "NotBefore": "Fri, 01 May 2026 12:00:00 GMT",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def make_handler(cloud: FakeCloud) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            if cloud.delay_s:
                cloud.closing.wait(cloud.delay_s)
            headers = {"Content-Type": content_type}
            if cloud.provider == "gcp":
                headers["Metadata-Flavor"] = "Google"
            if cloud.trickle:
                return self.trickle(status, headers, body + b" " * 50)
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client gave up (timeout): expected with delay_s

        def trickle(self, status: int, headers: dict[str, str], body: bytes) -> None:
            lines = [f"HTTP/1.1 {status} {self.responses[status][0]}"]
            lines += [f"{name}: {value}" for name, value in headers.items()]
            lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            head = "\r\n".join(lines).encode()
            at_once, slowly = (b"", head + body) if cloud.trickle == "head" else (head, body)
            self.close_connection = True
            try:
                self.wfile.write(at_once)
                for i in range(len(slowly)):
                    if cloud.closing.wait(TRICKLE_S):
                        return
                    self.wfile.write(slowly[i : i + 1])
            except OSError:
                pass  # the client gave up

        def redirect(self) -> None:
            cloud.refused.append((self.path, cloud.redirect_status))
            self.send_response(cloud.redirect_status)
            self.send_header("Location", f"{cloud.redirect_to}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def refuse(self, status: int, body: bytes) -> None:
            cloud.refused.append((self.path, status))
            self.reply(status, body)

        def do_PUT(self) -> None:
            with cloud.lock:
                cloud.seen.append(("PUT", self.path, dict(self.headers)))
                if cloud.provider != "aws" or self.path != "/latest/api/token":
                    return self.refuse(404, b"Not Found")
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self.refuse(400, b"Bad Request")
                token = secrets.token_urlsafe(32)
                cloud.tokens[token] = cloud.token_uses
                cloud.token_puts += 1
                return self.reply(200, token.encode())

        def do_GET(self) -> None:
            with cloud.lock:
                cloud.seen.append(("GET", self.path, dict(self.headers)))
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if cloud.provider == "aws":
                    return self.aws(url.path)
                if cloud.provider == "gcp":
                    return self.gcp(url.path)
                return self.azure(url.path, query)

        def aws(self, path: str) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            if not token or cloud.tokens.get(token, 0) <= 0:
                return self.refuse(401, b"Unauthorized")
            cloud.tokens[token] -= 1
            if path != "/latest/meta-data/spot/instance-action":
                return self.refuse(404, b"Not Found")
            if cloud.redirect_to:
                return self.redirect()
            cloud.polls += 1
            if not cloud.notice_due():
                return self.reply(404, b"Not Found")
            if cloud.notice_body is not None:
                return self.reply(200, cloud.notice_body, "text/html")
            doc = {"action": "terminate", "time": NOTICE_TIME}
            return self.reply(200, json.dumps(doc).encode(), "application/json")

        def gcp(self, path: str) -> None:
            if self.headers.get("Metadata-Flavor") != "Google" or self.headers.get(
                "X-Forwarded-For"
            ):
                return self.refuse(403, b"Missing Metadata-Flavor:Google header.")
            if path != "/computeMetadata/v1/instance/preempted":
                return self.refuse(404, b"Not Found")
            if cloud.redirect_to:
                return self.redirect()
            cloud.polls += 1
            return self.reply(200, b"TRUE" if cloud.notice_due() else b"FALSE")

        def azure(self, path: str, query: dict[str, list[str]]) -> None:
            if self.headers.get("Metadata") != "true":
                return self.refuse(400, b'{"error": "Bad request. Required metadata header"}')
            if not query.get("api-version"):
                return self.refuse(400, b'{"error": "Bad request. api-version missing"}')
            if path == "/metadata/instance/compute/name":
                cloud.name_lookups += 1
                if cloud.vm_name is None or query.get("format") != ["text"]:
                    return self.reply(404, b"Not found")
                return self.reply(200, cloud.vm_name.encode())
            if path != "/metadata/scheduledevents":
                return self.refuse(404, b"Not found")
            if cloud.redirect_to:
                return self.redirect()
            cloud.polls += 1
            due = cloud.notice_due()
            doc = {"DocumentIncarnation": 2 if due else 1, "Events": cloud.events if due else []}
            return self.reply(200, json.dumps(doc).encode(), "application/json")

    return Handler


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeCloud]]:
    """Start a fake metadata service on 127.0.0.1: ``serve(provider, **FakeCloud kwargs)``."""
    servers: list[tuple[QuietServer, FakeCloud, threading.Thread]] = []

    def start(provider: str, **kwargs: Any) -> FakeCloud:
        cloud = FakeCloud(provider, **kwargs)
        server = QuietServer(("127.0.0.1", 0), make_handler(cloud))
        thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
        thread.start()
        cloud.url = f"http://127.0.0.1:{server.server_address[1]}"
        servers.append((server, cloud, thread))
        return cloud

    yield start
    for server, cloud, thread in servers:
        cloud.closing.set()
        server.shutdown()
        server.server_close()
        thread.join(DEADLINE_S)


@pytest.fixture
def watchers() -> Iterator[list[Watcher]]:
    """Watchers to stop at teardown, whatever the test did."""
    made: list[Watcher] = []
    yield made
    for w in made:
        w.stop()


def closed_port_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


WATCHER_TYPES: dict[str, type[Watcher]] = {
    "aws": AWSSpotWatcher,
    "gcp": GCPPreemptionWatcher,
    "azure": AzureScheduledEventsWatcher,
}
EXPECTED_REASON = {
    "aws": f"aws-spot: terminate at {NOTICE_TIME}",
    "gcp": "gcp-preemption: instance preempted",
    "azure": "azure-scheduled-events: Preempt not before Fri, 01 May 2026 12:00:00 GMT",
}


def make_watcher(provider: str, endpoint: str, **kwargs: Any) -> Watcher:
    return WATCHER_TYPES[provider](endpoint=endpoint, **{**FAST, **kwargs})


# --------------------------------------------------------------------------- notices


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_notice_after_some_polls_is_reported_once(
    provider: str, serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    cloud = serve(provider, notice_after=3)
    w = make_watcher(provider, cloud.url)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.INFO, logger="resumable"):
        w.start(on_notice)
        assert on_notice.called.wait(DEADLINE_S)
        assert wait_until(lambda: not w.running)
    assert len(on_notice.calls) == 1
    assert on_notice.calls[0].startswith(EXPECTED_REASON[provider])
    assert w.notice == on_notice.calls[0]
    assert cloud.polls == 4  # 3 without a notice, the one with it, then no more polls
    assert cloud.refused == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_no_notice_never_calls_back(
    provider: str, serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    cloud = serve(provider, notice_after=None)
    w = make_watcher(provider, cloud.url)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.DEBUG, logger="resumable"):
        w.start(on_notice)
        assert wait_until(lambda: cloud.polls >= 6)
        assert w.running
        w.stop()
    assert not w.running
    assert on_notice.calls == []
    assert w.notice is None
    assert cloud.refused == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_poll_reports_the_notice_state(serve: Callable[..., FakeCloud]) -> None:
    for provider in ("aws", "gcp", "azure"):
        cloud = serve(provider, notice_after=1)
        w = make_watcher(provider, cloud.url)
        assert w.poll() is None
        assert (w.poll() or "").startswith(EXPECTED_REASON[provider])
        assert cloud.refused == []


# --------------------------------------------------------------------------- AWS tokens


def test_aws_renews_the_token_after_a_401(
    serve: Callable[..., FakeCloud], watchers: list[Watcher]
) -> None:
    cloud = serve("aws", notice_after=7, token_uses=2)
    w = make_watcher("aws", cloud.url)
    watchers.append(w)
    on_notice = Recorder()
    w.start(on_notice)
    assert on_notice.called.wait(DEADLINE_S)
    assert on_notice.calls == [f"aws-spot: terminate at {NOTICE_TIME}"]
    # 8 polls with 2 GETs per token: each expired token got a 401 and a new PUT.
    assert cloud.token_puts == 4
    assert [status for _, status in cloud.refused] == [401, 401, 401]


def test_aws_token_is_reused_while_valid(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("aws")
    w = make_watcher("aws", cloud.url)
    for _ in range(5):
        assert w.poll() is None
    assert cloud.token_puts == 1
    assert cloud.polls == 5


def test_aws_unparsable_notice_still_counts(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("aws", notice_after=0, notice_body=b"<html>terminate</html>")
    w = AWSSpotWatcher(endpoint=cloud.url, **FAST)
    assert w.poll() == "aws-spot: instance-action '<html>terminate</html>'"


# --------------------------------------------------------------------------- protocol checks


@pytest.mark.parametrize(
    ("provider", "method", "path", "expected"),
    [
        ("aws", "GET", "/latest/meta-data/spot/instance-action", 401),
        ("aws", "PUT", "/latest/api/token", 400),
        ("gcp", "GET", "/computeMetadata/v1/instance/preempted", 403),
        ("azure", "GET", "/metadata/scheduledevents?api-version=2020-07-01", 400),
    ],
)
def test_fake_services_refuse_requests_without_the_provider_headers(
    provider: str, method: str, path: str, expected: int, serve: Callable[..., FakeCloud]
) -> None:
    """The fakes enforce the headers, so the watcher tests above prove they are sent."""
    cloud = serve(provider, notice_after=0)
    request = urllib.request.Request(cloud.url + path, method=method)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=DEADLINE_S)
    info.value.close()
    assert info.value.code == expected


def test_azure_requires_the_api_version(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("azure", notice_after=0)
    request = urllib.request.Request(
        cloud.url + "/metadata/scheduledevents", headers={"Metadata": "true"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=DEADLINE_S)
    info.value.close()
    assert info.value.code == 400


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_refusing_service_counts_as_failures(
    provider: str, serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    """A wrong path (here: a service of another cloud) answers 4xx: not a notice, a failure."""
    other = {"aws": "gcp", "gcp": "azure", "azure": "aws"}[provider]
    cloud = serve(other, notice_after=0)
    w = make_watcher(provider, cloud.url, max_failures=2)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.WARNING, logger="resumable"):
        w.start(on_notice)
        assert wait_until(lambda: not w.running)
    assert on_notice.calls == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "HTTP 4" in warnings[0].getMessage()


# --------------------------------------------------------------------------- Azure events


@pytest.mark.parametrize("event_type", ["Preempt", "Terminate"])
def test_azure_preempt_and_terminate_are_notices(
    event_type: str, serve: Callable[..., FakeCloud]
) -> None:
    event = azure_event(event_type)
    cloud = serve("azure", notice_after=0, events=[azure_event("Freeze"), event])
    w = AzureScheduledEventsWatcher(endpoint=cloud.url, **FAST)
    reason = w.poll()
    assert reason is not None
    assert reason.startswith(f"azure-scheduled-events: {event_type} not before ")
    assert event["EventId"] in reason
    assert w.vm_name == SELF_VM


def test_azure_ignores_other_event_types_and_other_vms(
    serve: Callable[..., FakeCloud], watchers: list[Watcher]
) -> None:
    events = [
        azure_event("Freeze"),
        azure_event("Reboot"),
        azure_event("Redeploy"),
        azure_event("Preempt", resources=["train-vm_7"]),
        azure_event("Terminate", resources=["train-vm_8", "train-vm_9"]),
    ]
    cloud = serve("azure", notice_after=1, events=events)
    w = make_watcher("azure", cloud.url)
    watchers.append(w)
    on_notice = Recorder()
    w.start(on_notice)
    assert wait_until(lambda: cloud.polls >= 6)
    w.stop()
    assert on_notice.calls == []
    assert cloud.name_lookups == 1
    assert cloud.refused == []


def test_azure_event_types_are_configurable(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("azure", notice_after=0, events=[azure_event("Reboot")])
    assert make_watcher("azure", cloud.url).poll() is None
    w = make_watcher("azure", cloud.url, event_types=("Preempt", "Terminate", "Reboot"))
    assert (w.poll() or "").startswith("azure-scheduled-events: Reboot not before")


def test_azure_without_a_vm_name_counts_every_event(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("azure", notice_after=0, vm_name=None, events=[azure_event("Preempt", ["other"])])
    w = AzureScheduledEventsWatcher(endpoint=cloud.url, **FAST)
    assert (w.poll() or "").startswith("azure-scheduled-events: Preempt")
    assert w.vm_name is None


def test_azure_given_vm_name_skips_the_lookup(serve: Callable[..., FakeCloud]) -> None:
    cloud = serve("azure", notice_after=0, events=[azure_event("Preempt", ["vm-a"])])
    assert make_watcher("azure", cloud.url, vm_name="vm-b").poll() is None
    assert (make_watcher("azure", cloud.url, vm_name="vm-a").poll() or "").startswith(
        "azure-scheduled-events: Preempt"
    )
    assert cloud.name_lookups == 0


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_unreachable_endpoint_logs_one_warning_and_stops(
    provider: str, watchers: list[Watcher], caplog: Any
) -> None:
    url = closed_port_url()
    w = make_watcher(provider, url, max_failures=3)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.DEBUG, logger="resumable"):
        w.start(on_notice)
        assert wait_until(lambda: not w.running)
        thread = w._thread
        assert thread is not None
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    assert on_notice.calls == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert warnings[0].name == "resumable.watchers"
    assert w.name in message
    assert url in message
    assert "3 times in a row" in message
    failures = [r for r in caplog.records if "failed:" in r.getMessage()]
    assert len(failures) == 3


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_slow_service_times_out_as_a_failure(
    provider: str, serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    cloud = serve(provider, notice_after=0, delay_s=60.0)
    kwargs: dict[str, Any] = {"timeout_s": 0.2, "max_failures": 2}
    if provider == "azure":
        kwargs["first_timeout_s"] = 0.2
    w = make_watcher(provider, cloud.url, **kwargs)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.WARNING, logger="resumable"):
        w.start(on_notice)
        assert wait_until(lambda: not w.running)
    assert on_notice.calls == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "timed out" in warnings[0].getMessage()


def test_one_deadline_covers_every_request_of_a_poll(serve: Callable[..., FakeCloud]) -> None:
    """AWS polls with two requests (token, notice); each answers within ``timeout_s``,
    both together do not: the poll fails at its deadline."""
    cloud = serve("aws", notice_after=0, delay_s=0.6)
    w = make_watcher("aws", cloud.url, timeout_s=1.0)
    with pytest.raises(TimeoutError, match="timed out"):  # without one, the poll succeeds
        w.poll()


@pytest.mark.parametrize("where", ["head", "body"])
@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_trickling_answer_ends_the_poll_at_its_deadline(
    provider: str, where: str, serve: Callable[..., FakeCloud]
) -> None:
    """One byte every 0.2 s would take 10 s or more; each read alone is quick, so only
    a deadline for the whole poll ends it after ``timeout_s``."""
    cloud = serve(provider, notice_after=0, trickle=where)
    kwargs: dict[str, Any] = {"timeout_s": 1.0}
    if provider == "azure":
        kwargs["first_timeout_s"] = 1.0
    w = make_watcher(provider, cloud.url, **kwargs)
    with pytest.raises(TimeoutError, match="timed out"):  # without one, the poll succeeds
        w.poll()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_redirect_is_not_followed_and_not_a_notice(
    provider: str, serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    """The other server would answer with a notice, and would see the headers that
    authorize metadata requests (AWS: the session token) if the redirect were followed."""
    elsewhere = serve(provider, notice_after=0)
    cloud = serve(provider, notice_after=0, redirect_to=elsewhere.url)
    w = make_watcher(provider, cloud.url, max_failures=2)
    watchers.append(w)
    on_notice = Recorder()
    with caplog.at_level(logging.WARNING, logger="resumable"):
        w.start(on_notice)
        assert wait_until(lambda: not w.running)
    assert on_notice.calls == []
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "HTTP 302, a redirect to" in warnings[0].getMessage()
    assert elsewhere.seen == []
    if provider == "aws":
        assert [m for m, _, h in cloud.seen if "X-aws-ec2-metadata-token" in h] == ["GET", "GET"]


def test_proxies_from_the_environment_are_bypassed(
    serve: Callable[..., FakeCloud], monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = serve("gcp", notice_after=0)
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(name, proxy.url)
    cloud = serve("gcp", notice_after=None)
    assert make_watcher("gcp", cloud.url).poll() is None
    assert proxy.seen == []
    assert cloud.polls == 1


@pytest.mark.parametrize("status", [301, 303, 307, 308])
def test_no_redirect_status_is_followed(status: int, serve: Callable[..., FakeCloud]) -> None:
    elsewhere = serve("gcp", notice_after=0)
    cloud = serve("gcp", notice_after=0, redirect_to=elsewhere.url, redirect_status=status)
    with pytest.raises(OSError, match=f"HTTP {status}, a redirect to '{elsewhere.url}/"):
        make_watcher("gcp", cloud.url).poll()
    assert elsewhere.seen == []


def test_a_transient_failure_does_not_stop_the_watcher(
    serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    cloud = serve("gcp", notice_after=None)
    w = make_watcher("gcp", cloud.url, max_failures=2)
    watchers.append(w)
    answers = iter([ValueError("garbled"), None, OSError("reset"), None, ValueError("again")])
    real_poll = w.poll

    def flaky_poll() -> str | None:
        answer = next(answers, "gcp-preemption: instance preempted")
        if isinstance(answer, Exception):
            raise answer
        return real_poll() if answer is None else answer

    w.poll = flaky_poll  # type: ignore[method-assign]
    on_notice = Recorder()
    with caplog.at_level(logging.WARNING, logger="resumable"):
        w.start(on_notice)
        assert on_notice.called.wait(DEADLINE_S)
    assert on_notice.calls == ["gcp-preemption: instance preempted"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_failing_callback_is_logged_not_raised(
    serve: Callable[..., FakeCloud], watchers: list[Watcher], caplog: Any
) -> None:
    cloud = serve("gcp", notice_after=0)
    w = make_watcher("gcp", cloud.url)
    watchers.append(w)
    calls: list[str] = []

    def explode(reason: str) -> None:
        calls.append(reason)
        raise RuntimeError("handler bug")

    with caplog.at_level(logging.ERROR, logger="resumable"):
        w.start(explode)
        assert wait_until(lambda: not w.running)
    assert calls == ["gcp-preemption: instance preempted"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "on_notice" in errors[0].getMessage()
    assert errors[0].exc_info is not None


# --------------------------------------------------------------------------- lifecycle


def test_stop_before_a_notice_ends_the_thread(
    serve: Callable[..., FakeCloud], watchers: list[Watcher]
) -> None:
    cloud = serve("gcp", notice_after=None)
    w = make_watcher("gcp", cloud.url, interval_s=3600.0)
    watchers.append(w)
    on_notice = Recorder()
    w.start(on_notice)
    assert wait_until(lambda: cloud.polls >= 1)
    thread = w._thread
    w.stop()  # the thread sleeps for an hour unless stop() wakes it
    assert thread is not None and not thread.is_alive()
    assert not w.running
    w.stop()  # idempotent
    assert on_notice.calls == []


def test_stop_during_a_slow_request_returns_and_suppresses_the_notice(
    serve: Callable[..., FakeCloud], watchers: list[Watcher]
) -> None:
    cloud = serve("gcp", notice_after=0, delay_s=0.6)
    w = make_watcher("gcp", cloud.url, timeout_s=5.0)
    watchers.append(w)
    on_notice = Recorder()
    w.start(on_notice)
    assert wait_until(lambda: cloud.polls >= 1)  # the answer (TRUE) is on its way
    w.stop()
    thread = w._thread
    assert thread is not None
    thread.join(DEADLINE_S)
    assert not thread.is_alive()
    assert on_notice.calls == []
    assert w.notice is None


def test_start_twice_raises_and_restart_after_stop_works(
    serve: Callable[..., FakeCloud], watchers: list[Watcher]
) -> None:
    cloud = serve("gcp", notice_after=None)
    w = make_watcher("gcp", cloud.url)
    watchers.append(w)
    w.start(Recorder())
    with pytest.raises(RuntimeError, match="already running"):
        w.start(Recorder())
    w.stop()
    cloud.notice_after = cloud.polls + 1
    on_notice = Recorder()
    w.start(on_notice)
    assert on_notice.called.wait(DEADLINE_S)
    assert on_notice.calls == ["gcp-preemption: instance preempted"]


def test_stop_without_start_is_harmless() -> None:
    w = GCPPreemptionWatcher(endpoint=closed_port_url())
    w.stop()
    assert not w.running


def test_the_thread_is_a_daemon(serve: Callable[..., FakeCloud], watchers: list[Watcher]) -> None:
    cloud = serve("aws")
    w = make_watcher("aws", cloud.url)
    watchers.append(w)
    w.start(Recorder())
    assert w._thread is not None and w._thread.daemon
    assert w._thread.name == "resumable-watch-aws-spot"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval_s": 0},
        {"interval_s": -1.0},
        {"timeout_s": 0},
        {"max_failures": 0},
        {"max_failures": 1.5},
        {"endpoint": "file:///etc/passwd"},
        {"endpoint": "169.254.169.254"},
        {"endpoint": "http://"},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AWSSpotWatcher(**kwargs)


def test_defaults_and_endpoint_normalization() -> None:
    assert AWSSpotWatcher().endpoint == "http://169.254.169.254"
    assert GCPPreemptionWatcher().endpoint == "http://metadata.google.internal"
    assert AzureScheduledEventsWatcher().endpoint == "http://169.254.169.254"
    w = GCPPreemptionWatcher(endpoint="http://127.0.0.1:8080/")
    assert w.endpoint == "http://127.0.0.1:8080"
    assert (w.interval_s, w.timeout_s, w.max_failures) == (5.0, 1.0, 3)
    with pytest.raises(ValueError, match="first_timeout_s"):
        AzureScheduledEventsWatcher(first_timeout_s=0)


def test_watchers_from_env_empty() -> None:
    assert watchers_from_env({}) == []
    assert watchers_from_env({"RESUMABLE_WATCH": ""}) == []
    assert watchers_from_env({"RESUMABLE_WATCH": " , "}) == []


def test_watchers_from_env_names_and_endpoint() -> None:
    ws = watchers_from_env({"RESUMABLE_WATCH": "aws, GCP ,azure,aws"})
    assert [type(w) for w in ws] == [
        AWSSpotWatcher,
        GCPPreemptionWatcher,
        AzureScheduledEventsWatcher,
    ]
    assert [w.endpoint for w in ws] == [
        "http://169.254.169.254",
        "http://metadata.google.internal",
        "http://169.254.169.254",
    ]
    env = {"RESUMABLE_WATCH": "gcp,azure", "RESUMABLE_WATCH_ENDPOINT": "http://127.0.0.1:9/"}
    assert [w.endpoint for w in watchers_from_env(env)] == ["http://127.0.0.1:9"] * 2


def test_watchers_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_WATCH", "gcp")
    monkeypatch.delenv("RESUMABLE_WATCH_ENDPOINT", raising=False)
    (w,) = watchers_from_env()
    assert isinstance(w, GCPPreemptionWatcher)
    monkeypatch.delenv("RESUMABLE_WATCH")
    assert watchers_from_env() == []


def test_watchers_from_env_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown watcher 'ibm'.*aws, azure, gcp"):
        watchers_from_env({"RESUMABLE_WATCH": "aws,ibm"})
    with pytest.raises(ValueError, match="RESUMABLE_WATCH_ENDPOINT"):
        watchers_from_env({"RESUMABLE_WATCH": "aws", "RESUMABLE_WATCH_ENDPOINT": "localhost:80"})
