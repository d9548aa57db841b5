"""FSDP2 (or DDP) training on CPU with gloo, checkpointed by `resumable`, restartable by torchrun.

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 \\
        examples/distributed/train_fsdp.py --dir runs/fsdp --steps 40 --save-every 5 [--ddp]

Every rank runs the same code: ``Checkpointer(...)`` and ``ck.restore()`` at the start,
``ck.maybe_save(step)`` in the loop. A save is collective: each rank writes its own
shards (FSDP2) or its share of the replicated tensors (DDP), and the checkpoint commits
only if every rank wrote its part. When a worker dies, torchrun restarts the whole group
and every rank resumes from the same committed step.

Each step's batch is derived from (seed, step, rank) alone, not from a random stream
that advances as training goes, so a resumed run sees the batches an uninterrupted one
would. The last line, printed by rank 0, ``final step=<N> params_sha256=<hex>``, hashes
the full (gathered) model and optimizer state: a run killed and restarted any number of
times prints the same line as one that never was.

Two things this script does that any multi-rank script restarted by torchrun should:

- ``init_process_group`` gets a finite ``timeout`` (the default, 30 minutes, turns a
  failed start into a long hang), and a store prefixed by the restart count: after a
  restart, gloo otherwise may find its peers' addresses of the dead attempt in
  torchrun's store (same port, same run id) and fail to connect.
- the checkpoint cadence is step-based (``Every(steps=...)``): every rank falls due at
  the same step without talking. A time-based cadence also works (rank 0 decides and
  broadcasts at each ``maybe_save``), at the price of one small collective per step.

Preemption: SIGTERM (or SIGUSR1) to any rank leads every rank to an emergency
checkpoint of the same step at the next ``maybe_save`` and an exit with code 75, which
``torchrun --max-restarts`` restarts from.

Environment, for the tests: ``KILL_AT_STEP=N`` makes rank ``KILL_RANK`` (default 1)
SIGKILL itself after step N, on torchrun's first attempt only; ``TERM_AT_STEP=N`` makes
rank ``KILL_RANK`` send itself SIGTERM instead (only that rank gets the signal).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import resumable


def init_distributed(timeout_s: float) -> tuple[int, int]:
    """Join the process group (gloo); returns (rank, world size)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # Under torchrun the agent hosts the store at MASTER_ADDR:MASTER_PORT; a plain env://
    # launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand) hosts it on rank 0.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"attempt{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world


def build(ddp: bool, seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial values on every rank
    model: nn.Module = nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # Created after sharding, so its state is sharded like the parameters.
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    x = torch.randn(size, 16, generator=g)
    y = torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].norm(dim=1), x[:, 0] * x[:, 1]], 1
    )
    return x, y


def full_state_sha256(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """sha256 of the full model and optimizer state, in a fixed order (rank 0 only;
    collective: every rank calls it)."""
    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for name, t in sorted(msd.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for fqn, st in sorted(osd["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{fqn}/{key}".encode())
            h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory or URL")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2")
    p.add_argument(
        "--memory-every", action="store_true", help="snapshot every step into shared memory"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout (s)")
    args = p.parse_args()

    rank, world = init_distributed(args.timeout)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    term_at = int(os.environ.get("TERM_AT_STEP", "0"))
    kill_rank = int(os.environ.get("KILL_RANK", "1"))
    model, optimizer = build(args.ddp, args.seed, world)

    ck = resumable.Checkpointer(
        args.dir,
        {"model": model, "optim": optimizer},
        persist_every=resumable.Every(steps=args.save_every),
        keep=resumable.Keep(last=2),
        dist_timeout_s=args.timeout,
        memory_every=resumable.Every(steps=1) if args.memory_every else None,
        preemption=resumable.Preemption(grace_seconds=30),
    )
    with ck:
        start = ck.restore()
        print(f"rank {rank} attempt {attempt}: resumed from step {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = batch(args.seed, step, rank, args.batch_size)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ck.maybe_save(step, metrics={"loss": loss.item()})
            if rank == 0 and step % args.save_every == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == kill_at and rank == kill_rank and attempt == 0:
                print(f"rank {rank}: killing myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == term_at and rank == kill_rank and attempt == 0:
                print(f"rank {rank}: SIGTERM to myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
        digest = full_state_sha256(model, optimizer)
    if rank == 0:
        print(f"final step={args.steps} params_sha256={digest}", flush=True)
    dist.destroy_process_group()
    # FSDP2 on gloo: DTensor's caches keep the process group, and so gloo's worker
    # threads, alive past destroy_process_group; one of them finishing a collective
    # while the interpreter shuts down aborts the process (SIGABRT, "terminate called
    # without an active exception"; pytorch/pytorch#190489), which torchrun reports as a
    # failure. Everything is committed and closed here, so leave without shutting down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
