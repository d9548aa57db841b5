"""A lease holder that was frozen past its lease never writes again (`resumable.lock`).

The scenario of issue 44: holder A is stopped (SIGSTOP by ``scontrol suspend``, a VM
pause) for more than two lease lifetimes; B takes the root over and renews, pruning the
old generations; A wakes up. A's renewal used to recreate a pruned generation, believe
it still held the root, and keep saving beside B. Here A must find itself lost, refuse
every save, and leave B's lease alone. Run on memory and on real object-store servers
(SeaweedFS, fake-gcs-server, Azurite; each skips where its server is missing), with a
fake clock, and once with a real process stopped and continued.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import resumable
from resumable.errors import RootInUseError
from resumable.lock import LEASE_DIR, Holder, LeaseLock, acquire_root, read_holder
from resumable.storage import MemoryStorage, Storage
from resumable.storage.base import ForwardingStorage
from resumable.storage.fsspec_store import FsspecStorage
from resumable.storage.s3 import S3Storage

TTL_S, SKEW_S = 60.0, 10.0


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recording(ForwardingStorage):
    """Remembers the token written by each lease put that created its object."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.created: list[tuple[str, str]] = []  # (path, token)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        won = super().put_if_absent(path, data)
        if won and path.startswith(LEASE_DIR):
            self.created.append((path, json.loads(data)["token"]))
        return won


def s3_options(server: Any) -> dict[str, Any]:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "max_attempts": 2,
    }


def _s3(request: pytest.FixtureRequest) -> Storage:
    server = request.getfixturevalue("seaweedfs")
    bucket = request.getfixturevalue("s3_bucket")
    return S3Storage(f"s3://{bucket}/run", **s3_options(server))


def _gcs(request: pytest.FixtureRequest) -> Storage:
    server = request.getfixturevalue("fake_gcs")
    return FsspecStorage(f"gs://{server.new_bucket('lease')}/run", **server.options())


def _azure(request: pytest.FixtureRequest) -> Storage:
    server = request.getfixturevalue("azurite")
    url = f"az://{server.new_bucket('lease')}/run"
    return FsspecStorage(url, **server.options(max_attempts=2))


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], Storage]] = {
    "memory": lambda request: MemoryStorage(),
    "s3": _s3,
    "gcs": _gcs,
    "azure": _azure,
}


@pytest.fixture(params=list(BACKENDS))
def store(request: pytest.FixtureRequest) -> Recording:
    """A fresh lease root on each backend without operating-system locks, recording
    who created each lease object."""
    return Recording(BACKENDS[request.param](request))


def lease(storage: Storage, clock: Clock) -> LeaseLock:
    lock = acquire_root(storage, ttl_s=TTL_S, skew_s=SKEW_S, clock=clock, renew=False)
    assert isinstance(lock, LeaseLock)
    return lock


def take_over_and_prune(storage: Storage, clock: Clock, renewals: int = 4) -> LeaseLock:
    """B takes the root and renews often enough that the generations A knew are pruned."""
    b = lease(storage, clock)
    for _ in range(renewals):
        clock.now += TTL_S / 3
        assert b.renew()
    return b


def lease_tokens(storage: Storage) -> dict[str, str]:
    out = {}
    for name in storage.list_dir(LEASE_DIR):
        record = Holder.from_json(bytes(storage.read(f"{LEASE_DIR}/{name}")))
        assert record is not None
        out[name] = record.token
    return out


def test_a_holder_frozen_past_two_lifetimes_is_refused_and_b_keeps_the_root(
    store: Recording,
) -> None:
    clock = Clock()
    a = lease(store, clock)
    clock.now += 2.5 * TTL_S  # A is frozen: no renewal for more than two lifetimes
    b = take_over_and_prune(store, clock)
    puts_before = len(store.created)

    assert not a.renew()  # A wakes up: its renewal must not recreate a pruned generation
    with pytest.raises(RootInUseError, match=r"no longer holds.*took it over") as err:
        a.check()  # the check before every save refuses
    assert f"pid {os.getpid()}" in str(err.value)
    a.release()  # writes nothing either
    assert store.created[puts_before:] == []
    assert set(lease_tokens(store).values()) == {b.holder.token}

    b.check()  # B still holds the root and goes on renewing
    clock.now += TTL_S / 3
    assert b.renew()
    assert read_holder(store).token == b.holder.token  # type: ignore[union-attr]
    with pytest.raises(RootInUseError):
        a.check()  # lost for good


