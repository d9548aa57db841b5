"""A tiny Megatron-Core GPT trained on CPU ranks (gloo) through `resumable`.

Launched by ``tests/integrations/test_megatron.py`` under ``torchrun``:
``megatron_job.py --dir D --tp T --steps N [--every K] [--sleep S] [--reset-per-rank]
[--optimizer sgd] [--check-refusals]``. It restores from ``D`` (whatever TP or world
size wrote it), trains to iteration N with AdamW (or SGD with momentum) and Megatron's
``OptimizerParamScheduler``, checkpoints with the seed's
``save_checkpoint_if_needed`` every K iterations (and a memory snapshot at every one),
and prints, on rank 0:

- ``rank <r> resumed step=<s>`` (every rank) after the restore, and, when something
  was restored, ``restored step=<s> params_sha256=<hex> optim_sha256=<hex>``;
- ``step <i> loss <x>`` after each iteration, and ``at step=<i> params_sha256=<hex>
  optim_sha256=<hex>`` after each (the state a commit of that step holds: a persist
  due while the worker is busy is deferred to the next iteration, so a commit may
  hold any step, not only a K-th);
- ``final step=<N> params_sha256=<hex> optim_sha256=<hex>`` at the end.

The digests are of the *global* parameters and optimizer state (gathered over the TP
group): the same at any TP for the same values.

The batch of iteration i on data-parallel rank d depends on (i, d) only, dropout is
off, and gradients are averaged over the data-parallel group by hand (Megatron's own
DDP and optimizer wrappers need CUDA), so a resumed run is bit-identical to an
uninterrupted one. Megatron is made to run on CPU by `megatron_shim` (test-only).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import megatron_shim
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

megatron_shim.install()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import resumable  # noqa: E402
from resumable.integrations import megatron as rmegatron  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4


def digest(value: Any, h: Any) -> None:
    """Feed ``value`` (nested dicts/lists of tensors and plain values) into ``h``, in key
    order; DTensors as their full tensor (a collective over the TP group)."""
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            digest(value[k], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            digest(v, h)
    elif isinstance(value, DTensor):
        digest(value.full_tensor(), h)
    elif isinstance(value, torch.Tensor):
        h.update(value.detach().contiguous().cpu().numpy().tobytes())
    else:
        h.update(repr(value).encode())


def report(what: str, step: int, state: dict[str, Any]) -> None:
    """Print ``<what> step=<step> params_sha256=<hex> optim_sha256=<hex>`` on rank 0:
    digests of the global parameters and optimizer state (collective)."""
    params, optim = hashlib.sha256(), hashlib.sha256()
    digest(state["model"].state_dict(), params)
    digest(state["optim"].state_dict(), optim)
    if dist.get_rank() == 0:
        print(
            f"{what} step={step} params_sha256={params.hexdigest()} "
            f"optim_sha256={optim.hexdigest()}",
            flush=True,
        )


def check_refusals(model: torch.nn.Module) -> None:
    """Print ``refused <case>: <error class>`` for each layout or object that must be
    refused (rank 0): the model given to a Checkpointer as it is (what a snapshot
    captures), shards in an order torch's ``Shard`` would not put them, an object that is
    not a torch optimizer, and an optimizer over other parameters."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from resumable.capture import capture

    def reordered(*args: Any, **kwargs: Any) -> dict[str, Any]:
        out = dict(type(model).sharded_state_dict(model, *args, **kwargs))
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        for name, st in out.items():
            frags = st.axis_fragmentations if isinstance(st, ShardedTensor) else None
            if frags and max(frags) == tp > 1:  # TP ranks in reverse order
                axis = frags.index(tp)
                offset = list(st.global_offset)
                offset[axis] = (tp - 1 - rank) * st.local_shape[axis - st.prepend_axis_num]
                out[name] = dataclasses.replace(st, global_offset=tuple(offset))
        return out

    cases = {
        "raw model": lambda: capture({"model": model}),
        "offsets": lambda: rmegatron.MegatronModel(model),
        "optimizer": lambda: rmegatron.MegatronOptimizer(object(), model),  # type: ignore[arg-type]
        "foreign parameters": lambda: rmegatron.MegatronOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))]), model
        ),
    }
    for case, make in cases.items():
        if case == "offsets":
            model.sharded_state_dict = reordered  # type: ignore[method-assign]
        try:
            make()
            outcome = "accepted"
        except resumable.CheckpointError as exc:
            outcome = f"refused {case}: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            model.__dict__.pop("sharded_state_dict", None)
        if dist.get_rank() == 0:
            print(outcome, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--reset-per-rank", action="store_true")
    p.add_argument("--check-refusals", action="store_true")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    megatron_shim.manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        gated_linear_unit=True,  # swiglu-style linear_fc1: a ShardedTensorFactory
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    if args.check_refusals:
        check_refusals(model)
    if args.optimizer == "sgd":  # its momentum appears at the first step only
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=1e-3, momentum=0.9, weight_decay=0.01
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=4,
        lr_decay_steps=40,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=40,
        wd_incr_style="constant",
    )
    ckpt = rmegatron.checkpointer(
        args.dir,
        model,
        optimizer,
        scheduler,
        persist_every=resumable.Every(steps=args.every),
        memory_every=resumable.Every(steps=1),
        keep=resumable.Keep(last=3),
    )
    start = ckpt.restore(reset_per_rank_state=args.reset_per_rank)
    print(f"rank {rank} resumed step={start}", flush=True)
    if start:
        report("restored", start, ckpt.state)

    dp_group = parallel_state.get_data_parallel_group()
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    for iteration in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * iteration + dp_rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        loss = model(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if dp > 1:
            for param in model.parameters():
                dist.all_reduce(param.grad, group=dp_group)
                param.grad.div_(dp)
        optimizer.step()
        scheduler.step(1)
        rmegatron.save_checkpoint_if_needed(iteration + 1, model, optimizer, scheduler)
        report("at", iteration + 1, ckpt.state)
        if rank == 0:
            print(f"step {iteration + 1} loss {loss.item():.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    ckpt.close()

    report("final", max(start, args.steps), ckpt.state)
    dist.destroy_process_group()
    # docs/distributed.md: gloo's threads can abort a finished process at exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
