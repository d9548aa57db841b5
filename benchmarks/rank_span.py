"""Where a background `save()` of several ranks sharing too few cores goes: the save
against a snapshot alone and the copy floor, each timed from the first rank's start to
the last rank's return (one ``CLOCK_MONOTONIC`` for the machine's processes).

    python benchmarks/rank_span.py                 # 4 ranks, AdamW and SGD states
    python benchmarks/rank_span.py --ranks 2 --rounds 20

The same FSDP2 MLP as the several-ranks phase (`dist_worker.build`, 128 MiB with AdamW),
under one ``torchrun --standalone`` launch per optimizer, ``OMP_NUM_THREADS`` = cores ÷
ranks. Each round, after a barrier, in rotation: ``save()`` of a `Checkpointer` with the
default background persist (then ``wait()``, untimed), ``snapshot()`` of the same
checkpointer (the memory snapshot alone, no persist), and the copy floor (this rank's
local tensors copied into buffers allocated once). Per kind: the median span, the median
slowest rank's own time and the median CPU time per rank (``time.process_time``: the
rank's process, not its persist worker). With AdamW, each parameter's ``step`` is a
replicated scalar, and a rank's persist worker copies its share of the snapshot out of
shared memory before writing it; with SGD (momentum) every tensor is a shard.
Writes ``benchmarks/results/partial/rank-span-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ("save", "snapshot", "floor")


def worker(out: Path, rounds: int, optimizer: str, root: Path) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import dist_worker

    from resumable import Checkpointer, Keep

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, info = dist_worker.build(128, world)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        model(torch.randn(dist_worker.BATCH, info["width"])).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ck = Checkpointer(root, {"model": model, "optim": opt}, keep=Keep(last=1), incremental=False)
    local = [dist_worker._local(p) for p in model.parameters()]
    local += [
        dist_worker._local(v)
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    ]
    dst = [torch.empty_like(t) for t in local]
    step = 0
    rows: dict[str, list[list[list[float]]]] = {k: [] for k in KINDS}
    for i in range(rounds + 3):
        for kind in KINDS[i % 3 :] + KINDS[: i % 3]:
            dist.barrier()
            step += 1
            s, c = time.monotonic(), time.process_time()
            if kind == "save":
                ck.save(step)
            elif kind == "snapshot":
                ck.snapshot(step)
            else:
                for d, t in zip(dst, local):
                    d.copy_(t)
            took, cpu = time.monotonic() - s, time.process_time() - c
            if kind == "save":
                ck.wait()
            every = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, torch.tensor([s, took, cpu], dtype=torch.float64))
            if i >= 3:
                rows[kind].append([e.tolist() for e in every])
    ck.close()
    if rank == 0:
        summary: dict[str, Any] = {}
        for kind, rs in rows.items():
            span = [max(s + t for s, t, _ in r) - min(s for s, _, _ in r) for r in rs]
            own = [max(t for _, t, _ in r) for r in rs]
            cpu = [statistics.median(c for _, _, c in r) for r in rs]
            summary[kind] = {
                "span_ms": round(statistics.median(span) * 1e3, 3),
                "slowest_own_ms": round(statistics.median(own) * 1e3, 3),
                "cpu_per_rank_ms": round(statistics.median(cpu) * 1e3, 3),
                "rounds": [[[round(x, 6) for x in rank_row] for rank_row in r] for r in rs],
            }
        out.write_text(json.dumps({"world": world, "info": info, "kinds": summary}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as dist_worker: FSDP2's gloo group outlives destroy_process_group


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--optimizers", nargs="*", default=["adamw", "sgd"])
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "partial")
    ap.add_argument(
        "--worker", nargs=3, metavar=("OUT", "OPTIMIZER", "ROOT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), args.rounds, args.worker[1], Path(args.worker[2]))
        return 0
    cores = os.cpu_count() or 1
    result: dict[str, Any] = {"ranks": args.ranks, "cores": cores, "rounds": args.rounds, "by": {}}
    with tempfile.TemporaryDirectory(prefix="rank-span-") as tmp:
        for name in args.optimizers:
            out = Path(tmp) / f"{name}.json"
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.ranks}", str(Path(__file__).resolve()),
                "--rounds", str(args.rounds), "--worker", str(out), name, str(Path(tmp) / name),
            ]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // args.ranks)))
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            got = json.loads(out.read_text())
            result["by"][name] = got
            k = got["kinds"]
            floor = k["floor"]["span_ms"]
            print(
                f"{name}, {args.ranks} ranks on {cores} cores, spans: save "
                f"{k['save']['span_ms']:.2f} ms ({k['save']['span_ms'] / floor:.2f}x the "
                f"floor), snapshot {k['snapshot']['span_ms']:.2f} ms "
                f"({k['snapshot']['span_ms'] / floor:.2f}x), floor {floor:.2f} ms; CPU per "
                f"rank: save {k['save']['cpu_per_rank_ms']:.2f} ms, floor "
                f"{k['floor']['cpu_per_rank_ms']:.2f} ms",
                flush=True,
            )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"rank-span-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
