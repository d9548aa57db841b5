"""Commits and retention deletes check the root's lease where they run.

A job holds an object-store root by a lease (`resumable.lock`); a job frozen for longer
than the lease loses it to the next one. The training process checks the lease before
each persist starts, but a persist already under way runs on in the persist worker (a
process, a thread, or the training thread itself): its commit and its retention deletes
check the trainer's `LeaseFence` right before they change anything visible. Each test
below loses the lease between a persist's start and its commit: a second job takes the
root over (a fake wall clock makes the first lease lapse; the boot-clock deadline the
fence holds is then set to "lost" by the first job's next renewal), and the first job's
commit is refused, its error reaching ``wait()`` as `RootInUseError`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable
import resumable.pipeline.root_claim
from resumable import Checkpointer, Keep
from resumable.audit import AuditLog
from resumable.commit import list_committed
from resumable.errors import RootInUseError
from resumable.lock import LeaseFence, LeaseLock, RootLock, acquire_root
from resumable.retention import apply_retention
from resumable.storage import MemoryStorage, Storage
from resumable.storage.base import ForwardingStorage
from resumable.storage.local import LocalStorage
from resumable.storage.s3 import S3Storage

TTL_S, SKEW_S = 30.0, 5.0


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class PausedCommit(ForwardingStorage):
    """Calls ``at_commit`` when a rename commit writes a step's manifest into its staging
    directory (the persist has written its data and is about to make it visible), and
    ``after_commit`` once the staging directory is renamed into place (next: retention)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.at_commit: Callable[[], None] = lambda: None
        self.after_commit: Callable[[], None] = lambda: None

    def write(self, path: str, data: Any) -> int:
        n = super().write(path, data)
        if path.startswith(".tmp-step-") and path.endswith("/manifest.json"):
            self.at_commit()
        return n

    def rename_dir(self, src: str, dst: str) -> None:
        super().rename_dir(src, dst)
        if src.startswith(".tmp-step-") and dst.startswith("step-"):
            self.after_commit()


class Leases:
    """The leases `acquire_root` took in this test, on a clock the test moves by hand."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.taken: list[RootLock] = []

    def acquire(self, storage: Storage, **_: Any) -> RootLock:
        lock = acquire_root(storage, ttl_s=TTL_S, skew_s=SKEW_S, clock=self.clock, renew=False)
        self.taken.append(lock)
        return lock

    def take_over(self, storage: Storage) -> RootLock:
        """A second job takes the root once the first one's lease lapsed by the clock."""
        self.clock.now += 2.5 * TTL_S
        return self.acquire(storage)


@pytest.fixture
def leases(monkeypatch: pytest.MonkeyPatch) -> Leases:
    """The Checkpointer's lease runs on a fake clock, renewed only when the test says so."""
    leases = Leases()
    monkeypatch.setattr(resumable.pipeline.root_claim, "acquire_root", leases.acquire)
    return leases


def state() -> dict[str, Any]:
    return {"w": torch.arange(1000, dtype=torch.float32)}


@pytest.mark.parametrize("persist", ["thread", "sync"])
def test_a_persist_under_way_when_the_lease_is_lost_does_not_commit(
    leases: Leases, persist: str, tmp_path: Path
) -> None:
    inner = MemoryStorage()
    storage = PausedCommit(inner)
    ck = Checkpointer(
        storage, state(), persist=persist, keep=Keep(last=1), shm_dir=tmp_path, save_on_close=False
    )
    ck.save(1)
    ck.wait()
    assert list_committed(inner) == [1]  # a normal persist commits

    (a,) = leases.taken

    def lose_the_lease() -> None:  # the job froze here; another took the root over
        storage.at_commit = lambda: None
        leases.take_over(inner)
        assert isinstance(a, LeaseLock) and not a.renew()  # its renewal finds it lost

    storage.at_commit = lose_the_lease
    with pytest.raises(RootInUseError, match="no longer holds"):
        ck.save(2)
        ck.wait()
    assert list_committed(inner) == [1]  # step 2 not committed, step 1 not pruned
    assert not [n for n in inner.list_dir("") if n.startswith(".tmp-")]  # nothing left over
    with pytest.raises(RootInUseError):
        ck.close()
    leases.taken[1].check()  # the new holder holds the root


