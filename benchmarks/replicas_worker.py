"""One rank of `replicas_bench.py`: DDP training on a simulated node, a memory snapshot
every step, ``replicas`` copies of each node's snapshot.

``python -m torch.distributed.run --nnodes=N --node-rank=K ... replicas_worker.py MODE
ROOT SHM_DIR OUT --replicas R ...`` on each simulated node (its own ``SHM_DIR``). An MLP
of ``--param-mib`` MiB of float32 parameters, trained with Adam (so a rank's snapshot
holds about three times that), gradients all-reduced by DDP on gloo.

Modes (every file is ``OUT/<mode>-r<rank>.json``, written by each rank):

- ``throughput``: ``--warmup`` steps, then ``--steps`` timed steps, each one a forward,
  backward, optimizer step and ``maybe_save`` (a memory snapshot every step; no persist).
  Writes every timed step's wall time and the replication counters
  (``ck._memory.replication.stats``: bytes_sent, pushes, push_s) over the timed steps,
  after the last push ended.
- ``train``: restores, trains to ``--stop`` with a persist every ``--persist-every``
  steps, waits until every pending persist committed and the snapshot of ``--stop`` was
  pushed to the peers, writes ``OUT/stop-r<rank>.json`` and sleeps until the benchmark
  SIGKILLs its node.
- ``restore``: builds the `Checkpointer` and times ``ck.restore()`` alone; writes the
  seconds and the step restored, then exits without training.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resumable import Checkpointer, Every

WIDTH = 512
BATCH = 32
NEVER = 10**9  # a persist interval no run reaches


def layers_for(param_mib: float) -> int:
    """Hidden layers of ``WIDTH`` x ``WIDTH`` for about ``param_mib`` MiB of float32."""
    per_layer = (WIDTH * WIDTH + WIDTH) * 4
    return max(1, round(param_mib * 2**20 / per_layer))


def build(param_mib: float) -> torch.nn.Sequential:
    mods: list[torch.nn.Module] = []
    for _ in range(layers_for(param_mib)):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and of every tensor in the optimizer's state."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for entry in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in entry.values() if torch.is_tensor(t))
    return n


def replication_stats(ck: Checkpointer) -> dict[str, Any]:
    """The replication's own counters (zeros when ``replicas=1`` has none)."""
    memory = getattr(ck, "_memory", None)
    repl = getattr(memory, "replication", None) if memory is not None else None
    if repl is None:
        return {"pushes": 0, "bytes_sent": 0, "push_s": 0.0, "failures": 0, "fetches": 0}
    repl.wait()  # the push of the newest snapshot has ended: its bytes are counted
    return dict(repl.stats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["throughput", "train", "restore"])
    ap.add_argument("root")
    ap.add_argument("shm_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--param-mib", type=float, default=6.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stop", type=int, default=0)
    ap.add_argument("--persist-every", type=int, default=NEVER)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build(args.param_mib)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    # Adam's moments exist from the first step on: take one before the Checkpointer so
    # that every snapshot (and the room check) has the full state's size.
    x, y = batch(0, rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()

    persist_every = args.persist_every if args.mode == "train" else NEVER
    ck = Checkpointer(
        args.root,
        {"model": model, "opt": opt},
        memory_every=Every(steps=1),
        persist_every=Every(steps=persist_every),
        keep=None,
        shm_dir=args.shm_dir,
        persist="thread",
        replicas=args.replicas,
        dist_timeout_s=120,
        save_on_close=False,
    )
    out = args.out

    if args.mode == "restore":
        dist.barrier()
        t0 = time.perf_counter()
        step = ck.restore()
        seconds = time.perf_counter() - t0
        stats = replication_stats(ck)
        (out / f"restore-r{rank}.json").write_text(
            json.dumps({"step": step, "restore_s": seconds, "fetches": stats["fetches"]})
        )
        ck.close()
        dist.destroy_process_group()
        return

    start = ck.restore()
    last = start + args.warmup + args.steps if args.mode == "throughput" else args.stop
    times: list[float] = []
    before: dict[str, Any] = {}
    for step in range(start + 1, last + 1):
        if args.mode == "throughput" and step == start + args.warmup + 1:
            before = replication_stats(ck)
        t0 = time.perf_counter()
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        ck.maybe_save(step)
        times.append(time.perf_counter() - t0)

    if args.mode == "throughput":
        after = replication_stats(ck)
        timed = times[args.warmup :]
        (out / f"throughput-r{rank}.json").write_text(
            json.dumps(
                {
                    "step_s": timed,
                    "state_bytes": state_bytes(model, opt),
                    "snapshots": ck.stats["snapshots"],
                    "replication": {k: after[k] - before.get(k, 0) for k in after},
                }
            )
        )
        ck.close()
        dist.destroy_process_group()
        return

    # train: the newest commit is durable and the newest snapshot is on the peers
    ck.wait()
    stats = replication_stats(ck)
    (out / f"stop-r{rank}.json").write_text(
        json.dumps(
            {"step": last, "last_commit": ck.stats["last_commit_step"], "replication": stats}
        )
    )
    time.sleep(3600)  # until the benchmark kills this node


if __name__ == "__main__":
    main()
