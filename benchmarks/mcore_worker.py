"""One rank of the Megatron-Core phase (`mcore_bench.py`): a Megatron ``GPTModel``'s
checkpoint taken by ``megatron.core.dist_checkpointing.save`` (its default ``torch_dist``
strategy) and by `resumable` (``resumable.integrations.megatron.checkpointer``),
interleaved, timed on every rank; then restored into a second model by
``dist_checkpointing.load`` and by ``Checkpointer.restore``.

    python -m torch.distributed.run --nproc-per-node=2 --master-addr=127.0.0.1 \\
        --master-port=PORT benchmarks/mcore_worker.py --tp 2 --reps 5 --dir DIR --out OUT.json

Megatron-Core runs on these CPU ranks (gloo) through the test-only shim
``tests/integrations/megatron_shim.py`` (imported from there, as the integration's test
job does: it patches ``torch.cuda.current_device``/``synchronize`` and Megatron's RNG
tracker for CPU; no checkpointing code is patched).

Every rank builds the same ``GPTModel`` (local layer spec, dropout off, fp32, output
layer not tied to the embedding: ``GPTModel``'s default) twice at TP ``--tp`` (DP = 2 /
TP): model A with a ``torch.optim.AdamW`` and Megatron's ``OptimizerParamScheduler``,
which takes a training step so that the optimizer state exists, and model B, built from
another seed, the target of the restores. Megatron's optimizer is ``FP32Optimizer``
around that AdamW (what ``get_megatron_optimizer`` makes for fp32 without the
distributed optimizer), used only for its ``sharded_state_dict``/``load_state_dict``;
its constructor allocates one scalar on ``'cuda'``, so it is built without it
(``fp32_optimizer``). The state Megatron saves is what Megatron-LM's
``generate_state_dict`` builds: ``{"model": model.sharded_state_dict(), "optimizer":
optimizer.sharded_state_dict(model's), "opt_param_scheduler": ..., "iteration": ...}``
(no ``args``, no RNG states: resumable's state has the RNG tracker and the process's
streams, a few KB).

Then ``reps + 1`` save rounds, each saving A's state once with every method, the first
method rotating from round to round, all ranks meeting at a barrier before each call;
each rank times its own call and the sample kept is the slowest rank's Before each call (save
and restore rounds alike) every rank runs a full garbage collection, outside the timing
(`GcClock`), and records the time the collector still takes inside the call. Methods:

- ``megatron``: building the sharded state dict (timed apart as ``snapshot``) and
  ``dist_checkpointing.save(sd, DIR/megatron/roundN)``; blocking = total = both. Its
  ``torch_dist`` writer fsyncs its data files and its metadata; right after the call
  (and a barrier) rank 0 fsyncs every file of the directory anyway (``common.pt`` and
  ``metadata.json`` are written without), timed apart as ``fsync``.
- ``megatron_async`` (``--async``): the same with ``async_sharded_save=True``, the
  request scheduled on an ``AsyncCallsQueue`` (blocking), then
  ``maybe_finalize_async_calls(blocking=True)`` (total).
- ``resumable_auto``: ``checkpointer(DIR/auto, A, optimizer, scheduler,
  keep=Keep(last=1))`` with the default ``persist="auto"``: blocking = ``save(step)``;
  total = + ``wait()``.
- ``resumable_sync``: the same with ``persist="sync"`` (returns after the coordinated,
  fsynced commit).

Each sample is ``[blocking, total, fsync, snapshot]`` per rank, *snapshot* being
resumable's ``Checkpointer.last_snapshot_s`` or the time Megatron's sharded state dict
took to build.

After the save rounds, every rank's ``os.sync()`` (outside the timing: the save rounds'
buffered writes would otherwise be written back during the restores, and resumable's data
files, written around the page cache, are read from the disk), then the restore rounds
(``--restore-reps`` + 1, ``reps + 1`` unless given; `mcore_bench.py` asks for
`torchrun_phase.RESTORE_FACTOR` times the save rounds; the first reported apart); in
the first and the last round model B takes a training step of its own before each
restore (outside the timing), so that every part of its state differs from A's, and B's
state (every rank's parameter shards, AdamW moments and steps, the scheduler) is hashed
after the restore and compared with A's (``restored_equal``). The restores:

- ``megatron``: the sharded state dict of B (``is_loading=True``),
  ``dist_checkpointing.load(sd, DIR/megatron/<last>)``, then ``model.load_state_dict``,
  ``optimizer.load_state_dict`` and ``scheduler.load_state_dict`` of what it returns (as
  Megatron-LM's ``load_checkpoint`` does);
- ``resumable``: ``checkpointer(DIR/sync, B, ..., persist="sync")`` then
  ``restore(tier="storage")`` (checksums verified), timed together, then ``close()``.

The floors are methods of the rounds like the others, as in ``ds_worker.py``.
"""

