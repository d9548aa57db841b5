"""A user of `accelerate` with their own loop hands `Checkpointer` the prepared model,
optimizer and scheduler and a `ResumableDataLoader` kept out of ``prepare`` (it is a
``DataLoader``, which ``prepare`` would replace with its own ``DataLoaderShard``, position
and all): a run crashed mid-epoch and resumed ends bit-identical to one never stopped."""

from __future__ import annotations

from pathlib import Path

import accelerate
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import resumable
from resumable.data import ResumableDataLoader

STEPS = 14  # 10 batches an epoch: crosses an epoch boundary


def train(root: Path, *, crash_at: int | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    loader = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=0)
    model, opt, sched = acc.prepare(model, opt, sched)
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
    ckpt = resumable.Checkpointer(
        root,
        {"model": model, "optim": opt, "sched": sched, "data": loader},
        persist_every=resumable.Every(steps=4),
        persist="sync",
    )
    with ckpt:
        step = ckpt.restore()
        while step < STEPS:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                if step == crash_at:
                    raise RuntimeError("crash")
                ckpt.maybe_save(step)
                if step == STEPS:
                    break
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def test_prepared_objects_resume_bit_identical(tmp_path: Path) -> None:
    reference = train(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        train(tmp_path / "run", crash_at=11)  # committed step 8, mid-epoch 0 -> 1 boundary
    resumed = train(tmp_path / "run")
    assert reference.keys() == resumed.keys()
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k


def test_prepare_would_replace_the_loader() -> None:
    """Why the loader stays out of ``prepare``: it is a ``DataLoader``."""
    data = TensorDataset(torch.arange(8.0))
    prepared = accelerate.Accelerator(cpu=True).prepare(ResumableDataLoader(data, 2))
    assert not isinstance(prepared, ResumableDataLoader)
