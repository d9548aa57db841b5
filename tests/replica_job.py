"""Worker of `test_replicas_job`: DDP or FSDP2 training on simulated nodes with replicas.

``python -m torch.distributed.run --nnodes=N --node-rank=K ... tests/replica_job.py
ROOT SHM_DIR OUT STEPS STOP REPLICAS [ddp|fsdp]`` on each simulated node (its own
``SHM_DIR``). Every rank trains a small model with momentum SGD on its own
deterministic batches plus noise from torch's global random stream (captured with the
state), with a memory snapshot every step, a persist every 5 steps, and ``REPLICAS``
copies of each node's snapshot. It restores first and writes
``OUT/restored-r{rank}.json`` (the step).

- ``STOP`` > 0: after the snapshot of step STOP, the rank writes ``OUT/stop-r{rank}``
  and sleeps until the test SIGKILLs its node.
- otherwise it trains to STEPS, closes, and writes ``OUT/final-r{rank}.json``: a
  SHA-256 of its parameters and optimizer moments (its shards), bytes as they are,
  and the replication's counters.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resumable import Checkpointer, Every
from resumable.ddp import reduce_per_parameter


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x + 0.01 * torch.randn(16, 32), torch.randn(16, 4, generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes on this rank: an FSDP2 parameter's (a DTensor's) local shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p.detach()).numpy().tobytes())
        buf = opt.state[p].get("momentum_buffer")
        if buf is not None:
            h.update(local(buf).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    root, shm_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    steps, stop, replicas = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    fsdp = len(sys.argv) > 7 and sys.argv[7] == "fsdp"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp: torch.nn.Module
    if fsdp:  # FSDP2: each rank holds a shard of every parameter and moment
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        # Gradients all-reduced per parameter: from three ranks on, a resumed run
        # matches an uninterrupted one bit for bit only so (docs/distributed.md).
        ddp = reduce_per_parameter(DistributedDataParallel(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(100 + rank)  # each rank's own noise stream, restored with the state
    ck = Checkpointer(
        root,
        {"model": model, "opt": opt},
        memory_every=Every(steps=1),
        persist_every=Every(steps=5),
        keep=None,
        shm_dir=shm_dir,
        persist="thread",
        replicas=replicas,
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
        if step == stop:
            (out / f"stop-r{rank}").write_text("")
            time.sleep(600)  # until the test kills this node
    replication = ck._memory.replication if ck._memory is not None else None
    stats = dict(replication.stats) if replication is not None else {}
    ck.close()
    final = {"digest": digest(model, opt), "replication": stats}
    (out / f"final-r{rank}.json").write_text(json.dumps(final))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
