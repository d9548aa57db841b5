"""DDP training on CPU with gloo that reads a dataset through `ResumableDataLoader`.

    torchrun --standalone --nproc-per-node=2 \\
        examples/distributed/train_ddp_data.py --dir runs/ddp-data --epochs 3

The loader shards each epoch over the ranks (no ``DistributedSampler``, no ``set_epoch``)
and its position goes into the checkpoint with the model, the optimizer and each rank's
random streams (the model has dropout). Kill the job at any moment (SIGKILL to torchrun and
its workers) and start it again: it resumes every rank at its exact next sample, and the
last line, printed by rank 0, ``final params_sha256=<hex>``, is the one an uninterrupted
run prints. Rank 0 prints ``step N epoch E`` after each step.

The random streams are per-rank: to restart at another world size, pass
``--reset-per-rank-state``; the data position carries over as it is (the rest of the epoch
is dealt over the new ranks), the model and optimizer as DDP replicas.
"""

from __future__ import annotations

import argparse
import hashlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import resumable
from resumable.data import ResumableDataLoader


def dataset(seed: int, n: int) -> torch.utils.data.TensorDataset:
    """A regression problem made from a seed: the same on every rank and every launch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].norm(dim=1)], 1)
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory or URL")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--save-every", type=int, default=2, help="steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reset-per-rank-state", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 3))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(args.seed * 7919 + rank)  # each rank's own dropout stream
    loader = ResumableDataLoader(
        dataset(args.seed, args.samples), args.batch_size, shuffle=True, seed=args.seed
    )
    ck = resumable.Checkpointer(
        args.dir,
        {"model": model, "optim": optimizer, "data": loader},
        persist_every=resumable.Every(steps=args.save_every),
        keep=resumable.Keep(last=2),
        dist_timeout_s=60,
    )
    with ck:
        step = ck.restore(reset_per_rank_state=args.reset_per_rank_state)
        print(f"rank {rank}: resumed from step {step}", flush=True)
        while loader.epoch < args.epochs:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                ck.maybe_save(step)
                if rank == 0:
                    print(f"step {step} epoch {loader.epoch}", flush=True)
    h = hashlib.sha256()
    for name, t in sorted(model.module.state_dict().items()):
        h.update(name.encode() + t.numpy().tobytes())
    if rank == 0:
        print(f"final step={step} params_sha256={h.hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
