"""Worker of `test_node_objects_job`: DDP training on simulated nodes, one object per node.

``python -m torch.distributed.run --nnodes=N --node-rank=K ... tests/node_objects_job.py
ROOT OUT STEPS MODE [GATE]`` on each simulated node (each launcher with its own
``RESUMABLE_NODE_STAGING``). Every rank trains a small model under DDP (gradients
reduced per parameter, so a resumed run is bit-identical to an uninterrupted one) with
momentum SGD on its own deterministic batches, and checkpoints with
``node_objects=True``, a persist every 2 steps, the 2 newest kept and ``persist=MODE``
(``auto``: the persist workers, meeting in the coordination store; ``sync``: the
training threads, meeting over gloo). It writes ``OUT/pid-r{rank}`` (its process id),
restores first and writes ``OUT/restored-r{rank}.json`` (the step restored).

- ``GATE`` > 0 (a run to be killed): after step GATE every rank waits until ROOT holds
  a committed step (a background persist may have skipped later ones while the first
  ran), then trains on slowly (a second a step), so that the test kills a rank mid-run
  after a commit.
- it trains to STEPS, closes, and writes ``OUT/final-r{rank}.json``: the step restored
  and a SHA-256 of its parameters and momentum buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resumable import Checkpointer, Every, Keep
from resumable.commit import list_committed
from resumable.ddp import reduce_per_parameter
from resumable.storage import open_storage


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = opt.state[p].get("momentum_buffer")
        if buf is not None:
            h.update(buf.numpy().tobytes())
    return h.hexdigest()


def wait_for_commit(root: Path, timeout_s: float = 120.0) -> None:
    storage = open_storage(str(root))
    deadline = time.monotonic() + timeout_s
    while not list_committed(storage):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step committed in {root} in {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    steps, mode = int(sys.argv[3]), sys.argv[4]
    gate = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (out / f"pid-r{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = reduce_per_parameter(DistributedDataParallel(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ck = Checkpointer(
        root,
        {"model": model, "opt": opt},
        persist_every=Every(steps=2),
        keep=Keep(last=2),
        persist=mode,
        node_objects=True,
        dist_timeout_s=60,
    )
    start = ck.restore()
    (out / f"restored-r{rank}.json").write_text(json.dumps({"step": start}))
    for step in range(start + 1, steps + 1):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        ck.maybe_save(step)
        if gate and step == gate:
            wait_for_commit(root)
        if gate and step >= gate:
            time.sleep(1.0)  # until the test kills a rank
    ck.close()
    final = {"restored": start, "digest": digest(model, opt)}
    (out / f"final-r{rank}.json").write_text(json.dumps(final))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