from __future__ import annotations

import argparse
import hashlib
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "integrations"))

import megatron_shim  # noqa: E402  (test-only: Megatron-Core on CPU)
from ds_worker import Floor, GcClock, files_of, fsync_tree, slowest  # noqa: E402

BATCH = 2
MODEL = {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8, "vocab": 8192, "seq": 256}
"""GPT-2 shaped as in `ds_worker.py`, 27.4 M parameters (the output layer, untied, adds
4.2 M to GPT-2's 23.2 M): with AdamW's two moments a checkpoint of 0.33 GB, which the
disk here takes in 0.2-1 s: well above the timer's and the barriers' noise, small enough for a
phase of a few minutes on 2 cores."""
TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab": 128, "seq": 16}
"""``--tiny``: the smoke test's model (`tests/test_mcore_bench.py`)."""


def log(msg: str) -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"[mcore-worker {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fp32_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """Megatron's ``FP32Optimizer`` around ``optimizer``, built without its constructor's
    ``torch.tensor([1.0], device='cuda')`` (a loss scale of 1, unused here)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    def init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    config = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.01, params_dtype=torch.float32
    )
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, optimizer, config, init_state_fn)
    opt._scale = torch.tensor([1.0])
    opt.is_stub_optimizer = False
    return opt


