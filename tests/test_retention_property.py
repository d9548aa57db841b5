"""Retention and restore under random operation sequences (hypothesis state machine).

The machine saves with random metrics, crashes saves midway, restores, pins and
unpins, plants stale staging directories of dead writers, and corrupts checkpoints,
while a model predicts from `Keep.retained` which steps must remain. After every
operation: exactly the predicted steps are listed, foreign directories are untouched,
pinned and just-written checkpoints survive, and once a save succeeded at least one
committed checkpoint exists. Retention runs only after a commit: a crashed save
deletes nothing, and a successful save's audit trail reads save_start, commit, then
the deletes.
"""

from __future__ import annotations

import errno
import math
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from resumable import Checkpointer, CorruptCheckpointError, Keep, NoCheckpointError, StorageError
from resumable.audit import read_audit
from resumable.commit import list_uncommitted, step_dir
from resumable.policy import Entry
from resumable.reader import CheckpointReader
from resumable.storage import LocalStorage, Storage
from resumable.storage.base import Buffer, ForwardingStorage


class CrashingStorage(ForwardingStorage):
    """A local root whose ``crash_in``-th next write/delete/rename_dir/sync_dir (counted
    from 0; audit appends do not count) fails once with a full-disk `StorageError` (not
    retried), leaving a torn file if it was a write."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.crash_in: int | None = None

    def _crashes(self) -> bool:
        if self.crash_in is None:
            return False
        if self.crash_in == 0:
            self.crash_in = None
            return True
        self.crash_in -= 1
        return False

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        if self._crashes():
            data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
            self.inner.write(path, [data[: len(data) // 2]])
            raise StorageError(errno.ENOSPC, f"injected crash writing {path}")
        return self.inner.write(path, chunks)

    def delete(self, path: str) -> None:
        if self._crashes():
            raise StorageError(errno.ENOSPC, f"injected crash deleting {path}")
        self.inner.delete(path)

    def rename_dir(self, src: str, dst: str) -> None:
        if self._crashes():
            raise StorageError(errno.ENOSPC, f"injected crash renaming {src}")
        self.inner.rename_dir(src, dst)

    def sync_dir(self, path: str = "") -> None:
        if self._crashes():
            raise StorageError(errno.ENOSPC, f"injected crash syncing {path}")
        self.inner.sync_dir(path)


def make_state() -> dict[str, Any]:
    return {"w": torch.zeros(8), "n": torch.zeros(2, dtype=torch.int64), "meta": {"step": -1}}


def set_content(state: dict[str, Any], step: int) -> None:
    state["w"].copy_(torch.arange(8, dtype=torch.float32) * 0.5 + step)
    state["n"].copy_(torch.tensor([step, -step]))
    state["meta"]["step"] = step


def assert_content(state: dict[str, Any], step: int) -> None:
    expected = make_state()
    set_content(expected, step)
    assert state["meta"]["step"] == step
    assert torch.equal(state["w"], expected["w"])
    assert torch.equal(state["n"], expected["n"])


def stored_metrics(metrics: dict[str, float]) -> dict[str, Any]:
    """How a manifest records metrics: non-finite floats as their repr."""
    return {k: v if math.isfinite(v) else repr(v) for k, v in metrics.items()}


FOREIGN = {
    "step-000000000999-notes/readme.txt": b"my notes",
    "mydata/train.bin": b"\x00\x01\x02",
    "step-000000100000/rank-00000.safetensors": b"uncommitted: no manifest",
    "step-000000000000/notes.txt": b"uncommitted step 0",
}

keeps = st.builds(
    Keep,
    last=st.sampled_from([None, 1, 2, 3]),
    best=st.one_of(
        st.none(),
        st.tuples(st.just("loss"), st.just("min"), st.integers(1, 2)),
        st.tuples(st.just("acc"), st.just("max"), st.integers(1, 2)),
    ),
    every_steps=st.sampled_from([None, None, 2, 3]),
)
metric_values = st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, math.nan, math.inf])
metrics_st = st.dictionaries(st.sampled_from(["loss", "acc"]), metric_values, max_size=2)


class RetentionMachine(RuleBasedStateMachine):
    base: ClassVar[Path]
    dead_pid: ClassVar[int]

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(dir=self.base))
        self.storage = CrashingStorage(LocalStorage(self.root))
        for rel, data in FOREIGN.items():
            (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / rel).write_bytes(data)
        self.state = make_state()
        self.keep: Keep = Keep()
        self.ckpt: Checkpointer | None = None
        self.model: dict[int, dict[str, Any]] = {}
        self.corrupt: set[int] = set()
        self.pins: set[int] = set()
        self.stale: set[str] = set()
        self.next_step = 1
        self.saved_once = False

    @property
    def checkpointer(self) -> Checkpointer:
        assert self.ckpt is not None
        return self.ckpt

    def _new_checkpointer(self) -> Checkpointer:
        return Checkpointer(
            self.storage, self.state, keep=self.keep, capture_rng=False, persist="sync"
        )

    def teardown(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _tree(self) -> dict[str, bytes]:
        """Every file under the root but the audit log, with its content."""
        return {
            str(p.relative_to(self.root)): p.read_bytes()
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and p.name != "audit.jsonl"
        }

    @initialize(keep=keeps)
    def start(self, keep: Keep) -> None:
        self.keep = keep
        self.ckpt = self._new_checkpointer()

    # ------------------------------------------------------------------ operations

    def _next(self, gap: int) -> int:
        step = self.next_step + gap - 1
        self.next_step = step + 1
        set_content(self.state, step)
        return step

    @rule(saves=st.lists(st.tuples(st.integers(1, 3), metrics_st), min_size=1, max_size=4))
    def save(self, saves: list[tuple[int, dict[str, float]]]) -> None:
        """A few saves in a row, each a gap of 1-3 steps after the previous one."""
        for gap, metrics in saves:
            self._save(self._next(gap), metrics)

    @rule(gap=st.integers(1, 3), metrics=metrics_st, crash_in=st.integers(0, 3))
    def crashed_save(self, gap: int, metrics: dict[str, float], crash_in: int) -> None:
        """A save that crashes before its commit: in the data write, the manifest write,
        the staging sync or the publishing rename. It must change no checkpoint."""
        step = self._next(gap)
        before = self._tree()
        self.storage.crash_in = crash_in

        with pytest.raises(StorageError, match="injected crash"):
            self.checkpointer.save(step, metrics)

        assert self.storage.crash_in is None
        assert self._tree() == before, "a failed save changed a checkpoint"
        assert read_audit(self.storage)[-1]["event"] == "failure"

    def _save(self, step: int, metrics: dict[str, float]) -> None:
        audit_len = len(read_audit(self.storage))

        assert self.checkpointer.save(step, metrics)

        manifest = CheckpointReader(self.storage, step).manifest
        assert manifest["metrics"] == stored_metrics(metrics)
        self.model[step] = stored_metrics(metrics)
        self.saved_once = True
        doomed = []
        if not self.keep.keeps_all:
            entries = [Entry(s, m) for s, m in self.model.items()]
            kept = self.keep.retained(entries, self.pins | {step})
            doomed = sorted(s for s in self.model if s not in kept)
        for s in doomed:
            del self.model[s]
            self.corrupt.discard(s)

        assert step in self.checkpointer.steps(), "the checkpoint just written was deleted"
        # A ``progress`` note is due every few seconds of wall time: on a loaded
        # machine one can fall between two saves; it is not what this checks.
        events = [e for e in read_audit(self.storage)[audit_len:] if e["event"] != "progress"]
        assert [e["event"] for e in events] == ["save_start", "commit"] + ["delete"] * len(doomed)
        assert events[1]["step"] == step
        assert sorted(e["step"] for e in events[2:]) == doomed

    @rule()
    def restart_and_restore(self) -> None:
        # Staging of dead writers is removed by the clean close, or else by the start.
        audit_len = len(read_audit(self.storage))
        self.checkpointer.close()
        self.state = make_state()
        self.ckpt = self._new_checkpointer()
        events = read_audit(self.storage)[audit_len:]
        removed = {e["name"] for e in events if e["event"] == "stale_removed"}
        assert removed == self.stale
        assert not any((self.root / name).exists() for name in self.stale)
        self.stale.clear()

        valid = sorted(set(self.model) - self.corrupt)
        if not self.model:
            assert self.checkpointer.restore() == 0
        elif not valid:
            with pytest.raises(CorruptCheckpointError, match="none is valid"):
                self.checkpointer.restore()
        else:
            assert self.checkpointer.restore() == valid[-1]
            assert_content(self.state, valid[-1])

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        """Pin a committed checkpoint, or (sometimes) fail to pin a missing one."""
        if self.model and data.draw(st.sampled_from(["committed", "missing"])) == "committed":
            step = data.draw(st.sampled_from(sorted(self.model)))
        else:
            step = data.draw(st.integers(0, 40).filter(lambda s: s not in self.model))
        if step not in self.model:
            with pytest.raises(NoCheckpointError):
                self.checkpointer.pin(step)
            assert not (self.root / "pins" / step_dir(step)).exists()
            return
        self.checkpointer.pin(step)
        self.pins.add(step)

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.pins)))
        self.checkpointer.unpin(step)
        self.pins.discard(step)

    @rule(step=st.integers(0, 40), kind=st.sampled_from(["tmp", "trash"]))
    def plant_stale(self, step: int, kind: str) -> None:
        name = f".{kind}-{step_dir(step)}.{self.dead_pid}.{len(self.stale):08x}"
        (self.root / name).mkdir()
        (self.root / name / "rank-00000.safetensors").write_bytes(b"torn")
        (self.root / name / "manifest.json").write_bytes(b"{}")
        self.stale.add(name)

    @precondition(lambda self: bool(set(self.model) - self.corrupt))
    @rule(data=st.data())
    def corrupt_one(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(set(self.model) - self.corrupt)))
        path = self.root / step_dir(step) / "rank-00000.safetensors"
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        self.corrupt.add(step)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def listed_steps_are_the_predicted_ones(self) -> None:
        if self.ckpt is not None:
            assert self.checkpointer.steps() == sorted(self.model)

    @invariant()
    def foreign_files_are_untouched(self) -> None:
        for rel, content in FOREIGN.items():
            assert (self.root / rel).read_bytes() == content, rel
        uncommitted = list_uncommitted(LocalStorage(self.root))
        assert uncommitted == ["step-000000000000", "step-000000100000"]

    @invariant()
    def pinned_checkpoints_survive(self) -> None:
        assert self.pins <= set(self.model)
        pin_dir = self.root / "pins"
        markers = {p.name for p in pin_dir.iterdir()} if pin_dir.exists() else set()
        assert markers == {step_dir(s) for s in self.pins}

    @invariant()
    def never_zero_checkpoints_after_a_save(self) -> None:
        if self.saved_once:
            assert self.model
            assert any((self.root / step_dir(s) / "manifest.json").exists() for s in self.model)

    @invariant()
    def no_staging_leftovers_of_this_process(self) -> None:
        ours = [p.name for p in self.root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
        assert set(ours) == self.stale


@pytest.mark.parametrize(
    "examples", [20, pytest.param(200, marks=pytest.mark.slow)], ids=["20", "200"]
)
def test_retention_state_machine(tmp_path: Path, dead_pid: int, examples: int) -> None:
    """``examples`` operation sequences: `make test` draws 20 (with the ``ci`` profile,
    the same 20 at every run), `make campaign` 200."""
    RetentionMachine.base = tmp_path
    RetentionMachine.dead_pid = dead_pid
    run_state_machine_as_test(
        RetentionMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
