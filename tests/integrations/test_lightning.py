"""`ResumableCheckpoint`: Lightning's Trainer checkpointing through `resumable`.

In-process tests fit a small MLP for a few steps (``lightning_job``); the kill tests run
``examples/integrations/lightning_mlp.py`` as the user would and SIGKILL/SIGTERM it. Fabric
users hand a `Checkpointer` Fabric's wrapped objects (last test)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import resumable
from resumable.data import ResumableDataLoader, ResumableSampler
from resumable.integrations.lightning import ResumableCheckpoint

from .jobs import Job, steps_in
from .lightning_job import data, digest, fit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "lightning_mlp.py"
JOB = Job(EXAMPLE, "--steps", "36")
example = JOB.command
run_to_end = JOB.run_to_end
run_until = JOB.run_until


def kill_campaign(directory: Path, kills: int, seed: int, *extra: str) -> str:
    return JOB.kill_campaign(
        directory, kills, seed, *extra, last_step=35, while_killed=("--step-time", "0.05")
    )


EVERY_6 = resumable.Every(steps=6)
EVERY_1 = resumable.Every(steps=1)
PERSIST_NEVER = ("--persist-every", "1000")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    trainer, model, _ = fit(tmp_path_factory.mktemp("ref"), steps=30, persist_every=EVERY_6)
    return digest(trainer, model), model.seen


def test_every_lightning_epoch_reads_one_whole_loader_epoch(
    reference: tuple[str, list[Any]],
) -> None:
    """Lightning stops at the loader's length without asking past it; the loader must still
    start its next epoch (before the fix: every other Lightning epoch was empty)."""
    per_epoch: dict[int, list[int]] = {}
    for epoch, _, ids in reference[1]:
        per_epoch.setdefault(epoch, []).extend(ids)
    assert [len(v) for v in per_epoch.values()] == [48, 48, 24]
    assert sorted(per_epoch[0]) == sorted(per_epoch[1]) == list(range(48))
    assert per_epoch[0] != per_epoch[1]  # shuffled anew each epoch


@pytest.mark.parametrize("crash_at, resumed_from", [(17, 12), (9, 6)])
def test_a_crashed_fit_resumes_bit_identical(
    tmp_path: Path, reference: tuple[str, list[Any]], crash_at: int, resumed_from: int
) -> None:
    """Resumed mid-epoch (step 6) and exactly at an epoch boundary (step 12, with a
    per-epoch LR scheduler), the rest of the run reads the same samples in the same order
    and ends with the same parameters and optimizer state."""
    with pytest.raises(RuntimeError, match="crash at step"):
        fit(tmp_path, steps=30, crash_at=crash_at, persist_every=EVERY_6)
    trainer, model, callback = fit(tmp_path, steps=30, persist_every=EVERY_6)
    assert callback.restored_step == resumed_from
    assert digest(trainer, model) == reference[0]
    assert model.seen == [s for s in reference[1] if s[1] >= resumed_from]


@pytest.fixture(scope="module")
def by_epoch(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    trainer, model, _ = fit(tmp_path_factory.mktemp("by-epoch"), epochs=3, persist_every=EVERY_1)
    return digest(trainer, model), model.seen


def test_epoch_based_fit_reads_the_loader_epoch_lightning_names(
    by_epoch: tuple[str, list[Any]],
) -> None:
    """``max_epochs`` training, validated at each epoch end: Lightning epoch ``e`` reads the
    loader's permutation of epoch ``e`` whole (Lightning's own ``set_epoch(e)`` and the
    loader's epoch agree; before the fix epoch 1 was empty and epoch 2 read loader epoch 1)."""
    permutation = ResumableDataLoader(data(), batch_size=4, shuffle=True, seed=0).sampler
    assert isinstance(permutation, ResumableSampler)
    per_epoch: dict[int, list[int]] = {}
    for epoch, _, ids in by_epoch[1]:
        per_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, ids in per_epoch.items():
        assert ids == permutation.permutation(epoch).tolist(), epoch


@pytest.mark.parametrize("crash_at, resumed_from", [(13, 12), (14, 13), (25, 24)])
def test_epoch_based_fit_resumed_at_an_epoch_boundary_is_bit_identical(
    tmp_path: Path, by_epoch: tuple[str, list[Any]], crash_at: int, resumed_from: int
) -> None:
    """Checkpointed at the last batch of an epoch (steps 12 and 24, before the epoch-end
    validation) and at the first batch after one (step 13): the resumed ``max_epochs`` fit
    reads the same samples and ends with the same parameters and optimizer state. (The
    crash callback runs before ours, so the newest checkpoint is the step before it.)"""
    with pytest.raises(RuntimeError, match="crash at step"):
        fit(tmp_path, epochs=3, crash_at=crash_at, persist_every=EVERY_1)
    trainer, model, callback = fit(tmp_path, epochs=3, persist_every=EVERY_1)
    assert callback.restored_step == resumed_from
    assert trainer.global_step == 36
    assert model.seen == [s for s in by_epoch[1] if s[1] >= resumed_from]
    assert digest(trainer, model) == by_epoch[0]


