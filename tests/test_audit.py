"""The audit log: ``audit.jsonl`` appended where the storage appends atomically, per-writer
segments under ``audit/`` on object storage (a real SeaweedFS for the ``s3`` tests), and
`read_audit` merging both. What is checked: the cost of an event does not grow with the
log, concurrent writers (threads, processes, a Checkpointer's trainer and worker) lose
no line, and readers (the library and ``resumable log``) see every line in order.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from resumable import Checkpointer
from resumable.audit import AUDIT_DIR, AUDIT_LOG, SEGMENT_BYTES, AuditLog, read_audit
from resumable.cli import main as cli
from resumable.errors import StorageError
from resumable.storage import LocalStorage, MemoryStorage
from resumable.storage.base import Buffer, ForwardingStorage
from resumable.storage.s3 import S3Storage

WRITER = """\
import os, sys, time
from resumable.audit import AuditLog
from resumable.storage import open_storage

url, who, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
log = AuditLog(open_storage(url))
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
for n in range(count):
    log.record("probe", writer=who, n=n)
"""


class ObjectLike(ForwardingStorage):
    """A memory store that, like an object store, cannot append; it counts the bytes
    written and read, and fails the writes it is told to."""

    def __init__(self) -> None:
        super().__init__(MemoryStorage())
        self.supports_append = False
        self.written: list[tuple[str, int]] = []
        self.read_bytes = 0
        self.fail_writes = 0

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if self.fail_writes:
            self.fail_writes -= 1
            raise StorageError(errno.EIO, f"injected fault: write {path}")
        n = self.inner.write(path, chunks)
        self.written.append((path, n))
        return n

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.read_bytes += length
        return self.inner.read_range(path, offset, length)


def probes(entries: list[dict[str, Any]], writer: str | None = None) -> list[int]:
    return [
        e["n"]
        for e in entries
        if e.get("event") == "probe" and (writer is None or e.get("writer") == writer)
    ]


def legacy_log(lines: int, t0: float) -> bytes:
    """An old-style ``audit.jsonl`` of ``lines`` entries, all older than ``t0``."""
    pad = "x" * 200
    return b"".join(
        json.dumps({"time": t0 - 1000 + i * 1e-3, "event": "old", "n": i, "pad": pad}).encode()
        + b"\n"
        for i in range(lines)
    )


# --------------------------------------------------------------------------- segments


def test_segments_roll_over_and_each_event_rewrites_only_its_segment() -> None:
    storage = ObjectLike()
    log = AuditLog(storage)
    for n in range(1500):  # about 200 KiB of lines: several segments
        log.record("probe", n=n, pad="y" * 100)

    assert storage.read_bytes == 0, "a writer never reads the log back"
    assert all(path.startswith(f"{AUDIT_DIR}/") for path, _ in storage.written)
    longest_line = 300
    assert max(n for _, n in storage.written) <= SEGMENT_BYTES + longest_line
    segments = storage.list_dir(AUDIT_DIR)
    assert len(segments) >= 3
    assert segments == sorted(segments)
    assert AUDIT_LOG not in storage.list_dir("")
    assert probes(read_audit(storage)) == list(range(1500))


def test_a_failed_segment_put_goes_out_with_the_next_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = ObjectLike()
    log = AuditLog(storage)
    log.record("probe", n=0)
    storage.fail_writes = 1
    log.record("probe", n=1)  # logged, not raised
    assert "could not write to the audit log" in caplog.text
    assert probes(read_audit(storage)) == [0]
    log.record("probe", n=2)
    assert probes(read_audit(storage)) == [0, 1, 2]


def test_threads_sharing_one_audit_log_lose_no_line() -> None:
    storage = ObjectLike()
    log = AuditLog(storage)

    def write(who: str) -> None:
        for n in range(300):
            log.record("probe", writer=who, n=n)

    threads = [threading.Thread(target=write, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = read_audit(storage)
    for i in range(4):
        assert probes(entries, f"t{i}") == list(range(300))


def test_reader_merges_the_legacy_file_and_every_writers_segments_by_time() -> None:
    storage = ObjectLike()
    t0 = time.time()
    storage.inner.write(AUDIT_LOG, [legacy_log(3, t0) + b'{"event": "torn'])
    storage.inner.write(f"{AUDIT_DIR}/notes.txt", [b"not a segment\n"])
    a, b = AuditLog(storage), AuditLog(storage)
    for n in range(6):
        (a if n % 2 == 0 else b).record("probe", n=n)
        time.sleep(0.002)

    entries = read_audit(storage)
    assert [e["event"] for e in entries] == ["old"] * 3 + ["probe"] * 6
    assert probes(entries) == list(range(6))
    assert len(storage.list_dir(AUDIT_DIR)) == 3  # a segment each, and the foreign file


def test_local_roots_keep_appending_to_audit_jsonl(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    a, b = AuditLog(storage), AuditLog(storage)
    a.record("probe", n=0)
    b.record("probe", n=1)
    assert storage.list_dir("") == [AUDIT_LOG]
    assert [json.loads(x)["n"] for x in (tmp_path / AUDIT_LOG).read_text().splitlines()] == [0, 1]


# --------------------------------------------------------------------------- real S3


class RequestLog:
    """Every HTTP request a boto3 client sends: (method, key, body bytes)."""

    def __init__(self, client: Any) -> None:
        self.requests: list[tuple[str, str, int]] = []
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request: Any, **_: Any) -> None:
        headers = request.headers
        size = headers.get("X-Amz-Decoded-Content-Length") or headers.get("Content-Length") or 0
        self.requests.append((request.method, request.url.split("?")[0], int(size)))


def s3_root(seaweedfs: Any, url: str) -> tuple[S3Storage, RequestLog]:
    client = seaweedfs.client()
    return S3Storage(url, client=client), RequestLog(client)


def test_event_cost_on_s3_does_not_grow_with_the_log(seaweedfs: Any) -> None:
    """An 8 MiB log written by an older version, and 40 segments of other writers: an
    event is one PUT of this writer's segment, no read, and never more than a segment."""
    url = f"s3://{seaweedfs.new_bucket('audit')}/run"
    storage, requests = s3_root(seaweedfs, url)
    t0 = time.time()
    big = legacy_log(8 * 1024 * 1024 // 250, t0)
    assert len(big) > 8 * 1024 * 1024
    storage.write(AUDIT_LOG, [big])
    others = [AuditLog(storage) for _ in range(40)]
    for n, other in enumerate(others):
        other.record("other", n=n)

    log = AuditLog(storage)
    before = len(requests.requests)
    for n in range(20):
        log.record("probe", n=n)
    mine = requests.requests[before:]

    assert [m for m, _, _ in mine] == ["PUT"] * 20, mine
    assert max(size for _, _, size in mine) <= SEGMENT_BYTES
    entries = read_audit(storage)
    assert len(entries) == len(big.splitlines()) + 40 + 20
    assert entries[-20:] == [e for e in entries if e["event"] == "probe"]
    assert probes(entries) == list(range(20))


def test_concurrent_processes_on_s3_lose_no_line_and_the_cli_prints_all(
    s3_env: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3_env.new_bucket('audit')}/run"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    count = 100
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, f"p{i}", str(count), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    for proc in procs:  # all started and imported: then they write at once
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    go.touch()
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert "could not write" not in err

    storage = S3Storage(url)
    entries = read_audit(storage)
    for i in range(3):
        assert probes(entries, f"p{i}") == list(range(count)), f"writer p{i} lost lines"
    times = [e["time"] for e in entries]
    assert times == sorted(times)

    assert cli(["log", url]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == entries
    assert cli(["log", url, "--event", "nothing-like-this"]) == 0
    assert capsys.readouterr().out == ""


def test_checkpointer_trainer_worker_and_another_writer_share_the_s3_log(
    s3_env: Any, small_training_state: Any
) -> None:
    """persist="process": the trainer records save_start, the worker process commit;
    a third writer records at the same time. No line of any of them is lost."""
    url = f"s3://{s3_env.new_bucket('audit')}/run"
    other = AuditLog(S3Storage(url))
    done = threading.Event()

    def write() -> None:
        n = 0
        while not done.is_set() or n < 50:
            other.record("probe", n=n)
            n += 1
            time.sleep(0.002)

    thread = threading.Thread(target=write)
    thread.start()
    ts = small_training_state()
    try:
        with Checkpointer(url, ts.state, persist="process") as ck:
            for step in range(1, 7):
                ts.train()
                ck.save(step)
                ck.wait()
    finally:
        done.set()
        thread.join()

    entries = read_audit(S3Storage(url))
    n = probes(entries)
    assert n == list(range(len(n)))
    for event in ("save_start", "commit"):
        steps = [e["step"] for e in entries if e["event"] == event]
        assert steps == list(range(1, 7)), f"{event}: {steps}"
    pids = {e["pid"] for e in entries if e["event"] in ("save_start", "commit")}
    assert len(pids) == 2, "the trainer and the worker process both wrote"


class StalledStore(ObjectLike):
    """An object-like store whose writes wait until ``go`` is set (a stalled object store),
    recording the thread that wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.threads: set[str] = set()

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        self.threads.add(threading.current_thread().name)
        assert self.go.wait(30)
        return super().write(path, chunks)


def test_progress_entries_on_object_storage_never_wait_on_the_training_thread() -> None:
    from resumable.audit import ProgressNotes

    store = StalledStore()
    notes = ProgressNotes(AuditLog(store), every_s=0.0)
    for step in range(1, 51):  # the store holds the first entry's PUT all along
        notes.saw(step)
        notes.snapshot(0.001)
    assert threading.current_thread().name not in store.threads  # no step wrote, or waited
    store.go.set()
    notes.flush(final=True)  # close: waits for what is in flight, then writes the rest
    entries = [e for e in read_audit(store) if e["event"] == "progress"]
    assert (entries[0]["step"], entries[-1]["step"]) == (1, 50)
    assert sum(e["snapshots"] for e in entries) == 50  # counts kept while one was in flight
    assert len(entries) < 50


def test_progress_entries_on_a_local_root_are_written_in_place(tmp_path: Path) -> None:
    from resumable.audit import ProgressNotes

    storage = LocalStorage(tmp_path)
    notes = ProgressNotes(AuditLog(storage), every_s=0.0)
    for step in (1, 2):
        notes.saw(step)
    assert [e["step"] for e in read_audit(storage)] == [1, 2]
    notes.flush(final=True)
