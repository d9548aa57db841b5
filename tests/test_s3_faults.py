"""Checkpoints on S3 under failure: a real SeaweedFS server behind `FaultProxy`.

What a flaky or hostile object store must never do: make a save commit a torn
checkpoint, let two writers of one step both commit, or hang. Covered here:

- transient faults (5xx, connection resets, lost responses, slow responses past the read
  timeout) are retried and every committed step restores bit for bit;
- persistent faults fail the save within a bounded time and leave the older
  checkpoints untouched;
- a lost response to the manifest PUT still commits (the retry gets 412 and compares),
  and one to any request of a multipart upload is absorbed by retrying that request;
- of two concurrent committers of one step exactly one wins, and the loser leaves nothing;
- a server that ignores ``If-None-Match`` is refused unless ``allow_unconditional_commit``;
- a writer SIGKILLed at chosen requests never leaves a visible torn checkpoint, and what
  it abandons is exactly what `MarkerCommit.stale` lists.

Three bugs these tests found are fixed and pinned here: a writer committing after
another writer's completed commit replaced it; only the first save on a server ignoring
``If-None-Match`` was refused; a lost answer to the probe's first PUT failed the attempt.

botocore's back-off is scaled down (`fast_backoff`) so that dozens of injected faults
cost milliseconds: the retry logic under test is unchanged, only its sleeps are shorter.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import botocore.retries.standard
import pytest
import torch

from conftest import TrainingState, build_training_state, tensor_bytes_equal
from faultproxy import FaultProxy
from resumable import Checkpointer, StorageError
from resumable.audit import AUDIT_DIR
from resumable.capture import capture
from resumable.commit import MarkerCommit, list_committed, step_dir
from resumable.errors import CheckpointError
from resumable.format import MANIFEST
from resumable.lock import RootLock
from resumable.pipeline.write import PersistResult, WriteRequest, write_checkpoint
from resumable.reader import CheckpointReader
from resumable.snapshot import Arena
from resumable.storage.base import ForwardingStorage, Storage
from resumable.storage.s3 import S3Storage

if TYPE_CHECKING:
    from s3server import S3Server

MiB = 1 << 20
PART = 5 * MiB
TESTS_DIR = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's standard retry mode sleeps up to 1 s, 2 s, ... after a 503 SlowDown
    (throttling) and up to 50 ms, 100 ms, ... after other errors; both get the 50 ms base
    here, so a test with dozens of injected faults stays fast."""
    config = botocore.retries.standard.ExponentialBackoff._DEFAULT_BACKOFF_CONFIG
    monkeypatch.setitem(config, "throttling_base_scale", 0.05)


