"""One rank of the DeepSpeed phase (`ds_bench.py`): a DeepSpeed engine's checkpoint taken by
``engine.save_checkpoint`` and by `resumable` (``DeepSpeedState``), interleaved, timed on
every rank; then restored into a second engine by ``engine.load_checkpoint`` and by
``Checkpointer.restore``.

    python -m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 \\
        --master-port=PORT benchmarks/ds_worker.py --stage 2 --reps 5 --dir DIR --out OUT.json

Every rank builds the same GPT-2 (``GPT2LMHeadModel`` from a ``GPT2Config``, nothing
downloaded, dropout off, fp32) twice with ``deepspeed.initialize`` at ZeRO ``--stage``
(AdamW with ``torch_adam``, a warm-up scheduler, gloo): engine A, which takes a training
step so that the optimizer state exists, and engine B, built from another seed, the target
of the restores. Then ``reps + 1`` save rounds, each saving A's state once with every
method, the first method rotating from round to round, all ranks meeting at a barrier
before each call; each rank times its own call and the sample kept is the
slowest rank's Before each call (save
and restore rounds alike) every rank runs a full garbage collection, outside the timing
(`GcClock`), and records the time the collector still takes inside the call. Methods:

- ``deepspeed``: ``A.save_checkpoint(DIR/deepspeed, tag=...)``; blocking = total = the
  call. DeepSpeed writes with ``torch.save`` and does not fsync: right after the call
  (and a barrier) rank 0 fsyncs every file of the tag directory, timed apart as
  ``fsync`` (``durable`` = call + barrier + fsync), so that its dirty pages are not
  written back during the next method's timing.
- ``resumable_auto``: ``Checkpointer(DIR/auto, {"engine": DeepSpeedState(A)},
  keep=Keep(last=1))`` with the default ``persist="auto"`` (a background process per
  rank; the ranks commit together): blocking = ``save(step)``; total = + ``wait()``.
- ``resumable_sync``: the same with ``persist="sync"``: ``save(step)`` returns after the
  coordinated, fsynced commit, blocking = total.
- ``capture``: ``DeepSpeedState(A).state_dict()`` alone (DeepSpeed's own save code into
  memory, no copy): the part of resumable's save spent in DeepSpeed.

Each sample is ``[blocking, total, fsync, snapshot]`` per rank, *snapshot* being
resumable's ``Checkpointer.last_snapshot_s`` (its capture and copy of the state).

DeepSpeed's previous tag directory is removed after each round, outside the timings.
After the rounds, the restore rounds (``--restore-reps`` + 1, ``reps + 1`` unless given;
`ds_bench.py` asks for `ds_bench.RESTORE_FACTOR` times the save rounds, since a restore
takes a tenth of a second and its ratio decides a goal; the first reported apart), the
first method rotating again; in the first and the last round engine B takes a training
step of its own before each restore (outside the timing), so that every part of its state
differs from A's, and B's whole state (what ``DeepSpeedState`` takes: module, fp32 master
partition, moments, scheduler, counters, on every rank) is hashed after the restore and
compared with A's (``restored_equal``). The restores:

- ``deepspeed``: ``B.load_checkpoint(DIR/deepspeed, tag=<the last>)`` (module, ZeRO
  optimizer partition, scheduler, counters);
- ``resumable``: ``Checkpointer(DIR/sync, {"engine": DeepSpeedState(B)},
  persist="sync")`` then ``restore(tier="storage")`` (every tensor read and its checksum
  verified), timed together, then ``close()``.

The files were just written: every restore reads them from a warm page cache (this
process may not drop it), but resumable's first: it writes files of 8 MiB or more around
the page cache (O_DIRECT), and the first round is reported apart. The floors are methods
of the rounds like the others (`Floor`):
``write_floor`` in the save rounds, every rank writing its share of DeepSpeed's bytes
(total ÷ ranks) fsynced into a file of its own, all ranks at once; ``read_floor`` in the
restore rounds, that file read back. Rank 0 writes every sample to ``OUT``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import floors

SEQ, BATCH = 64, 2
MODEL = {"vocab_size": 8192, "n_positions": 256, "n_embd": 512, "n_layer": 6, "n_head": 8}
"""GPT-2 shaped, 23.2 M parameters: with AdamW's fp32 master partition and two moments a
ZeRO checkpoint of two ranks is about 0.37 GB, which the disk here takes in 0.3-1.5 s."""
TINY = {"vocab_size": 128, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
"""``--tiny``: the smoke test's model (`tests/test_ds_bench.py`), a launch of seconds."""


def ds_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 5, "total_num_steps": 1000, "warmup_max_lr": 1e-3},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def log(msg: str) -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"[ds-worker {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(stage: int, seed: int, shape: dict[str, int]) -> tuple[Any, int]:
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        **shape,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config(stage), model_parameters=model.parameters()
    )
    return engine, params