def test_a_won_put_still_loses_to_a_newer_generation(store: Recording) -> None:
    """A's own clock says its lease runs (B's clock is far ahead, beyond the allowance
    for skew), so only the store can tell A: its put into a generation B pruned wins,
    and a newer generation exists."""
    clock_a = Clock()
    a = lease(store, clock_a)
    clock_b = Clock(clock_a.now + 5 * TTL_S)
    b = take_over_and_prune(store, clock_b)

    assert not a.renew()
    with pytest.raises(RootInUseError, match="took it over"):
        a.check()
    assert set(lease_tokens(store).values()) == {b.holder.token}  # A's stray put removed
    b.check()
    clock_b.now += TTL_S / 3
    assert b.renew()


def test_a_lapsed_holder_taken_over_and_released_does_not_take_it_back() -> None:
    """The root was someone else's meanwhile (taken, written, released): A's lapsed lease
    is lost, even though a new job could take the released root."""
    storage, clock = MemoryStorage(), Clock()
    a = lease(storage, clock)
    clock.now += 2 * TTL_S
    lease(storage, clock).release()
    with pytest.raises(RootInUseError, match="took it over"):
        a.check()
    lease(storage, clock).release()  # the root itself is free


def test_a_lapsed_holder_nobody_took_takes_it_again_through_the_acquire_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage, clock = Recording(MemoryStorage()), Clock()
    a = lease(storage, clock)
    clock.now += 2.5 * TTL_S
    with caplog.at_level(logging.WARNING, logger="resumable.lock"):
        a.check()
    assert "lapsed" in caplog.text and "took it again" in caplog.text
    assert [token for _, token in storage.created] == [a.holder.token] * 2
    with pytest.raises(RootInUseError):
        lease(storage, clock)  # held again, with a fresh expiry
    a.release()


# --------------------------------------------------------------------------- a real process

# Takes the root with a 2 s lease, says so, then answers each "write" line on stdin with
# a check and a write of one object into the root ("wrote") or the refusal ("refused").
HOLDER = r"""
import json, sys
from resumable.errors import RootInUseError
from resumable.lock import acquire_root
from resumable.storage import open_storage
url, options = sys.argv[1], json.loads(sys.argv[2])
storage = open_storage(url, options)
lock = acquire_root(storage, ttl_s=2.0, skew_s=0.5)
print("held", lock.holder.token, flush=True)
for line in sys.stdin:
    try:
        lock.check()
        storage.write("written-by-a", [b"A"])
        print("wrote", flush=True)
    except RootInUseError as exc:
        print("refused", str(exc).replace("\n", " "), flush=True)
"""


def read_line(proc: Any, within_s: float = 120.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], within_s)
    assert ready, f"the holder said nothing within {within_s:.0f} s"
    line = str(proc.stdout.readline())
    assert line, f"the holder exited with {proc.wait()}"
    return line.strip()


def test_a_real_holder_stopped_and_continued_is_refused(seaweedfs: Any, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_options(seaweedfs)
    storage = S3Storage(url, **options)
    src = str(Path(resumable.__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
    )
    try:
        word, a_token = read_line(proc).split()
        assert word == "held"
        assert proc.stdin is not None
        proc.stdin.write("write\n")
        proc.stdin.flush()
        assert read_line(proc) == "wrote"  # it holds the root and writes
        storage.delete("written-by-a")

        proc.send_signal(signal.SIGSTOP)
        b = acquire_until_free(storage)  # A's lease lapses while it is stopped
        for _ in range(4):  # prune every generation A knew
            assert b.renew()
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("write\n")
        proc.stdin.flush()
        answer = read_line(proc)
        assert answer.startswith("refused") and "no longer holds" in answer, answer
        assert not storage.exists("written-by-a")
        b.check()
        assert b.renew()
        tokens = lease_tokens(storage)
        assert a_token not in tokens.values() and set(tokens.values()) == {b.holder.token}
        b.release()
    finally:
        proc.kill()
        proc.wait()


def acquire_until_free(storage: Storage) -> LeaseLock:
    """Take the root as soon as the stopped holder's lease lapses (bounded: 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            lock = acquire_root(storage, ttl_s=TTL_S, skew_s=0.5, renew=False)
        except RootInUseError:
            assert time.monotonic() < deadline, "the stopped holder's lease never lapsed"
            time.sleep(0.2)
            continue
        assert isinstance(lock, LeaseLock)
        return lock
