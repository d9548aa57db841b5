"""``resumable report``'s goodput and launch ends: only what the training job wrote counts.

An operator's ``pin`` or ``unpin`` (from the CLI or `Checkpointer.pin`), or a later
``resumable prune``, lands in the same audit log minutes or days after the job ended;
the time up to it is not training. The logs here are written by the real writers
(`Checkpointer`, the CLI, `AuditLog.record`) under a clock the test moves, so the
figures are exact.
"""

from __future__ import annotations

import re
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import resumable.audit as audit_module
from resumable import Checkpointer
from resumable.audit import AuditLog
from resumable.cli import main as cli
from resumable.report import build_report
from resumable.report_html import render_html
from resumable.storage import LocalStorage


class Clock:
    """The audit log's clock: `AuditLog.record` stamps entries with ``now``."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock()
    fake = types.SimpleNamespace(time=lambda: c.now, monotonic=time.monotonic)
    monkeypatch.setattr(audit_module, "time", fake)
    monkeypatch.setenv("RESUMABLE_PROGRESS_EVERY_S", "0")  # a progress entry per step
    yield c


def train(root: Path, ts: Any, clock: Clock, steps: range, seconds_per_step: float) -> None:
    """A real job: a `Checkpointer` (persist on a thread, so its entries share the
    clock), one save every fifth step, closed at the end."""
    with Checkpointer(str(root), ts.state, persist="thread") as ck:
        ck.restore()
        for step in steps:
            ts.train()
            clock.advance(seconds_per_step)
            ck.maybe_save(step)
            if step % 5 == 0:
                ck.save(step)
                ck.wait()


def test_pinning_a_finished_run_later_changes_neither_its_goodput_nor_its_span(
    tmp_path: Path, clock: Clock, small_training_state: Any
) -> None:
    root = tmp_path / "run"
    train(root, small_training_state(), clock, range(1, 21), 2.0)
    before = build_report(LocalStorage(root))
    assert before.goodput.ratio is not None and before.goodput.wall_s > 0

    clock.advance(600.0)  # ten minutes later an operator pins a checkpoint ...
    assert cli(["pin", str(root), "10"]) == 0
    clock.advance(60.0)  # ... and unpins it again
    assert cli(["unpin", str(root), "10"]) == 0
    after = build_report(LocalStorage(root))

    assert after.counts["pin"] == 1 and after.counts["unpin"] == 1
    assert after.last_time == pytest.approx(clock.now)  # the log goes on to the unpin
    assert after.run_end == before.run_end  # the run does not
    assert after.goodput.wall_s == pytest.approx(before.goodput.wall_s)
    assert after.goodput.useful_s == pytest.approx(before.goodput.useful_s)
    assert after.goodput.ratio == pytest.approx(before.goodput.ratio)
    assert [ln.end for ln in after.launches] == [ln.end for ln in before.launches]
    # The pin is still on the timeline, only not training.
    assert any(t["event"] == "pin" and t["step"] == 10 for t in after.timeline)


def test_a_pin_between_launches_is_downtime_not_training(
    tmp_path: Path, clock: Clock, small_training_state: Any
) -> None:
    """Launch 0 runs to step 10 and is closed; 300 s later someone pins step 10; 100 s
    after that the job is relaunched and runs to step 20."""
    root = tmp_path / "run"
    ts = small_training_state()
    train(root, ts, clock, range(1, 11), 1.0)
    ended = build_report(LocalStorage(root)).launches[0].end
    clock.advance(300.0)
    assert cli(["pin", str(root), "10"]) == 0
    clock.advance(100.0)
    restarted = clock.now
    train(root, ts, clock, range(11, 21), 1.0)

    report = build_report(LocalStorage(root))
    first, second = report.launches
    assert first.end == ended
    assert second.restored_step == 10
    assert second.downtime_s == pytest.approx(restarted - ended)  # 400 s, pin or not
    assert report.goodput.downtime_s == pytest.approx(restarted - ended)


def record_at(log: AuditLog, clock: Clock, t: float, event: str, **fields: Any) -> None:
    clock.now = t
    log.record(event, **fields)


def test_a_killed_launch_ends_at_its_last_training_entry_and_reached_what_it_snapshotted(
    tmp_path: Path, clock: Clock
) -> None:
    """The entries a killed launch and its restart write (the trainer's ``launch``,
    ``restore``, ``progress`` and ``save_start``; the worker's ``commit``), with a CLI
    pin after the kill. The restart resumes from the memory tier at step 27, past the
    killed launch's last ``progress`` entry (rate-limited): it reached step 27."""
    storage = LocalStorage(tmp_path / "run")
    job, worker, cli_log = AuditLog(storage), AuditLog(storage), AuditLog(storage)
    t0 = 1_800_000_000.0
    record_at(job, clock, t0, "launch", persist="process", memory=True, world_size=1)
    record_at(job, clock, t0 + 1, "restore", step=0, fresh=True)
    for step in (1, 10, 20):  # one progress entry each 5 s, at 2 s per step
        record_at(job, clock, t0 + 2 + 0.5 * (step - 1), "progress", step=step, snapshots=1)
    record_at(job, clock, t0 + 12, "save_start", step=21, bytes=1000, snapshot_s=0.01)
    record_at(worker, clock, t0 + 13, "commit", step=21, bytes=1000, duration_s=1.0)
    # Killed at step 27, about t0 + 15. 200 s later an operator pins step 21.
    record_at(cli_log, clock, t0 + 215, "pin", step=21, by="cli")
    record_at(job, clock, t0 + 300, "launch", persist="process", memory=True, world_size=1)
    record_at(job, clock, t0 + 301, "restore", step=27, tier="memory", duration_s=0.5)
    record_at(job, clock, t0 + 302, "progress", step=28, snapshots=1)
    record_at(job, clock, t0 + 310, "progress", step=40, snapshots=1)
    record_at(job, clock, t0 + 311, "close", step=40, clean=True)

    report = build_report(storage)
    killed, restart = report.launches
    assert killed.end == pytest.approx(t0 + 13)  # its worker's commit, not the pin
    assert not killed.closed
    assert killed.reached == 27
    assert restart.steps_lost == 0
    assert restart.downtime_s == pytest.approx(300 - 13)
    assert report.run_start == pytest.approx(t0) and report.run_end == pytest.approx(t0 + 311)
    assert report.goodput.wall_s == pytest.approx(311)
    assert report.goodput.downtime_s == pytest.approx(287)


def test_an_older_restore_does_not_raise_what_the_launch_before_reached(
    tmp_path: Path, clock: Clock
) -> None:
    """Launch 0 got to step 50; launch 1 resumed from 20 (``restore(step=20)``) and was
    killed at 30; launch 2 resumed from step 50 again: launch 1 did not reach 50."""
    storage = LocalStorage(tmp_path / "run")
    log = AuditLog(storage)
    t0 = 1_800_000_000.0
    for i, (restored, reached) in enumerate(((0, 50), (20, 30), (50, 60))):
        base = t0 + 100 * i
        record_at(log, clock, base, "launch", persist="thread", world_size=1)
        record_at(log, clock, base + 1, "restore", step=restored, fresh=restored == 0)
        record_at(log, clock, base + 2, "progress", step=restored + 1, snapshots=0)
        record_at(log, clock, base + 20, "progress", step=reached, snapshots=0)
    report = build_report(storage)
    assert [ln.reached for ln in report.launches] == [50, 30, 60]
    assert report.launches[1].steps_lost == 30  # 50 - 20
    assert report.launches[2].steps_lost == 0


def test_timeline_tooltips_show_steps_and_byte_counts_as_integers(
    tmp_path: Path, clock: Clock, small_training_state: Any
) -> None:
    root = tmp_path / "run"
    train(root, small_training_state(), clock, range(1, 11), 1.0)
    report = build_report(LocalStorage(root))
    steps = [t["step"] for t in report.timeline if "step" in t]
    assert steps and all(type(s) is int for s in steps)
    page = render_html(report)
    tips = re.findall(r"<circle [^>]*><title>([^<]*)</title>", page)
    assert any("step=10" in tip for tip in tips)
    assert not [tip for tip in tips if re.search(r"(step|bytes)=\d+\.0\b", tip)]


@pytest.mark.parametrize("event", [{"a": 1}, ["launch"], 7, None])
def test_an_event_name_that_is_not_a_string_is_skipped_not_a_crash(
    tmp_path: Path, event: Any
) -> None:
    """A hand-edited or damaged log line whose ``event`` is a JSON object or list
    (unhashable) is not a training entry; the report still renders."""
    import json

    from resumable.audit import AUDIT_LOG

    storage = LocalStorage(str(tmp_path))
    good = {"time": 1_800_000_000.0, "event": "launch", "rank": 0, "pid": 1, "host": "h"}
    bad = dict(good, time=1_800_000_001.0, event=event)
    storage.write(AUDIT_LOG, [(json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode()])
    page = render_html(build_report(storage))
    assert "<html" in page.lower()