def test_retention_after_a_commit_deletes_nothing_once_the_lease_is_lost(
    leases: Leases, tmp_path: Path
) -> None:
    """The lease is lost between a commit and its retention: the commit stands, the
    older checkpoint stays, and ``wait()`` says the root is lost."""
    inner = MemoryStorage()
    storage = PausedCommit(inner)
    ck = Checkpointer(
        storage, state(), persist="thread", keep=Keep(last=1), shm_dir=tmp_path, save_on_close=False
    )
    ck.save(1)
    ck.wait()
    (a,) = leases.taken

    def lose_the_lease() -> None:
        storage.after_commit = lambda: None
        leases.take_over(inner)
        assert isinstance(a, LeaseLock) and not a.renew()

    storage.after_commit = lose_the_lease
    ck.save(2)
    with pytest.raises(RootInUseError, match="no longer holds"):
        ck.wait()
    assert list_committed(inner) == [1, 2]  # step 1 was not pruned
    with pytest.raises(RootInUseError):
        ck.close()


def test_a_lapsed_lease_nobody_took_is_taken_again_and_the_persist_commits(
    leases: Leases, tmp_path: Path
) -> None:
    """A frozen job whose lease nobody took over takes it again at its next renewal; a
    persist under way meanwhile waits for that and commits (a suspend and resume of one
    job costs nothing)."""
    inner = MemoryStorage()
    storage = PausedCommit(inner)
    ck = Checkpointer(storage, state(), persist="thread", keep=Keep(last=1), shm_dir=tmp_path)
    (a,) = leases.taken

    def lapse_then_renew() -> None:
        storage.at_commit = lambda: None
        leases.clock.now += 2.5 * TTL_S
        assert isinstance(a, LeaseLock) and a.renew()  # taken again: nobody else wrote

    storage.at_commit = lapse_then_renew
    ck.save(1)
    ck.wait()
    ck.save(2)
    ck.wait()
    assert list_committed(inner) == [2]  # committed and pruned
    ck.close()


def test_retention_deletes_nothing_once_the_lease_is_lost(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    with Checkpointer(storage, state(), persist="sync", keep=None) as ck:
        for step in (1, 2, 3):
            ck.save(step)
    lock = acquire_root(MemoryStorage(), ttl_s=TTL_S, clock=Clock(), renew=False)
    fence = lock.fence()
    assert fence is not None and not fence.lapsed
    audit = AuditLog(storage, rank=0, enabled=False)
    lock.release()  # given back: nothing is written under it any more
    assert fence.lost
    with pytest.raises(RootInUseError, match=r"the delete of .*step-000000000002 was refused"):
        apply_retention(storage, Keep(last=1), audit, just_written=3, fence=fence.check)
    assert list_committed(storage) == [1, 2, 3]
    # The same pass without the fence (an operator's `resumable prune`) deletes.
    assert sorted(apply_retention(storage, Keep(last=1), audit, just_written=3)) == [1, 2]
    assert list_committed(storage) == [3]


def test_a_fence_crosses_into_another_process() -> None:
    """The worker process maps the trainer's fence: what the lock publishes, it reads."""
    lock = acquire_root(MemoryStorage(), ttl_s=TTL_S, clock=Clock(), renew=False)
    fence = lock.fence()
    assert fence is not None
    reader = (
        "import sys, time\n"
        "from resumable.lock import LeaseFence\n"
        "fence = LeaseFence.attach(int(sys.argv[1]))\n"
        "print(fence.lapsed, flush=True)\n"
        "sys.stdin.readline()\n"
        "print(fence.lapsed, fence.lost, flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", reader, str(fence.fd)],
        pass_fds=[fence.fd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(resumable.__file__).resolve().parents[1])},
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "False"
    lock.release()
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "True True"
    assert proc.wait() == 0


def test_a_lapsed_fence_waits_for_the_holder_to_take_the_lease_again() -> None:
    """A worker that wakes from a freeze before its trainer's renewal thread does waits
    for the renewal's verdict: taken again, the commit goes ahead."""
    fence = LeaseFence.create(wait_s=60.0)
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    fence.publish(now - 1.0)  # lapsed, no verdict yet
    renewal = threading.Timer(0.2, lambda: fence.publish(now + 60.0))
    renewal.start()
    fence.check("the commit of step-1")  # returns once the lease runs again
    renewal.join()


def test_a_lapsed_fence_refuses_at_once_when_the_holder_loses_the_lease() -> None:
    fence = LeaseFence.create(wait_s=60.0)
    fence.publish(time.clock_gettime(time.CLOCK_BOOTTIME) - 1.0)
    loss = threading.Timer(0.2, lambda: fence.publish(-math.inf, "another job took it"))
    loss.start()
    with pytest.raises(RootInUseError, match="it lost its lease"):
        fence.check("the commit of step-1")
    loss.join()
    assert fence.reason == "another job took it"


def test_a_fence_nobody_renews_refuses_once_its_wait_is_over() -> None:
    fence = LeaseFence.create(wait_s=0.2)
    fence.publish(time.clock_gettime(time.CLOCK_BOOTTIME) - 1.0)  # lapsed, no verdict
    with pytest.raises(RootInUseError, match=r"lapsed .* and was not renewed"):
        fence.check("the commit of step-1")


