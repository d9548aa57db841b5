"""One writer per root (`resumable.lock`): ``flock`` on filesystem roots, a renewed lease
object on object storage. Real processes hold the root; they are killed with SIGKILL to
show that nothing is left behind (local) or that the lease lapses and is taken over (S3).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from resumable.errors import RootInUseError, StorageError
from resumable.lock import (
    LEASE_DIR,
    LOCK_FILE,
    FileLock,
    Holder,
    LeaseLock,
    acquire_root,
    read_holder,
)
from resumable.storage import LocalStorage, MemoryStorage, Storage
from resumable.storage.s3 import S3Storage

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A process that takes the root given on its command line, says so, and waits to be
# killed. With "fork" it first forks a child that outlives it (a DataLoader worker).
HOLDER = r"""
import json, os, sys, time
from resumable.lock import acquire_root
from resumable.storage import open_storage
url, options, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
lock = acquire_root(open_storage(url, options or None), ttl_s=4.0, skew_s=1.0)
if mode == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print("child", child, flush=True)
print("held", os.getpid(), flush=True)
time.sleep(600)
"""


def start_holder(url: str, options: dict[str, Any] | None = None, mode: str = "") -> Any:
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, json.dumps(options or {}), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines = {}
    while "held" not in lines:
        line = proc.stdout.readline()
        assert line, f"holder exited with {proc.wait()} before taking the root"
        key, value = line.split()
        lines[key] = int(value)
    proc.info = lines  # type: ignore[attr-defined]
    return proc


def kill(proc: Any) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def acquire_eventually(storage: Storage, **kwargs: Any) -> Any:
    """Retry until the root is free (a killed holder's lease lapses), up to 60 s."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return acquire_root(storage, **kwargs)
        except RootInUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# --------------------------------------------------------------------------- local roots


def test_second_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    proc = start_holder(str(tmp_path))
    try:
        with pytest.raises(RootInUseError) as err:
            acquire_root(LocalStorage(tmp_path))
        msg = str(err.value)
        assert f"pid {proc.pid}" in msg and "since" in msg and str(tmp_path) in msg
        assert "another directory" in msg
        assert isinstance(err.value.holder, Holder) and err.value.holder.pid == proc.pid
        assert read_holder(LocalStorage(tmp_path)).pid == proc.pid  # type: ignore[union-attr]
    finally:
        kill(proc)


def test_sigkilled_holder_releases_the_root_at_once(tmp_path: Path) -> None:
    proc = start_holder(str(tmp_path))
    with pytest.raises(RootInUseError):
        acquire_root(LocalStorage(tmp_path))
    kill(proc)
    lock = acquire_root(LocalStorage(tmp_path))  # no wait, no expiry: the kernel released it
    assert isinstance(lock, FileLock)
    assert read_holder(LocalStorage(tmp_path)).pid == os.getpid()  # type: ignore[union-attr]
    lock.release()


def test_a_forked_child_outliving_the_holder_does_not_keep_the_root(tmp_path: Path) -> None:
    proc = start_holder(str(tmp_path), mode="fork")
    child = proc.info["child"]
    try:
        kill(proc)
        os.kill(child, 0)  # still alive, and it inherited the lock's descriptor
        acquire_root(LocalStorage(tmp_path)).release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_one_process_cannot_hold_a_root_twice(tmp_path: Path) -> None:
    first = acquire_root(LocalStorage(tmp_path))
    with pytest.raises(RootInUseError, match=f"pid {os.getpid()}"):
        acquire_root(LocalStorage(tmp_path))
    first.release()
    first.release()  # idempotent
    with acquire_root(LocalStorage(tmp_path)) as again:
        again.check()
    acquire_root(LocalStorage(tmp_path)).release()


def test_a_lock_dropped_without_release_frees_the_root(tmp_path: Path) -> None:
    lock = acquire_root(LocalStorage(tmp_path))
    del lock
    gc.collect()
    acquire_root(LocalStorage(tmp_path)).release()


def test_lock_file_names_the_holder_and_is_created_in_the_root(tmp_path: Path) -> None:
    root = tmp_path / "new" / "root"
    with acquire_root(LocalStorage(root)):
        record = json.loads((root / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] and record["since"] <= time.time()


def test_a_link_as_lock_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").write_text("x")
    (tmp_path / "root" / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StorageError, match="symbolic link"):
        acquire_root(LocalStorage(tmp_path / "root"))
    assert (tmp_path / "elsewhere").read_text() == "x"


def test_garbage_in_the_lock_file_does_not_break_the_lock(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(b"\xff\x00 not json")
    assert read_holder(LocalStorage(tmp_path)) is None
    with (
        acquire_root(LocalStorage(tmp_path)),
        pytest.raises(RootInUseError, match=f"pid {os.getpid()}"),
    ):
        acquire_root(LocalStorage(tmp_path))


# --------------------------------------------------------------------------- leases


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def lease(storage: Storage, clock: Clock) -> LeaseLock:
    lock = acquire_root(storage, ttl_s=60, skew_s=10, clock=clock, renew=False)
    assert isinstance(lock, LeaseLock)
    return lock


def test_lease_refuses_a_second_holder_until_it_lapses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage, clock = MemoryStorage(), Clock()
    first = lease(storage, clock)
    with pytest.raises(RootInUseError, match="lease runs until"):
        lease(storage, clock)
    clock.now += 65  # expired, but within the allowance for clock skew
    with pytest.raises(RootInUseError):
        lease(storage, clock)
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="resumable.lock"):
        second = lease(storage, clock)
    assert "took over" in caplog.text and f"pid {os.getpid()}" in caplog.text
    # The old holder learns it at its next renewal, and check() then refuses every save.
    assert not first.renew()
    with pytest.raises(RootInUseError, match="took it over"):
        first.check()
    second.check()
    assert second.renew()


def test_renewal_keeps_the_lease_and_old_generations_are_pruned() -> None:
    storage, clock = MemoryStorage(), Clock()
    lock = lease(storage, clock)
    for _ in range(20):
        clock.now += 20
        assert lock.renew()
        with pytest.raises(RootInUseError):
            lease(storage, clock)
    assert len(storage.list_dir(LEASE_DIR)) <= 3


def test_released_lease_is_taken_at_once() -> None:
    storage, clock = MemoryStorage(), Clock()
    lease(storage, clock).release()
    lease(storage, clock).check()


def test_lapsed_lease_nobody_took_is_renewed_at_check() -> None:
    storage, clock = MemoryStorage(), Clock()
    lock = lease(storage, clock)
    clock.now += 500
    lock.check()  # renews: no other process wrote the next generation
    with pytest.raises(RootInUseError):
        lease(storage, clock)


class Unreachable(MemoryStorage):
    down = False

    def put_if_absent(self, path: str, data: bytes) -> bool:
        if self.down:
            raise StorageError(110, "timed out")
        return super().put_if_absent(path, data)


def test_holder_that_cannot_renew_before_expiry_stops(caplog: pytest.LogCaptureFixture) -> None:
    storage, clock = Unreachable(), Clock()
    lock = lease(storage, clock)
    storage.down = True
    clock.now += 30
    assert lock.renew()  # still within its lease: retried later
    lock.check()
    clock.now += 40
    with pytest.raises(RootInUseError, match="no longer holds"):
        lock.check()


class LostAnswer(MemoryStorage):
    """With ``lose`` set, the next put that creates its object answers False, as the
    retry of a put whose answer was lost does (412: the first try had landed)."""

    lose = False

    def put_if_absent(self, path: str, data: bytes) -> bool:
        created = super().put_if_absent(path, data)
        if created and self.lose:
            self.lose = False
            return False
        return created


def test_a_lease_put_whose_answer_was_lost_still_takes_and_renews() -> None:
    """Regression (found by campaign 6, stress/objectstore.py): a lost answer to the
    lease put made a writer refuse the root as held by itself, and a lost answer to a
    renewal made the holder believe another process took the root, and stop saving."""
    storage, clock = LostAnswer(), Clock()
    storage.lose = True
    lock = lease(storage, clock)
    storage.lose = True
    clock.now += 20
    assert lock.renew()
    lock.check()
    clock.now += 50  # past the first record's expiry: the renewal's own record counts
    lock.check()
    with pytest.raises(RootInUseError):
        lease(storage, clock)


def test_garbage_lease_object_counts_as_lapsed() -> None:
    storage, clock = MemoryStorage(), Clock()
    storage.write(f"{LEASE_DIR}/lease-00000000000000000007.json", [b"{nonsense"])
    lock = lease(storage, clock)
    assert storage.exists(f"{LEASE_DIR}/lease-00000000000000000008.json")
    lock.release()


# --------------------------------------------------------------------------- S3 (SeaweedFS)


def s3_options(server: Any) -> dict[str, Any]:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "max_attempts": 2,
    }


def test_s3_lease_between_processes_survives_a_sigkill(seaweedfs: Any, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_options(seaweedfs)
    storage = S3Storage(url, **options)
    proc = start_holder(url, options)
    try:
        with pytest.raises(RootInUseError) as err:
            acquire_root(storage, ttl_s=4.0, skew_s=1.0)
        assert f"pid {proc.pid}" in str(err.value) and "lease runs until" in str(err.value)
        # The holder renews: wait until it wrote two more generations, then it still holds.
        deadline = time.monotonic() + 60
        while len(storage.list_dir(LEASE_DIR)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert read_holder(storage).pid == proc.pid  # type: ignore[union-attr]
        with pytest.raises(RootInUseError):
            acquire_root(storage, ttl_s=4.0, skew_s=1.0)
    finally:
        kill(proc)
    lock = acquire_eventually(storage, ttl_s=4.0, skew_s=1.0)
    assert read_holder(storage).pid == os.getpid()  # type: ignore[union-attr]
    lock.release()
    acquire_root(storage).release()  # released: free at once


def test_a_lease_of_a_dead_process_on_this_host_is_taken_at_once(
    dead_pid: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A relaunch on the machine of a SIGKILLed job need not wait for the lease to lapse:
    its pid is gone from this host's pid namespace."""
    storage = MemoryStorage()
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: dead_pid)
        acquire_root(storage, ttl_s=600.0, renew=False)  # never released: "killed"
    lock = acquire_root(storage, ttl_s=600.0, renew=False)
    assert read_holder(storage).pid == os.getpid()  # type: ignore[union-attr]
    assert "from a dead process on this host" in caplog.text
    lock.release()


def test_a_lease_of_a_process_elsewhere_is_waited_out_even_if_the_pid_is_free_here(
    dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = MemoryStorage()
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: dead_pid)
        m.setattr("socket.gethostname", lambda: "another-host")
        acquire_root(storage, ttl_s=600.0, renew=False)
    with pytest.raises(RootInUseError, match="another-host"):
        acquire_root(storage, ttl_s=600.0, renew=False)
