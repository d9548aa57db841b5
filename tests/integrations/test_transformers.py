"""`ResumableTrainer`: the Hugging Face Trainer checkpointing through `resumable`.

In-process tests train a one-layer GPT-2 for a few steps (``hf_job``); the kill tests run
``examples/integrations/transformers_gpt2.py`` as the user would and SIGKILL/SIGTERM it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2LMHeadModel, TrainerCallback

import resumable
from resumable.commit import step_dir

from .hf_job import digest, make_trainer, tiny_gpt2
from .jobs import Job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "transformers_gpt2.py"
JOB = Job(EXAMPLE, "--steps", "30")
example = JOB.command
run_to_end = JOB.run_to_end
run_until = JOB.run_until


def kill_campaign(directory: Path, kills: int, seed: int, *extra: str) -> str:
    return JOB.kill_campaign(directory, kills, seed, *extra, last_step=29, max_pause=0.3)


class Crash(TrainerCallback):
    """Raises at the end of step ``at``: a crash in the middle of training."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            raise RuntimeError(f"crash at step {self.at}")


def crash_at(out: Path, at: int, **kwargs: Any) -> None:
    trainer = make_trainer(out, **kwargs)
    trainer.add_callback(Crash(at))
    with pytest.raises(RuntimeError, match="crash at step"):
        trainer.train()


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "resumable").glob("step-*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    trainer = make_trainer(tmp_path_factory.mktemp("ref"), steps=10, persist="sync")
    trainer.train()
    return digest(trainer), trainer.state.log_history


def losses(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in history if "loss" in h]


def test_train_resumes_from_the_newest_checkpoint_bit_identical(
    tmp_path: Path, reference: tuple[str, list[dict[str, Any]]]
) -> None:
    crash_at(tmp_path, 8, steps=10, persist="sync")  # mid-epoch 1 (8 steps an epoch)
    assert checkpoint_steps(tmp_path) == [3, 6]
    trainer = make_trainer(tmp_path, steps=10, persist="sync")
    trainer.train()
    assert trainer.state.global_step == 10
    assert digest(trainer) == reference[0]
    # The TrainerState came back whole: the losses logged before the crash are there.
    assert losses(trainer.state.log_history) == losses(reference[1])


def test_resume_across_an_epoch_boundary_with_gradient_accumulation(tmp_path: Path) -> None:
    ref = make_trainer(tmp_path / "ref", steps=6, persist="sync", gradient_accumulation_steps=2)
    ref.train()  # 4 optimizer steps an epoch
    crash_at(tmp_path / "run", 5, steps=6, persist="sync", save_steps=4,
             gradient_accumulation_steps=2)  # fmt: skip
    assert checkpoint_steps(tmp_path / "run") == [4]  # exactly at the epoch boundary
    trainer = make_trainer(tmp_path / "run", steps=6, persist="sync", gradient_accumulation_steps=2)
    trainer.train()
    assert digest(trainer) == digest(ref)


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, reference: tuple[str, list[dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    crash_at(tmp_path, 8, steps=10, persist="sync")
    data = next((tmp_path / "resumable" / step_dir(6)).glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x01
    data.write_bytes(bytes(raw))
    trainer = make_trainer(tmp_path, steps=10, persist="sync")
    with caplog.at_level(logging.WARNING):
        trainer.train()
    skipped = [
        r for r in caplog.records if r.levelno == logging.WARNING and step_dir(6) in r.msg % r.args
    ]
    assert skipped, [r.getMessage() for r in caplog.records]
    assert digest(trainer) == reference[0]  # resumed from step 3, lost nothing else


def test_save_total_limit_and_the_best_checkpoint_are_kept(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, steps=15, evaluate=True, save_total_limit=2, persist="sync")
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    best = min(evals, key=lambda s: (evals[s], -s))
    assert trainer.state.best_global_step == best
    assert set(checkpoint_steps(tmp_path)) == {best, 12, 15}
    assert trainer.state.best_model_checkpoint == str(tmp_path / "resumable" / step_dir(best))
    # load_best_model_at_end: the trained model now holds the best step's weights.
    saved = GPT2LMHeadModel(tiny_gpt2().config)
    with resumable.Checkpointer(tmp_path / "resumable", {"model": saved}, persist="sync") as c:
        assert c.restore(step=best) == best
    for (name, a), b in zip(trainer.model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name


def test_save_strategy_epoch_and_no(tmp_path: Path) -> None:
    make_trainer(tmp_path / "epoch", steps=12, save_strategy="epoch", persist="sync").train()
    assert checkpoint_steps(tmp_path / "epoch") == [8, 12]  # each epoch end, and the last step
    make_trainer(tmp_path / "no", steps=4, save_strategy="no", persist="sync").train()
    assert checkpoint_steps(tmp_path / "no") == []


def test_a_relaunch_of_a_finished_run_trains_no_further(tmp_path: Path) -> None:
    """A kill after the last step (during the final persist, or with the last step in
    shared memory) leaves a checkpoint at ``max_steps``: the relaunch must not take one
    more step, as the plain Trainer does (it starts an epoch before its flow callback
    stops it)."""
    first = make_trainer(tmp_path, steps=4, persist="sync")
    first.train()
    again = make_trainer(tmp_path, steps=4, persist="sync")
    again.train()
    assert again.state.global_step == 4
    assert digest(again) == digest(first)
    assert checkpoint_steps(tmp_path) == [3, 4]


def test_a_plain_trainer_checkpoint_path_is_refused(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, steps=2, persist="sync")
    with pytest.raises(ValueError, match="resumes by itself"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_export_writes_what_from_pretrained_loads(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, steps=3, persist="sync")
    trainer.train()
    out = tmp_path / "exported"
    trainer.model.config.save_pretrained(out)
    cli = [sys.executable, "-m", "resumable.cli", "export", str(tmp_path / "resumable")]
    proc = subprocess.run(
        [*cli, "--key", "model", "--out", str(out / "model.safetensors")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    loaded = GPT2LMHeadModel.from_pretrained(out)
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


# --------------------------------------------------------------------------- killed jobs


@pytest.fixture(scope="module")
def example_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    line = run_to_end(example(tmp_path_factory.mktemp("example-ref")))
    assert line.startswith("final step=30 params_sha256=")
    return line


def test_sigkilled_twice_ends_bit_identical(tmp_path: Path, example_reference: str) -> None:
    assert kill_campaign(tmp_path, 2, 13, "--memory-every", "1") == example_reference


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sigkilled_at_random_moments_ends_bit_identical(
    tmp_path: Path, example_reference: str
) -> None:
    seed = int(os.environ.get("RESUMABLE_CAMPAIGN_SEED", "20261124"))
    assert kill_campaign(tmp_path / "memory", 8, seed, "--memory-every", "1") == example_reference
    assert kill_campaign(tmp_path / "disk", 6, seed + 1, "--save-steps", "2") == example_reference


def test_sigterm_takes_an_emergency_checkpoint_and_loses_no_step(
    tmp_path: Path, example_reference: str
) -> None:
    cmd = example(tmp_path, "--preempt", "--save-steps", "100")
    rc = run_until(cmd, 7, signal.SIGTERM)
    assert rc == resumable.REQUEUE_EXIT_CODE
    committed = checkpoint_steps(tmp_path)
    assert len(committed) == 1 and committed[0] >= 7  # nothing else was due before step 30
    assert run_to_end(cmd) == example_reference


def test_sigterm_without_a_preemption_argument_checkpoints_and_resumes(
    tmp_path: Path, example_reference: str
) -> None:
    """The example without ``--preempt``, as a user switching from the plain Trainer
    runs it, nothing else edited: SIGTERM still takes the emergency checkpoint and the
    relaunch loses nothing (from `test_transformers_switch`)."""
    cmd = example(tmp_path / "run", "--save-steps", "100")
    rc = run_until(cmd, 7, signal.SIGTERM)
    assert rc == resumable.REQUEUE_EXIT_CODE  # the plain Trainer dies with -SIGTERM
    saved = checkpoint_steps(tmp_path / "run")
    assert len(saved) == 1 and saved[0] >= 7  # the emergency checkpoint, no other was due
    assert run_to_end(cmd) == example_reference  # resumed at that step, lost nothing
