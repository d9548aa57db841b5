"""Preemption and failure handling: signals become an emergency checkpoint at the next
step boundary and an exit for requeueing; alerts and counters report trouble."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumable
from resumable.errors import StorageError
from resumable.storage.memory import MemoryStorage

STEPS = 40


def demo_cmd(directory: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "resumable.cli",
        "demo",
        "--dir",
        str(directory),
        "--steps",
        str(STEPS),
        "--every",
        "5",
        "--workers",
        "0",
        "--log-every",
        "1",
    ]


def read_until_step(fd: int, target: int) -> str:
    """What the demo printed on ``fd`` up to and including its line ``step N`` with
    N >= ``target`` (and whatever came in the same read)."""
    out = ""
    while True:
        chunk = os.read(fd, 4096)
        assert chunk, f"the demo ended before step {target}: {out[-2000:]}"
        out += chunk.decode()
        done = out.rpartition("\n")[0].splitlines()
        if any(x.startswith("step ") and int(x.split()[1]) >= target for x in done):
            return out


def events(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "audit.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = subprocess.run(
        demo_cmd(tmp_path_factory.mktemp("ref")), capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_sigterm_at_random_moments_loses_no_step(reference: str, tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("RESUMABLE_CAMPAIGN_SEED", "6")))
    root = tmp_path / "run"
    for trial in range(2):
        # Unbuffered bytes: a text pipe's read-ahead would hold lines that
        # `communicate` (which reads the raw descriptor) then never sees.
        proc = subprocess.Popen(
            demo_cmd(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
        )
        assert proc.stdout is not None
        target = rng.randint(2, STEPS - 5)
        seen = read_until_step(proc.stdout.fileno(), target)
        time.sleep(rng.uniform(0.0, 0.02))  # mid-step, or during a persist
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == resumable.REQUEUE_EXIT_CODE, (
            f"trial {trial}: {err.decode()[-2000:]}"
        )
        lines = (seen + rest.decode()).splitlines()
        last_printed = max(int(x.split()[1]) for x in lines if x.startswith("step "))
        ev = events(root)
        emergency = [e for e in ev if e["event"] == "emergency_commit"][-1]
        assert emergency["within_grace"] is True
        # The demo prints "step N" after maybe_save(N): the signal is acted on at the
        # boundary of the last step printed or of the one after it, never earlier.
        stopped_at = emergency["step"]
        assert stopped_at in (last_printed, last_printed + 1), (stopped_at, last_printed)
        relaunch = subprocess.Popen(
            demo_cmd(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert relaunch.stdout is not None
        first = relaunch.stdout.readline()
        assert first.strip() == f"resumed from step {stopped_at}", "zero lost steps"
        relaunch.send_signal(signal.SIGKILL)  # next trial starts from this checkpoint
        relaunch.communicate(timeout=60)
    final = subprocess.run(demo_cmd(root), capture_output=True, text=True, timeout=240)
    assert final.returncode == 0, final.stderr[-2000:]
    assert final.stdout.strip().splitlines()[-1] == reference


def small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters())}


def train(state: dict[str, Any]) -> None:
    state["model"](torch.randn(4, 16)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()


def test_signal_sets_should_stop_and_restores_handlers(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    state = small_state()
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        state,
        persist="sync",
        persist_every=resumable.Every(steps=100),
        preemption=resumable.Preemption(signals=("SIGUSR1",), exit=False),
    )
    train(state)
    assert ck.maybe_save(1) is False
    os.kill(os.getpid(), signal.SIGUSR1)  # while "evaluating": only a flag is set
    assert ck.steps() == [] and not ck.should_stop
    train(state)
    assert ck.maybe_save(2) is True
    assert ck.should_stop and ck.steps() == [2]
    ck.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_reclaim_signals_wins_over_a_later_handler_and_close_restores_the_first(
    tmp_path: Path,
) -> None:
    """A framework installing its own handler after the Checkpointer (Lightning's SIGTERM
    handler) would see the signal instead; ``reclaim_signals`` takes it back, and close
    restores what was there before the Checkpointer, not the framework's handler."""
    before = signal.getsignal(signal.SIGUSR1)
    framework_saw: list[int] = []
    state = small_state()
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        state,
        persist="sync",
        persist_every=resumable.Every(steps=100),
        preemption=resumable.Preemption(signals=("SIGUSR1",), exit=False),
    )
    signal.signal(signal.SIGUSR1, lambda signum, frame: framework_saw.append(signum))
    ck.reclaim_signals()
    os.kill(os.getpid(), signal.SIGUSR1)
    train(state)
    assert ck.maybe_save(1) is True and ck.should_stop and ck.steps() == [1]
    assert framework_saw == []
    ck.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    with pytest.raises(resumable.CheckpointError):
        ck.reclaim_signals()  # closed


def test_exit_raises_systemexit_with_requeue_code(tmp_path: Path) -> None:
    state = small_state()
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        state,
        persist="sync",
        preemption=resumable.Preemption(signals=("SIGUSR2",)),
    )
    os.kill(os.getpid(), signal.SIGUSR2)
    with pytest.raises(SystemExit) as info:
        ck.maybe_save(7)
    assert info.value.code == resumable.REQUEUE_EXIT_CODE
    assert ck.steps() == [7]