class Job:
    """A model, its AdamW, the Megatron wrapper of it and the scheduler, on this rank."""

    def __init__(self, seed: int, shape: dict[str, int]) -> None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        megatron_shim.manual_seed(seed)
        self.shape = shape
        config = TransformerConfig(
            num_layers=shape["num_layers"],
            hidden_size=shape["hidden_size"],
            num_attention_heads=shape["num_attention_heads"],
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        self.model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=shape["vocab"],
            max_sequence_length=shape["seq"],
        )
        # one param group with the keys get_megatron_optimizer gives its groups (Megatron's
        # load_state_dict matches groups by them)
        group = {
            "params": list(self.model.parameters()),
            "wd_mult": 1.0,
            "lr_mult": 1.0,
            "is_expert_parallel": False,
            "is_decoupled_lr": False,
        }
        self.optimizer = torch.optim.AdamW([group], lr=1e-3, weight_decay=0.01)
        self.mopt = fp32_optimizer(self.optimizer)
        self.fresh_scheduler()
        self.iteration = 0

    def fresh_scheduler(self) -> None:
        """A new ``OptimizerParamScheduler``, as at a launch: its ``load_state_dict`` adds
        the checkpoint's step count to its own (``step(increment=num_steps)``), so a
        restore is exact only into one that has not stepped."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=1e-3,
            min_lr=1e-4,
            lr_warmup_steps=4,
            lr_decay_steps=400,
            lr_decay_style="cosine",
            start_wd=0.01,
            end_wd=0.01,
            wd_incr_steps=400,
            wd_incr_style="constant",
        )

    def params(self) -> int:
        """Global parameter count (a TP-split parameter counted TP times)."""
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        return sum(
            p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in self.model.parameters()
        )

    def train_step(self, seed: int) -> None:
        from megatron.core import parallel_state

        seq, vocab = self.shape["seq"], self.shape["vocab"]
        dp_group = parallel_state.get_data_parallel_group()
        dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        g = torch.Generator().manual_seed(seed * 1_009 + dp_rank)
        tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        pos = torch.arange(seq).unsqueeze(0).expand(BATCH, seq)
        loss = self.model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if dp > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp)
        self.optimizer.step()
        self.scheduler.step(1)
        self.iteration += 1

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """What Megatron-LM's ``generate_state_dict`` builds, less ``args`` and RNG."""
        model_sd = self.model.sharded_state_dict()
        return {
            "model": model_sd,
            "optimizer": self.mopt.sharded_state_dict(model_sd, is_loading=is_loading),
            "opt_param_scheduler": self.scheduler.state_dict(),
            "iteration": self.iteration,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.mopt.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["opt_param_scheduler"])
        self.iteration = state["iteration"]

    def sha256(self) -> dict[str, str]:
        """sha256 of every rank's local state, by part (``model``: parameter shards;
        ``moments``: AdamW's per-parameter state; ``groups``: its param groups;
        ``sched``: the scheduler's state), the same on every rank; collective."""

        def digest(value: Any) -> str:
            h = hashlib.sha256()

            def walk(v: Any) -> None:
                if isinstance(v, dict):
                    for k in sorted(v, key=str):
                        h.update(str(k).encode())
                        walk(v[k])
                elif isinstance(v, (list, tuple)):
                    for x in v:
                        walk(x)
                elif isinstance(v, torch.Tensor):
                    t = v.detach().contiguous().reshape(-1)
                    h.update(str(t.dtype).encode())
                    h.update(t.view(torch.uint8).numpy().tobytes())
                elif isinstance(v, (int, float, str, bool)) or v is None:
                    h.update(repr(v).encode())

            walk(value)
            return h.hexdigest()

        osd = self.optimizer.state_dict()
        mine = {
            "model": digest(
                {k: v for k, v in self.model.state_dict().items() if "_extra_state" not in k}
            ),
            "moments": digest(osd["state"]),
            "groups": digest(osd["param_groups"]),
            "sched": digest(self.scheduler.state_dict()),
        }
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return {
            part: hashlib.sha256("".join(d[part] for d in every).encode()).hexdigest()
            for part in mine
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True, choices=(1, 2))
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument(
        "--restore-reps", type=int, default=None, help="restore rounds after a first (--reps)"
    )
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="the smoke test's model")
    ap.add_argument("--async", dest="use_async", action="store_true", help="also async save")
    args = ap.parse_args()
    shape = TINY if args.tiny else MODEL
    warnings.filterwarnings("ignore")

    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    megatron_shim.install()
    import megatron.core
    from megatron.core import dist_checkpointing, parallel_state

    from resumable import Keep
    from resumable.commit import step_dir
    from resumable.integrations.megatron import checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    dp = world // args.tp
    log(f"TP {args.tp} x DP {dp}: building the models")
    a = Job(1234, shape)
    b = Job(4321, shape)
    params = a.params()
    log("training step")
    a.train_step(1)
    ref = a.sha256()
    setup_s = time.perf_counter() - started
    log("save rounds")

    mc_dir = args.dir / "megatron"
    roots = {"resumable_auto": args.dir / "auto", "resumable_sync": args.dir / "sync"}
    auto = checkpointer(
        roots["resumable_auto"],
        a.model,
        a.optimizer,
        a.scheduler,
        keep=Keep(last=1),
        save_on_close=False,
        # full checkpoints, as dist_checkpointing writes: the state does not change
        # between saves
        incremental=False,
    )
    sync = checkpointer(
        roots["resumable_sync"],
        a.model,
        a.optimizer,
        a.scheduler,
        persist="sync",
        keep=Keep(last=1),
        save_on_close=False,
        incremental=False,
    )

    def tag(name: str, i: int) -> Path:
        return mc_dir / f"{name}{i}"

    def fresh(d: Path) -> None:
        if rank == 0:
            d.mkdir(parents=True, exist_ok=False)
        dist.barrier()

    def save_mc(i: int) -> list[float]:
        d = tag("round", i)
        fresh(d)
        t0 = time.perf_counter()
        sd = a.sharded_state_dict()
        built = time.perf_counter() - t0
        dist_checkpointing.save(sd, str(d))
        call = time.perf_counter() - t0
        dist.barrier()
        t1 = time.perf_counter()
        if rank == 0:
            fsync_tree(d)
            fsync_tree(mc_dir)
        return [call, call, time.perf_counter() - t1, built]

    queue: list[Any] = []

    def save_mc_async(i: int) -> list[float]:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if not queue:
            queue.append(AsyncCallsQueue())
        d = tag("async", i)
        fresh(d)
        t0 = time.perf_counter()
        sd = a.sharded_state_dict()
        built = time.perf_counter() - t0
        req = dist_checkpointing.save(sd, str(d), async_sharded_save=True)
        queue[0].schedule_async_request(req)
        blocking = time.perf_counter() - t0
        queue[0].maybe_finalize_async_calls(blocking=True, no_dist=False)
        total = time.perf_counter() - t0
        dist.barrier()
        t1 = time.perf_counter()
        if rank == 0:
            fsync_tree(d)
        return [blocking, total, time.perf_counter() - t1, built]

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
        if floor.share is None:  # round 0 starts with Megatron's save
            floor.share = sum(files_of(tag("round", 0)).values()) // world
        t = floor.write()
        return [t, t, 0.0, 0.0]

    savers: dict[str, Callable[[int], list[float]]] = {
        "megatron": save_mc,
        **({"megatron_async": save_mc_async} if args.use_async else {}),
        "resumable_auto": save_auto,
        "resumable_sync": save_sync,
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
            shutil.rmtree(tag("round", i - 1))
            shutil.rmtree(tag("async", i - 1), ignore_errors=True)
        dist.barrier()
    auto.close()
    sync.close()
    last = args.reps + 1
    nbytes = {
        "megatron": files_of(tag("round", args.reps)),
        **({"megatron_async": files_of(tag("async", args.reps))} if args.use_async else {}),
        **{n: files_of(root / step_dir(last)) for n, root in roots.items()},
    }

    log("restore rounds")
    # The save rounds leave dirty pages (Megatron's buffered writes) that the kernel writes
    # back over the next seconds; resumable's data files, written around the page cache,
    # are read back from the disk, behind that writeback. Flushed first, outside the
    # timing, as a restore at a launch finds the last job's writes long written.
    os.sync()
    dist.barrier()

    def load_mc() -> float:
        t0 = time.perf_counter()
        sd = b.sharded_state_dict(is_loading=True)
        state = dist_checkpointing.load(sd, str(tag("round", args.reps)))
        b.load(state)
        return time.perf_counter() - t0

    def load_ours() -> float:
        t0 = time.perf_counter()
        ck = checkpointer(
            roots["resumable_sync"],
            b.model,
            b.optimizer,
            b.scheduler,
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
        "megatron": load_mc,
        "resumable": load_ours,
        "read_floor": floor.read,
    }
    lnames = list(loaders)
    loads: dict[str, list[list[float]]] = {n: [] for n in lnames}
    gc_in["restores"] = {n: [] for n in lnames}
    equal: dict[str, list[bool]] = {"megatron": [], "resumable": []}
    differ: dict[str, list[str]] = {}
    restore_reps = args.reps if args.restore_reps is None else max(1, args.restore_reps)
    for i in range(restore_reps + 1):
        k = i % len(lnames)
        checked = i in (0, restore_reps)
        for name in lnames[k:] + lnames[:k]:
            checks = checked and name in equal
            if checks:
                b.train_step(200 + i)
            b.fresh_scheduler()  # as at a launch (outside the timing)
            clock.settle()
            dist.barrier()
            loads[name].append([r[0] for r in slowest([loaders[name]()])])
            gc_in["restores"][name].append(max(r[0] for r in slowest([clock.spent])))
            if checks:
                got = b.sha256()
                equal[name].append(got == ref)
                if got != ref:
                    differ[name] = sorted(
                        set(p for p in ref if got[p] != ref[p]) | set(differ.get(name, []))
                    )

    floor.path.unlink(missing_ok=True)

    if rank == 0:
        out = {
            "tp": args.tp,
            "dp": dp,
            "world_size": world,
            "torch_threads": torch.get_num_threads(),
            "megatron_core_version": megatron.core.__version__,
            "torch_version": torch.__version__,
            "model": {
                **shape,
                "params": params,
                "what": f"Megatron-Core GPTModel ({shape['num_layers']} layers, "
                f"{shape['hidden_size']} wide, vocabulary {shape['vocab']}, sequence "
                f"{shape['seq']}), fp32, AdamW",
            },
            "setup_s": round(setup_s, 3),
            "save_order": names,
            "restore_order": lnames,
            "restore_reps": restore_reps,
            "saves": saves,
            "restores": loads,
            "gc_in_calls": gc_in,
            "restored_equal": equal,
            "restored_differ": differ,
            "bytes": nbytes,
            "floor_bytes": (floor.share or 0) * world,
            "wall_s": round(time.perf_counter() - started, 3),
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # dist_checkpointing's writer keeps a multiprocessing Manager (a spawned server
    # process) for its results queue: end it, which os._exit would leave running.
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
