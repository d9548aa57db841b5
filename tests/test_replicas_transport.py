"""The replica transport (resumable.replicas.transport) over real loopback sockets and,
where a side is SIGKILLed, real processes: round trip, authentication (secret, run id,
replay), corruption in transit and before the send, a sender or receiver killed
mid-transfer, and the sender's rate limit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from resumable.errors import CheckpointError, ReplicaError
from resumable.replicas import _framing
from resumable.replicas.store import PARTIAL, ReplicaStore, plan_pieces
from resumable.replicas.transport import (
    TO_CLIENT,
    TO_SERVER,
    Channel,
    ReplicaClient,
    ReplicaServer,
    TokenBucket,
    fetch_replica,
    push_replica,
)

SECRET = bytes.fromhex("5e" * 32)
RUN = "0123456789abcdef0123456789abcdef"
PEER = Path(__file__).with_name("replicas_peer.py")


def _data(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 7 + i * 13) % 256 for i in range(256)) * (n // 256) + bytes(n % 256)


def _meta(step: int) -> bytes:
    return b'{"tree": {"step": %d}, "layout": []}' % step


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ReplicaServer]:
    store = ReplicaStore(tmp_path / "held", RUN)
    srv = ReplicaServer(store, secret=SECRET, rank=1, io_timeout=10.0)
    srv.start()
    yield srv
    srv.stop()
    store.close()


def _wait_for(cond: Callable[[], object], what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def _failures(srv: ReplicaServer, n: int = 1) -> list[ReplicaError]:
    found: list[ReplicaError] = []
    deadline = time.monotonic() + 60
    while len(found) < n and time.monotonic() < deadline:
        found += [f.error for f in srv.take_failures()]
        time.sleep(0.02)
    return found


class Proxy:
    """A loopback TCP relay to ``target``: records what the client sends and lets
    ``mutate(offset, chunk)`` change it on the way (offset: bytes before it)."""

    def __init__(
        self, target: tuple[str, int], mutate: Callable[[int, bytes], bytes] | None = None
    ) -> None:
        self.target = target
        self.mutate = mutate
        self.sent = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
        self._pipe(client, upstream, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if upward:
                    if self.mutate is not None:
                        chunk = self.mutate(len(self.sent), chunk)
                    self.sent += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


# --------------------------------------------------------------------------- round trip


def test_push_then_fetch_round_trip(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    data = _data(3_000_001)
    with ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0) as client:
        sent = client.push(7, _meta(7), data, chunk=1 << 20)
        assert [p.length for p in sent.pieces] == [len(_meta(7)), 1 << 20, 1 << 20, 902_849]
        newer = _data(1_000_000, seed=2)
        client.push(8, _meta(8), newer)
        assert [(i.source_rank, i.step) for i in client.held()] == [(0, 8)]
        back = client.fetch(0)
    assert back.meta == _meta(8) and back.data == newer and back.info.step == 8
    # the older replica went once the newer was complete; a fresh connection fetches too
    assert [i.step for i in server.store.held()] == [8]
    again = fetch_replica(addr, secret=SECRET, run_id=RUN, rank=0, source_rank=0, step=8)
    assert again.data == newer
    assert server.store.read(0).data == newer
    with pytest.raises(ReplicaError) as absent:
        fetch_replica(addr, secret=SECRET, run_id=RUN, rank=0, source_rank=0, step=7)
    assert absent.value.reason == "absent"
    assert isinstance(absent.value, CheckpointError) and isinstance(absent.value, OSError)
    assert server.take_failures() == []


def test_per_tensor_pieces_and_an_empty_data_region(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    data = _data(10_000)
    pieces = plan_pieces(_meta(1), data, ranges=[(0, 4000), (4000, 0), (4000, 6000)])
    with ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0) as client:
        client.push(1, _meta(1), data, pieces=pieces)
        assert client.fetch(0).data == data
        client.push(2, _meta(2), b"")
        assert client.fetch(0).data == b""


def test_an_older_step_than_the_one_held_is_refused(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=5, meta=_meta(5), data=b"x")
    with pytest.raises(ReplicaError) as stale:
        push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=4, meta=_meta(4), data=b"y")
    assert stale.value.reason == "stale"
    assert server.store.read(0).info.step == 5


# --------------------------------------------------------------------------- authentication


def test_a_client_with_another_secret_refuses_the_server(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    with pytest.raises(ReplicaError) as refused:
        push_replica(addr, secret=b"other", run_id=RUN, rank=0, step=1, meta=b"{}", data=b"1")
    assert refused.value.reason == "refused" and "authentication" in str(refused.value)
    assert server.store.held() == []


def test_the_server_refuses_a_hello_under_another_secret(server: ReplicaServer) -> None:
    """A client that skips checking the server (reads the challenge under the right key,
    then signs under a wrong one) gets no welcome; the server records the refusal."""
    addr = server.address
    assert addr is not None
    sock = socket.create_connection(addr, timeout=10)
    ch = Channel(sock, SECRET, out_dir=TO_SERVER, in_dir=TO_CLIENT)
    challenge = ch.recv(nonce=b"", sequenced=False, max_payload=0)
    ch.peer_nonce = bytes.fromhex(challenge.header["nonce"])
    ch._secret = b"not the job's secret"
    ch.send({"type": "hello", "protocol": 1, "run_id": RUN, "rank": 0, "nonce": ch.my_nonce.hex()})
    with pytest.raises(ReplicaError):
        ch.recv(max_payload=0)
    sock.close()
    errors = _failures(server)
    assert [e.reason for e in errors] == ["refused"]
    assert "authentication" in str(errors[0])


def test_another_run_is_refused_by_name(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    with pytest.raises(ReplicaError) as refused:
        push_replica(addr, secret=SECRET, run_id="f" * 32, rank=0, step=1, meta=b"{}", data=b"1")
    assert refused.value.reason == "refused"
    assert "from run 'ffff" in str(refused.value)
    assert server.store.held() == []


def test_a_rank_is_refused_a_replica_of_another_rank(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    with ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0) as client:
        client.rank = 2  # the hello said rank 0
        with pytest.raises(ReplicaError) as refused:
            client.push(1, b"{}", b"1")
    assert refused.value.reason == "refused" and "rank 2" in str(refused.value)
    assert server.store.held() == []


def test_a_recorded_session_replayed_on_a_new_connection_is_refused(
    server: ReplicaServer,
) -> None:
    addr = server.address
    assert addr is not None
    proxy = Proxy(addr)
    push_replica(
        proxy.address, secret=SECRET, run_id=RUN, rank=0, step=3, meta=_meta(3), data=_data(5000)
    )
    proxy.close()
    recorded = bytes(proxy.sent)
    assert server.store.drop_older(0, keep_step=4) == [3]
    assert server.store.held() == []
    with socket.create_connection(addr, timeout=10) as sock:
        try:  # the server refuses the hello and closes, maybe before all of it is sent
            sock.sendall(recorded)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass
    errors = _failures(server)
    assert [e.reason for e in errors] == ["refused"]
    assert server.store.held() == []


def test_a_frame_replayed_on_the_same_connection_is_refused(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    client = ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0)
    client.connect()
    ch = client._ch
    assert ch is not None
    assert client.held() == []
    ch._out_seq -= 1  # the same frame, byte for byte, again
    with pytest.raises(ReplicaError):
        client.held()
    errors = _failures(server)
    assert [e.reason for e in errors] == ["refused"]


# --------------------------------------------------------------------------- corruption


def test_a_byte_flipped_in_transit_is_refused_and_never_complete(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=_meta(1), data=_data(1000))
    target = 200_000  # inside the first piece's payload (frames before it are < 2 KB)

    def flip(offset: int, chunk: bytes) -> bytes:
        if offset <= target < offset + len(chunk):
            b = bytearray(chunk)
            b[target - offset] ^= 0x10
            return bytes(b)
        return chunk

    proxy = Proxy(addr, flip)
    with pytest.raises(ReplicaError) as refused:
        push_replica(
            proxy.address,
            secret=SECRET,
            run_id=RUN,
            rank=0,
            step=2,
            meta=_meta(2),
            data=_data(600_000),
        )
    proxy.close()
    assert refused.value.reason in {"refused", "io"}  # "io" if the reset beat the error frame
    errors = _failures(server)
    assert [e.reason for e in errors] == ["refused"]
    assert [i.step for i in server.store.held()] == [1]
    assert server.store.read(0).data == _data(1000)
    assert not [p for p in server.store.directory.iterdir() if p.name.startswith(PARTIAL)]


def test_bytes_changed_after_their_digest_are_refused(server: ReplicaServer) -> None:
    """A snapshot slot rewritten while it is sent: the HMAC is good, the digest is not."""
    addr = server.address
    assert addr is not None
    push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=_meta(1), data=_data(1000))
    data = bytearray(_data(300_000))
    pieces = plan_pieces(_meta(2), data, chunk=100_000)
    data[150_000] ^= 1
    with (
        ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0) as client,
        pytest.raises(ReplicaError) as corrupt,
    ):
        client.push(2, _meta(2), data, pieces=pieces)
    assert corrupt.value.reason == "corrupt" and "piece 2" in str(corrupt.value)
    assert [i.step for i in server.store.held()] == [1]
    assert server.store.read(0).data == _data(1000)


# --------------------------------------------------------------------------- killed processes


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "REPLICA_SECRET": SECRET.hex()}
    return subprocess.Popen(
        [sys.executable, str(PEER), *args], stdout=subprocess.PIPE, text=True, env=env
    )


def _partials(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(PARTIAL)]


def test_a_sender_killed_mid_send_leaves_the_previous_replica(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    sys.path.insert(0, str(PEER.parent))
    import replicas_peer

    meta1, data1 = replicas_peer.payload(1, 200_000)
    push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=meta1, data=data1)
    # 8 MB at 2 MB/s: about four seconds in flight
    proc = _spawn("push", str(addr[1]), RUN, "0", "2", str(8 << 20), str(2 << 20))
    try:
        _wait_for(lambda: _partials(server.store.directory), "the partial replica")
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
    errors = _failures(server)
    assert [e.reason for e in errors] == ["truncated"]
    _wait_for(lambda: not _partials(server.store.directory), "the partial's removal")
    assert [i.step for i in server.store.held()] == [1]
    assert server.store.read(0).data == data1


def test_a_receiver_killed_mid_transfer_is_reported_and_cleaned_at_restart(
    tmp_path: Path,
) -> None:
    held = tmp_path / "held"
    proc = _spawn("serve", str(held), RUN, "1")
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        addr = ("127.0.0.1", port)
        push_replica(
            addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=_meta(1), data=_data(4096)
        )
        errors: list[BaseException] = []

        def push() -> None:
            try:
                push_replica(
                    addr,
                    secret=SECRET,
                    run_id=RUN,
                    rank=0,
                    step=2,
                    meta=_meta(2),
                    data=_data(8 << 20),
                    rate=2 << 20,
                    io_timeout=10,
                )
            except BaseException as exc:
                errors.append(exc)

        sender = threading.Thread(target=push)
        sender.start()
        _wait_for(lambda: _partials(held), "the partial replica")
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        sender.join(30)
    finally:
        proc.kill()
        proc.wait(10)
    assert len(errors) == 1 and isinstance(errors[0], ReplicaError)
    assert errors[0].reason in {"io", "truncated"}
    assert _partials(held)  # the killed receiver left its partial file
    with ReplicaStore(held, RUN) as store:  # the next start
        assert _partials(held) == []
        assert [i.step for i in store.held()] == [1]
        assert store.read(0).data == _data(4096)


# --------------------------------------------------------------------------- rate limit


def test_the_token_bucket_paces_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(_framing.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(_framing.time, "sleep", sleep)
    bucket = TokenBucket(1000.0, burst=500.0)
    for _ in range(20):
        bucket.take(250)  # 5000 bytes: the first 500 are the burst, the rest at 1000 B/s
    assert sum(slept) == pytest.approx(4.5, rel=1e-6)
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_a_replica_damaged_at_rest_is_not_served(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    info = push_replica(
        addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=_meta(1), data=_data(9000)
    )
    path = server.store.find(0).path
    raw = bytearray(path.read_bytes())
    raw[info.meta_len + 5000] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ReplicaError) as corrupt:
        fetch_replica(addr, secret=SECRET, run_id=RUN, rank=0, source_rank=0)
    assert corrupt.value.reason == "corrupt" and "damaged at rest" in str(corrupt.value)


def test_an_idle_connection_is_closed_quietly(tmp_path: Path) -> None:
    with (
        ReplicaStore(tmp_path, RUN) as store,
        ReplicaServer(store, secret=SECRET, rank=1, idle_timeout=0.2) as srv,
    ):
        assert srv.address is not None
        client = ReplicaClient(srv.address, secret=SECRET, run_id=RUN, rank=0)
        assert client.held() == []
        assert client._ch is not None
        _wait_for(lambda: not srv._conns, "the idle connection's close")
        with pytest.raises(ReplicaError):  # this connection is gone; the next one works
            client.held()
        assert client.held() == []
        client.close()
        assert srv.take_failures() == []


def test_a_sender_gone_between_two_pieces_is_a_truncated_replica(server: ReplicaServer) -> None:
    addr = server.address
    assert addr is not None
    push_replica(addr, secret=SECRET, run_id=RUN, rank=0, step=1, meta=_meta(1), data=b"old")
    data = _data(2000)
    pieces = plan_pieces(_meta(2), data, chunk=1000)
    client = ReplicaClient(addr, secret=SECRET, run_id=RUN, rank=0)
    client.connect()
    ch = client._ch
    assert ch is not None
    ch.send(
        client._header(
            "put",
            source_rank=0,
            step=2,
            meta_len=len(_meta(2)),
            data_len=len(data),
            pieces=[[p.offset, p.length, p.digest] for p in pieces],
        )
    )
    assert ch.recv(max_payload=0).header["type"] == "ready"
    ch.send(client._header("piece", index=0), _meta(2))
    client.close()  # at a frame boundary, two pieces short
    errors = _failures(server)
    assert [e.reason for e in errors] == ["truncated"]
    _wait_for(lambda: not _partials(server.store.directory), "the partial's removal")
    assert bytes(server.store.read(0).data) == b"old"
