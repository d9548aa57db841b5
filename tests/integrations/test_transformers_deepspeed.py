"""`ResumableTrainer` with DeepSpeed (``TrainingArguments(deepspeed=...)``) on CPU.

The jobs run ``examples/integrations/transformers_gpt2.py --deepspeed STAGE`` as a user
would (one process, or two under torchrun) and SIGKILL it; the relaunch must end with
the same engine state (the script's last line hashes every rank's module, ZeRO
partitions with fp32 masters and moments, scheduler and counters) as a run never killed.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from launch import kill_session, start, torchrun_cmd

from .jobs import Job, steps_in

pytestmark = pytest.mark.usefixtures("deepspeed_shm_op_built")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "transformers_gpt2.py"
STEPS = 20


def job(stage: int) -> Job:
    return Job(
        EXAMPLE, "--steps", str(STEPS), "--deepspeed", str(stage), env={"OMP_NUM_THREADS": "1"}
    )


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in (0, 2, 3)])
def test_a_sigkilled_deepspeed_trainer_resumes_bit_identical(tmp_path: Path, stage: int) -> None:
    """Killed after step 13 (checkpoints every 5 steps), relaunched: the engine of every
    ZeRO stage comes back whole, and the run ends as one never killed."""
    j = job(stage)
    reference = j.run_to_end(j.command(tmp_path / "ref"))
    assert reference.startswith(f"final step={STEPS} ")
    run = tmp_path / "run"
    assert j.run_until(j.command(run), 13, signal.SIGKILL) == -signal.SIGKILL
    assert 5 in steps_in(run / "resumable")  # something to resume from
    assert j.run_to_end(j.command(run)) == reference


def torchrun(out: Path, *, kill_after: int | None = None) -> str:
    """The example with ZeRO-3 on two ranks; with ``kill_after``, both ranks are
    SIGKILLed once rank 0 printed that step. Returns the output."""
    cmd = torchrun_cmd(2, EXAMPLE, "--dir", out, "--steps", STEPS, "--deepspeed", 3)
    proc = start(cmd)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line)
        if kill_after is not None and line.startswith(f"step {kill_after}"):
            kill_session(proc.pid)  # torchrun and both ranks
            break
        if time.monotonic() > deadline:
            kill_session(proc.pid)
            pytest.fail("".join(lines)[-4000:])
    proc.stdout.close()
    proc.wait(timeout=60)
    return "".join(lines)


def test_a_two_rank_zero3_trainer_killed_and_relaunched_ends_bit_identical(
    tmp_path: Path,
) -> None:
    reference = [x for x in torchrun(tmp_path / "ref").splitlines() if x.startswith("final")]
    assert len(reference) == 1, reference
    torchrun(tmp_path / "run", kill_after=13)
    assert 5 in steps_in(tmp_path / "run" / "resumable")
    again = torchrun(tmp_path / "run")
    assert [x for x in again.splitlines() if x.startswith("final")] == reference