def train_step(engine: Any, seed: int, shape: dict[str, int]) -> None:
    g = torch.Generator().manual_seed(seed * 1_009 + dist.get_rank())
    seq = min(SEQ, shape["n_positions"])
    ids = torch.randint(0, shape["vocab_size"], (BATCH, seq), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def files_of(d: Path) -> dict[str, int]:
    """Every file under ``d`` (relative name: bytes)."""
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}


def files_beside(d: Path) -> dict[str, int]:
    """The files directly in a method's directory, beside its one checkpoint (the
    earlier ones removed): DeepSpeed's ``latest`` and the recovery scripts
    ``save_checkpoint`` copies there on every call; resumable's audit log (a line per
    save and close of the rounds) and its lease files."""
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}


def fsync_tree(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GcClock:
    """Python's cyclic garbage collector, settled before each timed call and watched
    during it. A generation-2 collection walks every container object of the process
    (the framework's modules, optimizer and config objects as well as the library's),
    here a quarter of a second, and would otherwise land in whichever call happens to
    cross its threshold, whoever allocated the objects before it: `settle` runs a full
    collection before every timed call of every method (outside the timing), so that
    each starts from the same collector state, and the time the collector still takes
    inside a call (started by that call's own allocations) is added up in `spent`.
    ``RESUMABLE_BENCH_GC_SETTLE=0`` leaves the collection out (the rounds as they were
    before, the collector still watched), to show what it changes."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.spent += time.perf_counter() - self._t0

    def settle(self) -> None:
        if os.environ.get("RESUMABLE_BENCH_GC_SETTLE", "1") != "0":
            gc.collect()
        self.spent = 0.0

    def close(self) -> None:
        gc.callbacks.remove(self._on)


def slowest(mine: list[float]) -> list[list[float]]:
    """Every rank's values of ``mine``, gathered (rank order)."""
    t = torch.tensor(mine, dtype=torch.float64)
    every = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return [[float(x) for x in e] for e in every]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3))
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument(
        "--restore-reps", type=int, default=None, help="restore rounds after a first (--reps)"
    )
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="the smoke test's model")
    args = ap.parse_args()
    shape = TINY if args.tiny else MODEL
    warnings.filterwarnings("ignore")

    import deepspeed

    from resumable import Checkpointer, Keep
    from resumable.commit import step_dir
    from resumable.integrations.deepspeed import DeepSpeedState, state_sha256

    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log(f"ZeRO {args.stage}, {world} ranks: building the engines")
    a, params = build(args.stage, 0, shape)
    b, _ = build(args.stage, 1, shape)
    log("training steps")
    train_step(a, 1, shape)
    log("hashing A's state")
    ref = state_sha256(a)
    log("save rounds")
    setup_s = time.perf_counter() - started

    ds_dir = args.dir / "deepspeed"
    roots = {"resumable_auto": args.dir / "auto", "resumable_sync": args.dir / "sync"}
    auto = Checkpointer(
        roots["resumable_auto"],
        {"engine": DeepSpeedState(a)},
        keep=Keep(last=1),
        save_on_close=False,
        # full checkpoints, as DeepSpeed writes: the state does not change between saves
        incremental=False,
    )
    sync = Checkpointer(
        roots["resumable_sync"],
        {"engine": DeepSpeedState(a)},
        persist="sync",
        keep=Keep(last=1),
        save_on_close=False,
        incremental=False,
    )

    def tag(i: int) -> str:
        return f"round{i}"

    def save_ds(i: int) -> list[float]:
        t0 = time.perf_counter()
        a.save_checkpoint(str(ds_dir), tag=tag(i))
        call = time.perf_counter() - t0
        dist.barrier()
        t1 = time.perf_counter()
        if rank == 0:
            fsync_tree(ds_dir / tag(i))
            fsync_tree(ds_dir)
        fsync = time.perf_counter() - t1
        return [call, call, fsync, 0.0]

    def save_auto(i: int) -> list[float]:
        t0 = time.perf_counter()
        auto.save(i + 1)
        blocking = time.perf_counter() - t0
        auto.wait()
        return [blocking, time.perf_counter() - t0, 0.0, auto.last_snapshot_s or 0.0]

    def save_sync(i: int) -> list[float]:
        t0 = time.perf_counter()
        sync.save(i + 1)
        t = time.perf_counter() - t0
        return [t, t, 0.0, sync.last_snapshot_s or 0.0]

    floor = Floor(args.dir / "floor", rank, world)

    def write_floor(i: int) -> list[float]:
        if floor.share is None:  # round 0 starts with DeepSpeed's save
            floor.share = sum(files_of(ds_dir / tag(0)).values()) // world
        t = floor.write()
        return [t, t, 0.0, 0.0]

    def capture(i: int) -> list[float]:
        t0 = time.perf_counter()
        DeepSpeedState(a).state_dict()
        t = time.perf_counter() - t0
        return [t, t, 0.0, 0.0]

    savers: dict[str, Callable[[int], list[float]]] = {
        "deepspeed": save_ds,
        "resumable_auto": save_auto,
        "resumable_sync": save_sync,
        "capture": capture,
        "write_floor": write_floor,
    }
    names = list(savers)
    saves: dict[str, list[list[list[float]]]] = {n: [] for n in names}
    clock = GcClock()
    gc_in: dict[str, dict[str, list[float]]] = {"saves": {n: [] for n in names}, "restores": {}}
    for i in range(args.reps + 1):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            clock.settle()
            dist.barrier()
            saves[name].append(slowest(savers[name](i)))
            gc_in["saves"][name].append(max(r[0] for r in slowest([clock.spent])))
        dist.barrier()
        if rank == 0 and i > 0:
            shutil.rmtree(ds_dir / tag(i - 1))
        dist.barrier()
    auto.close()
    sync.close()
    last = args.reps + 1
    nbytes = {
        "deepspeed": files_of(ds_dir / tag(args.reps)),
        **{n: files_of(root / step_dir(last)) for n, root in roots.items()},
    }
    beside = {n: files_beside(d) for n, d in [("deepspeed", ds_dir), *roots.items()]}

    log("restore rounds")

    def load_ds() -> float:
        t0 = time.perf_counter()
        b.load_checkpoint(str(ds_dir), tag=tag(args.reps))
        return time.perf_counter() - t0

    def load_ours() -> float:
        t0 = time.perf_counter()
        ck = Checkpointer(
            roots["resumable_sync"],
            {"engine": DeepSpeedState(b)},
            persist="sync",
            keep=None,
            save_on_close=False,
        )
        got = ck.restore(tier="storage")
        t = time.perf_counter() - t0
        ck.close()
        if got != last:
            raise RuntimeError(f"restored step {got}, expected {last}")
        return t

    loaders: dict[str, Callable[[], float]] = {
        "deepspeed": load_ds,
        "resumable": load_ours,
        "read_floor": floor.read,
    }
    lnames = list(loaders)
    loads: dict[str, list[list[float]]] = {n: [] for n in lnames}
    gc_in["restores"] = {n: [] for n in lnames}
    equal: dict[str, list[bool]] = {"deepspeed": [], "resumable": []}
    restore_reps = args.reps if args.restore_reps is None else max(1, args.restore_reps)
    for i in range(restore_reps + 1):
        k = i % len(lnames)
        checked = i in (0, restore_reps)
        for name in lnames[k:] + lnames[:k]:
            checks = checked and name in equal
            if checks:
                train_step(b, 200 + i, shape)
            clock.settle()
            dist.barrier()
            loads[name].append([r[0] for r in slowest([loaders[name]()])])
            gc_in["restores"][name].append(max(r[0] for r in slowest([clock.spent])))
            if checks:
                equal[name].append(state_sha256(b) == ref)

    floor.path.unlink(missing_ok=True)

    if rank == 0:
        out = {
            "stage": args.stage,
            "world_size": world,
            "torch_threads": torch.get_num_threads(),
            "deepspeed": deepspeed.__version__,
            "model": {
                **shape,
                "params": params,
                "what": f"GPT-2 ({shape['n_layer']} layers, {shape['n_embd']} wide, "
                f"vocabulary {shape['vocab_size']}), fp32, AdamW",
            },
            "setup_s": round(setup_s, 3),
            "save_order": names,
            "restore_order": lnames,
            "restore_reps": restore_reps,
            "saves": saves,
            "restores": loads,
            "gc_in_calls": gc_in,
            "restored_equal": equal,
            "bytes": nbytes,
            "beside": beside,
            "format_version": json.loads(
                (roots["resumable_sync"] / step_dir(last) / "manifest.json").read_text()
            )["format_version"],
            "floor_bytes": (floor.share or 0) * world,
            "wall_s": round(time.perf_counter() - started, 3),
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # As in the DeepSpeed example: the results are written; leave without the
    # interpreter's shutdown, where a gloo thread can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Floor:
    """The physical floors on this rank: its share of DeepSpeed's bytes written with 16 MiB
    ``write`` calls and an fsync into a file of its own (every rank at once, after the
    same barrier as the other methods), and that file read back (warm page cache)."""

    def __init__(self, d: Path, rank: int, world: int) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"rank{rank}.bin"
        self.block = os.urandom(floors.CHUNK)
        self.share: int | None = None
        self.buf: bytearray | None = None

    def write(self) -> float:
        """Seconds to write ``share`` bytes and fsync them into a new file."""
        assert self.share is not None
        self.path.unlink(missing_ok=True)
        share = self.share
        return floors.timed(lambda: floors.write_file_fsync(self.path, share, self.block))

    def read(self) -> float:
        """Seconds to read the file back into a buffer allocated once."""
        if self.buf is None:
            self.buf = bytearray(self.path.stat().st_size)
        buf = self.buf
        return floors.timed(lambda: floors.read_file_into(self.path, buf))


if __name__ == "__main__":
    main()
