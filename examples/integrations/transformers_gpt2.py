"""Fine-tune a tiny GPT-2 with the Hugging Face Trainer, checkpointed by `resumable`.

The one change to a plain Trainer script is ``Trainer`` -> ``ResumableTrainer``. Run it,
kill it (``kill -9``, SIGTERM, ^C) and run the same command again: it resumes from the
newest valid checkpoint in ``--dir`` and ends bit-identical to a run never stopped. The
model is built from a ``GPT2Config`` and the data are generated, so nothing is
downloaded. The last line, ``final step=<N> params_sha256=<hex>``, hashes every
parameter and optimizer state tensor.

    python examples/integrations/transformers_gpt2.py --dir runs/hf --steps 40

``--deepspeed STAGE`` trains through DeepSpeed at that ZeRO stage (0-3; CPU, gloo), with
the same one change: `ResumableTrainer` then checkpoints the DeepSpeed engine's whole
state. Run it as it is (one process) or under ``torchrun``; the last line then hashes
every rank's engine state (module, ZeRO partitions with fp32 masters and moments,
scheduler, counters).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import resumable
from resumable.integrations.transformers import ResumableTrainer

VOCAB = 64
SEQ = 16


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` fixed pseudo-random token sequences (a pure function of the seed)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # A learnable pattern: each sequence counts up from a random start, mod VOCAB.
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintSteps(TrainerCallback):
    """Prints ``step N`` at each step end (the kill tests watch for it)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"step {state.global_step}", flush=True)


def params_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter/buffer and every optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}/{key}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().cpu().numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def ds_config(stage: int) -> dict[str, Any]:
    """A DeepSpeed config for the Trainer: "auto" values come from TrainingArguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: DeepSpeed's own CPU Adam is a C++ op to compile
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    }


def single_process_env() -> None:
    """What torchrun would set, for a DeepSpeed run of one process launched directly."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="output and checkpoint directory")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--save-total-limit", type=int, default=3)
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate (and keep the best)")
    p.add_argument("--memory-every", type=int, default=0, help="memory snapshot cadence")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument(
        "--preempt",
        action="store_true",
        help="SIGUSR1 too, and a 60 s grace period (SIGTERM is handled by default)",
    )
    p.add_argument("--deepspeed", type=int, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage")
    a = p.parse_args(argv)
    if a.deepspeed is not None:
        single_process_env()

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    evaluate = a.eval_steps > 0
    args = TrainingArguments(
        output_dir=a.dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=a.save_steps,
        save_total_limit=a.save_total_limit,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=a.eval_steps if evaluate else None,
        load_best_model_at_end=evaluate,
        metric_for_best_model="loss" if evaluate else None,
        logging_steps=a.save_steps,
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds_config(a.deepspeed) if a.deepspeed is not None else None,
    )
    trainer = ResumableTrainer(
        model=model,
        args=args,
        train_dataset=Tokens(96, seed=1),  # 24 batches: runs cross epoch boundaries
        eval_dataset=Tokens(16, seed=2) if evaluate else None,
        callbacks=[PrintSteps()],
        memory_every=resumable.Every(steps=a.memory_every) if a.memory_every else None,
        # Without preemption=, SIGTERM leads to an emergency checkpoint and exit code 75.
        **({"preemption": resumable.Preemption(grace_seconds=60)} if a.preempt else {}),
    )
    trainer.train()
    if a.deepspeed is not None:
        from resumable.integrations.deepspeed import state_sha256

        digest = state_sha256(trainer.model_wrapped)
        if int(os.environ["RANK"]) != 0:
            return
    else:
        assert trainer.optimizer is not None
        digest = params_sha256(trainer.model, trainer.optimizer)
    print(f"final step={trainer.state.global_step} params_sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