def test_a_relaunch_of_a_finished_fit_trains_no_further(tmp_path: Path) -> None:
    first, model, _ = fit(tmp_path, steps=8, persist_every=EVERY_6)
    again, model2, callback = fit(tmp_path, steps=8, persist_every=EVERY_6)
    assert callback.restored_step == 8 and model2.seen == []
    assert digest(again, model2) == digest(first, model)


def test_other_checkpoint_paths_go_to_lightnings_own_checkpoint_io(tmp_path: Path) -> None:
    """The installed CheckpointIO wraps Lightning's: a plain ``.ckpt`` still saves and
    loads; the marker is not a file to write."""
    trainer, _, callback = fit(tmp_path / "run", steps=4, persist_every=EVERY_6)
    plain = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(plain)
    loaded = trainer.strategy.checkpoint_io.load_checkpoint(plain)
    assert loaded["global_step"] == 4
    assert callback.checkpointer is None  # closed at teardown, not reopened
    with pytest.raises(resumable.CheckpointError, match="resumes from"):
        trainer.save_checkpoint(callback.marker)


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, reference: tuple[str, list[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RuntimeError):
        fit(tmp_path, steps=30, crash_at=17, persist_every=EVERY_6)
    newest = tmp_path / "step-000000000012"
    data_file = next(newest.glob("*.safetensors"))
    raw = bytearray(data_file.read_bytes())
    raw[-50] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        trainer, model, callback = fit(tmp_path, steps=30, persist_every=EVERY_6)
    assert any(newest.name in r.getMessage() for r in caplog.records if r.levelno >= 30)
    assert callback.restored_step == 6
    assert digest(trainer, model) == reference[0]


def test_monitor_keeps_the_best_besides_the_newest(tmp_path: Path) -> None:
    """As ``ModelCheckpoint(monitor=..., mode=..., save_top_k=1)``: a checkpoint at each
    validation (every 4 batches) with its metrics; retention keeps the best by the
    monitored metric besides the ``keep_last`` newest. ``mode="max"`` makes the best an
    early step (the loss falls), so it is kept for being best, not for being new."""
    fit(
        tmp_path, steps=24, validate=True, monitor="val_loss", mode="max", keep_last=2,
        persist_every=resumable.Every(steps=1000),
    )  # fmt: skip
    commits = [
        json.loads(line)
        for line in (tmp_path / "audit.jsonl").read_text().splitlines()
        if '"commit"' in line
    ]
    val = {c["step"]: c["metrics"]["val_loss"] for c in commits}
    assert sorted(val) == [4, 8, 12, 16, 20, 24]
    best = max(val, key=lambda s: val[s])
    assert best not in (20, 24)
    assert steps_in(tmp_path) == sorted({best, 20, 24})


def test_on_object_storage(s3_env: Any, reference: tuple[str, list[Any]]) -> None:
    url = f"s3://{s3_env.new_bucket('lightning')}/run"
    with pytest.raises(RuntimeError):
        fit(url, steps=30, crash_at=9, persist_every=EVERY_6, persist="auto")
    trainer, model, callback = fit(url, steps=30, persist_every=EVERY_6, persist="auto")
    assert callback.restored_step == 6
    assert digest(trainer, model) == reference[0]


# --------------------------------------------------------------------------- killed jobs


@pytest.fixture(scope="module")
def example_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    line = run_to_end(example(tmp_path_factory.mktemp("example-ref")))
    assert line.startswith("final step=36 params_sha256=")
    return line


def test_sigterm_then_sigkill_end_bit_identical(tmp_path: Path, example_reference: str) -> None:
    """SIGTERM: an emergency checkpoint at the next step boundary and exit code 75 (nothing
    else was due); the relaunch is then SIGKILLed at a random later step (memory snapshots
    every step); the last relaunch ends bit-identical to a run never stopped."""
    cmd = example(tmp_path, "--preempt", "--memory-every", "1", "--step-time", "0.05",
                  *PERSIST_NEVER)  # fmt: skip
    assert run_until(cmd, 7, signal.SIGTERM) == resumable.REQUEUE_EXIT_CODE
    committed = steps_in(tmp_path)
    assert len(committed) == 1 and committed[0] >= 7
    rc = run_until(cmd, random.Random(13).randint(committed[0] + 2, 33), signal.SIGKILL)
    assert rc in (-signal.SIGKILL, 0)
    assert run_to_end(cmd) == example_reference


SIGTERM_AFTER_OUR_HOOK = """
import os, signal, sys
sys.path.insert(0, {examples!r})
import lightning_mlp

class Late(lightning_mlp.MLP):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        # after every callback's hook of this step (ResumableCheckpoint's included) and
        # before the loop's end-of-step check: the moment where Lightning's own SIGTERM
        # flag used to win, ending fit with exit code 0 and no emergency checkpoint
        if self.trainer.global_step == 7:
            os.kill(os.getpid(), signal.SIGTERM)

lightning_mlp.MLP = Late
lightning_mlp.main(sys.argv[1:])
"""


def test_sigterm_after_the_checkpoint_hook_still_requeues(
    tmp_path: Path, example_reference: str
) -> None:
    """A SIGTERM landing between ResumableCheckpoint's batch-end hook and Lightning's own
    check: the emergency checkpoint is taken at the next boundary (step 8) and the job
    exits with the requeue code, not 0; the relaunch ends bit-identical."""
    script = tmp_path / "late_sigterm.py"
    script.write_text(SIGTERM_AFTER_OUR_HOOK.format(examples=str(EXAMPLE.parent)))
    args = ["--dir", str(tmp_path / "run"), "--steps", "36", "--preempt", *PERSIST_NEVER]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, timeout=240, check=False, env=JOB.env)  # fmt: skip
    assert proc.returncode == resumable.REQUEUE_EXIT_CODE, proc.stderr[-3000:]
    assert "final step" not in proc.stdout
    assert steps_in(tmp_path / "run") == [8]
    assert run_to_end(example(tmp_path / "run", "--preempt", *PERSIST_NEVER)) == example_reference


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sigkilled_at_random_moments_ends_bit_identical(
    tmp_path: Path, example_reference: str
) -> None:
    seed = int(os.environ.get("RESUMABLE_CAMPAIGN_SEED", "20261124"))
    assert kill_campaign(tmp_path / "memory", 8, seed, "--memory-every", "1") == example_reference
    assert kill_campaign(tmp_path / "disk", 6, seed + 1, "--persist-every", "2") == (
        example_reference
    )