@pytest.fixture
def proxy(seaweedfs: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(seaweedfs.endpoint, seed=1234) as proxy:
        yield proxy
    assert proxy.errors == []


def s3_options(endpoint: str, server: S3Server, **overrides: Any) -> dict[str, Any]:
    """``storage_options`` for a root on ``server`` reached at ``endpoint`` (a proxy)."""
    options: dict[str, Any] = {
        "endpoint_url": endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        "region_name": server.region,
        "part_size": PART,
        "max_concurrency": 4,
        "max_attempts": 8,
        "connect_timeout": 2,
        "read_timeout": 10,
    }
    options.update(overrides)
    return options


def direct(server: S3Server, url: str) -> S3Storage:
    """A storage on ``url`` that bypasses the proxy: to inspect what really landed."""
    return S3Storage(url, **s3_options(server.endpoint, server))


def is_manifest_put(method: str, path: str) -> bool:
    return method == "PUT" and path.split("?", 1)[0].endswith(f"/{MANIFEST}")


def once(picks: Callable[[str, str], bool]) -> Callable[[str, str], bool]:
    """A `FaultProxy.set_faults` match for the first request that ``picks`` picks."""
    hits: list[str] = []

    def match(method: str, path: str) -> bool:
        if not hits and picks(method, path):
            hits.append(path)
            return True
        return False

    return match


def injected(proxy: FaultProxy) -> dict[str, int]:
    """How many requests got each fault so far."""
    out: dict[str, int] = {}
    for r in proxy.requests:
        if r.action != "pass":
            out[r.action] = out.get(r.action, 0) + 1
    return out


def verify_all(storage: Storage) -> list[int]:
    """Every committed step verifies in full; returns them."""
    steps = list_committed(storage)
    for step in steps:
        CheckpointReader(storage, step).verify()
    return steps


def stray_objects(storage: S3Storage) -> list[str]:
    """Objects that are neither a manifest, the audit log, the root's own bookkeeping
    (``.resumable-run``, ``.resumable-lease/``: docs/root-safety.md), nor referenced by
    a manifest."""
    referenced = {f"{AUDIT_DIR}/{name}" for name in storage.list_dir(AUDIT_DIR)}
    for step in list_committed(storage):
        referenced.add(f"{step_dir(step)}/{MANIFEST}")
        manifest = json.loads(storage.read(f"{step_dir(step)}/{MANIFEST}"))
        referenced.update(f"{step_dir(step)}/{name}" for name in manifest["files"])
    return sorted(
        name
        for name in storage.list_files()
        if name not in referenced and not name.endswith("/") and not name.startswith(".resumable-")
    )


# --------------------------------------------------------------------------- the job


class Job:
    """A deterministic training job with a ``big`` tensor, so that its data file goes up
    as a multipart upload: `advance` to step ``s`` gives the same state in any process.

    With ``optimizer`` it is the suite's `TrainingState` (model, AdamW, StepLR); without,
    a model changed in place, for child processes that should start fast (a torch
    optimizer's first construction imports ``torch._dynamo``: seconds)."""

    def __init__(self, big_numel: int, *, optimizer: bool = True) -> None:
        self.ts: TrainingState | None = None
        if optimizer:
            self.ts = build_training_state(seed=5, steps=1)
            self.model = self.ts.model
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(5)
                self.model = torch.nn.Linear(4, 8)
        self.big = torch.zeros(big_numel, dtype=torch.float32)
        base = self.ts.state if self.ts is not None else {"model": self.model}
        self.state: dict[str, Any] = {**base, "big": self.big}
        self.step = 0

    def advance(self, step: int) -> None:
        """Train up to ``step`` (one optimizer step per step)."""
        while self.step < step:
            self.step += 1
            if self.ts is not None:
                self.ts.train(1)
            else:
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.mul_(0.9).add_(0.01 * self.step)
            torch.arange(self.big.numel(), out=self.big).mul_(0.5).add_(self.step)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.ts is not None:
            out = self.ts.tensors()
        else:
            out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        return {**out, "big": self.big.clone()}


def expected_tensors(
    big_numel: int, steps: int, *, optimizer: bool = True
) -> dict[int, dict[str, torch.Tensor]]:
    """`Job.tensors` at steps 1..``steps``."""
    job = Job(big_numel, optimizer=optimizer)
    out = {}
    for step in range(1, steps + 1):
        job.advance(step)
        out[step] = job.tensors()
    return out


def mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    names = sorted(set(actual) | set(expected))
    return [
        n
        for n in names
        if n not in actual or n not in expected or not tensor_bytes_equal(actual[n], expected[n])
    ]


def open_ckpt(url: str, state: dict[str, Any], options: dict[str, Any]) -> Checkpointer:
    return Checkpointer(
        url, state, keep=None, persist="sync", capture_rng=False, storage_options=options
    )


def restore_fresh(
    url: str, options: dict[str, Any], big_numel: int, *, optimizer: bool = True
) -> tuple[int, dict[str, torch.Tensor]]:
    """Restore the newest committed step into a fresh job; (step, its tensors)."""
    job = Job(big_numel, optimizer=optimizer)
    with open_ckpt(url, job.state, options) as ck:
        step = ck.restore()
    return step, job.tensors()


def run_writer(url: str, options: dict[str, Any], big_numel: int, steps: int) -> None:
    """Save steps 1..``steps`` of `Job` (without optimizer), each committed before the next:
    the child process that gets killed."""
    job = Job(big_numel, optimizer=False)
    with open_ckpt(url, job.state, options) as ck:
        for step in range(1, steps + 1):
            job.advance(step)
            ck.save(step)
            print(step, flush=True)


# --------------------------------------------------------------------------- transient faults

FAULT_MIXES: dict[str, dict[str, Any]] = {
    "errors": {"error_rate": 0.3},
    "resets": {"reset_rate": 0.2},
    "mixed": {
        "error_rate": 0.1,
        "error_codes": (500, 502, 503, 504),
        "reset_rate": 0.1,
        "lost_response_rate": 0.05,
        "delay_rate": 0.1,
        "delay_s": 0.05,
    },
}


@pytest.mark.parametrize("mix", sorted(FAULT_MIXES))
def test_transient_faults_are_retried(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy, mix: str
) -> None:
    big = 3 * MiB  # 12 MiB: three parts, three ranged GETs on restore
    url = f"s3://{s3_bucket}/run"
    options = s3_options(proxy.endpoint, seaweedfs)
    expected = expected_tensors(big, 2)
    proxy.set_faults(**FAULT_MIXES[mix])

    job = Job(big)
    with open_ckpt(url, job.state, options) as ck:
        for step in (1, 2):
            job.advance(step)
            assert ck.save(step)
    faults = injected(proxy)
    assert sum(faults.values()) >= 5, f"too few faults injected to prove anything: {faults}"

    step, restored = restore_fresh(url, options, big)  # faults still on for the reads
    assert step == 2
    assert mismatches(restored, expected[2]) == []
    proxy.clear_faults()
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1, 2]
    assert (
        mismatches(CheckpointReader(storage, 1).tensors(["big"]), {"big": expected[1]["big"]}) == []
    )
    assert stray_objects(storage) == []


