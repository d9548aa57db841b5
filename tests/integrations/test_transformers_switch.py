"""Switching a script from the plain ``Trainer`` to `ResumableTrainer` with the one change
the docs give: the plain Trainer's ``checkpoint-N`` directories in ``output_dir`` are
imported the first time, never trained over in silence; ``--resume_from_checkpoint`` is
refused with a message that says to drop the flag. Both trainers are real (a one-layer
GPT-2 built from a config, ``hf_job``). That SIGTERM needs no second edit is checked in
`test_transformers` (``test_sigterm_without_a_preemption_argument_checkpoints_and_resumes``),
beside the example's other signal tests and their shared uninterrupted run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from resumable.errors import CheckpointError

from .hf_job import digest, make_trainer


class Crash(TrainerCallback):
    """Raises at the end of step ``at``: the job killed there."""

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


def resumable_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "resumable").glob("step-*"))


def plain_resumed(out: Path, checkpoint: Path) -> str:
    """The plain Trainer resumed from ``checkpoint`` with ``resume_from_checkpoint``."""
    trainer = make_trainer(out, steps=10, plain=True)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 10
    return digest(trainer)


@pytest.fixture
def plain_run(tmp_path: Path) -> Path:
    """A plain Trainer job killed at step 8: ``checkpoint-3`` and ``checkpoint-6``."""
    out = tmp_path / "run"
    crash_at(out, 8, steps=10, plain=True)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    return out


def test_the_newest_plain_checkpoint_is_imported_and_resumed_as_the_plain_trainer_does(
    tmp_path: Path, plain_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = plain_resumed(tmp_path / "plain", plain_run / "checkpoint-6")
    trainer = make_trainer(plain_run, steps=10, persist="sync")
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert any("importing the plain Trainer's" in r.getMessage() for r in caplog.records)
    assert trainer.state.global_step == 10
    assert resumable_steps(plain_run) == [6, 9, 10]  # the import is our first checkpoint
    assert digest(trainer) == expected
    # The TrainerState came along: the losses the plain run logged before step 6.
    assert [h["step"] for h in trainer.state.log_history if "loss" in h][:2] == [3, 6]


def test_the_imported_checkpoint_resumes_like_the_plain_one(
    tmp_path: Path, plain_run: Path
) -> None:
    expected = plain_resumed(tmp_path / "plain", plain_run / "checkpoint-6")
    crash_at(plain_run, 8, steps=10, persist="sync")  # imports step 6, killed before step 9
    assert resumable_steps(plain_run) == [6]
    trainer = make_trainer(plain_run, steps=10, persist="sync")
    # As run_clm.py-style scripts do by themselves: accepted, it is what we would find.
    trainer.train(resume_from_checkpoint=get_last_checkpoint(str(plain_run)))
    # From our step 6 now, not from checkpoint-6 again.
    assert resumable_steps(plain_run) == [6, 9, 10]
    assert digest(trainer) == expected


def test_a_torn_newest_plain_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, plain_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (plain_run / "checkpoint-6" / "trainer_state.json").unlink()  # killed while saving
    expected = plain_resumed(tmp_path / "plain", plain_run / "checkpoint-3")
    trainer = make_trainer(plain_run, steps=10, persist="sync")
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert any("skipping the plain Trainer's" in r.getMessage() for r in caplog.records)
    assert digest(trainer) == expected


def test_a_plain_checkpoint_without_optimizer_state_is_refused(plain_run: Path) -> None:
    (plain_run / "checkpoint-6" / "optimizer.pt").unlink()  # as save_only_model writes it
    trainer = make_trainer(plain_run, steps=10, persist="sync")
    with pytest.raises(CheckpointError, match=r"no optimizer state.*move the checkpoint-\*"):
        trainer.train()
    assert resumable_steps(plain_run) == []


def test_a_given_checkpoint_is_refused_naming_the_command_line_flag(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, steps=2, persist="sync")
    with pytest.raises(ValueError, match="drop --resume_from_checkpoint from the command line"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "elsewhere" / "checkpoint-2"))


def test_preemption_is_validated() -> None:
    with pytest.raises(ValueError, match="preemption must be"):
        make_trainer(Path("unused"), steps=2, preemption="sigterm")
