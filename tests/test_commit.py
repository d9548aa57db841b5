"""`RenameCommit`: a crash at any point of a save leaves the new complete checkpoint or
none, never a torn one; the leftovers are swept on the next start.

Two kinds of crash: a faulty storage that fails the k-th mutating call of a save (for
every k), and a real ``SIGKILL`` of a process saving in a loop. `make test` kills that
process twice (the second launch resumes from the first's checkpoint); `make campaign`
kills it three times.
"""

from __future__ import annotations

import errno
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import resumable.pipeline._worker as worker_mod
from resumable import Checkpointer, Keep, StorageError
from resumable.audit import read_audit
from resumable.commit import RenameCommit, list_committed, step_dir
from resumable.format import MANIFEST
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import Buffer, ForwardingStorage

LIFECYCLE = ("launch", "progress", "close")  # the entries every Checkpointer writes


class FaultyStorage(ForwardingStorage):
    """A real backend whose ``fail_at``-th mutating call (write, append, delete,
    rename_dir, sync_dir; counted from 0) raises `StorageError`, and with ``sticky``
    every later one too, like a disk that died. The error's errno is ``code``: ENOSPC
    is final, EIO is retried by the persist pipeline. A failing write leaves a torn file and a
    failing delete removes part of a tree, as real failures do. ``calls`` logs every
    mutating call as ``(verb, path, second_path)``."""

    def __init__(
        self,
        inner: Storage,
        *,
        fail_at: int | None = None,
        sticky: bool = False,
        code: int = errno.ENOSPC,
    ) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.sticky = sticky
        self.code = code
        self.calls: list[tuple[str, str, str]] = []

    def _fails(self, verb: str, path: str, other: str = "") -> bool:
        k = len(self.calls)
        self.calls.append((verb, path, other))
        if self.fail_at is None:
            return False
        return k == self.fail_at or (self.sticky and k > self.fail_at)

    def _fault(self, verb: str, path: str) -> StorageError:
        k = len(self.calls) - 1
        return StorageError(self.code, f"injected fault in call {k}: {verb} {path}")

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if self._fails("write", path):
            data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
            self.inner.write(path, [data[: len(data) // 2]])
            raise self._fault("write", path)
        return self.inner.write(path, chunks)

    def append(self, path: str, data: bytes) -> None:
        if self._fails("append", path):
            raise self._fault("append", path)
        self.inner.append(path, data)

    def delete(self, path: str) -> None:
        if self._fails("delete", path):
            children = self.inner.list_dir(path)
            if children:
                self.inner.delete(f"{path}/{children[0]}")
            raise self._fault("delete", path)
        self.inner.delete(path)

    def rename_dir(self, src: str, dst: str) -> None:
        if self._fails("rename_dir", src, dst):
            raise self._fault("rename_dir", src)
        self.inner.rename_dir(src, dst)

    def sync_dir(self, path: str = "") -> None:
        if self._fails("sync_dir", path):
            raise self._fault("sync_dir", path)
        self.inner.sync_dir(path)


def make_state() -> dict[str, Any]:
    return {"w": torch.zeros(64), "b": torch.zeros(3, dtype=torch.int64), "meta": {}}


def set_content(state: dict[str, Any], step: int, version: int) -> None:
    """The state saved as ``version`` of ``step``: a deterministic function of both."""
    state["w"].copy_(torch.arange(64, dtype=torch.float32) * (version + 1) + step)
    state["b"].copy_(torch.tensor([step, version, step * 7 + version]))
    state["meta"].clear()
    state["meta"].update(step=step, version=version)


def content_of(state: dict[str, Any]) -> tuple[int, int]:
    """(step, version) of a restored state, after checking it is exactly that content."""
    step, version = state["meta"]["step"], state["meta"]["version"]
    expected = make_state()
    set_content(expected, step, version)
    assert torch.equal(state["w"], expected["w"]), "restored tensor w is torn"
    assert torch.equal(state["b"], expected["b"]), "restored tensor b is torn"
    return step, version


def staging_leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def plant_stale(root: Path, dead_pid: int, step: int) -> str:
    """A staging directory a killed writer would leave: data file, no manifest."""
    name = f".tmp-{step_dir(step)}.{dead_pid}.0badc0de"
    (root / name).mkdir(parents=True)
    (root / name / "rank-00000.safetensors").write_bytes(b"\0" * 100)
    return name


def open_ckpt(url: Path | Storage, state: dict[str, Any], keep: Keep | None = None) -> Checkpointer:
    """A Checkpointer persisting on the calling thread, so a wrapped storage sees it all."""
    return Checkpointer(url, state, keep=keep, capture_rng=False, persist="sync")


@pytest.fixture
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries of transient storage errors happen at once instead of after a back-off."""
    fast = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if n[0] != "_"})
    fast.sleep = lambda seconds: None
    monkeypatch.setattr(worker_mod, "time", fast)


# --------------------------------------------------------------------------- protocol


def test_save_writes_data_then_manifest_then_renames(tmp_path: Path) -> None:
    storage = FaultyStorage(LocalStorage(tmp_path))
    state = make_state()
    ckpt = open_ckpt(storage, state)
    set_content(state, 5, 0)
    assert ckpt.save(5)

    calls = [c for c in storage.calls if c[0] != "append"]
    staging = calls[0][1].split("/")[0]
    assert re.fullmatch(rf"\.tmp-step-000000000005\.{os.getpid()}\.[0-9a-f]+", staging)
    assert calls == [
        ("write", f"{staging}/rank-00000.safetensors", ""),
        ("write", f"{staging}/{MANIFEST}", ""),
        ("sync_dir", staging, ""),
        ("rename_dir", staging, step_dir(5)),
        ("sync_dir", "", ""),
    ]
    assert staging_leftovers(tmp_path) == []


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    state = make_state()
    ckpt = open_ckpt(tmp_path, state)
    set_content(state, 7, 0)
    ckpt.save(7)
    set_content(state, 7, 1)
    ckpt.save(7)

    commits = [e for e in read_audit(ckpt.storage) if e["event"] == "commit"]
    assert [(e["step"], e["replaced"]) for e in commits] == [(7, False), (7, True)]
    assert ckpt.steps() == [7]
    assert staging_leftovers(tmp_path) == []

    restored = make_state()
    assert open_ckpt(tmp_path, restored).restore() == 7
    assert content_of(restored) == (7, 1)


def test_commit_reports_replacement(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    committer = RenameCommit(storage)
    for version, expect_replaced in enumerate((False, True)):
        attempt = committer.begin(3)
        storage.write(f"{attempt.staging}/rank-00000.safetensors", [b"v%d" % version])
        assert committer.commit(attempt, b"{}") is expect_replaced
    assert list_committed(storage) == [3]
    assert storage.read(f"{step_dir(3)}/rank-00000.safetensors") == b"v1"
    assert staging_leftovers(tmp_path) == []


def test_start_sweeps_only_staging_of_dead_writers(tmp_path: Path, dead_pid: int) -> None:
    state = make_state()
    set_content(state, 1, 0)
    open_ckpt(tmp_path, state).save(1)
    parent = os.getppid()
    names = {
        "dead-tmp": f".tmp-{step_dir(2)}.{dead_pid}.ab12",
        "dead-trash": f".trash-{step_dir(1)}.{dead_pid}.cd34",
        "impossible-pid": f".tmp-{step_dir(3)}.{10**30}.ef56",
        "live-parent": f".tmp-{step_dir(4)}.{parent}.0a0b",
        # this process's pid, but not made by it: a process that had the pid before
        "earlier-self": f".tmp-{step_dir(5)}.{os.getpid()}.0c0d",
        "not-ours": f".tmp-{step_dir(6)}.{dead_pid}.NOTHEX",
        "user-hidden": ".tmp-mine",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.bin").write_bytes(b"x")

    restored = make_state()
    ckpt = open_ckpt(tmp_path, restored)

    gone = {k for k, name in names.items() if not (tmp_path / name).exists()}
    assert gone == {"dead-tmp", "dead-trash", "impossible-pid", "earlier-self"}
    removed = {e["name"] for e in read_audit(ckpt.storage) if e["event"] == "stale_removed"}
    assert removed == {names[k] for k in gone}
    assert ckpt.restore() == 1
    assert content_of(restored) == (1, 0)


def test_close_sweeps_what_a_dead_writer_left_meanwhile(tmp_path: Path, dead_pid: int) -> None:
    """A trash or staging directory of a process that ended while the Checkpointer was
    open (its persist worker, killed at stop) is removed by a clean close, not left for
    the next launch; a live process's is kept."""
    state = make_state()
    set_content(state, 1, 0)
    ckpt = open_ckpt(tmp_path, state)
    ckpt.save(1)
    dead = tmp_path / f".trash-{step_dir(7)}.{dead_pid}.ab12"
    live = tmp_path / f".tmp-{step_dir(8)}.{os.getppid()}.cd34"
    for d in (dead, live):
        d.mkdir()
        (d / "f.bin").write_bytes(b"x")
    ckpt.close()
    assert not dead.exists() and live.exists()
    removed = [
        e["name"] for e in read_audit(LocalStorage(tmp_path)) if e["event"] == "stale_removed"
    ]
    assert removed == [dead.name]


def test_a_reused_pid_does_not_keep_a_dead_writers_directories(tmp_path: Path) -> None:
    """Pids are reused (32,768 of them on many systems): a trash directory named with this
    process's pid that this process did not make, and one named with a child's pid that
    was killed and not reaped yet (a zombie), are stale; this process's own in-flight
    staging directory is not."""
    state = make_state()
    set_content(state, 1, 0)
    ckpt = open_ckpt(tmp_path, state)
    ckpt.save(1)
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        time.sleep(0.2)  # it exits and stays a zombie until waitpid below
        earlier = tmp_path / f".trash-{step_dir(7)}.{os.getpid()}.ab12"
        zombie = tmp_path / f".tmp-{step_dir(8)}.{child}.cd34"
        for d in (earlier, zombie):
            d.mkdir()
            (d / "f.bin").write_bytes(b"x")
        mine = RenameCommit(LocalStorage(tmp_path)).begin(9)  # not yet written
        (tmp_path / mine.staging).mkdir()
        ckpt.close()
        assert not earlier.exists() and not zombie.exists()
        assert (tmp_path / mine.staging).exists()
    finally:
        os.waitpid(child, 0)


# --------------------------------------------------------------------------- faulty storage


@dataclass(frozen=True)
class Scenario:
    name: str
    keep: Keep | None
    before: tuple[tuple[int, int], ...]  # committed (step, version) before the faulty save
    save: tuple[int, int]


SCENARIOS = [
    Scenario("new-step-retention-deletes-old", Keep(last=1), ((1, 0), (2, 0)), (3, 0)),
    Scenario("new-step-keep-all", None, ((1, 0),), (2, 0)),
    Scenario("replace-existing-step", Keep(last=2), ((1, 0), (2, 0)), (2, 1)),
]


def _prepare(root: Path, scenario: Scenario) -> None:
    state = make_state()
    ckpt = open_ckpt(root, state)
    for step, version in scenario.before:
        set_content(state, step, version)
        ckpt.save(step)
    ckpt.close()


def _faulty_save(scenario: Scenario, fault: FaultyStorage) -> StorageError | None:
    state = make_state()
    ckpt = open_ckpt(fault, state, scenario.keep)
    set_content(state, *scenario.save)
    try:
        ckpt.save(scenario.save[0])
    except StorageError as exc:
        return exc
    return None


@pytest.mark.usefixtures("no_retry_sleep")
@pytest.mark.parametrize(
    ("code", "sticky"),
    [(errno.ENOSPC, False), (errno.ENOSPC, True), (errno.EIO, False), (errno.EIO, True)],
    ids=["full-disk-once", "full-disk-stays", "io-error-once-retried", "disk-dies"],
)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_crash_at_every_call_of_a_save(
    tmp_path: Path, dead_pid: int, scenario: Scenario, code: int, sticky: bool
) -> None:
    step, version = scenario.save
    dry_root = tmp_path / "dry"
    _prepare(dry_root, scenario)
    dry = FaultyStorage(LocalStorage(dry_root))
    assert _faulty_save(scenario, dry) is None
    publish = next(
        i
        for i, (verb, src, dst) in enumerate(dry.calls)
        if verb == "rename_dir" and src.startswith(".tmp-") and dst == step_dir(step)
    )
    before_steps = {s for s, _ in scenario.before}
    older = max(before_steps - {step})

    for k in range(len(dry.calls) + 1):
        root = tmp_path / f"k{k}"
        _prepare(root, scenario)
        fault = FaultyStorage(LocalStorage(root), fail_at=k, sticky=sticky, code=code)
        error = _faulty_save(scenario, fault)
        where = f"fault at call {k} {fault.calls[k] if k < len(fault.calls) else '(none)'}"
        if k == len(dry.calls):
            assert error is None, where
        if error is not None:
            assert error.errno == code, where
        published = error is None or k > publish

        stale = plant_stale(root, dead_pid, step + 1)
        leftovers = staging_leftovers(root)
        storage = LocalStorage(root)
        restored = make_state()
        fresh = open_ckpt(storage, restored)
        steps = fresh.steps()
        for s in steps:
            CheckpointReader(storage, s).verify()
        got = fresh.restore()

        assert got == content_of(restored)[0], where
        if published:
            assert content_of(restored) == (step, version), where
        else:
            assert got in (max(before_steps), older), where
            assert content_of(restored) == (got, dict(scenario.before)[got]), where
            assert set(steps) >= before_steps - {step}, f"{where}: a failed save deleted"
            if step not in before_steps:
                assert step not in steps, where

        # Stale staging of a dead writer goes; a live writer's (this process) stays.
        assert stale not in staging_leftovers(root), where
        assert staging_leftovers(root) == [n for n in leftovers if n != stale], where
        removed = [e["name"] for e in read_audit(storage) if e["event"] == "stale_removed"]
        assert removed == [stale], where

        # Once the writer is dead, its leftovers are swept on the next start.
        renamed = []
        for name in staging_leftovers(root):
            dead_name = name.replace(f".{os.getpid()}.", f".{dead_pid}.")
            (root / name).rename(root / dead_name)
            renamed.append(dead_name)
        again = make_state()
        restarted = open_ckpt(storage, again)
        assert staging_leftovers(root) == [], where
        removed = [e["name"] for e in read_audit(storage) if e["event"] == "stale_removed"]
        assert sorted(removed[1:]) == sorted(renamed), where
        assert restarted.steps() == steps, where
        assert restarted.restore() == got, where
        assert content_of(again) == content_of(restored), where


def test_failed_save_is_reported_and_audited(tmp_path: Path) -> None:
    # calls 0-2 append the launch, progress and save_start entries; 3 writes the data file
    fault = FaultyStorage(LocalStorage(tmp_path), fail_at=3)
    state = make_state()
    ckpt = open_ckpt(fault, state)
    set_content(state, 4, 0)
    with pytest.raises(StorageError, match="injected fault") as info:
        ckpt.save(4)

    assert info.value.errno == errno.ENOSPC
    events = [e["event"] for e in read_audit(fault) if e["event"] not in LIFECYCLE]
    assert events == ["save_start", "failure"]
    assert ckpt.steps() == []
    assert staging_leftovers(tmp_path) == []
    assert open_ckpt(tmp_path, make_state()).restore() == 0


@pytest.mark.usefixtures("no_retry_sleep")
def test_transient_error_is_retried_from_a_fresh_staging_directory(tmp_path: Path) -> None:
    fault = FaultyStorage(LocalStorage(tmp_path), fail_at=3, code=errno.EIO)  # the data file
    state = make_state()
    ckpt = open_ckpt(fault, state)
    set_content(state, 4, 0)
    assert ckpt.save(4)

    events = [e["event"] for e in read_audit(fault) if e["event"] not in LIFECYCLE]
    assert events == ["save_start", "retry", "commit"]
    writes = [path for verb, path, _ in fault.calls if verb == "write"]
    assert writes[0].split("/")[0] != writes[1].split("/")[0]
    assert staging_leftovers(tmp_path) == []
    restored = make_state()
    assert open_ckpt(tmp_path, restored).restore() == 4
    assert content_of(restored) == (4, 0)


# --------------------------------------------------------------------------- real kill

CHILD = textwrap.dedent(
    """
    import sys

    import torch

    from resumable import Checkpointer, Keep

    root, n = sys.argv[1], int(sys.argv[2])
    base = torch.arange(n, dtype=torch.int32)
    state = {"w": torch.zeros(n, dtype=torch.int32), "meta": {"step": 0}}
    ckpt = Checkpointer(root, state, keep=Keep(last=2), capture_rng=False, persist="sync")
    step = ckpt.restore()
    while True:
        step += 1
        torch.add(base, step, out=state["w"])
        state["meta"]["step"] = step
        ckpt.save(step, metrics={"step": step})
        print(step, flush=True)
    """
)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"the saving child printed nothing in {timeout} s")
    return proc.stdout.readline()


@pytest.mark.parametrize(
    "trials", [2, pytest.param(3, marks=pytest.mark.slow)], ids=["2 kills", "3 kills"]
)
def test_sigkill_while_saving_leaves_a_committed_checkpoint(tmp_path: Path, trials: int) -> None:
    n = 30_000_000 // 4
    root = tmp_path / "ckpt"
    script = tmp_path / "saver.py"
    script.write_text(CHILD)
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    base = torch.arange(n, dtype=torch.int32)
    last_restored = 0

    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        first = _read_line(proc, 120)
        assert first.strip(), f"trial {trial}: the child died before its first save"
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        reported = [int(x) for x in (first + rest).split()]
        where = f"trial {trial} (seed {seed}), child reported steps {reported}"

        state = {"w": torch.zeros(n, dtype=torch.int32), "meta": {"step": -1}}
        ckpt = open_ckpt(root, state, Keep(last=2))
        assert staging_leftovers(root) == [], where
        for s in ckpt.steps():
            CheckpointReader(ckpt.storage, s).verify()
        got = ckpt.restore()

        assert reported[-1] <= got <= reported[-1] + 1, where
        assert got > last_restored, where
        assert state["meta"]["step"] == got, where
        assert torch.equal(state["w"], base + got), where
        last_restored = got
        ckpt.close()