def test_budget_too_small_persists_the_newest_snapshot(tmp_path: Path) -> None:
    state = small_state()
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        state,
        persist="thread",
        memory_every=resumable.Every(steps=1),
        persist_every=resumable.Every(steps=1000),
        preemption=resumable.Preemption(signals=("SIGUSR1",), grace_seconds=5, exit=False),
        shm_dir=tmp_path,
    )
    ck.maybe_save(1)
    ck.monitor.stats["last_persist_s"] = 1000.0  # measured: a persist takes far too long
    os.kill(os.getpid(), signal.SIGUSR1)
    ck.maybe_save(2)
    ck.close()
    ev = events(tmp_path / "ck")
    done = [e for e in ev if e["event"] == "emergency_commit"][-1]
    assert done["how"] == "persisted the older snapshot of step 1"
    assert ck.steps() == [1]


class NoticeNow:
    """A watcher whose termination notice is already there."""

    name = "fake"

    def __init__(self) -> None:
        self.stopped = False

    def start(self, on_notice: Any) -> None:
        on_notice("fake: terminate")

    def stop(self) -> None:
        self.stopped = True


def test_watcher_notice_triggers_emergency_checkpoint(tmp_path: Path) -> None:
    watcher = NoticeNow()
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        small_state(),
        persist="sync",
        preemption=resumable.Preemption(signals=(), exit=False, watchers=(watcher,)),
    )
    ck.maybe_save(3)
    assert ck.should_stop and ck.steps() == [3]
    ck.close()
    assert watcher.stopped
    assert any(
        e["event"] == "preempt" and e["reason"] == "fake: terminate"
        for e in events(tmp_path / "ck")
    )


class Failing(MemoryStorage):
    def __init__(self) -> None:
        super().__init__("memory://alerts")
        self.fail = False
        self.delay = 0.0

    def write(self, path: str, chunks: Any) -> int:
        time.sleep(self.delay)
        if self.fail and path.endswith(".safetensors"):
            raise StorageError(5, "I/O error (injected)")
        return super().write(path, chunks)


def test_alerts_and_counters(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    alerts: list[tuple[str, str]] = []
    registry = CollectorRegistry()
    storage = Failing()
    ck = resumable.Checkpointer(
        storage,
        small_state(),
        persist="thread",
        persist_every=resumable.Every(steps=1),
        alert=lambda kind, msg, details: alerts.append((kind, msg)),
        max_commit_age_s=0.2,
        prometheus_registry=registry,
        shm_dir=tmp_path,
    )
    ck.maybe_save(1)
    ck.wait()
    assert ck.stats["commits"] == 1 and registry.get_sample_value("resumable_commits_total") == 1
    storage.delay = 0.3
    for step in range(2, 7):
        ck.maybe_save(step)  # the worker is busy: these are deferred
    ck.wait()
    assert "persists_skipped" in {k for k, _ in alerts}, alerts
    storage.delay = 0.0
    storage.fail = True
    ck.save(10)
    with pytest.raises(resumable.PersistError):
        ck.wait()
    assert any(k == "save_failed" for k, _ in alerts)
    assert registry.get_sample_value("resumable_failed_saves_total") == 1
    time.sleep(0.3)
    ck.maybe_save(11)  # deferred/failed saves do not count as commits: too old now
    assert any(k == "no_recent_commit" for k, _ in alerts)
    storage.fail = False
    ck.close()


def test_bad_preemption_config() -> None:
    with pytest.raises(ValueError, match="unknown signal"):
        resumable.Preemption(signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="grace_seconds"):
        resumable.Preemption(grace_seconds=0)


def test_auto_interval_plans_with_the_measured_cost(tmp_path: Path) -> None:
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        small_state(),
        persist="sync",
        persist_every=resumable.Every(auto=True, mtbf=3600.0, min_seconds=0.001),
        keep=None,
    )
    time.sleep(0.01)
    assert ck.maybe_save(1)  # no cost measured yet: due after min_seconds
    cost = ck.stats["persist_cost_s"]
    assert cost is not None and cost > 0
    planned = ck.persist_every.interval_seconds_for(cost)
    assert planned is not None and planned > 1.0  # Daly with a ms-scale cost and 1 h MTBF
    assert not ck.maybe_save(2), "not due again until the planned interval has passed"
    ck.close()


def test_persists_deferred_behind_the_worker_start_raise_no_alert(tmp_path: Path) -> None:
    """A short run of a small model saves faster than the persist process starts (it
    imports torch): the persists deferred behind the first one are not a slow storage."""
    alerts: list[tuple[str, str]] = []
    ck = resumable.Checkpointer(
        tmp_path / "ck",
        small_state(),
        persist="process",
        persist_every=resumable.Every(steps=1),
        alert=lambda kind, msg, details: alerts.append((kind, msg)),
        shm_dir=tmp_path,
    )
    for step in range(1, 30):
        ck.maybe_save(step)
    ck.close()
    assert ck.stats["commits"] >= 1 and ck.steps()[-1] == 29
    assert alerts == [], alerts
