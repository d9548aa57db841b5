"""A tiny Lightning job for the integration tests: an MLP with dropout on generated data,
read through a shuffling `ResumableDataLoader` (12 batches an epoch), trained in this
process; `fit` can raise at a given step (a crash)."""

from __future__ import annotations

import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from resumable.data import ResumableDataLoader
from resumable.integrations.lightning import ResumableCheckpoint

logging.getLogger("lightning").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="lightning")


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.seen: list[tuple[int, int, list[int]]] = []  # (epoch, global step, sample ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.append((self.current_epoch, self.global_step, ids.tolist()))
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)  # per epoch
        return {"optimizer": opt, "lr_scheduler": sched}


class Crash(L.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError(f"crash at step {self.at}")


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(48, 1, generator=g)
    return TensorDataset(x, y, torch.arange(48))


def fit(
    root: Path | str,
    *,
    steps: int = -1,
    epochs: int | None = None,
    crash_at: int | None = None,
    validate: bool = False,
    **options: Any,
) -> tuple[L.Trainer, MLP, ResumableCheckpoint]:
    """Fit `MLP` for ``steps`` optimizer steps (or ``epochs`` epochs, validated at each
    epoch end) with a `ResumableCheckpoint` on ``root`` (``options`` go to it), resuming
    with ``ckpt_path="last"``."""
    torch.manual_seed(0)
    model = MLP()
    train = ResumableDataLoader(data(), batch_size=4, shuffle=True, seed=0)
    val = DataLoader(torch.utils.data.Subset(data(), range(16)), batch_size=8)
    options.setdefault("persist", "sync")
    callback = ResumableCheckpoint(root, **options)
    callbacks: list[L.Callback] = [callback]
    if crash_at is not None:
        callbacks.insert(0, Crash(crash_at))
    by_epoch = epochs is not None
    trainer = L.Trainer(
        max_steps=steps,
        max_epochs=epochs,
        callbacks=callbacks,
        val_check_interval=4 if validate else None,
        check_val_every_n_epoch=None if validate else 1,
        limit_val_batches=None if validate or by_epoch else 0,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, train, val if validate or by_epoch else None, ckpt_path="last")
    return trainer, model, callback


def digest(trainer: L.Trainer, model: nn.Module) -> str:
    """sha256 over the model's and the optimizer's tensors."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
    for idx, st in sorted(trainer.optimizers[0].state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode() + v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