# ------------------------------------------------------------------ a real worker process


def s3_options(server: Any) -> dict[str, Any]:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "max_attempts": 2,
    }


def worker_pids() -> list[int]:
    """The persist worker processes this test process started."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"worker_main" in cmdline:
            out.append(int(entry))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_worker_process_frozen_before_its_commit_does_not_commit_after_a_takeover(
    leases: Leases, seaweedfs: Any, s3_bucket: str, tmp_path: Path
) -> None:
    """The persist worker is stopped with the job queued; meanwhile another job takes the
    root over. Continued, the worker writes the data, its commit is refused, and the
    error reaches ``wait()``."""
    url = f"s3://{s3_bucket}/fenced"
    options = s3_options(seaweedfs)
    storage = S3Storage(url, **options)
    ck = Checkpointer(
        url,
        state(),
        persist="process",
        keep=Keep(last=1),
        storage_options=options,
        shm_dir=tmp_path,
        save_on_close=False,
    )
    ck.save(1)
    ck.wait()
    ck.save(2)
    ck.wait()
    assert list_committed(storage) == [2]  # a normal run commits and prunes
    (worker,) = worker_pids()
    (a,) = leases.taken
    os.kill(worker, signal.SIGSTOP)
    try:
        ck.save(3)  # the job waits in the stopped worker's socket
        b = leases.take_over(storage)
        assert isinstance(a, LeaseLock) and not a.renew()
    finally:
        os.kill(worker, signal.SIGCONT)
    with pytest.raises(RootInUseError, match="was refused"):
        ck.wait()
    assert list_committed(storage) == [2]
    assert storage.list_dir("step-000000000003") == []  # its data removed again
    with pytest.raises(RootInUseError):
        ck.close()
    b.check()
    b.release()


# A trainer with a real lease on SeaweedFS (ttl 2 s, its own renewal thread) that saves
# a 64 MiB state in the background and prints "saved" as soon as the worker writes it.
TRAINER = """
import functools, json, sys, time
import torch
import resumable, resumable.pipeline.root_claim
from resumable.lock import acquire_root
url, options, shm = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
resumable.pipeline.root_claim.acquire_root = functools.partial(acquire_root, ttl_s=2.0, skew_s=0.5)
ck = resumable.Checkpointer(url, {"w": torch.ones(1 << 24)}, persist="process",
                            storage_options=options, shm_dir=shm, save_on_close=False)
ck.save(1)
print("saved", flush=True)
try:
    ck.wait()
    print(json.dumps({"outcome": "committed"}), flush=True)
except Exception as exc:
    print(json.dumps({"outcome": type(exc).__name__, "error": str(exc)}), flush=True)
try:
    ck.close()
except Exception:
    pass
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
def test_a_trainer_and_worker_stopped_together_past_the_lease_commit_nothing(
    seaweedfs: Any, s3_bucket: str, tmp_path: Path
) -> None:
    """SIGSTOP of the whole process group (``scontrol suspend``) while the worker writes;
    another job takes the root over and writes a checkpoint; the job continued commits
    nothing. (The stop is sent once the save started; a worker fast enough to commit
    first makes the outcome "committed", which the test then accepts as a skip.)"""
    url = f"s3://{s3_bucket}/frozen"
    options = s3_options(seaweedfs)
    storage = S3Storage(url, **options)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER))
    proc = subprocess.Popen(
        [sys.executable, str(script), url, json.dumps(options), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(resumable.__file__).resolve().parents[1])},
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "saved"
        os.killpg(proc.pid, signal.SIGSTOP)
        if list_committed(storage):
            pytest.skip("the worker committed before it was stopped")
        b = acquire_until_free(storage)
        for _ in range(4):  # prune every lease generation the stopped job knew
            assert b.renew()
        os.killpg(proc.pid, signal.SIGCONT)
        result = json.loads(read_line(proc))
        assert result["outcome"] == "RootInUseError", result
        assert list_committed(storage) == []
        b.check()
        b.release()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proc.kill()
        proc.wait()


def read_line(proc: Any, within_s: float = 120.0) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(within_s)
    assert result and result[0], f"the trainer said nothing within {within_s:.0f} s"
    return result[0].strip()


def acquire_until_free(storage: Storage) -> RootLock:
    """Take the root once the stopped job's lease lapsed (bounded: 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return acquire_root(storage, ttl_s=TTL_S, skew_s=0.5, renew=False)
        except RootInUseError:
            assert time.monotonic() < deadline, "the stopped job's lease never lapsed"
            time.sleep(0.2)
