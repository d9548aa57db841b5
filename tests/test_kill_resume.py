"""SIGKILL campaign: the demo job, killed at random moments and relaunched with the same
command any number of times, ends bit-identical to an uninterrupted run.

Kills land anywhere: during interpreter start-up, during restore, mid-step and mid-save
(the campaign saves every step so a large share of kills hit a save in flight).

`make test` runs one chain of three kills (four launches and the one that ends it);
`make campaign` adds the twenty kills of five chains, as four-kill chains.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 48


def demo_cmd(directory: Path, *, workers: int) -> list[str]:
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
        "1",
        "--workers",
        str(workers),
        "--log-every",
        "1",
    ]


def run_to_end(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def run_and_kill(cmd: list[str], rng: random.Random) -> str:
    """Start the job and SIGKILL it at a random moment; returns how the kill was timed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    how = "finished first"
    try:
        if rng.random() < 0.25:
            delay = rng.uniform(0.0, 2.5)
            time.sleep(delay)
            how = f"after {delay:.2f}s"
        else:
            target = rng.randint(1, STEPS - 1)
            for line in proc.stdout:
                if line.startswith("step ") and int(line.split()[1]) >= target:
                    time.sleep(rng.uniform(0.0, 0.01))
                    how = f"at step {target}"
                    break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.stdout.close()
        proc.wait(timeout=60)
    return how


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of an uninterrupted run (`reference`), run to its end."""
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> str:
    """The last line of an uninterrupted run."""
    line = run_to_end(demo_cmd(reference_dir, workers=0))
    assert line.startswith(f"final step={STEPS} loss=")
    return line


def kill_chains(tmp_path: Path, reference: str, *, chains: int, kills: int) -> list[str]:
    """``chains`` runs in fresh directories, each SIGKILLed ``kills`` times at random
    moments then run to its end: each ends on the reference's line, with no staging
    directory left. Returns how each kill was timed."""
    rng = random.Random(int(os.environ.get("RESUMABLE_CAMPAIGN_SEED", "20261122")))
    timings = []
    for chain in range(chains):
        directory = tmp_path / f"chain{chain}"
        cmd = demo_cmd(directory, workers=0)
        for _ in range(kills):
            timings.append(run_and_kill(cmd, rng))
        diverged = f"chain {chain} diverged after kills {timings[-kills:]}"
        assert run_to_end(cmd) == reference, diverged
        leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
        assert leftovers == [], "stale staging directories survived a relaunch"
    return timings


@pytest.mark.timeout(600)  # 5 launches and the reference's: a hang guard on a loaded machine
def test_three_random_sigkills_end_bit_identical(reference: str, tmp_path: Path) -> None:
    assert len(kill_chains(tmp_path, reference, chains=1, kills=3)) == 3


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 25 launches: a hang guard, generous on a loaded machine
def test_twenty_random_sigkills_end_bit_identical(reference: str, tmp_path: Path) -> None:
    assert len(kill_chains(tmp_path, reference, chains=5, kills=4)) == 20


def test_sigkill_with_loader_workers(reference: str, tmp_path: Path) -> None:
    rng = random.Random(7)
    cmd = demo_cmd(tmp_path / "workers", workers=2)
    for _ in range(3):
        run_and_kill(cmd, rng)
    assert run_to_end(cmd) == reference


def test_rerun_after_finish_prints_same_line(reference: str, reference_dir: Path) -> None:
    """The reference's own command, run again in its finished directory."""
    assert run_to_end(demo_cmd(reference_dir, workers=0)) == reference
