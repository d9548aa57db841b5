"""Train a small MLP with PyTorch Lightning, checkpointed by `resumable`.

The changes to a plain Lightning script: ``ResumableCheckpoint`` in the callbacks,
``ckpt_path="last"`` in ``fit``, and a `resumable.data.ResumableDataLoader` for the
training data (a ``DataLoader`` whose position is saved, so a mid-epoch resume reads no
consumed batch again). Run it, kill it (``kill -9``, SIGTERM, ^C) and run the same
command again: it resumes from the newest valid checkpoint in ``--dir`` and ends
bit-identical to a run never stopped (dropout and shuffling included). The last line,
``final step=<N> params_sha256=<hex>``, hashes every parameter and optimizer state tensor.

    python examples/integrations/lightning_mlp.py --dir runs/lightning --steps 60
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import resumable
from resumable.data import ResumableDataLoader
from resumable.integrations.lightning import ResumableCheckpoint


class MLP(L.LightningModule):
    def __init__(self, lr: float = 0.05, step_time: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.lr = lr
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.step_time:
            time.sleep(self.step_time)  # lets the kill tests land mid-run
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintSteps(L.Callback):
    """Prints ``step N`` after each optimizer step (the kill tests watch for it)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        print(f"step {trainer.global_step}", flush=True)


def params_sha256(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter/buffer and every optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().cpu().numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (or s3://bucket/prefix)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--persist-every", type=int, default=5, help="persist cadence, in steps")
    p.add_argument("--memory-every", type=int, default=0, help="memory snapshot cadence")
    p.add_argument("--val-every", type=int, default=0, help="validate every N batches, keep best")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--preempt", action="store_true", help="SIGTERM -> emergency checkpoint")
    p.add_argument("--step-time", type=float, default=0.0, help="sleep per step (tests)")
    a = p.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=g)
    train = ResumableDataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, seed=0)
    validate = a.val_every > 0
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16) if validate else None
    model = MLP(step_time=a.step_time)
    checkpoint = ResumableCheckpoint(
        a.dir,
        persist_every=resumable.Every(steps=a.persist_every),
        memory_every=resumable.Every(steps=a.memory_every) if a.memory_every else None,
        monitor="val_loss" if validate else None,
        keep_last=a.keep_last,
        preemption=resumable.Preemption(grace_seconds=60) if a.preempt else None,
    )
    trainer = L.Trainer(
        max_steps=a.steps,  # 12 batches an epoch: runs cross epoch boundaries
        callbacks=[PrintSteps(), checkpoint],
        val_check_interval=a.val_every if validate else None,
        check_val_every_n_epoch=None if validate else 1,
        num_sanity_val_steps=0,
        limit_val_batches=None if validate else 0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path="last")
    digest = params_sha256(model, trainer.optimizers[0])
    print(f"final step={trainer.global_step} params_sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
