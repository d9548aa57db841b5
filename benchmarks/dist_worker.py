"""One rank of the distributed phase (`dist_bench.py`): an FSDP2 model saved by `resumable`
and by ``torch.distributed.checkpoint``, interleaved, timed on every rank.

    python -m torch.distributed.run --standalone --nproc-per-node=N \\
        benchmarks/dist_worker.py --size-mb 128 --reps 3 --dir DIR --out OUT.json

Every rank builds the same MLP (``fully_shard`` on each Linear and on the root, on a CPU
mesh of all ranks, world 1 included), trains one step so that AdamW's state exists, and
then runs ``warmup + reps`` rounds; each round saves once with every method, the first
method rotating from round to round. The warm-up rounds are recorded but not timed: the
first saves of a method into a new directory run slower here than later ones (a
background persist's first rounds at 2 ranks took 0.21-0.25 s, later ones 0.09 s), and
a training job saves many times. Before each save all ranks meet at a barrier; each rank
times its own call, and the sample kept is the slowest rank's (what a training step
waits for). Rank 0 writes the samples, the per-rank times and the bytes of each file to
``OUT``. Methods:

- ``resumable``: ``Checkpointer(DIR/resumable, {"model", "optim"}, persist="sync",
  keep=Keep(last=1))``, built once; ``save(step)`` returns after the commit is durable
  (with several ranks: after the coordinated commit), so blocking = total.
- ``resumable_process`` (``--background``): the same with the default background
  persist (``persist="process"``; with several ranks the workers commit together through
  the coordination store): blocking = ``save()``, total = + ``wait()``.
- ``copy_floor``: copying this rank's parameters and optimizer state (its local shards)
  into buffers allocated once: the least a snapshot can block.
- ``dcp_save``: ``get_state_dict`` then ``dcp.save(..., FileSystemWriter(dir))``.
- ``dcp_async``: ``get_state_dict`` then ``dcp.async_save`` (thread executor, default
  stager) on a gloo side group; blocking = until it returns, total = ``.result()``.

Each rank also records the CPU time its process spent in each call (``time.process_time``,
every thread of the process): with more ranks than cores, the ranks take turns on the
cores, and the slowest rank's wall time follows the sum of the ranks' CPU time over the
cores rather than any one rank's work. Each rank's start (``CLOCK_MONOTONIC``, one clock
for the machine's processes) gives every call's *span* too: from the first rank's start
to the last rank's return, what the step's next collective waits for. With more ranks
than cores the slowest rank's own time is a lottery: a rank the scheduler runs alone
copies in 5.5 ms, one that shares a core in 11 (the copy floor at 4 ranks on 2 cores
took either in the run of 2026-12-05T05); the span is not.

After the timed rounds, `LAYER_ROUNDS` more rounds of the copy floor then the
background save (+ ``wait()``) time the layers of that save where they run
(`timed_parts`, `save_layers`): the snapshot (the capture, the copy into shared memory,
and between them the slot and its metadata), asking and waiting for the other ranks'
decision whether the persist starts, and the hand-off to the persist worker; the rest of
its blocking is the bookkeeping of ``save()``.
The timers stay out of the timed rounds.

The ``get_state_dict`` call is inside DCP's timings, as resumable's own capture is inside
``save()``. DCP's directories are removed after each round, outside the timings.

With ``--loop-steps N``, the rounds are followed by a training loop timed twice: N steps
with no checkpointing, then N steps calling ``maybe_save`` of a `Checkpointer` with a
memory snapshot every step and a persist every 50 steps (its default background mode),
the last persist waited for inside the timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEPTH = 8
BATCH = 16
LAYER_ROUNDS = 10  # rounds after the timed ones with the background save's layers timed


def save_layers() -> tuple[tuple[str, type, str], ...]:
    """The layers of a background ``save()`` timed by `layers` (`timed_parts`)."""
    from resumable.coordination import Agreement, Pending
    from resumable.pipeline.memory import MemoryTier
    from resumable.pipeline.persister import BackgroundPersister
    from resumable.snapshot import CopyPlan

    return (
        ("copy", CopyPlan, "copy"),  # into the shared-memory slot
        ("capture", MemoryTier, "_capture"),  # the walk of the state, the random streams
        ("take", MemoryTier, "take"),  # the snapshot: the capture, the slot, the copy
        ("ask", Agreement, "decide_later"),  # whether the persist starts: asked
        ("answer", Pending, "result"),  # ... and waited for, after the copy
        ("hand_off", BackgroundPersister, "persist"),  # the job to the persist worker
    )


def build(size_mb: float, world: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """An MLP of ``DEPTH`` square Linear layers whose parameters plus AdamW's two moments
    take about ``size_mb`` MiB, sharded with FSDP2 over every rank, after one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_layer = size_mb * 2**20 / (3 * 4 * DEPTH)
    width = max(32, 32 * round(math.sqrt(per_layer) / 32))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    info = {
        "layers": DEPTH,
        "width": width,
        "params": params,
        "state_bytes": 3 * 4 * params,
        "what": f"{DEPTH} x Linear({width}, {width}) with ReLU, fp32, AdamW (2 moments)",
    }
    return model, opt, info


