"""A tiny GPT-2 trained by DeepSpeed (any ZeRO stage) on CPU, checkpointed by `resumable`.

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 \\
        examples/integrations/deepspeed_gpt2.py --dir runs/ds --stage 2 --steps 40

The lines that differ from a plain DeepSpeed script: the engine goes into a `Checkpointer`
as ``DeepSpeedState(engine)``, ``ckpt.restore()`` replaces ``engine.load_checkpoint``, and
``ckpt.maybe_save(step)`` replaces ``engine.save_checkpoint``. ``init_distributed`` replaces
``deepspeed.init_distributed()``: under ``torchrun --max-restarts`` and torch 2.13 the
plain start-up's relaunched ranks can fail to connect (``Gloo connectFullMesh failed``)
and wait for the timeout; this one namespaces the store by the restart count
(``docs/deepspeed.md``, "Starting the processes"; ``docs/distributed.md``, "torchrun
restarts"). Saves are collective (every
rank writes its own ZeRO partition) and commit only when every rank wrote its part; when
a rank dies, torchrun restarts the group and every rank resumes from the same step.

Each step's batch is a function of (seed, step, rank), so a resumed run sees the batches
an uninterrupted one would. The last line, printed by rank 0,
``final step=<N> params_sha256=<hex>``, hashes every rank's whole engine state (module,
fp32 master weights and optimizer moments of each ZeRO partition, scheduler, counters):
a run killed and restarted any number of times prints the same line as one never killed.

The model is built from a ``GPT2Config`` (nothing is downloaded); dropout is off.

``--import-deepspeed DIR`` starts from a checkpoint in DeepSpeed's own layout (made by
``engine.save_checkpoint`` or by `resumable.integrations.deepspeed.export_deepspeed`):
``engine.load_checkpoint`` reads it and the first `Checkpointer.save` commits it, when
the `Checkpointer` has no checkpoint of its own yet.

Environment, for the tests: ``KILL_AT_STEP=N`` makes rank ``KILL_RANK`` (default 1)
SIGKILL itself right after ``maybe_save`` of step N, on torchrun's first attempt only;
with ``KILL_AFTER_COMMIT=1`` it first waits for the persist in flight to commit (on this
2-core machine a first persist, which starts the worker process, can take longer than
the whole run).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import resumable
from resumable.integrations.deepspeed import DeepSpeedState, state_sha256

VOCAB, SEQ = 128, 16


def init_distributed(timeout_s: float = 600.0, backend: str = "gloo") -> int:
    """Join the process group on a store namespaced by torchrun's restart count, with
    a finite timeout; returns the rank. ``backend="nccl"`` on GPUs."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")),
        world,
        is_master=rank == 0 and not agent_store,  # torchrun's agent may host the store
        timeout=timeout,
    )
    store = dist.PrefixStore(f"attempt{attempt}", base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend)  # adopts the group made above
    return rank


def ds_config(stage: int, bf16: bool, micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 5, "total_num_steps": 1000, "warmup_max_lr": 3e-3},
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }


def build(stage: int, bf16: bool, micro_batch: int, seed: int) -> Any:
    torch.manual_seed(seed)  # the same initial values on every rank
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config(stage, bf16, micro_batch), model_parameters=model.parameters()
    )
    return engine


def batch(seed: int, step: int, rank: int, size: int) -> torch.Tensor:
    """This rank's token ids for ``step``: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory or URL")
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--bf16", action="store_true", help="bf16 training (default fp32)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-every", action="store_true", help="snapshot every step into shared memory"
    )
    p.add_argument("--persist", default="auto", help="the Checkpointer's persist= mode")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout (s)")
    p.add_argument("--import-deepspeed", help="start from this DeepSpeed checkpoint directory")
    args = p.parse_args()

    rank = init_distributed(args.timeout)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    kill_rank = int(os.environ.get("KILL_RANK", "1"))
    kill_after_commit = os.environ.get("KILL_AFTER_COMMIT") == "1"
    engine = build(args.stage, args.bf16, args.micro_batch, args.seed)

    ck = resumable.Checkpointer(
        args.dir,
        {"engine": DeepSpeedState(engine)},
        persist_every=resumable.Every(steps=args.save_every),
        memory_every=resumable.Every(steps=1) if args.memory_every else None,
        keep=resumable.Keep(last=2),
        persist=args.persist,
        dist_timeout_s=args.timeout,
    )
    with ck:
        start = ck.restore()
        if start == 0 and args.import_deepspeed:
            engine.load_checkpoint(args.import_deepspeed)  # DeepSpeed's own reader
            start = engine.global_steps
            ck.save(start)  # from here on, resumable's checkpoints
        print(f"rank {rank} attempt {attempt}: resumed from step {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            ids = batch(args.seed, step, rank, args.micro_batch)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            ck.maybe_save(step)
            if rank == 0:
                print(f"step {step} loss {loss.float().item():.4f}", flush=True)
            if step == kill_at and attempt == 0:
                if kill_after_commit:
                    ck.wait()  # every rank: the coordinated persist needs them all
                if rank != kill_rank:
                    continue
                print(f"rank {rank}: killing myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        digest = state_sha256(engine)  # every rank's whole engine state
    if rank == 0:
        print(f"final step={args.steps} params_sha256={digest}", flush=True)
    dist.destroy_process_group()
    # As in examples/distributed/train_fsdp.py: everything is committed and closed; leave
    # without the interpreter's shutdown, where a gloo thread can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