# --------------------------------------------------------------------------- persistent faults


def test_persistent_errors_fail_the_save_in_bounded_time(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_options(proxy.endpoint, seaweedfs, max_attempts=2, read_timeout=2)
    job = Job(1024)
    storage = direct(seaweedfs, url)
    with open_ckpt(url, job.state, options) as ck:
        job.advance(1)
        ck.save(1)
        proxy.set_faults(error_rate=1.0)
        job.advance(2)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as failure:
            ck.save(2)
        elapsed = time.monotonic() - t0
        assert isinstance(failure.value, OSError), failure.value
        assert elapsed < 20, f"a dead server took {elapsed:.1f} s to fail the save"
        assert injected(proxy).get("error", 0) >= 2

        proxy.clear_faults()
        assert verify_all(storage) == [1]
        assert not storage.exists(f"{step_dir(2)}/{MANIFEST}")
        assert stray_objects(storage) == []  # the errors never reached the server

        ck.save(2)
    assert verify_all(storage) == [1, 2]
    step, restored = restore_fresh(url, options, 1024)
    assert step == 2
    assert mismatches(restored, job.tensors()) == []


# --------------------------------------------------------------------------- lost response


def test_lost_response_to_the_manifest_put_still_commits(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    proxy.set_faults(lost_response_rate=1.0, match=once(is_manifest_put))
    job = Job(1024)
    with open_ckpt(url, job.state, s3_options(proxy.endpoint, seaweedfs)) as ck:
        job.advance(1)
        assert ck.save(1)

    puts = [r for r in proxy.requests if is_manifest_put(r.method, r.path)]
    assert [(r.action, r.status) for r in puts] == [("lost_response", None), ("pass", 412)]
    deletes = [r for r in proxy.requests if r.method == "POST" and "?delete" in r.path]
    assert deletes == [], "the retried commit took the re-save path instead of comparing bytes"
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1]
    assert stray_objects(storage) == []
    step, restored = restore_fresh(url, s3_options(seaweedfs.endpoint, seaweedfs), 1024)
    assert step == 1
    assert mismatches(restored, job.tensors()) == []


def test_commit_failing_after_its_manifest_landed_keeps_the_data(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    """Regression: the manifest PUT landed but its answer was lost, and the retry
    failed, so the commit raised; the abort then deleted the data that the landed
    manifest names, and a torn checkpoint was listed."""
    url = f"s3://{s3_bucket}/run"
    storage = S3Storage(url, **s3_options(proxy.endpoint, seaweedfs, max_attempts=2))
    proxy.set_faults(lost_response_rate=1.0, match=once(is_manifest_put))

    def fail_the_retry(index: int, method: str, path: str) -> None:
        if is_manifest_put(method, path):
            proxy.on_request(None)
            proxy.schedule({index + 1: 500})

    proxy.on_request(fail_the_retry)
    with pytest.raises(StorageError):
        save_with_marker(storage, 1, content(0, 1))
    puts = [r for r in proxy.requests if is_manifest_put(r.method, r.path)]
    assert [r.action for r in puts] == ["lost_response", "error"]
    assert verify_all(direct(seaweedfs, url)) == [1]  # committed after all, and whole


MULTIPART_REQUESTS: dict[str, Callable[[str, str], bool]] = {
    "create": lambda method, path: method == "POST" and path.split("?", 1)[-1] == "uploads",
    "part": lambda method, path: method == "PUT" and "partNumber=" in path,
    "complete": lambda method, path: method == "POST" and "uploadId=" in path,
}


@pytest.mark.parametrize("kind", sorted(MULTIPART_REQUESTS))
def test_lost_response_during_a_multipart_upload(
    seaweedfs: S3Server,
    s3_bucket: str,
    proxy: FaultProxy,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"s3://{s3_bucket}/run"
    proxy.set_faults(lost_response_rate=1.0, match=once(MULTIPART_REQUESTS[kind]))
    job = Job(1536 * 1024)
    with (
        caplog.at_level(logging.WARNING),
        open_ckpt(url, job.state, s3_options(proxy.endpoint, seaweedfs)) as ck,
    ):
        job.advance(1)
        assert ck.save(1)
    assert [r.action for r in proxy.requests].count("lost_response") == 1
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == [], "the lost answer was not absorbed by retrying the request"
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1]
    assert stray_objects(storage) == []
    step, restored = restore_fresh(url, s3_options(seaweedfs.endpoint, seaweedfs), 1536 * 1024)
    assert step == 1
    assert mismatches(restored, job.tensors()) == []


# --------------------------------------------------------------------------- concurrent writers


class BarrierStorage(ForwardingStorage):
    """Holds every conditional put at ``barrier``: both writers have checked for an
    existing marker before either puts its manifest, so the conditional put alone decides.
    (A writer that commits after the other one's put loses too: see
    `test_a_writer_committing_after_another_writer_committed_loses`.)"""

    def __init__(self, inner: Storage, barrier: threading.Barrier) -> None:
        super().__init__(inner)
        self.barrier = barrier

    def put_if_absent(self, path: str, data: bytes) -> bool:
        if path.endswith(MANIFEST):  # not the root's own files (run id, probe)
            self.barrier.wait()
        return self.inner.put_if_absent(path, data)


def content(writer: int, step: int) -> dict[str, Any]:
    return {
        "w": torch.arange(4096, dtype=torch.float32) * (writer + 1) + step,
        "meta": {"writer": writer, "step": step},
    }


def save_with_marker(
    storage: Storage, step: int, state: dict[str, Any], **kw: Any
) -> PersistResult:
    captured = capture(state, include_rng=False)
    snap = Arena().snapshot(captured.tensors)
    return write_checkpoint(
        storage, MarkerCommit(storage), WriteRequest(step, snap, captured.tree), **kw
    )


def race(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` in threads; each result is a return value or the exception raised."""
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a committer hung"
    return results


def split_winner(results: list[Any]) -> tuple[int, Any]:
    """(index of the one writer that returned, the loser's exception)."""
    won = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, f"expected one winner and one loser: {results}"
    assert isinstance(lost[0], StorageError), lost[0]
    assert lost[0].errno == errno.EEXIST, lost[0]
    assert "another writer" in str(lost[0])
    return won[0], lost[0]


def test_concurrent_committers_of_one_step_have_one_winner(
    seaweedfs: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    storages = [direct(seaweedfs, url) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=30)
    wrapped = [BarrierStorage(s, barrier) for s in storages]
    for step in (1, 2, 3):
        states = [content(w, step) for w in range(2)]
        results = race(
            [functools.partial(save_with_marker, wrapped[w], step, states[w]) for w in range(2)]
        )
        winner, _ = split_winner(results)
        result: PersistResult = results[winner]

        committed = json.loads(storages[0].read(f"{step_dir(step)}/{MANIFEST}"))
        assert committed["files"] == result.manifest["files"]
        reader = CheckpointReader(storages[0], step)
        reader.verify()
        assert torch.equal(reader.tensors()["w"], states[winner]["w"])
        assert stray_objects(storages[0]) == [], f"step {step}: the loser's objects remain"
    assert list_committed(storages[0]) == [1, 2, 3]
    assert MarkerCommit(storages[0], gc_grace_s=0).stale() == []


def test_concurrent_checkpointers_of_one_step_have_one_winner(
    seaweedfs: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beneath the one-writer lock (which would refuse the second writer): should two
    writers ever commit at once (a lease lost mid-save), the commit still has one winner."""
    monkeypatch.setattr("resumable.pipeline.root_claim.acquire_root", lambda storage: RootLock())
    monkeypatch.setattr("resumable.manager.Checkpointer._supersede", lambda self: None)
    url = f"s3://{s3_bucket}/run"
    barrier = threading.Barrier(2, timeout=30)
    states = [content(w, 7) for w in range(2)]
    ckpts = [
        Checkpointer(
            BarrierStorage(direct(seaweedfs, url), barrier),
            states[w],
            keep=None,
            persist="sync",
            capture_rng=False,
        )
        for w in range(2)
    ]
    try:
        results = race([functools.partial(c.save, 7) for c in ckpts])
    finally:
        for c in ckpts:
            c.close()
    winner, _ = split_winner(results)
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [7]
    assert stray_objects(storage) == []
    fresh = content(9, 0)
    with open_ckpt(url, fresh, s3_options(seaweedfs.endpoint, seaweedfs)) as ck:
        assert ck.restore() == 7
    assert fresh["meta"] == states[winner]["meta"]
    assert torch.equal(fresh["w"], states[winner]["w"])


def test_a_writer_committing_after_another_writer_committed_loses(
    seaweedfs: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/run"
    first, second = direct(seaweedfs, url), direct(seaweedfs, url)
    states = [content(w, 4) for w in range(2)]
    won: list[PersistResult] = []

    def other_writer_commits() -> None:  # runs while `second` has its data written
        won.append(save_with_marker(first, 4, states[0]))

    with pytest.raises(StorageError) as lost:
        save_with_marker(second, 4, states[1], before_commit=other_writer_commits)
    assert lost.value.errno == errno.EEXIST
    committed = json.loads(first.read(f"{step_dir(4)}/{MANIFEST}"))
    assert committed["files"] == won[0].manifest["files"]
    CheckpointReader(first, 4).verify()


# --------------------------------------------------------------------------- conditional-put probe


def test_server_ignoring_if_none_match_is_refused(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    proxy.drop_request_headers("If-None-Match")
    job = Job(1024)
    job.advance(1)
    with pytest.raises(StorageError) as refused:  # the root is checked at construction
        open_ckpt(url, job.state, s3_options(proxy.endpoint, seaweedfs))
    assert refused.value.errno == errno.ENOTSUP
    assert "allow_unconditional_commit" in str(refused.value)
    storage = direct(seaweedfs, url)
    assert list_committed(storage) == []
    assert list(storage.list_files()) == []


def test_server_ignoring_if_none_match_is_refused_on_every_save(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    proxy.drop_request_headers("If-None-Match")
    job = Job(1024)
    job.advance(1)
    for _ in range(2):  # a refusal is not remembered as a pass
        with pytest.raises(StorageError) as refused:
            open_ckpt(url, job.state, s3_options(proxy.endpoint, seaweedfs))
        assert refused.value.errno == errno.ENOTSUP
    assert list_committed(direct(seaweedfs, url)) == []


def test_lost_answer_to_the_probe_put_is_absorbed(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"s3://{s3_bucket}/run"
    probe_put = once(lambda method, path: method == "PUT" and "/.resumable-probe/" in path)
    proxy.set_faults(lost_response_rate=1.0, match=probe_put)
    job = Job(1024)
    with (
        caplog.at_level(logging.WARNING),
        open_ckpt(url, job.state, s3_options(proxy.endpoint, seaweedfs)) as ck,
    ):
        job.advance(1)
        assert ck.save(1)
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert stray_objects(storage) == []


def test_allow_unconditional_commit_saves_with_a_warning(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"s3://{s3_bucket}/run"
    proxy.drop_request_headers("If-None-Match")
    options = s3_options(proxy.endpoint, seaweedfs, allow_unconditional_commit=True)
    job = Job(1024)
    with (
        caplog.at_level(logging.WARNING, logger="resumable.storage.s3"),
        open_ckpt(url, job.state, options) as ck,
    ):
        for step in (1, 2):
            job.advance(step)
            assert ck.save(step)
    warnings = [r for r in caplog.records if "allow_unconditional_commit" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert verify_all(direct(seaweedfs, url)) == [1, 2]


# --------------------------------------------------------------------------- killed writer

WRITER = """\
import json, sys
sys.path.insert(0, {tests!r})
from test_s3_faults import run_writer
run_writer(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
"""


class Killed(Exception):
    """Raised by `KillSwitch` after the SIGKILL: the proxy drops the request unsent."""


Picker = Callable[["KillSwitch", int, str, str], bool]


class KillSwitch:
    """A proxy callback: SIGKILL the writer ``pid`` at the first request ``at`` picks
    (called with this switch, the request's index, method and path) and drop that
    request. With ``lose_answer`` the picked request reaches the server, its answer is
    lost (give `match` to `FaultProxy.set_faults`), and the writer dies at its retry.
    ``manifests`` counts the manifest PUTs that reached the server: the steps committed."""

    def __init__(self, at: Picker, *, lose_answer: bool = False) -> None:
        self.at = at
        self.lose_answer = lose_answer
        self.pid: int | None = None
        self.manifests = 0
        self.lost: int | None = None
        self.request = ""

    def match(self, method: str, path: str) -> bool:
        return self.lose_answer and self.lost is None and self.at(self, -1, method, path)

    def __call__(self, index: int, method: str, path: str) -> None:
        if self.request or self.pid is None:
            return
        if self.lost is not None or (not self.lose_answer and self.at(self, index, method, path)):
            self.request = f"request {index}: {method} {path}"
            os.kill(self.pid, signal.SIGKILL)
            raise Killed(f"writer killed at {self.request}")
        if self.lose_answer and self.at(self, index, method, path):
            self.lost = index
        if is_manifest_put(method, path):
            self.manifests += 1


def nth_manifest_put(n: int) -> Picker:
    return lambda sw, i, method, path: is_manifest_put(method, path) and sw.manifests == n - 1


def marker_check(step: int) -> Picker:
    """The HEAD that looks for the step's manifest just before its conditional PUT (the
    second one: `MarkerCommit.begin` looks once before the data is written)."""
    suffix = f"/{step_dir(step)}/{MANIFEST}"
    seen = [0]

    def pick(sw: KillSwitch, i: int, method: str, path: str) -> bool:
        if method == "HEAD" and path.endswith(suffix):
            seen[0] += 1
            return seen[0] == 2
        return False

    return pick


def first_part_2(sw: KillSwitch, i: int, method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=2" in path


# (where, which request, lose its answer, whether an uncommitted attempt's data is complete)
KILL_POINTS: list[tuple[str, Picker, bool, bool]] = [
    ("part 2 of step 1's data upload", first_part_2, False, False),
    ("step 2's manifest PUT, dropped", nth_manifest_put(2), False, True),
    ("the retry of step 2's manifest PUT, whose answer was lost", nth_manifest_put(2), True, False),
    ("step 3's marker check", marker_check(3), False, True),
]


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_writer_killed_at_any_request_leaves_no_torn_checkpoint(
    seaweedfs: S3Server, tmp_path: Path
) -> None:
    """Writers saving steps 1..3 run side by side, each through its own proxy, which
    SIGKILLs it at one chosen request: early, mid multipart upload, at a manifest PUT
    (dropped, or landed with its answer lost), between data and manifest. Then exactly
    the steps whose manifest reached the server are committed, and they are whole."""
    big = 1536 * 1024  # 6 MiB: every data file is a two-part upload
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(tests=str(TESTS_DIR)))
    with contextlib.ExitStack() as stack:
        runs = []
        for what, at, lose_answer, data_written in KILL_POINTS:
            proxy = stack.enter_context(FaultProxy(seaweedfs.endpoint))
            switch = KillSwitch(at, lose_answer=lose_answer)
            proxy.on_request(switch)
            proxy.set_faults(lost_response_rate=1.0, match=switch.match)
            url = f"s3://{seaweedfs.new_bucket('kill')}/run"
            options = json.dumps(s3_options(proxy.endpoint, seaweedfs))
            proc = subprocess.Popen(
                [sys.executable, str(script), url, options, str(big), "3"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            stack.callback(stop, proc)
            switch.pid = proc.pid
            runs.append((what, data_written, url, proxy, switch, proc))

        expected = expected_tensors(big, 3, optimizer=False)  # while the writers start
        for what, data_written, url, proxy, switch, proc in runs:
            out, err = proc.communicate(timeout=120)
            where = f"killed at {what} ({switch.request})"
            assert proc.returncode == -signal.SIGKILL, f"{where}: writer ended\n{err[-3000:]}"
            assert switch.request, where
            assert [e for e in proxy.errors if not isinstance(e, Killed)] == [], where
            committed = list(range(1, switch.manifests + 1))
            printed = [int(x) for x in out.split()]
            assert printed in (committed, committed[:-1]), f"{where}: printed {printed}"
            stale = check_after_kill(seaweedfs, url, committed, expected, big, where)
            if data_written:
                assert len(stale) == 1, f"{where}: the abandoned attempt is not listed"


def check_after_kill(
    server: S3Server,
    url: str,
    committed: list[int],
    expected: dict[int, dict[str, torch.Tensor]],
    big: int,
    where: str,
) -> list[str]:
    """Exactly ``committed`` is visible and valid; the newest restores bit for bit;
    `MarkerCommit.stale` lists exactly the abandoned attempt, and removing it leaves only
    what the manifests reference. Returns what `stale` listed."""
    storage = direct(server, url)
    assert verify_all(storage) == committed, where
    step, restored = restore_fresh(url, s3_options(server.endpoint, server), big, optimizer=False)
    assert step == (committed[-1] if committed else 0), where
    if committed:
        assert mismatches(restored, expected[step]) == [], where

    stale = MarkerCommit(storage, gc_grace_s=0).stale()
    attempts = {
        f"{step_dir(s)}/{name.split('/', 1)[0]}"
        for s in committed
        for name in json.loads(storage.read(f"{step_dir(s)}/{MANIFEST}"))["files"]
    }
    assert not set(stale) & attempts, f"{where}: stale() lists committed data: {stale}"
    uncommitted_data = {
        name.rsplit("/", 1)[0] for name in stray_objects(storage) if name.endswith(".safetensors")
    }
    assert set(stale) == uncommitted_data, where
    for name in stale:
        storage.delete(name)
    assert MarkerCommit(storage, gc_grace_s=0).stale() == [], where
    assert verify_all(storage) == committed, where
    leftovers = stray_objects(storage)
    assert leftovers == [], f"{where}: objects no manifest references: {leftovers}"
    return stale


# --------------------------------------------------------------------------- slow storage


def test_slow_requests_past_the_read_timeout_are_retried(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_options(proxy.endpoint, seaweedfs, read_timeout=0.25)
    proxy.set_faults(delay_rate=0.15, delay_s=0.5)
    job = Job(1024)
    with open_ckpt(url, job.state, options) as ck:
        for step in (1, 2):
            job.advance(step)
            assert ck.save(step)
    requests = proxy.requests
    delayed = [r for r in requests if r.action == "delay"]
    assert len(delayed) >= 2, injected(proxy)
    retried = [
        r
        for r in delayed
        if any(
            q.index > r.index and (q.method, q.path) == (r.method, r.path)
            for q in requests[r.index + 1 : r.index + 3]
        )
    ]
    assert retried, "no timed-out request was retried"
    proxy.clear_faults()
    time.sleep(0.6)  # let the delayed originals land
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1, 2]
    step, restored = restore_fresh(url, options, 1024)
    assert step == 2
    assert mismatches(restored, job.tensors()) == []


def test_storage_slower_than_every_timeout_fails_in_bounded_time(
    seaweedfs: S3Server, s3_bucket: str, proxy: FaultProxy
) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_options(proxy.endpoint, seaweedfs, read_timeout=0.15, max_attempts=2)
    job = Job(1024)
    with open_ckpt(url, job.state, options) as ck:
        job.advance(1)
        ck.save(1)
        proxy.set_faults(delay_rate=1.0, delay_s=0.5)
        job.advance(2)
        t0 = time.monotonic()
        with pytest.raises(StorageError) as failure:
            ck.save(2)
        elapsed = time.monotonic() - t0
        assert elapsed < 20, f"a hung server took {elapsed:.1f} s to fail the save"
        assert failure.value.errno == errno.EIO
        assert "timeout" in str(failure.value).lower(), failure.value
        proxy.clear_faults()
    time.sleep(0.6)  # let the delayed originals land
    storage = direct(seaweedfs, url)
    assert verify_all(storage) == [1]
    assert not storage.exists(f"{step_dir(2)}/{MANIFEST}")
