"""The smallest complete script: train, get killed, run it again, carry on.

python examples/train_minimal.py runs/minimal
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import resumable
from resumable.data import ResumableDataLoader


def main(directory: str) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    loader = ResumableDataLoader(data, batch_size=32, shuffle=True, seed=0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total_steps = 300

    ckpt = resumable.Checkpointer(
        directory,
        state={"model": model, "optim": optimizer, "data": loader},
        persist_every=resumable.Every(steps=50),
        keep=resumable.Keep(last=2),
    )
    step = ckpt.restore()
    print(f"starting at step {step}")
    while step < total_steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ckpt.maybe_save(step, metrics={"loss": loss.item()})
            if step == total_steps:
                break
    ckpt.close()
    print(f"done at step {step}, checkpoints: {ckpt.steps()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/minimal")
