"""A kill in the middle of a snapshot costs one snapshot, not a persist interval (issue 45
item 5): each rank keeps its previous complete snapshot while it copies the next one,
and a relaunch resumes from the newest step every rank holds complete, from memory.

The jobs are `memory_previous_job.py`; they SIGKILL themselves in the middle of a
snapshot (data copied, slot not yet published)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch import environment, kill_session, run, torchrun_cmd
from memory_previous_job import checkpointer
from resumable import _shm as shm
from resumable._shm import SlotMeta
from resumable.snapshot import ShmArena
from state_checks import shm_dir

__all__ = ["shm_dir"]  # a fixture

JOB = Path(__file__).with_name("memory_previous_job.py")


def complete_steps(shm_dir: Path) -> list[int]:
    steps = []
    for seg in shm.list_segments(shm_dir):
        if seg.step is not None:
            steps.append(seg.step)
    return sorted(steps)


def test_a_kill_during_a_copy_while_a_persist_holds_a_slot_resumes_one_step_back(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One process: the persist of step 6 holds its slot while steps 7 and 8 are
    snapshotted; a kill during the copy of step 8 leaves step 7 complete, and the
    relaunch restores it from memory (before: step 7's slot was the one step 8 was
    copied into, and the relaunch went back to step 6)."""
    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(JOB), "solo", str(root), str(shm_dir), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=environment(),
        check=False,
    )
    pid = int((out / "worker.pid").read_text())
    try:
        os.kill(pid, signal.SIGKILL)  # the stopped worker: it holds the slots' locks
    except ProcessLookupError:
        pass
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert complete_steps(shm_dir) == [6, 7]
    caplog.set_level(logging.INFO, logger="resumable")
    w = torch.zeros(1 << 20)
    with checkpointer(root, shm_dir, w) as ck:
        assert ck.restore() == 7
    assert bool((w == 7).all())
    assert "restored step 7 from shared memory" in caplog.text


def test_the_third_slot_is_made_only_while_a_persist_holds_one(shm_dir: Path) -> None:
    """Two slots alternate; the third is made when a persist holds one of them and the
    other is the newest, so the newest is never overwritten; without room for it, the
    newest is (with a WARNING), as before."""
    arena = ShmArena("k3", shm_dir=shm_dir)
    t = {"w": torch.zeros(1024)}
    try:
        for step in range(1, 5):
            t["w"].fill_(step)
            arena.snapshot(step, t, SlotMeta(tree={}))
        assert [s is not None for s in arena.slots] == [True, True, False, False]
        assert sorted(sn.step for sn, _ in arena.complete()) == [3, 4]
        assert arena.newest is not None
        arena.locked.add(arena.newest.index)  # a persist of step 4
        arena.snapshot(5, t, SlotMeta(tree={}))
        arena.snapshot(6, t, SlotMeta(tree={}))
        assert arena.slots[2] is not None
        assert sorted(sn.step for sn, _ in arena.complete()) == [4, 5, 6]
        arena.locked.clear()
        arena.snapshot(7, t, SlotMeta(tree={}))  # overwrites the oldest: step 4
        assert sorted(sn.step for sn, _ in arena.complete()) == [5, 6, 7]
        # A restore back to step 5 drops the later steps (a timeline left).
        five = next(sn for sn, _ in arena.complete() if sn.step == 5)
        arena.forget_after(5, five)
        assert [sn.step for sn, _ in arena.complete()] == [5]
    finally:
        arena.close(unlink=True)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("snapshot"), st.integers(-2, 3)),  # the step after the newest, + k
        st.tuples(st.just("lock"), st.integers(0, 3)),
        st.tuples(st.just("unlock"), st.integers(0, 3)),
        st.tuples(st.just("keep"), st.integers(1, 2)),
        st.tuples(st.just("forget"), st.integers(0, 3)),
    ),
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_the_usual_slot_choice_is_the_one_every_case_makes(shm_dir: Path, ops: list) -> None:
    """`ShmArena._choose`'s shortcut (no slot locked, one kept, two slots made) picks the
    slot its every-case rule (`_choose_any`) picks, after any sequence of snapshots,
    persists taking and releasing slots, replicas' keep and restores going back."""
    arena = ShmArena("choice", shm_dir=shm_dir)
    t = {"w": torch.zeros(16)}
    step = 0
    try:
        for op, k in ops:
            for s in (step - 1, step, step + 1):
                try:
                    want = arena._choose_any(s)
                except Exception as exc:
                    want = repr(exc)
                try:
                    got = arena._choose(s)
                except Exception as exc:
                    got = repr(exc)
                assert got == want, (op, k, s, arena.locked, arena.keep, arena.newest)
            if op == "snapshot":
                step = max(0, step + k)
                try:
                    arena.snapshot(step, t, SlotMeta(tree={}))
                except Exception:
                    pass  # every slot locked
            elif op == "lock" and arena.slots[k] is not None:
                arena.locked.add(k)
            elif op == "unlock":
                arena.locked.discard(k)
            elif op == "keep":
                arena.keep = k
            elif op == "forget":
                done = [sn for sn, _ in arena.complete() if sn.step <= step - k]
                arena.forget_after(step - k, done[0] if done else None)
    finally:
        arena.close(unlink=True)


def test_two_ranks_killed_during_a_copy_resume_from_the_step_both_hold(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Two ranks: rank 1 is killed in its copy of step 7 after rank 0 finished its own.
    Every rank still holds step 6: the relaunch restores it from memory on both ranks
    (before: the ranks offered 7 and 6 and both went back to step 4, the last commit)."""
    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        torchrun_cmd(2, JOB, "ranks", root, shm_dir, out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(),
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_session(proc.pid)  # persist workers left behind
    assert proc.returncode != 0, output
    assert (out / "r0-7").exists(), output
    code, output = run(torchrun_cmd(2, JOB, "resume", root, shm_dir, out))
    assert code == 0, output
    for r in (0, 1):
        got = json.loads((out / f"resume-rank{r}.json").read_text())
        assert got == {"step": 6, "values": [6.0 + 1000 * r]}, (r, got, output[-3000:])
    assert "restored step 6 from shared memory" in output
    assert "discarding the shared-memory snapshot of step 7" in output
    assert "rank 1: its newest complete snapshot is of step 6" in output