# --------------------------------------------------------------------------- Fabric


def fabric_train(root: Path, *, crash_at: int | None = None) -> dict[str, torch.Tensor]:
    """A Fabric loop: the Checkpointer takes Fabric's wrapped model and optimizer, and a
    `ResumableDataLoader` kept out of ``setup_dataloaders`` (Fabric would re-wrap it)."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=3, gamma=0.5)
    x, y, _ = data().tensors
    loader = ResumableDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, seed=0)
    ckpt = resumable.Checkpointer(
        root,
        {"model": model, "optim": opt, "sched": sched, "data": loader},
        persist_every=resumable.Every(steps=4),
        persist="sync",
    )
    with ckpt:
        step = ckpt.restore()
        while step < 20:  # 12 batches an epoch: crosses an epoch boundary
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                fabric.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                if step == crash_at:
                    raise RuntimeError("crash")
                ckpt.maybe_save(step)
                if step == 20:
                    break
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def test_fabric_wrapped_objects_resume_bit_identical(tmp_path: Path) -> None:
    reference = fabric_train(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        fabric_train(tmp_path / "run", crash_at=15)  # committed step 12, an epoch boundary
    resumed = fabric_train(tmp_path / "run")
    assert reference.keys() == resumed.keys()
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k


def test_the_callback_builds_the_options_a_checkpointer_would(tmp_path: Path) -> None:
    """The callback's keywords go through `CheckpointOptions.from_kwargs`, as the
    `Checkpointer`'s do: the same arguments give the same options."""
    same: dict[str, Any] = {
        "persist_every": EVERY_6,
        "memory_every": resumable.Every(steps=2),
        "keep": resumable.Keep(last=2),
        "persist": "sync",
        "on_busy": "wait",
    }
    callback = ResumableCheckpoint(tmp_path / "a", **same)
    own = {"capture_rng": False, "save_on_close": False}
    with resumable.Checkpointer(tmp_path / "b", {"w": torch.zeros(1)}, **same, **own) as ckpt:
        assert callback.options == ckpt.options
    assert callback.options.memory_tier
    with pytest.raises(resumable.CheckpointError, match=r"keep must be a resumable\.Keep"):
        ResumableCheckpoint(tmp_path / "c", keep="all")
    with pytest.raises(resumable.CheckpointError, match="on_busy must be 'skip' or 'wait'"):
        ResumableCheckpoint(tmp_path / "c", on_busy="later")
