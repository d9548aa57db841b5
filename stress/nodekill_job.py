"""A rank of campaign 1d (`stress.nodekill`), run by ``torchrun`` on a simulated node.

``python -m torch.distributed.run --nnodes=2 --node-rank=K ... stress/nodekill_job.py
ROOT SHM_DIR OUT REPLICAS``: restores, checks that every value is exactly what the
restored step saved (the model depends on the step only, a per-rank tensor on the step
and the rank), writes ``OUT/restored-r{rank}`` (the step), then takes a memory snapshot
every step (a persist every `PERSIST_EVERY`), writing the newest snapshotted step to
``OUT/progress-r{rank}`` after each, until it is killed. A wrong value exits 3.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resumable import Checkpointer, Every

PERSIST_EVERY = 10
N = 1 << 16  # floats per tensor: 256 KiB


def values(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shared = torch.randn(N, generator=g)
    g.manual_seed(step * 1000 + rank + 1)
    return shared, torch.randn(N // 4, generator=g)


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    root, shm_dir, out, replicas = (
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]),
        int(sys.argv[4]),
    )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(N // 64, 64, bias=False)  # replicated: N floats
    own = torch.zeros(N // 4)  # per rank
    state = {"model": model, "own": {"t": own}}
    ck = Checkpointer(
        root,
        state,
        memory_every=Every(steps=1),
        persist_every=Every(steps=PERSIST_EVERY),
        keep=None,
        shm_dir=shm_dir,
        persist="thread",
        replicas=replicas,
        dist_timeout_s=30,
        capture_rng=False,
    )
    start = ck.restore()
    if start:
        shared, mine = values(start, rank)
        if not (torch.equal(model.weight.detach().reshape(-1), shared) and torch.equal(own, mine)):
            print(f"rank {rank}: the values restored are not step {start}'s", flush=True)
            os._exit(3)
    write(out / f"restored-r{rank}", str(start))
    step = start
    while True:
        step += 1
        shared, mine = values(step, rank)
        with torch.no_grad():
            model.weight.copy_(shared.reshape(model.weight.shape))
        own.copy_(mine)
        dist.barrier()  # the ranks keep in step, as a training step's collective does
        ck.maybe_save(step)
        write(out / f"progress-r{rank}", str(step))
        time.sleep(0.02)


if __name__ == "__main__":
    main()
