"""`ResumableCallback`: Keras 3 ``fit`` (torch backend) checkpointing through `resumable`.

In-process tests fit a small model for a few epochs; the kill tests run
``examples/integrations/keras_mlp.py`` as the user would and SIGKILL/SIGTERM it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import pytest
import torch
from torch.utils.data import TensorDataset

import resumable
from resumable.data import ResumableDataLoader
from resumable.integrations.keras import FRAMEWORK_DRIVEN, ResumableCallback

from .jobs import Job, steps_in

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "integrations" / "keras_mlp.py"
JOB = Job(EXAMPLE, "--epochs", "3", env={"KERAS_BACKEND": "torch"})
example = JOB.command
run_to_end = JOB.run_to_end
run_until = JOB.run_until


def kill_campaign(directory: Path, kills: int, seed: int, *extra: str) -> str:
    return JOB.kill_campaign(
        directory, kills, seed, *extra, last_step=35, while_killed=("--step-time", "0.05")
    )


PERSIST_NEVER = ("--save-freq", "1000")

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="tested on the torch backend (KERAS_BACKEND)"
)


class Crash(keras.callbacks.Callback):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if int(self.model.optimizer.iterations.numpy()) == self.at:
            raise RuntimeError(f"crash at step {self.at}")


def digest(model: keras.Model) -> str:
    h = hashlib.sha256()
    for v in [*model.variables, *model.optimizer.variables]:
        h.update(v.path.encode() + keras.ops.convert_to_numpy(v.value).tobytes())
    return h.hexdigest()


def fit(
    root: Path, *, epochs: int = 3, crash_at: int | None = None, use_loader: bool = True,
    **options: Any,
) -> tuple[keras.Model, ResumableCallback]:  # fmt: skip
    """3 epochs of 12 batches (a `ResumableDataLoader`, or NumPy arrays shuffled by Keras)."""
    keras.backend.clear_session()  # layer names (the state tree's keys) as in a new process
    keras.utils.set_random_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    loader = ResumableDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, seed=0)
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.2), keras.layers.Dense(1),
    ])  # fmt: skip
    model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse")
    options.setdefault("persist", "sync")
    callback = ResumableCallback(root, loader=loader if use_loader else None, **options)
    callbacks: list[keras.callbacks.Callback] = [callback]
    if crash_at is not None:
        callbacks.insert(0, Crash(crash_at))
    data: dict[str, Any] = (
        {"x": loader} if use_loader else {"x": x.numpy(), "y": y.numpy(), "batch_size": 4}
    )
    model.fit(
        **data, epochs=epochs, callbacks=callbacks, verbose=0,
        validation_data=(x[:16].numpy(), y[:16].numpy()),
    )  # fmt: skip
    return model, callback


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    model, _ = fit(tmp_path_factory.mktemp("ref"))
    assert int(model.optimizer.iterations.numpy()) == 36  # every batch of every epoch
    return digest(model)


def test_a_crash_mid_epoch_resumes_bit_identical(tmp_path: Path, reference: str) -> None:
    """BackupAndRestore would rerun epoch 1 whole; here the resumed epoch reads only its
    remaining batches, from the checkpoint taken at step 20 (batch 8 of epoch 1)."""
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path, crash_at=23, save_freq=5)
    assert steps_in(tmp_path)[-1] == 20  # every 5 batches
    model, callback = fit(tmp_path, save_freq=5)
    assert (callback.restored_step, callback.restored_epoch) == (20, 1)
    assert digest(model) == reference


def test_without_a_loader_it_resumes_at_epoch_ends(tmp_path: Path) -> None:
    ref, _ = fit(tmp_path / "ref", use_loader=False)
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "run", crash_at=30, use_loader=False)
    model, callback = fit(tmp_path / "run", use_loader=False)
    assert (callback.restored_step, callback.restored_epoch) == (24, 2)
    assert digest(model) == digest(ref)


def test_inside_an_epoch_needs_the_loader(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loader="):
        ResumableCallback(tmp_path, save_freq=10)
    with pytest.raises(ValueError, match="loader="):
        ResumableCallback(tmp_path, memory_every=resumable.Every(steps=1))


def test_a_relaunch_of_a_finished_fit_trains_no_further(tmp_path: Path, reference: str) -> None:
    fit(tmp_path)
    model, callback = fit(tmp_path)
    assert callback.restored_step == 36 and digest(model) == reference


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, reference: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RuntimeError):
        fit(tmp_path, crash_at=30)
    newest = tmp_path / "step-000000000024"
    data_file = next(newest.glob("*.safetensors"))
    raw = bytearray(data_file.read_bytes())
    raw[-50] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        model, callback = fit(tmp_path)
    assert any(newest.name in r.getMessage() for r in caplog.records if r.levelno >= 30)
    assert callback.restored_step == 12
    assert digest(model) == reference


def test_monitor_keeps_the_best_besides_the_newest(tmp_path: Path) -> None:
    """As ``ModelCheckpoint(save_best_only=True)`` keeps the best by ``monitor``: here
    besides the ``keep_last`` newest (``mode="max"`` makes it an early epoch)."""
    fit(tmp_path, epochs=4, monitor="val_loss", mode="max", keep_last=1)
    commits = [
        json.loads(line)
        for line in (tmp_path / "audit.jsonl").read_text().splitlines()
        if '"commit"' in line
    ]
    val = {c["step"]: c["metrics"]["val_loss"] for c in commits if "val_loss" in c["metrics"]}
    assert sorted(val) == [12, 24, 36, 48]
    best = max(val, key=lambda s: val[s])
    assert best != 48
    assert steps_in(tmp_path) == sorted({best, 48})


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
    assert len(committed) == 1 and 7 <= committed[0] < 12
    rc = run_until(cmd, random.Random(13).randint(committed[0] + 2, 33), signal.SIGKILL)
    assert rc in (-signal.SIGKILL, 0)
    assert run_to_end(cmd) == example_reference


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sigkilled_at_random_moments_ends_bit_identical(
    tmp_path: Path, example_reference: str
) -> None:
    seed = int(os.environ.get("RESUMABLE_CAMPAIGN_SEED", "20261124"))
    assert kill_campaign(tmp_path / "memory", 8, seed, "--memory-every", "1") == example_reference
    assert kill_campaign(tmp_path / "disk", 6, seed + 1, "--save-freq", "2") == example_reference


def test_the_callback_builds_the_options_a_checkpointer_would(tmp_path: Path) -> None:
    """The callback's keywords go through `CheckpointOptions.from_kwargs`, as the
    `Checkpointer`'s do: the same arguments give the same options."""
    same: dict[str, Any] = {"keep": resumable.Keep(last=4), "persist": "sync", "on_busy": "skip"}
    callback = ResumableCallback(tmp_path / "a", **same)
    own = {"persist_every": FRAMEWORK_DRIVEN, "save_on_close": False}
    with resumable.Checkpointer(tmp_path / "b", {"w": torch.zeros(1)}, **same, **own) as ckpt:
        assert callback.options == ckpt.options
    assert not callback.options.memory_tier
    with pytest.raises(resumable.CheckpointError, match=r"keep must be a resumable\.Keep"):
        ResumableCallback(tmp_path / "c", keep="all")
