"""Train a small Keras 3 model (torch backend), checkpointed by `resumable`.

The changes to a plain Keras script: ``ResumableCallback`` in ``fit``'s callbacks (in
place of ``ModelCheckpoint``/``BackupAndRestore``), and a `resumable.data.ResumableDataLoader`
as ``x`` (handed to the callback too), which lets a checkpoint taken inside an epoch
resume exactly. Run it, kill it (``kill -9``, SIGTERM, ^C) and run the same command again:
it resumes from the newest valid checkpoint in ``--dir`` and ends bit-identical to a run
never stopped (dropout and shuffling included). The last line,
``final step=<N> params_sha256=<hex>``, hashes every model and optimizer variable.

    python examples/integrations/keras_mlp.py --dir runs/keras --epochs 4
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
import warnings
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch
from torch.utils.data import TensorDataset

import resumable
from resumable.data import ResumableDataLoader
from resumable.integrations.keras import ResumableCallback


class PrintSteps(keras.callbacks.Callback):
    """Prints ``step N`` after each batch (the kill tests watch for it)."""

    def __init__(self, step_time: float) -> None:
        super().__init__()
        self.step_time = step_time

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.step_time:
            time.sleep(self.step_time)  # lets the kill tests land mid-run
        print(f"step {int(self.model.optimizer.iterations.numpy())}", flush=True)


def params_sha256(model: keras.Model) -> str:
    """sha256 over every model variable (weights, seed states) and optimizer variable."""
    h = hashlib.sha256()
    for v in [*model.variables, *model.optimizer.variables]:
        h.update(v.path.encode())
        h.update(keras.ops.convert_to_numpy(v.value).tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (or s3://bucket/prefix)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-freq", default="epoch", help="'epoch' or a number of batches")
    p.add_argument("--memory-every", type=int, default=0, help="memory snapshot cadence")
    p.add_argument("--preempt", action="store_true", help="SIGTERM -> emergency checkpoint")
    p.add_argument("--step-time", type=float, default=0.0, help="sleep per batch (tests)")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")

    keras.utils.set_random_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=g)
    loader = ResumableDataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, seed=0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(1),
    ])  # fmt: skip
    model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse", metrics=["mae"])
    save_freq = a.save_freq if a.save_freq == "epoch" else int(a.save_freq)
    checkpoint = ResumableCallback(
        a.dir,
        loader=loader,
        save_freq=save_freq,
        monitor="val_loss",
        memory_every=resumable.Every(steps=a.memory_every) if a.memory_every else None,
        preemption=resumable.Preemption(grace_seconds=60) if a.preempt else None,
    )
    model.fit(
        loader,  # 12 batches an epoch
        epochs=a.epochs,
        validation_data=(x[:32].numpy(), y[:32].numpy()),
        callbacks=[PrintSteps(a.step_time), checkpoint],
        verbose=0,
    )
    step = int(model.optimizer.iterations.numpy())
    print(f"final step={step} params_sha256={params_sha256(model)}", flush=True)


if __name__ == "__main__":
    main()