def _files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}


def _per_rank(files: dict[str, int], world: int, name: Callable[[int], str]) -> dict[str, Any]:
    per_rank = [files.get(name(r), 0) for r in range(world)]
    named = {name(r) for r in range(world)}
    return {
        "per_rank": per_rank,
        "other": {k: v for k, v in files.items() if k not in named},
        "total": sum(files.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=1, help="rounds before the timed ones (1)")
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--background", action="store_true")
    ap.add_argument("--loop-steps", type=int, default=0)
    ap.add_argument(
        "--pair-reps",
        type=int,
        default=0,
        help="rounds after the others of the background save and the copy floor alone (0)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from resumable import Checkpointer, Every, Keep
    from resumable.commit import step_dir

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, info = build(args.size_mb, world)
    side = dist.new_group(backend="gloo")
    state = {"model": model, "optim": opt}
    # Full checkpoints, as dcp writes: the state does not change between saves, so an
    # incremental one would write nothing after the first (incr_bench.py measures those).
    ours = Checkpointer(
        args.dir / "resumable", state, persist="sync", keep=Keep(last=1), incremental=False
    )
    bg = None
    if args.background:
        bg = Checkpointer(
            args.dir / "resumable-process",
            state,
            persist="process",
            keep=Keep(last=1),
            incremental=False,
        )
    snapshots: list[float] = []  # the background save's own snapshot time, per round
    local = [_local(p) for p in model.parameters()]
    local += [_local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    floor_dst = [torch.empty_like(t) for t in local]

    def copy_floor(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for dst, src in zip(floor_dst, local):
            dst.copy_(src)
        t = time.perf_counter() - t0
        return t, t

    def dcp_dir(name: str, i: int) -> Path:
        return args.dir / f"{name}-{i}"

    def save_ours(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        ours.save(i + 1)
        t = time.perf_counter() - t0
        return t, t

    def save_bg(i: int) -> tuple[float, float]:
        assert bg is not None
        t0 = time.perf_counter()
        bg.save(i + 1)
        blocking = time.perf_counter() - t0
        snapshots.append(float(bg.last_snapshot_s or 0.0))  # its capture and copy
        bg.wait()
        return blocking, time.perf_counter() - t0

    def save_dcp(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(dcp_dir("dcp", i)))
        t = time.perf_counter() - t0
        return t, t

    def save_dcp_async(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        fut = dcp.async_save(
            {"model": msd, "optim": osd},
            storage_writer=FileSystemWriter(dcp_dir("dcp-async", i)),
            process_group=side,
        )
        blocking = time.perf_counter() - t0
        fut.result()  # type: ignore[union-attr]
        return blocking, time.perf_counter() - t0

    methods: dict[str, Callable[[int], tuple[float, float]]] = {
        "resumable": save_ours,
        "dcp_save": save_dcp,
        "dcp_async": save_dcp_async,
        "copy_floor": copy_floor,
    }
    if bg is not None:
        methods["resumable_process"] = save_bg
    names = list(methods)
    times: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in names}
    cpu: dict[str, list[list[float]]] = {n: [] for n in names}  # per round, each rank's
    starts: dict[str, list[list[float]]] = {n: [] for n in names}  # CLOCK_MONOTONIC
    snap_times: list[list[float]] = []  # per round, each rank's snapshot inside save()
    nbytes: dict[str, Any] = {}

    def one_round(i: int, order: list[str]) -> None:
        for name in order:
            dist.barrier()
            c0, s0 = time.process_time(), time.monotonic()  # one clock for all ranks
            blocking, total = methods[name](i)
            used = time.process_time() - c0
            snap = snapshots[-1] if name == "resumable_process" else float("nan")
            mine = torch.tensor([blocking, total, snap, used, s0], dtype=torch.float64)
            every = [torch.zeros(5, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            times[name].append([(float(t[0]), float(t[1])) for t in every])
            cpu[name].append([float(t[3]) for t in every])
            starts[name].append([float(t[4]) for t in every])
            if name == "resumable_process":
                snap_times.append([float(t[2]) for t in every])

    for i in range(args.warmup + args.reps):
        k = i % len(names)
        one_round(i, names[k:] + names[:k])
        dist.barrier()
        if rank == 0:
            if i == 0:
                nbytes["resumable"] = _per_rank(
                    _files(args.dir / "resumable" / step_dir(i + 1)),
                    world,
                    lambda r: f"rank-{r:05d}.safetensors",
                )
                if bg is not None:
                    nbytes["resumable_process"] = _per_rank(
                        _files(args.dir / "resumable-process" / step_dir(i + 1)),
                        world,
                        lambda r: f"rank-{r:05d}.safetensors",
                    )
                for name, sub in (("dcp_save", "dcp"), ("dcp_async", "dcp-async")):
                    nbytes[name] = _per_rank(
                        _files(dcp_dir(sub, i)), world, lambda r: f"__{r}_0.distcp"
                    )
            for sub in ("dcp", "dcp-async"):
                shutil.rmtree(dcp_dir(sub, i), ignore_errors=True)
        dist.barrier()

    # The deciding pair alone, alternating which goes first: more samples of the two
    # whose ratio the goal reads, at a fraction of a full round's time.
    pair = ["copy_floor", "resumable_process"] if bg is not None else []
    done = args.warmup + args.reps
    for j in range(args.pair_reps if pair else 0):
        one_round(done + j, pair if j % 2 == 0 else pair[::-1])
    if pair:
        done += args.pair_reps
    dist.barrier()

    layered = layers(bg, copy_floor, done) if bg is not None else None
    ours.close()
    if bg is not None:
        bg.close()
    loop = _loop(model, opt, info, args, Checkpointer, Every, Keep) if args.loop_steps else None
    if rank == 0:
        out = {
            "world_size": world,
            "warmup": args.warmup,
            "torch_threads": torch.get_num_threads(),
            "model": info,
            "order": names,
            "loop": loop,
            "methods": {
                name: {
                    "blocking": [max(b for b, _ in rep) for rep in reps],
                    "total": [max(t for _, t in rep) for rep in reps],
                    "per_rank_blocking": [[round(b, 6) for b, _ in rep] for rep in reps],
                    "per_rank_total": [[round(t, 6) for _, t in rep] for rep in reps],
                    "per_rank_cpu": [[round(c, 6) for c in rep] for rep in cpu[name]],
                    "span_blocking": [
                        _span(st, [b for b, _ in rep]) for st, rep in zip(starts[name], reps)
                    ],
                    "span_total": [
                        _span(st, [t for _, t in rep]) for st, rep in zip(starts[name], reps)
                    ],
                    "bytes": nbytes.get(name),
                }
                for name, reps in times.items()
            },
        }
        if snap_times:  # the snapshot (capture + copy) inside the background save
            bgm = out["methods"]["resumable_process"]
            bgm["snapshot"] = [max(rep) for rep in snap_times]
            bgm["per_rank_snapshot"] = [[round(x, 6) for x in rep] for rep in snap_times]
        if layered is not None:
            out["methods"]["resumable_process"]["layers"] = layered
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2 keeps the gloo group alive past destroy_process_group; a gloo thread ending a
    # collective during interpreter shutdown can abort the rank (pytorch/pytorch#190489,
    # docs/distributed.md). The results are written: leave without shutting down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def layers(
    bg: Any, copy_floor: Callable[[int], tuple[float, float]], after: int
) -> list[list[dict[str, float]]]:
    """`LAYER_ROUNDS` rounds of the copy floor, then the background save of step
    ``after + 1 + i`` with its layers timed (`save_layers`), then ``wait()``; per round,
    every rank's milliseconds: ``floor``, ``blocking`` and each layer's (summed over its
    calls in the save)."""
    from timed_parts import timing_parts

    parts = save_layers()
    keys = ["floor", "blocking", *(name for name, _, _ in parts)]
    mine = torch.zeros(LAYER_ROUNDS, len(keys), dtype=torch.float64)
    for i in range(LAYER_ROUNDS):
        dist.barrier()
        floor, _ = copy_floor(i)
        dist.barrier()
        samples: dict[str, list[float]] = {}
        with timing_parts(samples, parts):
            t0 = time.perf_counter()
            bg.save(after + 1 + i)
            blocking = time.perf_counter() - t0
        bg.wait()
        took = [floor, blocking, *(sum(samples.get(name, ())) for name, _, _ in parts)]
        mine[i] = torch.tensor(took, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [
        [{k: round(float(v) * 1e3, 4) for k, v in zip(keys, e[i])} for e in every]
        for i in range(LAYER_ROUNDS)
    ]


def _span(starts: list[float], took: list[float]) -> float:
    """From the first rank's start to the last rank's return (every rank reads the same
    ``CLOCK_MONOTONIC``): what the next collective of a training step waits for, and,
    with more ranks than cores, no lottery of which ranks the scheduler ran first."""
    return round(max(s + t for s, t in zip(starts, took)) - min(starts), 6)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


SEGMENT = 50  # steps per timed segment: one persist each, with `Every(steps=SEGMENT)`


def _loop(
    model: nn.Module, opt: torch.optim.Optimizer, info: dict[str, Any], args: Any, *classes: Any
) -> dict[str, Any]:
    """Training segments of `SEGMENT` steps without checkpointing, with it, and with it
    in overlap mode, interleaved in triples (the first of each rotating),
    ``args.loop_steps`` steps each way; each segment's seconds are the slowest rank's."""
    checkpointer, every, keep = classes
    x = torch.randn(BATCH, info["width"], generator=torch.Generator().manual_seed(2))
    pairs = max(1, args.loop_steps // SEGMENT)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def timed(run: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        run()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    def plain() -> None:
        for _ in range(SEGMENT):
            step()

    def make(name: str, **kw: Any) -> Any:
        return checkpointer(
            args.dir / name,
            {"model": model, "optim": opt},
            memory_every=every(steps=1),
            persist_every=every(steps=SEGMENT),
            keep=keep(last=1),
            **kw,
        )

    # the default (the copy inside maybe_save), and overlap=True (the parameters' and
    # moments' copy runs behind the next forward and backward; optimizer.step() waits)
    cks = {"ck": make("loop"), "overlap": make("loop-overlap", overlap=True)}
    done = dict.fromkeys(cks, 0)  # the last step each checkpointed

    def checkpointed(which: str) -> Callable[[], None]:
        ck = cks[which]

        def run() -> None:
            # a segment's first step is due for a persist, which runs behind its other
            # steps; the segment ends when that persist is committed
            for _ in range(SEGMENT):
                step()
                done[which] += 1
                ck.maybe_save(done[which])
            ck.wait()

        return run

    def first_save(which: str) -> Callable[[], None]:
        def run() -> None:  # starts the workers, allocates and touches the slots
            cks[which].maybe_save(done[which])
            cks[which].wait()
            done[which] = SEGMENT - 1  # the next segment starts at a persist step

        return run

    plain()  # warm-up of the loop itself
    first_s = {w: timed(first_save(w)) for w in cks}  # the checkpointers' warm-ups, apart
    segments: dict[str, list[float]] = {"plain": [], **{w: [] for w in cks}}
    order = list(segments)
    for k in range(pairs):
        for which in order[k % len(order) :] + order[: k % len(order)]:
            run = plain if which == "plain" else checkpointed(which)
            segments[which].append(timed(run))
    stats = {w: dict(ck.stats) for w, ck in cks.items()}
    for ck in cks.values():
        ck.close()
    base, with_ck, ov = segments["plain"], segments["ck"], segments["overlap"]
    return {
        "steps": pairs * SEGMENT,
        "segment_steps": SEGMENT,
        "persist_every": SEGMENT,
        "memory_every": 1,
        "first_save_s": round(first_s["ck"], 6),
        "plain_segments_s": [round(t, 6) for t in base],
        "checkpointed_segments_s": [round(t, 6) for t in with_ck],
        "plain_s": round(sum(base), 6),
        "checkpointed_s": round(sum(with_ck), 6),
        "throughput_ratio": round(statistics.median(base) / statistics.median(with_ck), 4),
        "commits": stats["ck"].get("commits"),
        "skips": stats["ck"].get("skips"),
        "overlap": {
            "first_save_s": round(first_s["overlap"], 6),
            "segments_s": [round(t, 6) for t in ov],
            "checkpointed_s": round(sum(ov), 6),
            "throughput_ratio": round(statistics.median(base) / statistics.median(ov), 4),
            "commits": stats["overlap"].get("commits"),
            "skips": stats["overlap"].get("skips"),
        },
    }


if __name__ == "__main__":
    main()
