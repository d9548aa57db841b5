"""The trainer-worker messages as they cross the socket: JSON, no pickle. Each kind
goes out and comes back equal (nested dicts and lists included), and what is not a
message is refused with the library's error."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from resumable.errors import CheckpointError
from resumable.pipeline import messages as m
from resumable.pipeline._worker_process import receive_message, send_message

GROUP = {
    "host": "127.0.0.1",
    "port": 29500,
    "rank": 1,
    "world": 2,
    "key": "p7",
    "timeout": 300.0,
    "nodes": {"node": "n1", "peers": [["n0", 0], ["n1", 1]]},
}

EVERY_KIND = [
    m.WorkerConfig(url="file:///x", keep={"last": 2}, rank=1, versions={"torch": "2.13.0"}),
    m.PersistJob(slot="/dev/shm/r/slot-0", seq=4, step=12, group=GROUP, id=3),
    m.PersistJob(slot="/dev/shm/r/slot-1", seq=6, step=13),
    m.MirrorFlushJob(timeout=2.5, id=4),
    m.StopJob(id=5),
    m.Ready(pid=1234),
    m.Committed(step=12, seconds=0.25, bytes=10, replaced=True, deleted=[3, 4], id=3),
    m.Failed(step=None, error="disk full", errno=28, traceback="tb", id=6),
    m.MirrorFlushed(newest=12, error=None, id=4),
    m.Mirrored(step=12, bytes=10, seconds=0.5),
    m.MirrorFailed(step=12, error="refused"),
]


@pytest.mark.parametrize("msg", EVERY_KIND, ids=lambda x: type(x).__name__)
def test_every_kind_crosses_a_socket_and_comes_back_equal(msg: m.Message) -> None:
    a, b = socket.socketpair()
    with a, b:
        send_message(a, msg)
        got = receive_message(b)
    assert got == msg and type(got) is type(msg)


def test_the_encoded_form_is_plain_json_of_every_field_and_leaves_the_message_alone() -> None:
    job = EVERY_KIND[1]
    before = json.dumps(GROUP, sort_keys=True)
    obj = m.encode(job)
    assert obj == {"kind": "persist", **dataclasses.asdict(job)}
    assert json.loads(json.dumps(obj)) == obj
    assert json.dumps(GROUP, sort_keys=True) == before


def test_what_is_not_a_message_is_refused_with_the_librarys_error() -> None:
    with pytest.raises(CheckpointError, match="unknown message kind"):
        m.decode({"kind": "pickle", "id": 1})
    with pytest.raises(CheckpointError, match="malformed 'persist'"):
        m.decode({"kind": "persist", "seq": 1})
    with pytest.raises(CheckpointError, match="expected a message object"):
        m.decode(["persist"])
    a, b = socket.socketpair()
    with a, b:
        body = b"not json"
        a.sendall(len(body).to_bytes(4, "big") + body)
        with pytest.raises(CheckpointError, match="malformed message"):
            receive_message(b)
